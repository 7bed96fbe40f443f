"""What BatchNorm's modes cost: step time of a CNN with BatchNorm2d/1d under
``training.batch_norm: microbatch``, ``deferred`` and ``global``, beside the same CNN with its
BatchNorms replaced by identities.

    .venv/bin/python bench/batchnorm.py [--steps 8] [--channels 16] [--sleep-ms 0.25]

Digits (8x8), microbatches of 16, M = 4 and 8, at dp x pp = 1x2 and 2x1, GPipe (the one
schedule ``global`` runs), collective transport.  Each job's median ``step_time_s`` over its
steps after the first.  ``microbatch`` and ``deferred`` normalise per microbatch (they differ in
how the running statistics move); ``global`` normalises with the whole batch, so at pp = 2 each
stage (both hold a BatchNorm) waits for all its microbatches at its first BatchNorm: the
pipeline's stages run one after another.  Run twice: real compute, and "paced", where a layer
after each block sleeps ``--sleep-ms`` per sample forward and twice that backward (simulated
device time: on 2 cores the pipeline's overlap shows only when the work is not CPU).  Beside the
paced figures, the planner's modelled ratio (service/planner.py ``gathered_units``).
Writes bench/results/batchnorm.{txt,json}.
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


def cnn(channels: int = 16, hidden: int = 64, classes: int = 10, norms: bool = True, sleep_ms: float = 0.0):
    """Conv-BN-ReLU x 3, then Linear-BN-ReLU and the head, as a layer list; with ``sleep_ms`` a
    Sleep after each block (bench/paced_mlp.py's)."""
    norm2d = (lambda: nn.BatchNorm2d(channels)) if norms else nn.Identity
    pace = [lambda: _sleep(sleep_ms / 1e3)] if sleep_ms else []
    return [
        lambda: nn.Unflatten(1, (1, 8, 8)),
        lambda: nn.Conv2d(1, channels, 3, padding=1), norm2d, nn.ReLU, *pace,
        lambda: nn.Conv2d(channels, channels, 3, padding=1), norm2d, nn.ReLU, *pace,
        lambda: nn.Conv2d(channels, channels, 3, padding=1), norm2d, nn.ReLU, *pace,
        nn.Flatten,
        lambda: nn.Linear(channels * 64, hidden), (lambda: nn.BatchNorm1d(hidden)) if norms else nn.Identity, nn.ReLU,
        *pace, lambda: nn.Linear(hidden, classes),
    ]


def _sleep(seconds: float):
    import types

    from bench.paced_mlp import PACED

    mod = types.ModuleType("paced")
    exec(compile(PACED, "paced", "exec"), mod.__dict__)
    return mod.Sleep(seconds)


def spec_of(mode: str, dp: int, pp: int, m: int, steps: int, channels: int, sleep_ms: float):
    from service.spec import parse_spec

    mbs = 16
    return parse_spec({
        "name": f"bench-bn-{mode}-{dp}x{pp}-m{m}",
        "model": {"builder": "bench.batchnorm:cnn",
                  "args": {"channels": channels, "norms": mode != "none", "sleep_ms": sleep_ms}},
        "data": {"kind": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "training": {"global_batch_size": mbs * m * dp, "microbatch_size": mbs, "steps": steps, "seed": 0,
                     "batch_norm": "deferred" if mode == "none" else mode},
        "parallelism": {"dp": dp, "pp": pp, "schedule": "gpipe", "partition": "uniform"},
    })


MODES = ("none", "microbatch", "deferred", "global")
SHAPES = ((1, 2), (2, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--channels", type=int, default=16)
    ap.add_argument("--sleep-ms", type=float, default=0.25)
    args = ap.parse_args()
    import ray

    from actors.runner import run_job
    from bench.machine import machine
    from service.planner import gathered_units

    ray.init(address="local", num_cpus=16, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    t0, rows = time.time(), []
    load0 = os.getloadavg()
    for sleep_ms in (0.0, args.sleep_ms):
        for dp, pp in SHAPES:
            for m in (4, 8):
                for mode in MODES:
                    spec = spec_of(mode, dp, pp, m, args.steps, args.channels, sleep_ms)
                    with tempfile.TemporaryDirectory() as out:
                        final = run_job(spec=spec, out=out, progress=False, record=False, spec_dir=str(ROOT))
                    times = [r["step_time_s"] for r in final["metrics"]][1:]
                    rows.append({"dp": dp, "pp": pp, "M": m, "mode": mode, "sleep_ms": sleep_ms,
                                 "step_ms": statistics.median(times) * 1e3})
                    print(rows[-1], flush=True)
    lines = [f"CNN ({args.channels} channels, 3 conv + BatchNorm2d, Linear + BatchNorm1d), digits, microbatch 16, "
             f"GPipe, median of {args.steps - 1} steps; paced: {args.sleep_ms} ms per sample per block forward, twice "
             f"backward; {machine()['cpu']}, {machine()['cores']} cores; load {load0} -> {os.getloadavg()}; "
             f"{time.time() - t0:.0f} s", "",
             "| compute | dp x pp | M | no BatchNorm (ms) | microbatch (ms) | deferred (ms) | global (ms) | "
             "global over deferred | modelled |",
             "|---|---|---|---|---|---|---|---|---|"]
    for sleep_ms in (0.0, args.sleep_ms):
        for dp, pp in SHAPES:
            for m in (4, 8):
                got = {r["mode"]: r["step_ms"] for r in rows
                       if (r["dp"], r["pp"], r["M"], r["sleep_ms"]) == (dp, pp, m, sleep_ms)}
                model = gathered_units(m, [True] * pp) / (m + pp - 1)
                lines.append(f"| {'paced' if sleep_ms else 'real'} | {dp}x{pp} | {m} | {got['none']:.1f} | "
                             f"{got['microbatch']:.1f} | {got['deferred']:.1f} | {got['global']:.1f} | "
                             f"{got['global'] / got['deferred']:.2f}x | {model:.2f}x |")
    text = "\n".join(lines)
    print(text)
    out = ROOT / "bench" / "results"
    (out / "batchnorm.txt").write_text(text + "\n")
    (out / "batchnorm.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
