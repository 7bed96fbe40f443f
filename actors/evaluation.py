"""The evaluation of spec ``eval``: after every ``every_steps`` committed steps (and after the
last), every worker runs the forwards of the eval batches with the committed parameters
(``StageWorker.run_eval``); the last stages' sums of microbatch-mean shares, over replicas and
batches, give the mean of the batch-mean losses."""
from __future__ import annotations

from typing import Optional

from actors.failures import WorkerLost
from service.spec import JobSpec


def due(spec: JobSpec, committed: int, last: Optional[int] = None) -> bool:
    """``last``: the job's last step when it ends before the spec's (asked to finish early)."""
    e = spec.eval
    return e is not None and (committed % e.every_steps == 0 or committed == (last or spec.training.steps))


def run(group, record, spec: JobSpec, step: int, stats: dict,
        last: Optional[int] = None) -> tuple[Optional[float], Optional[WorkerLost]]:
    """After 0-based ``step`` (committed by the caller either way): its eval loss when due,
    or the ``WorkerLost`` that ended the evaluation (an ``eval_skipped`` event says so; the
    workers applied the step before evaluating, so it stands)."""
    if not due(spec, step + 1, last):
        return None, None
    refs = group.call_all("run_eval", step + 1)
    try:
        return collect(group, spec, refs, step, stats), None
    except WorkerLost as lost:
        record.event("eval_skipped", f"the evaluation after step {step + 1} was lost with a worker", step=step + 1)
        lost.refs = refs
        return None, lost


def collect(group, spec: JobSpec, refs: dict, step: int, stats: dict) -> float:
    """The eval loss from the workers' ``run_eval`` calls ``refs``; their forwards join the
    step's timeline (``stats``).  Raises what ``WorkerGroup.gather`` raises."""
    evals = group.gather(refs, step, group.timeout, phase=f"while evaluating step {step + 1}")
    for c, e in evals.items():
        stats[c]["timeline"] = stats[c]["timeline"] + e["timeline"]
        stats[c]["output"] = stats[c].get("output", []) + e.get("output", [])
    return sum(e["loss_sum"] for e in evals.values() if e["loss_sum"] is not None) / spec.eval.batches
