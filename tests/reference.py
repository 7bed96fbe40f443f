"""The plain single-process PyTorch loop every relaytrain run must equal.

Written from the README's semantics alone (not from the engine's code): the initial
parameters are ``torch.manual_seed(seed); builder()``, step g of epoch e uses positions
[s*B, (s+1)*B) of the epoch's order, and the loss is the mean over the global batch.
"""
from __future__ import annotations

import torch

from service.loading import build_optimizer, load_job
from service.spec import JobSpec


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    if not shuffle:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


def train(spec: JobSpec, steps: int | None = None, search=(), microbatched: bool = False) -> tuple[dict, list[float]]:
    """Parameters and losses after ``steps``.  ``microbatched``: the model sees one microbatch
    at a time (each loss scaled by mbs / B), for models whose output depends on the batch."""
    job = load_job(spec, search)
    model = job.model
    opt = build_optimizer(spec, model.parameters())
    t = spec.training
    n, b = len(job.samples), t.global_batch_size
    losses = []
    for g in range(t.steps if steps is None else steps):
        e, s = divmod(g, n // b)
        idx = epoch_order(n, t.seed, e, t.shuffle)[s * b:(s + 1) * b]
        x, y = job.samples.batch(idx)
        opt.zero_grad()
        if microbatched:
            m, loss = t.microbatch_size, torch.zeros(())
            for j in range(0, b, m):
                part = job.loss(model(x[j:j + m]), y[j:j + m]) * (m / b)
                part.backward()
                loss = loss + part.detach()
        else:
            loss = job.loss(model(x), y)
            loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses
