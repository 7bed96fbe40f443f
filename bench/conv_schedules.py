"""A CNN on 2 workers: 1F1B against ZB-H1, which chooses how the CNN's chunks split.

Each worker's chunk holds convolutions and a Linear that has most of its weights but little of
its weight-gradient work (``actors/deferred.covered``), so a split schedule tries both splits of
its backward in steps 2-8: torch's ``stage_backward_input`` / ``stage_backward_weight`` (every
weight gradient in W, at more compute than the whole backward on a CPU: bench/split_backward.py)
and the Linears' own products (the convolutions' gradients in B), and keeps the faster from
step 10 on (``service/schedules.choose_split``; the table says which).  1F1B keeps the whole backward with
the Linears' own products and sends each input gradient early.  Steps from the 11th are timed.  Real compute, one thread per worker,
digits data through Linear(64, 2048) into 8 x 16 x 16 images, four Conv2d(., 32, 3), a Linear head
8192 -> 128 -> 10; p = 2, M = 8; the schedules alternate round by round; median step of each.

    .venv/bin/python bench/conv_schedules.py [--mbs 16 32 64] [--rounds 3] [--steps 20]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))

CNN = '''"""bench/conv_schedules.py's CNN."""
from torch import nn


def build(channels=32, classes=10):
    c = channels
    return nn.Sequential(
        nn.Linear(64, 8 * 256), nn.Unflatten(1, (8, 16, 16)),
        nn.Conv2d(8, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(c * 256, 128), nn.ReLU(), nn.Linear(128, classes))
'''

SETTLED = 10  # the first step, the trial of the two splits (7), the step sent before the choice, one more
RUNS = {"1F1B": ("1f1b", 1), "ZB-H1": ("zb_h1", 1), "ZB-H1 W xM": ("zb_h1", 0)}


def spec(name: str, m: int, mbs: int, steps: int):
    from service.spec import parse_spec

    schedule, group = RUNS[name]
    par = {"dp": 1, "pp": 2, "schedule": schedule, "transport": "collective", "partition": [6, 8]}
    if group == 0:
        par["weight_group"] = m
    return parse_spec({
        "name": f"cnn-{schedule}-m{m}-b{mbs}".replace("_", "-"),
        "model": {"builder": "cnn_layers:build"}, "data": {"kind": "digits"}, "loss": "cross_entropy",
        "optimizer": {"name": "sgd", "lr": 0.01},
        "training": {"global_batch_size": m * mbs, "microbatch_size": mbs, "steps": steps, "seed": 0},
        "parallelism": par, "resources": {"cpus_per_worker": 1}, "checkpoint": {"every_steps": 0}})


def alternate(names: list, make_spec, rounds: int, folder: str, label: str) -> dict:
    """Each of ``names`` run ``rounds`` times, the order rotating round by round (``make_spec(name)``,
    the model's module in ``folder``): name -> its runs' timed rows (after ``SETTLED``) and its
    ``weight_split`` choices, as ``{"rows": [...], "kept": [...], "last": the last run's last row}``."""
    from actors.runner import run_job

    got = {k: {"rows": [], "kept": [], "last": None} for k in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            final = run_job(spec=make_spec(name), spec_dir=folder, out=tempfile.mkdtemp(), progress=False,
                            record=False)
            timed = final["metrics"][SETTLED:]
            got[name]["kept"] += [e["kept"] for e in final["events"] if e["type"] == "weight_split"]
            got[name]["rows"] += timed
            got[name]["last"] = timed[-1]
            print(f"{label} round {r + 1} {name}: {statistics.median(x['step_time_s'] for x in timed) * 1e3:.0f} ms",
                  flush=True)
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mbs", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    import ray

    folder = tempfile.mkdtemp(prefix="relaytrain-cnn-")
    Path(folder, "cnn_layers.py").write_text(CNN)
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"RAY_worker_niceness": "0"}})
    lines = [f"CNN on p = 2, M = {args.m}, median step (ms) over {args.rounds} alternated rounds of "
             f"{args.steps - SETTLED} timed steps, measured bubble median; {time.strftime('%Y-%m-%d %H:%M')}", "",
             "| rows | schedule | step (ms) | vs 1F1B | measured bubble | split kept (rounds) |", "|---|---|---|---|---|---|"]
    for mbs in args.mbs:
        got = alternate(list(RUNS), lambda name: spec(name, args.m, mbs, args.steps), args.rounds, folder, f"rows {mbs}")
        base = statistics.median(x["step_time_s"] for x in got["1F1B"]["rows"])
        for name in RUNS:
            med = statistics.median(x["step_time_s"] for x in got[name]["rows"])
            bubble = statistics.median(x["bubble"] for x in got[name]["rows"])
            lines.append(f"| {mbs} | {name} | {med * 1e3:.0f} | {base / med:.2f}x | {bubble:.1%} | "
                         f"{', '.join(got[name]['kept']) or '-'} |")
    ray.shutdown()
    text = "\n".join(lines)
    print(text)
    (BENCH / "results" / "conv_schedules.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
