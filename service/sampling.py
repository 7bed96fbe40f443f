"""The sample order: a pure function of (seed, epoch, step), whatever the shape.

Step g (0-based) of epoch e = g // (N // B) uses positions [s*B, (s+1)*B),
s = g % (N // B), of the epoch's order: ``torch.arange(N)`` without shuffle,
``torch.randperm(N, generator=torch.Generator().manual_seed(seed + e))`` with it.
Microbatch j of the step is positions [j*mbs, (j+1)*mbs) of the step's batch.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=4)
def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    if not shuffle:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


def step_indices(step: int, n: int, batch: int, seed: int, shuffle: bool) -> torch.Tensor:
    per_epoch = n // batch
    if per_epoch < 1:
        raise ValueError(f"{n} samples cannot fill a batch of {batch}")
    epoch, s = divmod(step, per_epoch)
    return epoch_order(n, seed, epoch, shuffle)[s * batch:(s + 1) * batch]


def microbatches(samples, idx: torch.Tensor, mbs: int, inputs: bool, targets: bool, device) -> tuple:
    """Samples ``idx`` cut into microbatches of ``mbs``: (inputs or None, targets or None)."""
    xs = list(samples.inputs(idx).to(device).split(mbs)) if inputs else None
    ys = list(samples.targets(idx).to(device).split(mbs)) if targets else None
    return xs, ys
