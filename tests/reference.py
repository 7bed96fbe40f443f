"""The plain single-process PyTorch loop every relaytrain run must equal.

Written from the README's semantics alone (not from the engine's code): the initial
parameters are ``torch.manual_seed(seed); builder()`` for an nn.Sequential builder, and for a
layer list layer i is built after ``torch.manual_seed(s_i)``, s_i from sha256 of
"{seed}:{i}", into ``nn.Sequential(*layers)`` with each tie one shared parameter; step g of epoch e uses positions
[s*B, (s+1)*B) of the epoch's order, and the loss is the mean over the global batch.

The training recipe (issue 16), per step s (1-based): every param_group's lr is
``lr_at(spec, s)``; the gradient norm is the total L2 norm over the model's parameters (a tied
parameter is one parameter here, so it counts once); a non-finite norm skips the step
(``training.skip_nonfinite``) or raises :class:`FloatingPointError` naming the step; with
``training.grad_clip_norm`` every gradient is scaled as ``clip_grad_norm_`` does; ``bf16``
runs forward and loss under ``torch.autocast`` (backward outside it, parameters, gradients and
optimizer state fp32); ``activation_checkpointing`` wraps each entry of the Sequential in
``checkpoint(layer, x, use_reentrant=False)``; ``eval`` takes the mean of the per-batch mean
losses over the first ``batches x B`` eval samples in order, after every ``every_steps`` steps
and after step ``training.steps``, with no grad, in ``model.eval()`` mode and under the same
autocast as training.  A spec without these fields trains bit-identically to the loop before them.

Randomness (issue 22): with ``microbatched``, entry i of the model runs its forward on microbatch j
of step s after ``torch.manual_seed(forward_seed(seed, s, j, i))``, so dropout draws the masks
the pipeline draws.
"""
from __future__ import annotations

import contextlib
import math

import torch

import hashlib

from torch import nn
from torch.utils.checkpoint import checkpoint

from service import builtins
from service.loading import (Samples, build_data, build_loss, build_optimizer, counted_targets, cross_entropy_sum,
                             forward_seed, import_object)
from service.recipe import lr_at
from service.spec import JobSpec, SpecError
from service.tracing import norms_of
from relaytrain import skip


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
    out = run(spec, steps, search, microbatched)
    return out["params"], out["losses"]


def run(spec: JobSpec, steps: int | None = None, search=(), microbatched: bool = False) -> dict:
    """:func:`train` with the recipe's per-step figures.  Returns a dict:

    - ``params``: ``{name: tensor}``, the state_dict after the last step (as :func:`train`);
    - ``losses``: the loss of each step (mean over the global batch; a skipped step's too);
    - ``lr``: the learning rate each step used, ``lr_at(spec, s)`` for s = 1, 2, ...;
    - ``grad_norm``: each step's total gradient norm before clipping (inf or nan on a bad step);
    - ``skipped``: the 1-based steps skipped for a non-finite norm (``training.skip_nonfinite``);
    - ``eval``: ``{step: eval loss}`` for the steps evaluated (empty without ``eval``).

    ``steps`` stops early; the schedule and the eval after the last step still refer to
    ``training.steps``, so a shorter run is a prefix of the full one."""
    model = build(spec, search)
    samples, loss_fn = build_data(spec, search), build_loss(spec, search)
    params = list(model.parameters())  # a tie is one parameter: counted once in the norm
    opt = build_optimizer(spec, params)
    t = spec.training
    n, b = len(samples), t.global_batch_size
    amp = _autocast(spec, model)
    eval_samples = eval_data(spec, search) if spec.eval is not None else None
    out: dict = {"losses": [], "lr": [], "grad_norm": [], "skipped": [], "eval": {}}
    for g in range(t.steps if steps is None else steps):
        step = g + 1
        e, s = divmod(g, n // b)
        idx = epoch_order(n, t.seed, e, t.shuffle)[s * b:(s + 1) * b]
        x, y = samples.batch(idx)
        opt.zero_grad()
        kept = _norm_buffers(model) if t.skip_nonfinite else None  # a skipped step leaves them as they were
        if microbatched and t.batch_norm == "global":
            m = t.microbatch_size
            with amp():
                outs = forward_together(model, list(x.split(m)), t.activation_checkpointing, (t.seed, step))
                loss = sum(loss_fn(o, yj) * (m / b) for o, yj in zip(outs, y.split(m)))
            loss.backward()
            loss = loss.detach()
        elif microbatched:
            m, loss = t.microbatch_size, torch.zeros(())
            deferred_norms = _DeferredNorms(model) if t.batch_norm == "deferred" else None
            counted = counted_targets(spec, y)  # padding (-100): the mean over the batch's counted targets
            for j in range(0, b, m):
                with amp():
                    pred = forward(model, x[j:j + m], t.activation_checkpointing, (t.seed, step, j // m))
                    part = (loss_fn(pred, y[j:j + m]) * (m / b) if counted is None
                            else cross_entropy_sum(pred, y[j:j + m]) / counted)
                part.backward()
                loss = loss + part.detach()
            if deferred_norms is not None:
                deferred_norms.finish()
        else:
            with amp():
                loss = loss_fn(forward(model, x, t.activation_checkpointing), y)
            loss.backward()
        lr = lr_at(spec, step)
        for group in opt.param_groups:
            group["lr"] = lr
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        out["losses"].append(loss.item())
        out["lr"].append(lr)
        out["grad_norm"].append(norm.item())
        if not math.isfinite(norm.item()):
            if not t.skip_nonfinite:
                raise FloatingPointError(f"step {step}: the gradient norm is {norm.item()}; the step's loss is "
                                         f"{loss.item()} (set training.skip_nonfinite: true to skip such steps)")
            out["skipped"].append(step)
            with torch.no_grad():
                for v, was in kept:
                    v.copy_(was)
        else:
            if t.grad_clip_norm is not None:
                torch.nn.utils.clip_grads_with_norm_(params, t.grad_clip_norm, norm)
            opt.step()
        if eval_samples is not None and (step % spec.eval.every_steps == 0 or step == t.steps):
            out["eval"][step] = evaluate(spec, model, eval_samples, loss_fn, microbatched)
    out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _norm_buffers(model: nn.Module) -> list:
    """(buffer, a copy of it) for every BatchNorm's running statistics."""
    return [(v, v.clone()) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            for v in m.buffers()]


class _DeferredNorms:
    """``training.batch_norm: deferred`` in one process: the microbatches' forwards leave the
    BatchNorm buffers as they were; after the last, each BatchNorm runs once, in training mode
    and without gradients, on its inputs of the whole global batch (concatenated in microbatch
    order): one process's update after one forward of the whole batch."""

    def __init__(self, model: nn.Module):
        self.norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                      and m.track_running_stats]
        self.saved = [{k: v.clone() for k, v in m.named_buffers()} for m in self.norms]
        self.inputs: list[list] = [[] for _ in self.norms]
        self.hooks = [m.register_forward_pre_hook(lambda mod, args, i=i: self.inputs[i].append(args[0].detach()))
                      for i, m in enumerate(self.norms)]

    def finish(self) -> None:
        for h in self.hooks:
            h.remove()
        with torch.no_grad():
            for m, saved, xs in zip(self.norms, self.saved, self.inputs):
                for k, v in m.named_buffers():
                    v.copy_(saved[k])
                if xs:
                    m(torch.cat(xs))


def forward(model: nn.Sequential, x: torch.Tensor, checkpointing: bool = False, seeds=None) -> torch.Tensor:
    """The model's output; with ``checkpointing`` each top-level entry is recomputed in backward.
    ``seeds`` = (training.seed, step, microbatch): entry i runs after
    ``torch.manual_seed(forward_seed(seed, step, microbatch, i))`` (its dropout masks)."""
    if not checkpointing and seeds is None:
        return model(x)
    for i, layer in enumerate(model):
        if seeds is not None:
            torch.manual_seed(forward_seed(*seeds, i))
        x = checkpoint(layer, x, use_reentrant=False) if checkpointing else layer(x)
    return x


def forward_together(model: nn.Sequential, xs: list, checkpointing: bool, seeds: tuple) -> list:
    """``training.batch_norm: global`` in one process: entry by entry, each microbatch j through
    an entry after ``torch.manual_seed(forward_seed(seed, step, j, i))``, except that an entry
    holding a BatchNorm runs once on all the microbatches concatenated (its BatchNorm sees the
    whole batch; such an entry must have no randomness of its own here) and is not checkpointed."""
    hs, trackers = list(xs), [skip.Tracker() for _ in xs]  # each microbatch's skips apart
    for i, layer in enumerate(model):
        if norms_of(layer):
            hs = list(layer(torch.cat(hs)).split([h.shape[0] for h in hs]))
            continue
        for j, h in enumerate(hs):
            torch.manual_seed(forward_seed(*seeds[:2], j, i))
            with skip.use_tracker(trackers[j]):
                hs[j] = checkpoint(layer, h, use_reentrant=False) if checkpointing else layer(h)
    return hs


def _autocast(spec: JobSpec, model: nn.Module):
    """A factory of the forward's context: bf16 autocast on the parameters' device type, or nothing."""
    if spec.training.precision != "bf16":
        return contextlib.nullcontext
    device = next((p.device.type for p in model.parameters()), "cpu")
    return lambda: torch.autocast(device_type=device, dtype=torch.bfloat16)


def eval_data(spec: JobSpec, search=()) -> Samples:
    """The eval samples, built like the job's data (``eval.data``), holding ``batches x B``."""
    samples = build_data(spec.model_copy(update={"data": spec.eval.data}), search)
    need = spec.eval.batches * spec.training.global_batch_size
    if len(samples) < need:
        raise SpecError(f"eval.data gave {len(samples)} samples, fewer than eval.batches x "
                        f"training.global_batch_size ({need}); lower eval.batches or give more eval data")
    return samples


def evaluate(spec: JobSpec, model: nn.Sequential, samples: Samples, loss_fn, microbatched: bool = False) -> float:
    """The mean of the per-batch mean losses over the first ``eval.batches x B`` samples, in order."""
    b, m = spec.training.global_batch_size, spec.training.microbatch_size
    amp = _autocast(spec, model)
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        with torch.no_grad():
            for i in range(spec.eval.batches):
                x, y = samples.batch(torch.arange(i * b, (i + 1) * b))
                with amp():
                    counted = counted_targets(spec, y)
                    if microbatched and counted is not None:
                        loss = sum(cross_entropy_sum(model(x[j:j + m]), y[j:j + m]).float() / counted
                                   for j in range(0, b, m))
                    elif microbatched:
                        loss = sum(loss_fn(model(x[j:j + m]), y[j:j + m]).float() * (m / b) for j in range(0, b, m))
                    else:
                        loss = loss_fn(model(x), y)
                total += loss.item()
    finally:
        model.train(was_training)
    return total / spec.eval.batches
