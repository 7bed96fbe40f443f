"""What BatchNorm's modes cost: step time of a CNN with BatchNorm2d/1d under
``training.batch_norm: microbatch`` and ``deferred``, beside the same CNN with its BatchNorms
replaced by identities (what normalisation itself costs is then out of the figure's way).

    .venv/bin/python bench/batchnorm.py [--steps 8] [--channels 16]

Digits (8x8), microbatches of 16, M = 4 and 8, at dp x pp = 1x2 and 2x1, 1F1B, collective
transport.  Each job's median ``step_time_s`` over its steps after the first.  Both modes
normalise per microbatch; they differ in how the running statistics move (once per step or
once per microbatch), and both record per-channel sums of each BatchNorm's input and sum them
over the stage's replicas once per step.  Writes bench/results/batchnorm.{txt,json}.
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

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torch import nn  # noqa: E402


def cnn(channels: int = 16, hidden: int = 64, classes: int = 10, norms: bool = True):
    """Conv-BN-ReLU x 3, then Linear-BN-ReLU and the head, as a layer list."""
    norm2d = (lambda: nn.BatchNorm2d(channels)) if norms else nn.Identity
    return [
        lambda: nn.Unflatten(1, (1, 8, 8)),
        lambda: nn.Conv2d(1, channels, 3, padding=1), norm2d, nn.ReLU,
        lambda: nn.Conv2d(channels, channels, 3, padding=1), norm2d, nn.ReLU,
        lambda: nn.Conv2d(channels, channels, 3, padding=1), norm2d, nn.ReLU,
        nn.Flatten,
        lambda: nn.Linear(channels * 64, hidden), (lambda: nn.BatchNorm1d(hidden)) if norms else nn.Identity, nn.ReLU,
        lambda: nn.Linear(hidden, classes),
    ]


def spec_of(mode: str, dp: int, pp: int, m: int, steps: int, channels: int):
    from service.spec import parse_spec

    mbs = 16
    return parse_spec({
        "name": f"bench-bn-{mode}-{dp}x{pp}-m{m}",
        "model": {"builder": "bench.batchnorm:cnn", "args": {"channels": channels, "norms": mode != "none"}},
        "data": {"kind": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "training": {"global_batch_size": mbs * m * dp, "microbatch_size": mbs, "steps": steps, "seed": 0,
                     "batch_norm": "deferred" if mode == "none" else mode},
        "parallelism": {"dp": dp, "pp": pp, "schedule": "1f1b", "partition": "uniform"},
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--channels", type=int, default=16)
    args = ap.parse_args()
    import ray

    from actors.runner import run_job
    from bench.machine import machine

    ray.init(address="local", num_cpus=16, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    t0, rows = time.time(), []
    load0 = os.getloadavg()
    for dp, pp in ((1, 2), (2, 1)):
        for m in (4, 8):
            for mode in ("none", "microbatch", "deferred"):
                spec = spec_of(mode, dp, pp, m, args.steps, args.channels)
                with tempfile.TemporaryDirectory() as out:
                    final = run_job(spec=spec, out=out, progress=False, record=False, spec_dir=str(ROOT))
                times = [r["step_time_s"] for r in final["metrics"]][1:]
                rows.append({"dp": dp, "pp": pp, "M": m, "mode": mode, "step_ms": statistics.median(times) * 1e3})
                print(rows[-1], flush=True)
    lines = [f"CNN ({args.channels} channels, 3 conv + BatchNorm2d, Linear + BatchNorm1d), digits, microbatch 16, "
             f"1F1B, median of {args.steps - 1} steps; {machine()['cpu']}, {machine()['cores']} cores; load {load0} -> {os.getloadavg()}; "
             f"{time.time() - t0:.0f} s", "",
             "| dp x pp | M | no BatchNorm (ms) | microbatch (ms) | deferred (ms) | deferred over none |",
             "|---|---|---|---|---|---|"]
    for dp, pp in ((1, 2), (2, 1)):
        for m in (4, 8):
            got = {r["mode"]: r["step_ms"] for r in rows if (r["dp"], r["pp"], r["M"]) == (dp, pp, m)}
            lines.append(f"| {dp}x{pp} | {m} | {got['none']:.1f} | {got['microbatch']:.1f} | {got['deferred']:.1f} | "
                         f"{got['deferred'] / got['none']:.2f}x |")
    text = "\n".join(lines)
    print(text)
    out = ROOT / "bench" / "results"
    (out / "batchnorm.txt").write_text(text + "\n")
    (out / "batchnorm.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
