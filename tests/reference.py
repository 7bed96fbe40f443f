"""The plain single-process PyTorch loop every relaytrain run must equal.

Written from the README's semantics alone (not from the engine's code): the initial
parameters are ``torch.manual_seed(seed); builder()`` for an nn.Sequential builder, and for a
layer list layer i is built after ``torch.manual_seed(s_i)``, s_i from sha256 of
"{seed}:{i}", into ``nn.Sequential(*layers)`` with each tie one shared parameter; step g of epoch e uses positions
[s*B, (s+1)*B) of the epoch's order, and the loss is the mean over the global batch.
"""
from __future__ import annotations

import torch

import hashlib

from torch import nn

from service import builtins
from service.loading import build_data, build_loss, build_optimizer, import_object
from service.spec import JobSpec


def build(spec: JobSpec, search=()) -> nn.Sequential:
    m = spec.model
    fn = builtins.MODELS[m.kind] if m.kind else import_object(m.builder, "model.builder", search)
    torch.manual_seed(spec.training.seed)
    out = fn(**m.args)
    if isinstance(out, nn.Sequential):
        return out
    makers, tied = (out["layers"], out.get("tied", [])) if isinstance(out, dict) else (out, [])
    layers = []
    for i, make in enumerate(makers):
        seed = int.from_bytes(hashlib.sha256(f"{spec.training.seed}:{i}".encode()).digest()[:8], "little") >> 1
        torch.manual_seed(seed)
        layers.append(make())
    model = nn.Sequential(*layers)
    for first, *others in tied:
        for name in others:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, model.get_parameter(first))
    return model


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    if not shuffle:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


def train(spec: JobSpec, steps: int | None = None, search=(), microbatched: bool = False) -> tuple[dict, list[float]]:
    """Parameters and losses after ``steps``.  ``microbatched``: the model sees one microbatch
    at a time (each loss scaled by mbs / B), for models whose output depends on the batch."""
    model = build(spec, search)
    samples, loss_fn = build_data(spec, search), build_loss(spec, search)
    opt = build_optimizer(spec, model.parameters())
    t = spec.training
    n, b = len(samples), t.global_batch_size
    losses = []
    for g in range(t.steps if steps is None else steps):
        e, s = divmod(g, n // b)
        idx = epoch_order(n, t.seed, e, t.shuffle)[s * b:(s + 1) * b]
        x, y = samples.batch(idx)
        opt.zero_grad()
        if microbatched:
            m, loss = t.microbatch_size, torch.zeros(())
            for j in range(0, b, m):
                part = loss_fn(model(x[j:j + m]), y[j:j + m]) * (m / b)
                part.backward()
                loss = loss + part.detach()
        else:
            loss = loss_fn(model(x), y)
            loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses
