"""Cutting a Sequential into contiguous stages.

``balanced`` uses a short profile of each layer (forward + backward on a sample
microbatch) and minimises the slowest stage; ``uniform`` splits layer counts evenly;
an explicit list gives the layer count of each stage.
"""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Sequence, Union

if TYPE_CHECKING:  # torch is imported where a layer is profiled: a job's scheduler plans without it
    import torch
    from torch import nn


def profile_layers(model: nn.Sequential, x: torch.Tensor, repeats: int = 5, threads: int | None = None) -> list[float]:
    """Median seconds of forward + backward of each layer on input ``x`` (after one
    warm-up pass), with ``threads`` torch threads as a worker would have."""
    import torch

    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _profile(model, x, repeats)
    finally:
        torch.set_num_threads(old_threads)


def _profile(model: nn.Sequential, x: torch.Tensor, repeats: int) -> list[float]:
    import torch

    inputs = []
    with torch.no_grad():
        h = x
        for layer in model:
            inputs.append(h)
            h = layer(h)
    costs = []
    for layer, inp in zip(model, inputs):
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            a = inp.detach().requires_grad_(inp.is_floating_point())
            out = layer(a)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            times.append(time.perf_counter() - t0)
        costs.append(statistics.median(times[1:]))  # the first run warms caches and allocators
    model.zero_grad(set_to_none=True)
    return costs


def uniform(layers: int, stages: int) -> list[int]:
    base, extra = divmod(layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def balanced(costs: Sequence[float], stages: int) -> list[int]:
    """Contiguous split of ``costs`` into ``stages`` non-empty parts minimising the largest
    part's sum (ties broken towards the earlier cut)."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][j]: minimal max-stage cost of the first j layers in k stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], prefix[j] - prefix[i])
                if v < best[k][j] - 1e-15:
                    best[k][j], cut[k][j] = v, i
    sizes, j = [], n
    for k in range(stages, 0, -1):
        i = cut[k][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


def bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Layer ranges [start, end) of each stage."""
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


def chunk_of(bounds: Sequence[tuple[int, int]], layer: int) -> int:
    """The stage (model chunk) of ``bounds`` that holds ``layer``."""
    return next(vs for vs, (lo, hi) in enumerate(bounds) if lo <= layer < hi)


def choose(partition: Union[str, list[int]], layers: int, stages: int, costs: Sequence[float] | None = None) -> list[int]:
    if isinstance(partition, list):
        if len(partition) != stages or sum(partition) != layers or min(partition) < 1:
            raise ValueError(f"partition {partition} does not cut {layers} layers into {stages} stages")
        return list(partition)
    if stages > layers:
        raise ValueError(f"cannot cut {layers} layers into {stages} stages")
    if partition == "uniform" or costs is None:
        return uniform(layers, stages)
    return balanced(costs, stages)
