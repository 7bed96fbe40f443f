"""Weight gradients of ``nn.Linear`` layers deferred from B to W, for the zero-bubble schedules.

A split schedule (zb_h1, zbv) runs each chunk's backward as B, the gradient of the chunk's
input (the next stage back waits for it), and later W, the weight gradients (which fill the
bubble).  torch's ``stage_backward_input`` / ``stage_backward_weight`` split any graph, but on a
CPU they cost 27-61 % more than the whole backward (bench/split_backward.py): W runs the
autograd engine once per parameter group, through graph nodes kept alive from B.

Most of a model's weights sit in ``nn.Linear`` layers (or transformers' ``Conv1D``, GPT-2's
projections: the same layer with its weight stored transposed), whose weight gradient is one
matrix product: ``grad_out^T @ input`` (``input^T @ grad_out`` for a ``Conv1D``).  So where a
chunk holds plain ``nn.Linear`` layers (or the built-in models' ``Linear``, which only casts its
input to the weight's dtype first), their forward goes through ``_Linear`` below (a ``Conv1D``'s
through ``_Conv1D``, the ``addmm`` its own forward runs): in B the autograd engine computes the input gradient
(and every other layer's gradients) as in a whole backward, while each Linear only keeps its
(input, grad_out) pair; W does the matrix products, each straight into ``.grad``
(``grad.addmm_(g^T, x)``), where autograd computes a new gradient and adds it.  B + W then
costs no more than the whole backward (bench/split_backward.py).  The layer's forward and its
gradients are the same operations ``nn.Linear`` runs, so the numbers equal a whole backward's
up to summation order.

A weight's first gradient of a step is written into the memory of its gradient of the step
before, where nothing holds that any more (``_new_grad``; actors/heap.py: freed and asked for
anew each step, those blocks fragmented the heap).

Only the worker's own copies of the layers are touched (an instance attribute ``forward``,
removed again by ``uninstall``); the user's class and its state dict are unchanged.
"""
from __future__ import annotations

import sys
import weakref
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from actors.collectives import got_gradient
from service import schedules, tracing


class Pending:
    """Where the Linear layers of a backward leave what their weight gradients need: the
    runner points ``into`` at a fresh list before each backward and hands it to W."""

    def __init__(self) -> None:
        self.into: Optional[list] = None


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, pending):
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.pending = module, pending
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx = g.matmul(weight) if ctx.needs_input_grad[0] else None
        _keep_pair(ctx, x, g)
        return gx, None, None, None, None


class _Conv1D(torch.autograd.Function):
    """transformers' ``Conv1D`` (``addmm(b, x, W)``, the weight stored (in, out)) as ``_Linear``:
    the input gradient in B, the (input, grad_out) pair kept for W."""

    @staticmethod
    def forward(ctx, x, weight, bias, module, pending):
        x2 = x.view(-1, x.size(-1))
        ctx.save_for_backward(x2, weight)
        ctx.module, ctx.pending, ctx.shape = module, pending, x.shape
        return torch.addmm(bias, x2, weight).view(x.size()[:-1] + (weight.shape[1],))

    @staticmethod
    def backward(ctx, g):
        x2, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])
        gx = g2.mm(weight.t()).view(ctx.shape) if ctx.needs_input_grad[0] else None
        _keep_pair(ctx, x2, g2)
        return gx, None, None, None, None


def _keep_pair(ctx, x: torch.Tensor, g: torch.Tensor) -> None:
    """A layer's (input, grad_out) pair for W, where its weight or bias wants a gradient; in a
    backward outside the runner's B, its weight gradients at once."""
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        if ctx.pending.into is None:
            weight_grads([(ctx.module, x, g)])
        else:
            ctx.pending.into.append((ctx.module, x, g))


def _accumulate(p: nn.Parameter, value: torch.Tensor) -> None:
    """As autograd's AccumulateGrad: into ``.grad`` in place (it may be a view into a
    gradient-sum bucket), or a fresh ``.grad``."""
    if p.grad is None:
        p.grad = value
    else:
        p.grad.add_(value)
    got_gradient(p)


# each weight's gradient of the step before, kept after ``zero_grad(set_to_none=True)`` let go
# of it: the next step's first product is written into it (actors/heap.py: a gradient freed and
# allocated anew every step fragmented the heap, and the heap grew into fresh pages)
# (by the weight's id: a tensor is no dictionary key; dropped when the weight is)
_spare: dict = {}


def _keep(w: torch.Tensor, grad: torch.Tensor) -> None:
    key = id(w)
    _spare[key] = (weakref.ref(w, lambda _, key=key: _spare.pop(key, None)), grad)


def _new_grad(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as ``w``'s new gradient: in the memory of its gradient of the step before
    where nothing holds that any more (no ``.grad``, no view, no gradient bucket, no reference
    kept by the user's code), else in new memory."""
    ref, spare = _spare.pop(id(w), (None, None))
    try:  # Python's references (here: ``spare`` and the call's argument), then torch's
        unheld = (spare is not None and sys.getrefcount(spare) == 2 and spare._use_count() == 1
                  and torch._C._storage_Use_Count(spare.untyped_storage()._cdata) == 2)
    except (AttributeError, RuntimeError):  # private: a torch without them allocates anew
        unheld = False
    if (unheld and ref() is w and spare.shape == (a.shape[0], b.shape[1]) and spare.dtype == a.dtype
            and spare.device == a.device):
        out = torch.mm(a, b, out=spare)
    else:
        del spare
        out = a.mm(b)
    _keep(w, out)
    return out


@torch.no_grad()
def weight_grads(pending: list) -> None:
    """W: each Linear's weight (and bias) gradient from its (input, grad_out) pairs: ``g^T x``
    for an ``nn.Linear`` (weight (out, in)), ``x^T g`` for a ``Conv1D`` (weight (in, out))."""
    for module, x, g in pending:
        g2 = g.reshape(-1, g.shape[-1])
        w = module.weight
        if w.requires_grad:
            x2 = x.reshape(-1, x.shape[-1])
            a, b = (g2.t(), x2) if isinstance(module, nn.Linear) else (x2.t(), g2)
            if w.grad is None:
                w.grad = _new_grad(w, a, b)
            else:  # one product into the gradient, no temporary the size of the weight
                w.grad.addmm_(a, b)
            got_gradient(w)
        if module.bias is not None and module.bias.requires_grad:
            _accumulate(module.bias, g2.sum(0))


@torch.no_grad()
def weight_grads_grouped(whats: list) -> None:
    """W of several microbatches (``parallelism.weight_group``): each Linear's weight gradient
    as one product over the rows of all of them, ``grad += cat(g)^T @ cat(x)``, where W of each
    alone reads and writes the gradient once per microbatch.  The same terms, summed in
    another order."""
    if len(whats) <= 1:
        for what in whats:
            weight_grads(what)
        return
    by: dict = {}  # the module's id -> (module, its inputs, its output gradients), in first-seen order
    for what in whats:
        for module, x, g in what:
            _, xs, gs = by.setdefault(id(module), (module, [], []))
            xs.append(x.reshape(-1, x.shape[-1]))
            gs.append(g.reshape(-1, g.shape[-1]))
    weight_grads([(m, torch.cat(xs), torch.cat(gs)) for m, xs, gs in by.values()])


def install(part: nn.Module, pending: Pending) -> int:
    """Route the forward of every plain Linear in ``part`` through ``_Linear`` (a transformers
    ``Conv1D`` through ``_Conv1D``); returns how many."""
    n = 0
    for m in part.modules():
        if tracing.plain_linear(m):
            m.forward = _bound(m, pending) if isinstance(m, nn.Linear) else _bound_conv1d(m, pending)
            n += 1
    return n


# the share of a chunk's weight-gradient work its Linears' own products must hold for a split
# schedule to leave them alone (``covered``), and for 1F1B's backwards to send early; below it,
# a split schedule's chunk tries both torch's stage_backward_input / stage_backward_weight, where
# every weight gradient waits for W, and the own products, and keeps the faster
# (service/schedules.py SPLIT_TRIAL, choose_split); the planner weighs the traced layers alike
LINEAR_COVER = schedules.LINEAR_COVER
# under this share a chunk of 1F1B, GPipe or interleaved defers nothing worth the while
# (service/schedules.py FEW_LINEARS)
FEW_LINEARS = schedules.FEW_LINEARS


# the rows each module of a chunk sees in the first step, what ``covered`` weighs each weight by
count_rows, forget_rows = tracing.count_rows, tracing.forget_rows


def covered(part: nn.Module, rows: dict) -> float:
    """The share of ``part``'s weight-gradient work (by the rows ``count_rows`` saw) held by its
    Linears whose forward went through ``_Linear`` (``install``ed, and called: ``rows`` holds
    them): what a split backward can leave for W (``tracing.weighed``)."""
    mine, total = tracing.weighed(part, rows, lambda m: "forward" in m.__dict__ and tracing.plain_linear(m))
    return mine / total if total else 1.0


def uninstall(part: nn.Module) -> None:
    forget_rows(part)
    for m in part.modules():
        if tracing.plain_linear(m):
            m.__dict__.pop("forward", None)


def _bound(m: nn.Linear, pending: Pending):
    casts = tracing.LINEAR_FORWARDS[type(m).forward]  # whether it casts the input first

    def forward(x):
        if casts and x.dtype != m.weight.dtype:
            x = x.to(m.weight.dtype)
        return _Linear.apply(x, m.weight, m.bias, m, pending)
    return forward


def _bound_conv1d(m: nn.Module, pending: Pending):
    def forward(x):
        return _Conv1D.apply(x, m.weight, m.bias, m, pending)
    return forward
