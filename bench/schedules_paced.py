"""relaytrain's pipeline schedules on simulated device time: where the bubble goes when compute
does not compete for the cores.

On this 2-core machine two stages computing at once slow each other (shared cores and memory
bandwidth), so a schedule that removes idle time also adds contention, and B/W splitting costs
Python and autograd overhead per layer: real compute hides what the schedule does.  Here every
layer is a ``PacedLinear``: a tiny real Linear whose forward sleeps ``f_ms`` per sample, whose
input-gradient path sleeps ``b_ms`` per sample and whose weight-gradient path sleeps ``w_ms``
per sample (a sleep on the weight's own autograd node), so a split backward puts B's and W's
time where a device would, and any number of workers fits on 2 cores.

For p in {2, 4} and M in {4, 8, 16}: each schedule's median step time and measured bubble (the
metrics rows of a real relaytrain job, collective transport), beside the plan's bubble at
F = B = W.  Equivalence with one process is the tests' job (tests/test_schedules_engine.py).
The same paced model also runs in this process, one thread, accumulating the M microbatches
(the plain PyTorch loop): the pipeline efficiency is (that step / p) / the schedule's step, as
in bench/peers.py, here without the contention of real compute.

The paced layers call ``F.linear`` themselves, so a split schedule's chunks try both splits of
the backward in steps 2-8 and keep the faster from step 10 (README, "Which split a chunk keeps");
steps from the 11th are timed, and the table says which split was kept.

    .venv/bin/python bench/schedules_paced.py [--ms 4 8 16] [--pps 2 4] [--steps 16]

Writes bench/results/schedules_paced.{json,txt}; a run of other sizes or schedules than the
defaults writes them under its own name (``schedules_paced_p2_m8.txt``).
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
SETTLED = 10  # the first step, the trial of the two splits (7), the step sent before the choice, one more
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

PACED = '''"""Paced linear layers: simulated device time in forward, input gradient and weight gradient."""
import time

import torch
from torch import nn
import torch.nn.functional as F


class _Sleep(torch.autograd.Function):
    """Identity; sleeps ``fwd`` seconds in forward and ``bwd`` in backward."""

    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        if fwd:
            time.sleep(fwd)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.bwd:
            time.sleep(ctx.bwd)
        return grad, None, None


class PacedLinear(nn.Module):
    def __init__(self, width, f_ms, b_ms, w_ms):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.f, self.b, self.w = f_ms / 1e3, b_ms / 1e3, w_ms / 1e3

    def forward(self, x):
        n = x.shape[0]
        x = _Sleep.apply(x, self.f * n, self.b * n)                        # forward; B: the input's gradient
        weight = _Sleep.apply(self.lin.weight, 0.0, self.w * n)            # W: the weight's gradient
        return torch.relu(F.linear(x, weight, self.lin.bias))


def build(layers=8, width=64, classes=10, f_ms=0.25, b_ms=0.25, w_ms=0.25):
    mods = [nn.Linear(64, width)]
    mods += [PacedLinear(width, f_ms, b_ms, w_ms) for _ in range(layers)]
    mods.append(nn.Linear(width, classes))
    return nn.Sequential(*mods)
'''

SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1", "zbv")
LABEL = {"1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B v=2", "zb_h1": "ZB-H1", "zbv": "ZB-V"}


def spec(folder: str, schedule: str, pp: int, m: int, mbs: int, steps: int, layers: int):
    from service.spec import parse_spec

    return parse_spec({
        "name": f"paced-{schedule}-p{pp}-m{m}".replace("_", "-"),
        "model": {"builder": "paced_layers:build", "args": {"layers": layers}},
        "data": {"kind": "digits"}, "loss": "cross_entropy",
        "optimizer": {"name": "sgd", "lr": 0.05},
        "training": {"global_batch_size": m * mbs, "microbatch_size": mbs, "steps": steps, "seed": 0},
        "parallelism": {"dp": 1, "pp": pp, "schedule": schedule, "transport": "collective", "partition": "balanced",
                        # each paced layer costs the same; the light input and head almost nothing
                        "layer_costs_ms": [0.01] + [1.0] * layers + [0.01]},
        "resources": {"cpus_per_worker": 1},
        "checkpoint": {"every_steps": 0},
    })


def one_process(folder: str, m: int, mbs: int, steps: int, layers: int) -> list[float]:
    """Step times of the paced model in this process, one thread, the M microbatches
    accumulated as the plain PyTorch loop does (SGD step after them)."""
    import importlib.util

    import torch

    torch.set_num_threads(1)
    found = importlib.util.spec_from_file_location("paced_layers_here", Path(folder, "paced_layers.py"))
    mod = importlib.util.module_from_spec(found)
    found.loader.exec_module(mod)
    torch.manual_seed(0)
    model = mod.build(layers=layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    xs = [torch.randn(mbs, 64) for _ in range(m)]
    ys = [torch.randint(0, 10, (mbs,)) for _ in range(m)]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for x, y in zip(xs, ys):
            (torch.nn.functional.cross_entropy(model(x), y) / m).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--pps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    args = ap.parse_args()

    import ray

    from actors.runner import run_job
    from machine import machine
    from service import schedules

    folder = tempfile.mkdtemp(prefix="relaytrain-paced-")
    Path(folder, "paced_layers.py").write_text(PACED)
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING", runtime_env={"env_vars": {"RAY_worker_niceness": "0"}})
    rows, t_start = [], time.time()
    for pp in args.pps:
        layers = 4 * pp  # 4 paced layers per worker (2 per chunk with 2 chunks)
        for m in args.ms:
            alone = one_process(folder, m, args.mbs, args.steps, layers)[2:]
            single = statistics.median(alone)
            rows.append({"schedule": "one process", "pp": pp, "M": m, "mbs": args.mbs, "step_s": single,
                         "steps": alone})
            print(f"p={pp} M={m:2d} {'one process':22s} step {single * 1e3:7.1f} ms", flush=True)
            for sch in args.schedules:
                s = spec(folder, sch, pp, m, args.mbs, args.steps, layers)
                final = run_job(spec=s, spec_dir=folder, out=tempfile.mkdtemp(), progress=False, record=False)
                timed = final["metrics"][SETTLED:]  # the first steps warm up and try the splits
                kept = [e["kept"] for e in final["events"] if e["type"] == "weight_split"]
                v = s.parallelism.chunks
                plan = float(schedules.simulate(schedules.build(sch, pp, m, v), 1, 1).bubble)
                step_s = statistics.median(r["step_time_s"] for r in timed)
                row = {"schedule": sch, "pp": pp, "M": m, "chunks": v, "mbs": args.mbs,
                       "step_s": step_s, "efficiency": single / pp / step_s,
                       "bubble": statistics.median(r["bubble"] for r in timed), "bubble_plan": plan,
                       "steps": [r["step_time_s"] for r in timed], "split_kept": kept[-1] if kept else None}
                rows.append(row)
                print(f"p={pp} M={m:2d} {LABEL[sch]:22s} step {row['step_s'] * 1e3:7.1f} ms  bubble "
                      f"{row['bubble']:.1%} (plan {plan:.1%})  efficiency {row['efficiency']:.2f}", flush=True)
    facts = machine()
    ray.shutdown()
    lines = [f"Paced layers: {4} per worker, forward, input gradient and weight gradient "
             f"0.25 ms per sample each, microbatches of {args.mbs}; median of {args.steps - SETTLED} steps; "
             f"collective transport; {time.strftime('%Y-%m-%d')}", "",
             "| p | M | schedule | step (ms) | vs 1F1B | measured bubble | plan bubble (F = B = W) "
             "| efficiency (one process / p / step) | split kept |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["schedule"] == "one process":
            lines.append(f"| {r['pp']} | {r['M']} | one process, one thread | {r['step_s'] * 1e3:.0f} | | | | | |")
            continue
        base = next(x for x in rows if x["pp"] == r["pp"] and x["M"] == r["M"] and x["schedule"] == "1f1b")
        lines.append(f"| {r['pp']} | {r['M']} | {LABEL[r['schedule']]} | {r['step_s'] * 1e3:.0f} | "
                     f"{base['step_s'] / r['step_s']:.2f}x | {r['bubble']:.1%} | {r['bubble_plan']:.1%} "
                     f"| {r['efficiency']:.2f} | {r.get('split_kept') or '-'} |")
    text = "\n".join(lines)
    print(text)
    out = BENCH / "results"
    name = "schedules_paced" + _subset(args, ap)
    (out / f"{name}.txt").write_text(text + "\n")
    (out / f"{name}.json").write_text(json.dumps(
        {"machine": facts, "seconds": time.time() - t_start, "rows": rows}, indent=1))
    print(f"wrote bench/results/{name}.txt and .json")


def _subset(args, ap) -> str:
    """"" for the whole default run; else what it ran, e.g. "_p2_m8" (a subset does not
    overwrite the whole run's results, which the README cites)."""
    parts = [f"{flag}{'-'.join(map(str, getattr(args, dest)))}" for flag, dest in
             (("p", "pps"), ("m", "ms"), ("mbs", "mbs"), ("steps", "steps"), ("", "schedules"))
             if getattr(args, dest) != ap.get_default(dest)]
    return "".join(f"_{x}" for x in parts)


if __name__ == "__main__":
    main()
