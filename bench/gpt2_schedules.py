"""transformers' GPT-2 blocks on 2 workers: 1F1B, ZB-H1 and ZB-V, real compute.

GPT-2's projections are transformers' ``Conv1D`` (``addmm(b, x, W)``, a Linear with its weight
stored transposed).  Since 2026-12-02 the workers compute those weight products themselves after
the input gradient is sent (actors/deferred.py), as they do for ``nn.Linear``: 1F1B sends every
input gradient early and the split schedules keep the products for W without a trial.  Before,
those chunks counted as holding no Linear: 1F1B split only its last backward torch's way, and
ZB-H1 / ZB-V tried torch's split against the whole backward in steps 2-8.  Run this from two
checkouts to compare engines (the table names the commit).

The model: character embedding (96 symbols, 64 a sequence), 8 GPT2Blocks of width 256 (4 heads),
a LayerNorm and a head; fp32, one thread per worker; p = 2, M = 8, microbatches of 2, 4 and 8
sequences; the schedules alternate round by round; steps from the 11th are timed.

    .venv/bin/python bench/gpt2_schedules.py [--mbs 2 4 8] [--rounds 2] [--steps 18] [--out NAME]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

GPT2 = '''"""bench/gpt2_schedules.py's model: transformers GPT-2 blocks in a layer list."""
import functools

import torch
from torch import nn


class Embed(nn.Module):
    def __init__(self, vocab, d, context):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(context, d) * 0.02)

    def forward(self, idx):
        return self.tok(idx) + self.pos[: idx.shape[1]]


class Block(nn.Module):
    def __init__(self, d, heads, context):
        super().__init__()
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        cfg = GPT2Config(n_embd=d, n_head=heads, n_positions=context, attn_implementation="eager",
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.block = GPT2Block(cfg)

    def forward(self, x):
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def build(vocab=96, d=256, heads=4, layers=8, context=64):
    entries = [functools.partial(Embed, vocab, d, context)]
    entries += [functools.partial(Block, d, heads, context) for _ in range(layers)]
    entries += [functools.partial(nn.LayerNorm, d), functools.partial(nn.Linear, d, vocab)]
    return {"layers": entries}
'''

RUNS = {"1F1B": ("1f1b", 1), "ZB-H1": ("zb_h1", 1), "ZB-V": ("zbv", 2)}


def spec(name: str, m: int, mbs: int, steps: int):
    from service.spec import parse_spec

    schedule, v = RUNS[name]
    par = {"dp": 1, "pp": 2, "schedule": schedule, "transport": "collective"}
    if v > 1:
        par["stages_per_worker"] = v
    return parse_spec({
        "name": f"gpt2-{schedule}-m{m}-b{mbs}".replace("_", "-"),
        "model": {"builder": "gpt2_layers:build"}, "data": {"kind": "chars", "args": {"context": 64, "stride": 16}},
        "loss": "cross_entropy", "optimizer": {"name": "adamw", "lr": 1e-3},
        "training": {"global_batch_size": m * mbs, "microbatch_size": mbs, "steps": steps, "seed": 0},
        "parallelism": par, "resources": {"cpus_per_worker": 1}, "checkpoint": {"every_steps": 0}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mbs", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=18)
    ap.add_argument("--out", default="gpt2_schedules", help="results file name under bench/results (.txt)")
    args = ap.parse_args()

    import ray

    from conv_schedules import SETTLED, alternate

    commit = subprocess.run(["git", "-C", str(BENCH), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "?"
    folder = tempfile.mkdtemp(prefix="relaytrain-gpt2-")
    Path(folder, "gpt2_layers.py").write_text(GPT2)
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"RAY_worker_niceness": "0"}})
    lines = [f"GPT-2 blocks (transformers, width 256, 8 blocks, 64 tokens) on p = 2, M = {args.m}, commit {commit}; "
             f"median step (ms) over {args.rounds} alternated rounds of {args.steps - SETTLED} timed steps, "
             f"measured bubble median; {time.strftime('%Y-%m-%d %H:%M')}", "",
             "| sequences | schedule | step (ms) | vs 1F1B | measured bubble | plan bubble | sends early | split kept |",
             "|---|---|---|---|---|---|---|---|"]
    for mbs in args.mbs:
        got = alternate(list(RUNS), lambda name: spec(name, args.m, mbs, args.steps), args.rounds, folder,
                        f"sequences {mbs}")
        base = statistics.median(x["step_time_s"] for x in got["1F1B"]["rows"])
        for name in RUNS:
            med = statistics.median(x["step_time_s"] for x in got[name]["rows"])
            bubble = statistics.median(x["bubble"] for x in got[name]["rows"])
            last = got[name]["last"]
            early = "all" if last.get("sends_early") else "last" if last.get("last_sent_early") else "no"
            lines.append(f"| {mbs} | {name} | {med * 1e3:.0f} | {base / med:.2f}x | {bubble:.1%} | "
                         f"{last['bubble_plan']:.1%} | {early} | {', '.join(got[name]['kept']) or '-'} |")
    ray.shutdown()
    text = "\n".join(lines)
    print(text)
    (BENCH / "results" / f"{args.out}.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
