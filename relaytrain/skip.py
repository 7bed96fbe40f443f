"""Skip connections that cross pipeline stages, written with torchgpipe's convention.

A layer that starts a skip declares its name and stashes a tensor under it; a later layer
declares the same name and pops it::

    from relaytrain.skip import Namespace, pop, skippable, stash

    @skippable(stash=["enc1"])
    class Down(nn.Module):
        def forward(self, x):
            y = self.conv(x)
            yield stash("enc1", y)
            return self.pool(y)

    @skippable(pop=["enc1"])
    class Up(nn.Module):
        def forward(self, x):
            skip = yield pop("enc1")
            return self.conv(torch.cat([self.up(x), skip], 1))

Such layers run unchanged in one process as ``nn.Sequential(*layers)`` (a tracker per thread
keeps what was stashed until it is popped): that is the reference semantics.  In a relaytrain
pipeline a skip tensor goes from the stage that stashes it straight to the stage that pops it,
and its gradient straight back; the stages between never see it.

One skippable class may appear several times: give each use a :class:`Namespace` with
``Block().isolate(ns)`` (or ``isolate(ns, only=["name"])``), and the names of different
namespaces do not meet.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Optional

from torch import nn

__all__ = ["Namespace", "skippable", "stash", "pop", "SkipError", "layout", "Skip", "recomputable"]


class SkipError(ValueError):
    """A model's skips do not add up (a name popped and never stashed, and so on)."""


class Namespace:
    """A namespace for skip names: the same name in two namespaces is two skips."""

    _count = 0

    def __init__(self, label: str = "") -> None:
        Namespace._count += 1
        self.label = label or f"ns{Namespace._count}"

    def __repr__(self) -> str:
        return f"Namespace({self.label!r})"


_DEFAULT = Namespace("default")


class _Stash:
    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor) -> None:
        self.name, self.tensor = name, tensor


class _Pop:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def stash(name: str, tensor) -> _Stash:
    """``yield stash(name, tensor)`` inside a skippable layer's forward."""
    return _Stash(name, tensor)


def pop(name: str) -> _Pop:
    """``tensor = yield pop(name)`` inside a skippable layer's forward."""
    return _Pop(name)


class Tracker:
    """Where stashed tensors wait for their pop: one per thread by default (one process), one
    per microbatch in a pipeline (the engine's, which also moves them between stages)."""

    def __init__(self) -> None:
        self.tensors: dict = {}

    def save(self, key: tuple, tensor) -> None:
        self.tensors[key] = tensor

    def load(self, key: tuple):
        try:
            return self.tensors.pop(key)
        except KeyError:
            ns, name = key
            raise SkipError(f"skip {name!r} ({ns!r}) is popped before anything stashed it in this forward: "
                            "the layer that stashes it must come before the layer that pops it") from None


_local = threading.local()


def current_tracker() -> Tracker:
    t = getattr(_local, "tracker", None)
    if t is None:
        t = _local.tracker = Tracker()
    return t


@contextmanager
def use_tracker(tracker: Tracker) -> Iterator[Tracker]:
    """Run forwards with ``tracker`` as this thread's tracker."""
    before = getattr(_local, "tracker", None)
    _local.tracker = tracker
    try:
        yield tracker
    finally:
        _local.tracker = before


class _Recording(Tracker):
    """The tracker of a forward that may be recomputed: saves and loads go to ``under``; what
    was loaded is remembered for the recomputation."""

    def __init__(self, under: Tracker) -> None:
        super().__init__()
        self.tensors, self.under, self.loaded = under.tensors, under, {}

    def save(self, key: tuple, tensor) -> None:
        self.under.save(key, tensor)

    def load(self, key: tuple):
        x = self.loaded[key] = self.under.load(key)
        return x


class _Replaying(Tracker):
    """The tracker of a recomputation: each pop gets what the first forward popped, stashes are
    dropped (the first forward's stashed tensors are the ones in the graph)."""

    def __init__(self, loaded: dict) -> None:
        super().__init__()
        self.loaded = loaded

    def save(self, key: tuple, tensor) -> None:
        pass

    def load(self, key: tuple):
        return self.loaded[key]


class recomputable:
    """``checkpoint(recomputable(layer), x, use_reentrant=False)``: a skippable layer (or one
    holding skippable modules) that activation checkpointing recomputes in backward.  Its first
    call stashes and pops through the thread's tracker as usual; the recomputation pops the
    same tensors again (their stashers are not recomputed first, and what they stashed was
    popped already) and drops what it stashes."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer, self.loaded = layer, None

    def __call__(self, *args, **kwargs):
        if self.loaded is None:
            rec = _Recording(current_tracker())
            with use_tracker(rec):
                out = self.layer(*args, **kwargs)
            self.loaded = rec.loaded
            return out
        with use_tracker(_Replaying(self.loaded)):
            return self.layer(*args, **kwargs)


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()):
    """Class decorator: the layer's ``forward`` may ``yield stash(name, t)`` for each name of
    ``stash`` and ``yield pop(name)`` for each name of ``pop``, once per forward."""
    stashes, pops = tuple(stash), tuple(pop)
    both = set(stashes) & set(pops)
    if both:
        raise SkipError(f"skippable(stash=..., pop=...) names {sorted(both)} on both sides: a layer cannot pop "
                        "what it stashes itself; use another name")

    def wrap(cls):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@skippable decorates an nn.Module class, not {cls!r}")
        inner = cls.forward

        def forward(self, *args, **kwargs):
            gen = inner(self, *args, **kwargs)
            if not hasattr(gen, "send"):  # a forward that does not yield
                return gen
            tracker = current_tracker()
            done_stash, done_pop = set(), set()
            sent: Any = None
            while True:
                try:
                    cmd = gen.send(sent)
                except StopIteration as stop:
                    out = stop.value
                    break
                sent = None
                if isinstance(cmd, _Stash):
                    _declared(self, cmd.name, stashes, "stash", done_stash)
                    tracker.save(self.skip_key(cmd.name), cmd.tensor)
                elif isinstance(cmd, _Pop):
                    _declared(self, cmd.name, pops, "pop", done_pop)
                    sent = tracker.load(self.skip_key(cmd.name))
                else:
                    raise SkipError(f"{type(self).__name__}.forward yielded {cmd!r}: a skippable layer yields only "
                                    "stash(name, tensor) or pop(name)")
            missing = [f"stash {n!r}" for n in stashes if n not in done_stash] + \
                      [f"pop {n!r}" for n in pops if n not in done_pop]
            if missing:
                raise SkipError(f"{type(self).__name__}.forward declared but did not {', '.join(missing)}: every "
                                "declared name is stashed or popped once per forward")
            return out

        def isolate(self, ns: Namespace, *, only: Optional[Iterable[str]] = None):
            names = set(stashes + pops) if only is None else set(only)
            unknown = names - set(stashes + pops)
            if unknown:
                raise SkipError(f"isolate(only={sorted(unknown)}): {cls.__name__} declares only "
                                f"{sorted(set(stashes + pops))}")
            self._skip_ns = {**getattr(self, "_skip_ns", {}), **{n: ns for n in names}}
            return self

        def skip_key(self, name: str) -> tuple:
            return getattr(self, "_skip_ns", {}).get(name, _DEFAULT), name

        return type(cls.__name__, (cls,), {
            "forward": forward, "isolate": isolate, "skip_key": skip_key,
            "stashable_names": stashes, "poppable_names": pops,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
        })
    return wrap


def _declared(layer, name: str, names: tuple, verb: str, done: set) -> None:
    if name not in names:
        raise SkipError(f"{type(layer).__name__}.forward does {verb}({name!r}) but declares {verb}={list(names)}: "
                        f"add {name!r} to @skippable({verb}=[...])")
    if name in done:
        raise SkipError(f"{type(layer).__name__}.forward does {verb}({name!r}) twice in one forward")
    done.add(name)


class Skip:
    """One skip of a model: its key, the layer (index in the layer list) that stashes it, the
    one that pops it, and where in each layer's declarations it is (``at``: (stash, pop)
    position among the layer's declared names in ``modules()`` order: the same in every
    process that builds the layer, where the Namespace objects are not)."""

    __slots__ = ("key", "stasher", "popper", "at")

    def __init__(self, key: tuple, stasher: int, popper: int, at: tuple = (0, 0)) -> None:
        self.key, self.stasher, self.popper, self.at = key, stasher, popper, at

    @property
    def name(self) -> str:
        return self.key[1]

    def __repr__(self) -> str:
        return f"Skip({self.name!r}, layer {self.stasher} -> layer {self.popper})"


def declarations(layer: nn.Module) -> list:
    """(module, name, stashing) for every name the skippable modules inside ``layer`` declare,
    in ``modules()`` order, stashes before pops within a module."""
    out = []
    for m in layer.modules():
        out += [(m, n, True) for n in getattr(m, "stashable_names", ())]
        out += [(m, n, False) for n in getattr(m, "poppable_names", ())]
    return out


def layout(layers: list) -> list[Skip]:
    """The skips of a layer list (each entry an nn.Module), checked: every name stashed once
    and popped once per namespace, the pop in the same or a later layer than the stash.  A
    skip inside one layer is returned too (stasher == popper).  Raises :class:`SkipError`
    saying what to change."""
    stashed: dict = {}
    popped: dict = {}
    for i, layer in enumerate(layers):
        for at, (m, name, stashing) in enumerate(declarations(layer)):
            key = m.skip_key(name)
            seen = stashed if stashing else popped
            if key in seen:
                verb = "stashed" if stashing else "popped"
                raise SkipError(f"skip {name!r} is {verb} twice in one namespace (layers {seen[key][0]} and {i}): "
                                f"give each use of the layer its own Namespace, e.g. "
                                f"{type(m).__name__}().isolate(Namespace())")
            seen[key] = (i, at)
    skips = []
    for key, (i, at) in stashed.items():
        if key not in popped:
            raise SkipError(f"skip {key[1]!r} is stashed by layer {i} and never popped: add a layer that pops it, or "
                            "remove it from the layer's @skippable(stash=[...])")
        j, at_pop = popped[key]
        if j < i:
            raise SkipError(f"skip {key[1]!r} is popped by layer {j} before layer {i} stashes it: the pop must come "
                            "after the stash in the layer list")
        skips.append(Skip(key, i, j, (at, at_pop)))
    for key, (j, _) in popped.items():
        if key not in stashed:
            raise SkipError(f"skip {key[1]!r} is popped by layer {j} and never stashed: add a layer that stashes it "
                            "(or check the Namespace given to isolate)")
    return sorted(skips, key=lambda s: (s.stasher, s.popper, s.name))
