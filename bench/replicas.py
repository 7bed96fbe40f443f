"""Replicated stages (``parallelism.replicas``) on the seed article's case: a pipeline whose
middle stage costs twice the others and cannot be cut, on 4 workers.

Four ways to use the 4 workers, each a real relaytrain job (collective transport):
- ``pp=3``: three stages, the middle one the bottleneck, one worker idle;
- ``[1,2,1]``: the same three stages, the middle one on two workers (microbatch k on replica k mod 2);
- ``pp=4``: four stages as balanced as the layers allow (the heavy layer is one layer: still a stage of its own);
- ``dp=4``: four replicas of the whole model.

The model: a light input layer, five blocks of relative cost [1, 1, 4, 1, 1] and a light head;
stage boundaries [3, 1, 3] entries (stage costs 2, 4, 2).  Two kinds of cost:
- *paced* (simulated device time): each block's forward sleeps cost x ``--ms-per-sample`` per
  sample and its backward twice that, as a GPU kernel would keep the device, not the CPU, busy.
  On this 2-core machine this is the fair measure of a schedule: 4 workers fit.
- *real*: the blocks compute (a cost-1 block is a width x width Linear; the cost-4 block a
  width -> 2 width -> width MLP), and the 4 workers share 2 cores.

For each kind, M in {4, 8, 16} and microbatches of --mbs rows: the median step time (after 2
warm-up steps), the speed-up over pp=3, the measured bubble and the planner's modelled step.

    .venv/bin/python bench/replicas.py [--ms 4 8 16] [--mbs 16] [--steps 8] [--kinds paced real]
        [--ms-per-sample 0.25 1.0] [--shapes pp=3 [1,2,1] pp=4 dp=4] [--out replicas]

Writes bench/results/OUT.{json,txt} (replicas_mbs8 and replicas_mbs32: the same at --mbs 8 and 32,
M = 8, paced 0.25 ms, pp=3 against [1,2,1]).
"""
from __future__ import annotations

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

MODEL = '''"""Blocks of given relative cost: paced (sleeping, simulated device time) or computing."""
import time

import torch
from torch import nn


class _Pace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds * x.shape[0]
        time.sleep(ctx.seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class Paced(nn.Module):
    def __init__(self, width, seconds_per_sample):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.seconds = seconds_per_sample

    def forward(self, x):
        return torch.relu(self.lin(_Pace.apply(x, self.seconds)))


def block(width, cost, paced, ms):
    if paced:
        return Paced(width, cost * ms / 1e3)
    if cost == 1:
        return nn.Sequential(nn.Linear(width, width), nn.ReLU())
    hidden = width * cost // 2
    return nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, width), nn.ReLU())


def build(costs=(1, 1, 4, 1, 1), width=512, paced=True, ms=0.25, classes=10):
    return nn.Sequential(nn.Linear(64, width), *[block(width, c, paced, ms) for c in costs],
                         nn.Linear(width, classes))
'''

COSTS = [1, 1, 4, 1, 1]
SHAPES = {  # name -> parallelism
    "pp=3": {"dp": 1, "pp": 3, "partition": [3, 1, 3]},
    "[1,2,1]": {"dp": 1, "pp": 3, "partition": [3, 1, 3], "replicas": [1, 2, 1]},
    "pp=4": {"dp": 1, "pp": 4, "partition": "balanced"},
    "dp=4": {"dp": 4, "pp": 1, "partition": "balanced"},
}


def spec(kind: str, name: str, m: int, mbs: int, steps: int, width: int, ms: float):
    from service.spec import parse_spec

    layer_ms = [0.01] + [c * 1.0 for c in COSTS] + [0.01]
    return parse_spec({
        "name": f"rep-{kind}-{name.replace('=', '').replace('[', '').replace(']', '').replace(',', '')}-m{m}",
        "model": {"builder": "replica_blocks:build",
                  # paced blocks are narrow (their real compute, a 64-wide Linear, is small beside the sleep)
                  "args": {"costs": COSTS, "width": 64 if kind == "paced" else width, "paced": kind == "paced",
                           "ms": ms}},
        "data": {"kind": "digits"}, "loss": "cross_entropy",
        "optimizer": {"name": "sgd", "lr": 0.01},
        "training": {"global_batch_size": m * mbs, "microbatch_size": mbs, "steps": steps, "seed": 0},
        "parallelism": {"schedule": "1f1b", "transport": "collective", "layer_costs_ms": layer_ms, **SHAPES[name]},
        "resources": {"cpus_per_worker": 1},
        "checkpoint": {"every_steps": 0},
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--mbs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--ms-per-sample", type=float, nargs="+", default=[0.25, 1.0])
    ap.add_argument("--kinds", nargs="+", default=["paced", "real"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--out", default="replicas", help="bench/results/OUT.{txt,json}")
    args = ap.parse_args()

    import ray

    from actors import layerfacts
    from actors.runner import run_job
    from machine import machine
    from service import planner

    folder = tempfile.mkdtemp(prefix="relaytrain-replicas-")
    Path(folder, "replica_blocks.py").write_text(MODEL)
    sys.path.insert(0, folder)
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"RAY_worker_niceness": "0"}})
    rows, t_start = [], time.time()
    runs = [(kind, ms) for kind in args.kinds for ms in (args.ms_per_sample if kind == "paced" else [0.0])]
    for kind, pace in runs:
        for m in args.ms:
            for name in args.shapes:
                if name == "dp=4" and m % 4:
                    continue
                s = spec(kind, name, m, args.mbs, args.steps, args.width, pace)
                final = run_job(spec=s, spec_dir=folder, out=tempfile.mkdtemp(), progress=False, record=False)
                timed = final["metrics"][2:]
                shape = next(e for e in final["events"] if e["type"] == "shape")
                p = s.parallelism
                facts = layerfacts.learn(s, [folder]).facts
                modelled = planner.model_shape(facts, p.dp, p.pp, s.microbatches, schedule=p.schedule,
                                               partition_rule=shape["partition"], replicas=p.replica_counts).step_s
                row = {"kind": kind, "ms_per_sample": pace, "shape": name, "M": m, "mbs": args.mbs, "partition": shape["partition"],
                       "step_s": statistics.median(r["step_time_s"] for r in timed),
                       "bubble": statistics.median(r["bubble"] for r in timed),
                       "modelled_s": modelled, "steps": [r["step_time_s"] for r in timed]}
                rows.append(row)
                print(f"{kind:5s} {pace:4g} M={m:2d} {name:8s} partition {shape['partition']}: step "
                      f"{row['step_s'] * 1e3:7.1f} ms, bubble {row['bubble']:.1%}, planner {modelled * 1e3:.1f} "
                      f"(units of layer_costs_ms)", flush=True)
    facts = machine()
    ray.shutdown()
    lines = [f"Replicated stages: blocks of cost {COSTS} (stages [3, 1, 3] entries: 2, 4, 2), 4 workers, 1F1B, "
             f"microbatches of {args.mbs} rows, collective transport; paced: the given ms per sample per unit of "
             f"cost forward (2x backward), 64 wide; real: width {args.width} on 2 cores; median of "
             f"{args.steps - 2} steps; {time.strftime('%Y-%m-%d')}", "",
             "| cost | M | shape | step (ms) | vs pp=3 | measured bubble | planner vs pp=3 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(x for x in rows if (x["kind"], x["ms_per_sample"], x["M"], x["shape"])
                    == (r["kind"], r["ms_per_sample"], r["M"], "pp=3"))
        cost = f"paced {r['ms_per_sample']:g} ms" if r["kind"] == "paced" else "real"
        lines.append(f"| {cost} | {r['M']} | {r['shape']} | {r['step_s'] * 1e3:.0f} | "
                     f"{base['step_s'] / r['step_s']:.2f}x | {r['bubble']:.1%} | "
                     f"{base['modelled_s'] / r['modelled_s']:.2f}x |")
    text = "\n".join(lines)
    print(text)
    out = BENCH / "results"
    (out / f"{args.out}.txt").write_text(text + "\n")
    (out / f"{args.out}.json").write_text(json.dumps({"machine": facts, "seconds": time.time() - t_start,
                                                   "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
