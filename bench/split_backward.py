"""What splitting a backward into B (input gradient) and W (weight gradient) costs on a CPU.

Zero-bubble schedules (zb_h1, zbv) run each chunk's backward in two calls: torch's
``stage_backward_input`` (the input's gradient, keeping what W needs) and later
``stage_backward_weight``; relaytrain splits chunks that hold plain ``nn.Linear`` layers its own
way (actors/deferred.py: B is the whole backward with each Linear's weight product left out,
W does those products).  This times, on one thread, a stage of 4 Linear(1024, 1024) + ReLU
blocks (bench/peers.py's model, half of it) at microbatches of 16, 32 and 64 rows: forward, the
whole backward, and B and W; and the pure matrix products of W (grad_out^T @ input per layer) for
comparison, and relaytrain's deferred-Linear B and W.  First it times a stage's whole step (M = 8,
forward and whole backward per microbatch) with torch's autograd against relaytrain's own weight
gradients, which every schedule uses for plain Linears.  The difference between B + W and the whole backward is what a split schedule must
win back from the bubble.  Last, a CNN stage whose Linear head holds most of the weights but
little of the weight-gradient work: torch's split (what relaytrain runs on such a chunk,
``deferred.covered``) against the head's own product alone in W, the convolutions' in B.  And a
stage of transformers' GPT-2 blocks, whose Conv1D projections relaytrain's own products cover.

    .venv/bin/python bench/split_backward.py
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from torch import nn  # noqa: E402

from actors import deferred  # noqa: E402
from actors.stage import stage_backward_input, stage_backward_weight  # noqa: E402


PURE = "W's matrix products"


def _stage() -> nn.Module:
    """Half of bench/peers.py's model: 4 blocks of Linear(1024, 1024) + ReLU."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()) for _ in range(4)])


def _conv_stage() -> nn.Module:
    """A middle stage of a small CNN: two Conv2d(32, 32, 3) on 16 x 16 images, then a Linear head
    (8192 -> 128) that holds 98% of the weights but about a fifth of the weight-gradient work."""
    return nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(32 * 16 * 16, 128), nn.ReLU())


def _gpt2_stage(d: int = 256, heads: int = 4, seq: int = 64) -> nn.Module:
    """4 transformers GPT2Blocks (width 256, 64 tokens; their projections are transformers'
    Conv1D, which relaytrain's own products cover since 2026-12-02): bench/gpt2_schedules.py's block."""
    from gpt2_schedules import GPT2

    ns: dict = {}
    exec(GPT2, ns)  # the module that bench writes for its jobs
    return nn.Sequential(*[ns["Block"](d, heads, seq) for _ in range(4)])


def measure(mbs: int, runs: int = 60, build=_stage, shape: tuple = (1024,)) -> dict:
    torch.manual_seed(0)
    model = build()
    params = list(model.parameters())
    got = {"forward": [], "whole backward": [], "B": [], "W": [], "deferred B": [], "deferred W": []}
    pending = deferred.Pending()
    with torch.no_grad():
        out_shape = model(torch.zeros(mbs, *shape)).shape
    for i in range(runs):
        for split in (False, True, "deferred"):
            x = torch.randn(mbs, *shape, requires_grad=True)
            g = torch.randn(out_shape)
            t0 = time.perf_counter()
            out = model(x)
            t1 = time.perf_counter()
            if split == "deferred":
                pending.into = []
                torch.autograd.backward(out, g)
                t2 = time.perf_counter()
                deferred.weight_grads(pending.into)
                t3 = time.perf_counter()
                pending.into = None
                if i >= 10:
                    got["deferred B"].append(t2 - t1)
                    got["deferred W"].append(t3 - t2)
            elif split:
                _, groups = stage_backward_input([out], [g], [x], iter(params))
                t2 = time.perf_counter()
                stage_backward_weight(iter(params), groups)
                t3 = time.perf_counter()
                if i >= 10:
                    got["B"].append(t2 - t1)
                    got["W"].append(t3 - t2)
            else:
                torch.autograd.backward(out, g)
                t2 = time.perf_counter()
                if i >= 10:
                    got["forward"].append(t1 - t0)
                    got["whole backward"].append(t2 - t1)
            for p in params:  # zeroed in place: every backward accumulates, as microbatches 2..M of a
                if p.grad is not None:  # step do and as gradient-sum buckets do; no page faults of new
                    p.grad.zero_()      # gradients in the figures (allocator noise of 2x here)
            if split is True:
                deferred.install(model, pending)
            elif split == "deferred":
                deferred.uninstall(model)
    out = {k: statistics.median(v) * 1e3 for k, v in got.items()}
    if build is not _stage:
        return out
    a, go = torch.randn(mbs, 1024), torch.randn(mbs, 1024)
    acc, bias = torch.zeros(1024, 1024), torch.zeros(1024)
    t0 = time.perf_counter()
    for _ in range(runs):
        for _ in range(4):
            acc.addmm_(go.t(), a)
            bias.add_(go.sum(0))
    out[PURE] = (time.perf_counter() - t0) / runs * 1e3
    return out


def measure_step(mbs: int, m: int = 8, runs: int = 40) -> dict:
    """A stage's step as 1F1B runs it on one worker: m microbatches' forward and whole backward,
    the gradients starting from none; torch's autograd (AccumulateGrad: a new gradient per
    Linear, added) against relaytrain's own weight gradients (one addmm_ into ``.grad``), which
    every schedule uses for plain Linears.  Alternated run by run; median and best (ms), and
    the minor page faults per step (a new 4 MiB gradient above glibc's mmap threshold faults in
    1024 fresh pages)."""
    import resource

    torch.manual_seed(0)
    models = {}
    for how in ("autograd", "own"):
        model = _stage()
        if how == "own":
            deferred.install(model, deferred.Pending())
        models[how] = model
    xs = [torch.randn(mbs, 1024, requires_grad=True) for _ in range(m)]
    gs = [torch.randn(mbs, 1024) for _ in range(m)]
    times = {how: [] for how in models}
    faults = {how: 0 for how in models}
    for i in range(runs):
        for how, model in models.items():
            for p in model.parameters():
                p.grad = None
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            for x, g in zip(xs, gs):
                torch.autograd.backward(model(x), g)
            if i >= 5:
                times[how].append(time.perf_counter() - t0)
                faults[how] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    return {how: (statistics.median(v) * 1e3, min(v) * 1e3, faults[how] / len(v)) for how, v in times.items()}


def main() -> None:
    torch.set_num_threads(1)
    print("A stage's step: 4 x (Linear(1024, 1024) + ReLU), M = 8, forward + whole backward per microbatch, "
          "median / best ms, minor page faults per step")
    print("| rows | torch autograd | relaytrain's own weight gradients | less time (median) | page faults autograd / own |")
    print("|---|---|---|---|---|")
    for mbs in (16, 32, 64):
        r = measure_step(mbs)
        (am, ab, af), (om, ob, of) = r["autograd"], r["own"]
        print(f"| {mbs} | {am:.1f} / {ab:.1f} | {om:.1f} / {ob:.1f} | {1 - om / am:.0%} | {af:.0f} / {of:.0f} |")
    print()
    print("| rows | forward (ms) | whole backward | torch B | torch W | B + W over whole | W's matrix products "
          "| deferred B | deferred W | B + W over whole |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mbs in (16, 32, 64):
        m = measure(mbs)
        bw = m["B"] + m["W"]
        dw = m["deferred B"] + m["deferred W"]
        print(f"| {mbs} | {m['forward']:.2f} | {m['whole backward']:.2f} | {m['B']:.2f} | {m['W']:.2f} | "
              f"{bw / m['whole backward'] - 1:+.0%} | {m[PURE]:.2f} | {m['deferred B']:.2f} | {m['deferred W']:.2f} | "
              f"{dw / m['whole backward'] - 1:+.0%} |")
    model = _conv_stage()
    deferred.install(model, deferred.Pending())
    rows: dict = {}
    deferred.count_rows(model, rows)
    with torch.no_grad():
        model(torch.zeros(4, 32, 16, 16))
    deferred.forget_rows(model)
    head = sum(q.numel() for q in model[5].parameters()) / sum(q.numel() for q in model.parameters())
    print()
    print(f"A CNN stage (2 x Conv2d(32, 32, 3) on 16 x 16, a Linear head 8192 -> 128: {head:.0%} of the weights, "
          f"{deferred.covered(model, rows):.0%} of the weight-gradient work): torch's split (every weight gradient in W, "
          "what relaytrain runs on it) against the Linear's own product alone in W (the convolutions' in B, "
          "what it ran when the rule weighed weight elements), ms")
    print("| rows | forward | whole backward | torch B | torch W | B + W over whole | Linear-only B | Linear-only W "
          "| B + W over whole |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mbs in (16, 32, 64):
        m = measure(mbs, runs=30, build=_conv_stage, shape=(32, 16, 16))
        bw = m["B"] + m["W"]
        dw = m["deferred B"] + m["deferred W"]
        print(f"| {mbs} | {m['forward']:.2f} | {m['whole backward']:.2f} | {m['B']:.2f} | {m['W']:.2f} | "
              f"{bw / m['whole backward'] - 1:+.0%} | {m['deferred B']:.2f} | {m['deferred W']:.2f} | "
              f"{dw / m['whole backward'] - 1:+.0%} |")


    print()
    print("A GPT-2 stage (4 transformers GPT2Blocks, width 256, 64 tokens a sequence; its projections are "
          "transformers' Conv1D): torch's split against relaytrain's own Conv1D products in W (the norms' "
          "and attention's other gradients in B), ms; rows = sequences a microbatch")
    print("| sequences | forward | whole backward | torch B | torch W | B + W over whole | own B | own W "
          "| B + W over whole |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mbs in (2, 4, 8):
        m = measure(mbs, runs=30, build=_gpt2_stage, shape=(64, 256))
        bw = m["B"] + m["W"]
        dw = m["deferred B"] + m["deferred W"]
        print(f"| {mbs} | {m['forward']:.2f} | {m['whole backward']:.2f} | {m['B']:.2f} | {m['W']:.2f} | "
              f"{bw / m['whole backward'] - 1:+.0%} | {m['deferred B']:.2f} | {m['deferred W']:.2f} | "
              f"{dw / m['whole backward'] - 1:+.0%} |")


if __name__ == "__main__":
    main()
