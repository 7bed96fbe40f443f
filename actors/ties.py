"""Parameters tied across layers (a token embedding and the output head): one parameter in
the semantics, one copy per layer that uses it in the engine.

Every copy starts from the tie's first name's initial value (service/loading.py
``ModelRecipe.copy_tied_init``).  After a step's backward and the gradient sum over the
stage's replicas, ``TiedGrads.finish`` gives every copy the gradient of the one parameter:
each stage adds up its own copies' gradients, sends that sum to the other stages that hold
the tie (through the transport, ``kind="tie"``), and adds up all stages' sums in stage
order.  Every copy then holds the same gradient, bit for bit, and the same optimizer state,
so every copy takes the same step and the copies stay identical.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from actors.state import layer_of


@dataclass(frozen=True)
class _Held:
    key: int              # the tie's index among the model's ties
    params: list          # this stage's copies
    stages: list[int]     # every stage that holds a copy, in order


class TiedGrads:
    def __init__(self, tied: list[tuple[str, ...]], stage: nn.Module, bounds: list, pp_rank: int):
        """``tied``: groups of names of the whole model; ``stage``: this worker's layers (named
        as in the whole model); ``bounds``: every stage's [lo, hi) layers."""
        self.pp_rank = pp_rank
        owner = lambda name: next(s for s, (lo, hi) in enumerate(bounds) if lo <= layer_of(name) < hi)  # noqa: E731
        self.held: list[_Held] = []
        for key, group in enumerate(tied):
            mine = [stage.get_parameter(n) for n in group if owner(n) == pp_rank]
            if mine:
                self.held.append(_Held(key, mine, sorted({owner(n) for n in group})))

    def __bool__(self) -> bool:
        return bool(self.held)

    def finish(self, step: int, transport) -> None:
        for h in self.held:
            local = _sum([_grad(p) for p in h.params])
            sums = {self.pp_rank: local}
            others = [s for s in h.stages if s != self.pp_rank]
            for s in others:
                transport.send_to(s, step, "tie", h.key, local)
            for s in others:
                sums[s] = transport.recv_from(s, step, "tie", h.key, (tuple(local.shape), local.dtype))
            total = _sum([sums[s] for s in h.stages])
            for p in h.params:
                p.grad.copy_(total)
        if self.held:
            transport.finish_step()  # the sends are done before the step's result


def _grad(p: torch.Tensor) -> torch.Tensor:
    if p.grad is None:  # a copy this step did not use
        p.grad = torch.zeros_like(p)
    return p.grad


def _sum(ts: list) -> torch.Tensor:
    out = ts[0].clone()
    for t in ts[1:]:
        out += t
    return out
