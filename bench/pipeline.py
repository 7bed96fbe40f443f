"""Step time of relaytrain 1F1B (p = 2, M in {4, 8, 16}) on each transport against a
single process, for an MLP whose per-microbatch compute (tens of ms per stage) is well
above the transport cost; and the measured bubble beside the plan's (p-1)/(M+p-1).

    .venv/bin/python bench/pipeline.py [--steps 12] [--quick]

Prints a table (markdown) and writes bench/results/pipeline.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from service.loading import build_optimizer, load_job  # noqa: E402
from service.sampling import step_indices  # noqa: E402
from service.spec import parse_spec  # noqa: E402

MBS = 128  # large enough that a stage's GEMMs run at full speed on one thread
MODEL = {"kind": "mlp", "args": {"in_features": 512, "hidden": 1536, "layers": 7, "out_features": 10}}


def spec_for(m: int, steps: int, pp: int, transport: str, schedule: str = "1f1b"):
    return parse_spec({
        "name": f"bench-{pp}-{m}-{transport}".replace("_", "-"),
        "model": MODEL,
        "data": {"kind": "regression", "args": {"n": MBS * 16 * 2, "in_features": 512, "out_features": 10}},
        "loss": "mse", "optimizer": {"name": "sgd", "lr": 0.001},
        "training": {"global_batch_size": MBS * m, "microbatch_size": MBS, "steps": steps, "seed": 0},
        "parallelism": {"dp": 1, "pp": pp, "schedule": schedule, "transport": transport, "partition": "balanced"},
    })


def single_process(spec, warmup: int, threads: int = 1, microbatched: bool = False) -> list[float]:
    """The same steps in one process (the base line): the whole batch at once, or
    accumulating gradients over microbatches (the same matrix shapes a stage computes)."""
    torch.set_num_threads(threads)
    job = load_job(spec)
    opt = build_optimizer(spec, job.model.parameters())
    t = spec.training
    times = []
    for g in range(t.steps):
        t0 = time.perf_counter()
        x, y = job.samples.batch(step_indices(g, len(job.samples), t.global_batch_size, t.seed, t.shuffle))
        opt.zero_grad()
        if microbatched:
            for xm, ym in zip(x.split(t.microbatch_size), y.split(t.microbatch_size)):
                (job.loss(job.model(xm), ym) * (len(xm) / len(x))).backward()
        else:
            job.loss(job.model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times[warmup:]


def relaytrain(spec, warmup: int) -> tuple[list[float], list[float], float]:
    from actors.runner import run_job

    with tempfile.TemporaryDirectory() as out:
        rows = run_job(spec=spec, out=out, progress=False, record=False)["metrics"][warmup:]
    return [r["step_time_s"] for r in rows], [r["bubble"] for r in rows], rows[0]["bubble_plan"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="M in {4, 8} only, 6 steps")
    args = ap.parse_args()
    if args.quick:
        args.steps, ms = 6, [4, 8]
    else:
        ms = [4, 8, 16]
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    results = []
    for m in ms:
        base = single_process(spec_for(m, args.steps, 1, "object_store"), args.warmup)
        b = statistics.median(base)
        results.append({"contestant": "single process, 1 thread", "M": m, "step_s": b,
                        "samples_per_s": MBS * m / b, "bubble": None, "bubble_plan": None})
        mbd = statistics.median(single_process(spec_for(m, args.steps, 1, "object_store"), args.warmup, 1, True))
        results.append({"contestant": "single process, 1 thread, microbatched", "M": m, "step_s": mbd,
                        "samples_per_s": MBS * m / mbd, "bubble": None, "bubble_plan": None, "speedup": b / mbd})
        two = statistics.median(single_process(spec_for(m, args.steps, 1, "object_store"), args.warmup, 2))
        results.append({"contestant": "single process, 2 threads", "M": m, "step_s": two,
                        "samples_per_s": MBS * m / two, "bubble": None, "bubble_plan": None, "speedup": b / two})
        for transport in ("object_store", "collective"):
            steps, bubbles, plan = relaytrain(spec_for(m, args.steps, 2, transport), args.warmup)
            s = statistics.median(steps)
            results.append({"contestant": f"relaytrain 1f1b p=2 {transport}", "M": m, "step_s": s,
                            "samples_per_s": MBS * m / s, "bubble": statistics.median(bubbles),
                            "bubble_plan": plan, "speedup": b / s})
    ray.shutdown()
    print(f"model: MLP 512-{MODEL['args']['hidden']}x{MODEL['args']['layers']}-10, microbatch {MBS}, "
          f"{args.steps - args.warmup} timed steps each, median\n")
    print("| contestant | M | step time (ms) | samples/s | speed-up vs 1 process, 1 thread | measured bubble | plan bubble |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        bub = "" if r["bubble"] is None else f"{r['bubble']:.1%}"
        plan = "" if r["bubble_plan"] is None else f"{r['bubble_plan']:.1%}"
        sp = f"{r['speedup']:.2f}x" if "speedup" in r else ""
        print(f"| {r['contestant']} | {r['M']} | {r['step_s'] * 1000:.0f} | {r['samples_per_s']:.0f} | {sp} | {bub} | {plan} |")
    out = Path(__file__).parent / "results" / "pipeline.json"
    out.write_text(json.dumps({"time": time.time(), "steps": args.steps, "results": results}, indent=1))


if __name__ == "__main__":
    main()
