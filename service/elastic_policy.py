"""The elastic policy: what a job should do about the cluster it sees now.  Pure: a
``Situation`` in, one small decision out (``Keep``, ``Reshape``, ``Wait``, ``Fail``), tested
without Ray.  The job's controller (actors/controller.py) carries the decisions out.

Three moments ask it:

- **a loss**: workers died (``lost``) or their nodes announced they are going (``draining``):
  the job must move, over the workers it keeps plus the free slots (a forced reshape);
- **a boundary** with nothing wrong: grow when free slots make a shape at least
  ``elastic.min_gain`` faster than the current one (the controller starts the workers it
  needs, and asks again once they are up: ``joined``), else keep going;
- **a wait**: too few slots for any shape: wait, then fail after ``elastic.wait_timeout_s``.

On a shared cluster the cluster scheduler (service/fairshare.py) allots each job a number of
workers (``Situation.cap``): the job never plans over more, and above it the controller shrinks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from service import planner
from service.spec import JobSpec


@dataclass(frozen=True)
class Keep:
    reason: str = "nothing changed"


@dataclass(frozen=True)
class Reshape:
    shape: planner.Shape
    reason: str            # why the planner chose this shape
    forced: bool           # the current shape cannot go on (a loss, a drain); else a voluntary growth

    def more_workers(self, have: int) -> int:
        return max(0, self.shape.workers - have)


@dataclass(frozen=True)
class Wait:
    reason: str


@dataclass(frozen=True)
class Fail:
    reason: str


Decision = Union[Keep, Reshape, Wait, Fail]


@dataclass(frozen=True)
class Situation:
    """What the job's controller sees at one moment."""

    kept: int                              # live workers of the job that may take cells of a new shape
    free: int                              # free worker slots on alive, non-draining, unsuspected nodes
    current: Optional[tuple]               # the running shape's key ((dp, pp), planner.Shape.key); None while starting
    forced: bool = False                   # workers were lost or their nodes are draining
    joined: int = 0                        # of ``kept``, workers started for a growth and now up
    waited_s: float = 0.0                  # seconds already spent waiting for slots
    cap: Optional[int] = None              # workers the cluster scheduler allots the job (None: no limit)
    steps_left: Optional[int] = None       # steps still to train (a growth must pay back its reshape)
    step_s: Optional[float] = None         # the current shape's modelled seconds per step
    measured_s: Optional[float] = None     # its measured seconds per step (the median of its last steps)
    previous: Optional[planner.Shape] = None  # the shape that ran (also after a loss: fewer replicas keep its layers)

    @property
    def slots(self) -> int:
        return self.kept + self.free if self.cap is None else min(self.cap, self.kept + self.free)


def plan(spec: JobSpec, facts: planner.LayerFacts, slots: int,
         current: Optional[tuple] = None, previous: Optional[planner.Shape] = None) -> planner.Decision:
    """The planner's answer for this job over ``slots`` (the one place its arguments are spelled)."""
    e, p, res = spec.elastic, spec.parallelism, spec.resources
    mem = res.memory_per_worker_mb
    preferred = (p.dp, p.pp, p.replica_counts) if p.replica_counts else (p.dp, p.pp) + ((p.tp,) if p.tp > 1 else ())
    return planner.plan(slots, facts, spec.training.global_batch_size, spec.training.microbatch_size,
                        preferred=preferred, min_workers=e.min_workers, max_workers=e.max_workers,
                        replicas=p.replicas, previous=previous,
                        schedule=p.schedule, chunks=p.chunks, transport=p.transport, optimizer=spec.optimizer.name,
                        partition_rule=p.partition, memory_bytes=mem * 2**20 if mem else None,
                        current=current, min_gain=e.min_gain, tp=p.tp, weight_group=p.weight_group)


def decide(sit: Situation, spec: JobSpec, facts: planner.LayerFacts) -> Decision:
    """The decision for ``sit``; see the module's docstring."""
    if sit.forced or sit.current is None:
        return _place(sit, spec, facts)
    if sit.joined:
        return _grow_onto_joined(sit, spec, facts)
    return _maybe_grow(sit, spec, facts)


def _place(sit: Situation, spec: JobSpec, facts: planner.LayerFacts) -> Decision:
    d = plan(spec, facts, sit.slots, previous=sit.previous)
    if not d.wait:
        return Reshape(d.shape, d.reason, forced=True)
    limit = spec.elastic.wait_timeout_s
    if sit.waited_s > limit:
        return Fail(f"{d.reason}; gave up after elastic.wait_timeout_s={limit:g} s")
    return Wait(d.reason)


def usable_sizes(spec: JobSpec, facts: planner.LayerFacts) -> list[int]:
    """The worker counts this job's planner uses whole (what the cluster scheduler allots)."""
    e = spec.elastic
    out = []
    for n in range(e.min_workers, e.max_workers + 1):
        d = plan(spec, facts, n)
        if not d.wait and d.shape.workers == n:
            out.append(n)
    return out


def _grow_onto_joined(sit: Situation, spec: JobSpec, facts: planner.LayerFacts) -> Decision:
    """Workers started for a growth are up: reshape onto them unless it no longer pays."""
    d = plan(spec, facts, sit.slots, current=sit.current)
    if d.wait or d.shape.key == sit.current:
        return Keep(d.reason)
    return Reshape(d.shape, d.reason, forced=False)


AT_ALLOTMENT, AT_MAX = "at the workers the cluster scheduler allots it", "at elastic.max_workers"
EXPECTED_KEEPS = (AT_ALLOTMENT, AT_MAX)  # a job that keeps its shape for these says nothing


def _maybe_grow(sit: Situation, spec: JobSpec, facts: planner.LayerFacts) -> Decision:
    """A boundary with nothing wrong: a ``Reshape`` here means "start the workers it needs"."""
    if sit.cap is not None and sit.kept >= sit.cap:
        return Keep(AT_ALLOTMENT)
    if sit.kept >= spec.elastic.max_workers or sit.free <= 0:
        return Keep("no free slot" if sit.free <= 0 else AT_MAX)
    d = plan(spec, facts, sit.slots, current=sit.current)
    if d.wait or d.shape.key == sit.current:
        return Keep(d.reason)
    if d.shape.workers <= sit.kept:
        return Keep(f"the faster shape {d.shape.label()} needs no more workers")
    payback = spec.elastic.grow_payback_s  # its reshape pauses every worker (about 1 s measured), and its
    if sit.steps_left is not None and sit.step_s is not None and payback:  # new workers' start takes CPU
        # the model's gain at the measured pace: where a step takes 10x the model's (a loaded
        # machine, a device the model does not know), so does what a growth saves (a user trial's
        # job kept 1x3 on a modelled 0.9 s where it would have saved about 9 s)
        scale = sit.measured_s / sit.step_s if sit.measured_s and sit.step_s > 0 else 1.0
        saved = sit.steps_left * (sit.step_s - d.shape.step_s) * scale
        if saved < payback:
            return Keep(f"growing to {d.shape.label()} would save {max(saved, 0):.1f} s over the {sit.steps_left} "
                        f"steps left, less than elastic.grow_payback_s={payback:g} s")
    return Reshape(d.shape, d.reason, forced=False)
