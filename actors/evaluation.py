"""The evaluation of spec ``eval``: after every ``every_steps`` committed steps (and after the
last), every worker runs the forwards of the eval batches with the committed parameters
(``StageWorker.run_eval``); the last stages' sums of microbatch-mean shares, over replicas and
batches, give the mean of the batch-mean losses."""
from __future__ import annotations

from service.spec import JobSpec


def due(spec: JobSpec, committed: int) -> bool:
    e = spec.eval
    return e is not None and (committed % e.every_steps == 0 or committed == spec.training.steps)


def collect(group, spec: JobSpec, refs: dict, step: int, stats: dict) -> float:
    """The eval loss from the workers' ``run_eval`` calls ``refs``; their forwards join the
    step's timeline (``stats``).  Raises what ``WorkerGroup.gather`` raises."""
    evals = group.gather(refs, step, group.timeout, phase=f"while evaluating step {step + 1}")
    for c, e in evals.items():
        stats[c]["timeline"] = stats[c]["timeline"] + e["timeline"]
        stats[c]["output"] = stats[c].get("output", []) + e.get("output", [])
    return sum(e["loss_sum"] for e in evals.values() if e["loss_sum"] is not None) / spec.eval.batches
