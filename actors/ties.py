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
    def __init__(self, tied: list[tuple[str, ...]], stage: nn.Module, bounds, pp_rank: int):
        """``tied``: groups of names of the whole model; ``stage``: this worker's layers (named
        as in the whole model); ``bounds``: every stage's [lo, hi) layers, or a dict from each
        layer to the pipeline rank that holds it (several model chunks per worker)."""
        self.pp_rank = pp_rank
        holder = bounds if isinstance(bounds, dict) else {
            i: s for s, (lo, hi) in enumerate(bounds) for i in range(lo, hi)}
        owner = lambda name: holder[layer_of(name)]  # noqa: E731
        self.held: list[_Held] = []
        for key, group in enumerate(tied):
            mine = [stage.get_parameter(n) for n in group if owner(n) == pp_rank]
            if mine:
                self.held.append(_Held(key, mine, sorted({owner(n) for n in group})))

    def __bool__(self) -> bool:
        return bool(self.held)

    def finish(self, step: int, transport) -> None:
        """In place: the copies' gradients are added into the first copy's, that sum goes to
        the other stages, their sums are added in stage order, and the total is copied to this
        stage's other copies.  The temporaries: a 16 MiB piece when two stages hold the tie
        (the usual embedding and head), else one received sum per other stage."""
        for h in self.held:
            grads = [_grad(p) for p in h.params]
            local = grads[0]
            for g in grads[1:]:
                local += g
            others = [s for s in h.stages if s != self.pp_rank]
            if len(others) == 1 and local.is_contiguous():
                self._add_pairwise(step, transport, h.key, others[0], local.view(-1))
            elif others:
                k = piece_key(h.key, 0)
                for s in others:
                    transport.send_to(s, step, "tie", k, local)
                got = {s: transport.recv_from(s, step, "tie", k, (tuple(local.shape), local.dtype)) for s in others}
                transport.finish_step()  # ``local`` is sent before it changes
                if len(h.stages) == 2:
                    local += got[others[0]]  # a + b == b + a, bit for bit
                else:
                    total = None
                    for s in h.stages:  # stage order: every stage adds the same way
                        t = local if s == self.pp_rank else got.pop(s)
                        total = t.clone() if total is None else total.add_(t)
                    local.copy_(total)
                    del total
            for g in grads[1:]:
                g.copy_(local)
        if self.held:
            transport.finish_step()  # the sends are done before the step's result

    @staticmethod
    def _add_pairwise(step: int, transport, key: int, other: int, flat: torch.Tensor) -> None:
        """Two stages hold the tie: each sends its sum and adds the other's, in pieces of
        PIECE_BYTES (so the temporary is one piece, not the whole gradient).  a + b == b + a,
        bit for bit, so both stages end with the same total."""
        step_n = max(1, PIECE_BYTES // flat.element_size())
        for i, lo in enumerate(range(0, flat.numel(), step_n)):
            part = flat[lo:lo + step_n]
            transport.send_to(other, step, "tie", piece_key(key, i), part)
            got = transport.recv_from(other, step, "tie", piece_key(key, i), ((part.numel(),), part.dtype))
            transport.finish_step()  # ``part`` is sent before it changes
            part += got.view_as(part)


PIECE_BYTES = 16 << 20


def piece_key(key: int, piece: int) -> int:
    """The transport key of piece ``piece`` of tie ``key``'s gradient (a tie has under 2**16
    pieces: up to 1 TiB)."""
    return (key << 16) | piece


def _grad(p: torch.Tensor) -> torch.Tensor:
    if p.grad is None:  # a copy this step did not use
        p.grad = torch.zeros_like(p)
    return p.grad
