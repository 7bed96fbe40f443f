"""Portals: a skip tensor (relaytrain.skip) goes straight from the model chunk that stashes it
to the chunk that pops it, and its gradient straight back; the chunks between never see it.

The scheduler's trace finds the model's skips (service/tracing.py ``SkipFacts``: the layers
that stash and pop each, its tensor's shape and dtype); a skip whose two layers fall in one
chunk stays inside that chunk's forward (the chunk's tracker holds it).  A skip that crosses
chunks travels under kind ``skip`` (its gradient ``skipgrad``, an evaluation's ``evalskip``)
and key ``g * skips + k``; between two chunks of one worker it is handed over in memory.  In
the stasher's backward the skip tensor is one more output, with the gradient the popper sent;
in the popper's it is one more input, whose gradient is sent back."""
from __future__ import annotations

from dataclasses import dataclass

from relaytrain import skip
from service.partition import chunk_of
from service.tracing import dtype_named


@dataclass(frozen=True)
class Route:
    """A skip that crosses chunks: its index k among the model's skips, its layers, name and
    declaration positions, (shape, dtype) for one microbatch, and the virtual stages (chunks)
    that stash it (``src``) and pop it (``dst``)."""

    k: int
    stasher: int
    popper: int
    name: str
    at: tuple
    meta: tuple
    src: int
    dst: int

    @property
    def differentiable(self) -> bool:
        return self.meta[1].is_floating_point


def routes(skips: list, bounds: list) -> tuple:
    """The skips (``(stasher, popper, name, at, (shape, dtype))`` each) that cross the chunks
    ``bounds`` ([lo, hi) per virtual stage)."""
    out = []
    for k, (stasher, popper, name, at, meta) in enumerate(skips):
        src, dst = chunk_of(bounds, stasher), chunk_of(bounds, popper)
        if src != dst:
            out.append(Route(k, stasher, popper, name, tuple(at), (tuple(meta[0]), dtype_named(meta[1])), src, dst))
    return tuple(out)


class Portals:
    """A worker's ends of the routes: which skips each of its chunks pops and stashes, and the
    key each has in that chunk's layers (their Namespace objects are this process's own)."""

    def __init__(self, all_routes: tuple, parts: dict, ranges: dict, count: int):
        self.count = count
        self.into = {vs: [r for r in all_routes if r.dst == vs] for vs in parts}
        self.out_of = {vs: [r for r in all_routes if r.src == vs] for vs in parts}
        self.stash_key, self.pop_key = {}, {}
        for vs, part in parts.items():
            lo = ranges[vs][0]
            for r in self.out_of[vs]:
                m, name, _ = skip.declarations(part[r.stasher - lo])[r.at[0]]
                self.stash_key[r.k] = m.skip_key(name)
            for r in self.into[vs]:
                m, name, _ = skip.declarations(part[r.popper - lo])[r.at[1]]
                self.pop_key[r.k] = m.skip_key(name)

    def key(self, g: int, r: Route) -> int:
        return g * self.count + r.k

    def tracker(self, received: dict) -> skip.Tracker:
        """A chunk's tracker for one forward, holding what it pops from other chunks."""
        t = skip.Tracker()
        for k, x in received.items():
            t.tensors[self.pop_key[k]] = x
        return t

    def stashed(self, vs: int, tracker: skip.Tracker) -> dict:
        """What the chunk's forward stashed for later chunks: k -> tensor (in its graph).  It is
        cloned: a split backward detaches its outputs in place, and the stashed tensor may be
        one the chunk's own backward still needs (a layer's input, saved for its weight gradient)."""
        out = {}
        for r in self.out_of[vs]:
            x = tracker.tensors.pop(self.stash_key[r.k])
            out[r.k] = x.clone() if x.requires_grad else x
        return out
