"""Replicated stages (``parallelism.replicas``): a pipeline stage run by several workers.

A pipeline runs at the pace of its slowest stage.  When one stage cannot be cut further,
PipeDream (Narayanan et al., SOSP 2019, "1F1B-RR") gives it r workers: microbatch k goes to
replica ``k mod r``, its forward and its backward on that replica, and the replicas' gradients
are summed as data parallelism's are, so their parameters stay identical.  The slow stage
then takes 1/r of the time per microbatch.

Pure: the per-worker action lists of one pipeline replica's step and their timing, tested
without Ray.  Words as in service/schedules.py (F forward, B backward, actions written like
``1F3``), and a pipeline of pp stages where stage s has ``replicas[s]`` workers: a *slot* is
one worker of the pipeline, numbered stage by stage (stage 0's replicas first), so a pipeline
has ``sum(replicas)`` slots.  An action keeps its stage and its microbatch; which replica runs
it follows from the microbatch (``replica_of``), so dependencies are those of a plain pipeline
(``schedules.dependencies``).

The orders come from simulating the step (list scheduling): each worker runs, of the actions
it may run, the one that can start first, a backward before a forward at a tie.

- gpipe: every worker runs all its forwards, then all its backwards (as GPipe).
- 1f1b: a worker of stage s keeps at most ``ceil(W_s / r_s)`` microbatches in flight, where
  W_s is the number of workers from stage s to the end (PipeDream's "NOAM": as many
  microbatches as it takes to keep the workers after it busy, shared by its replicas); with
  every stage at one replica this is 1F1B's ``pp - s``.

Because the orders come from an execution that ran to its end, the workers cannot deadlock
whatever their real timings are: the simulated run is one consistent order of all the
actions.  The costs used (forward c_s, backward 2 c_s per stage) shape the order only.
"""
from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence

from service import schedules
from service.schedules import Action, ScheduleError, dependencies

SCHEDULES = ("gpipe", "1f1b")  # the schedules a pipeline with replicated stages runs


def check(replicas: Sequence[int], pp: int) -> None:
    """Raise ValueError unless ``replicas`` is a replica count (>= 1) for each of ``pp`` stages."""
    if len(replicas) != pp:
        raise ValueError(f"parallelism.replicas has {len(replicas)} entries but the pipeline has pp={pp} stages: "
                         f"give one replica count per stage (e.g. {[1] * pp})")
    bad = [i for i, r in enumerate(replicas) if int(r) < 1]
    if bad:
        raise ValueError(f"parallelism.replicas[{bad[0]}] is {replicas[bad[0]]}: every stage needs at least 1 "
                         "worker (1 = not replicated)")


def width(replicas: Sequence[int]) -> int:
    """Workers (slots) of one pipeline."""
    return sum(replicas)


def slot_of(replicas: Sequence[int], stage: int, rep: int) -> int:
    """The slot of replica ``rep`` of ``stage``."""
    return sum(replicas[:stage]) + rep


def stage_of(replicas: Sequence[int], slot: int) -> tuple[int, int]:
    """(stage, replica) of ``slot``."""
    for s, r in enumerate(replicas):
        if slot < r:
            return s, slot
        slot -= r
    raise ValueError(f"slot out of range for replicas {list(replicas)}")


def replica_of(mb: int, r: int) -> int:
    """The replica of a stage with ``r`` replicas that runs (local) microbatch ``mb``."""
    return mb % r


def label(replicas: Sequence[int]) -> str:
    return "[" + ",".join(str(r) for r in replicas) + "]"


def shape_label(dp: int, pp: int, replicas: Optional[Sequence[int]] = None, tp: Optional[int] = 1) -> str:
    """A shape as every view says it: ``2x3``, ``1x3 replicas [1,2,1]``, ``1x2x2 (tp)`` (a TP or
    replicated job was ``1x2`` / ``1x3`` in the status, the list, the page and the timeline
    beside lanes of 4 workers: a user trial)."""
    return f"{dp}x{pp}" + (f" replicas {label(replicas)}" if replicas else "") + (
        f"x{tp} (tp)" if (tp or 1) > 1 else "")


def shape_label_of(shape: dict) -> str:
    """:func:`shape_label` of a shape dict (a job's ``shape``, a metrics row, a timeline entry)."""
    return shape_label(shape.get("dp", "?"), shape.get("pp", "?"), shape.get("replicas"), shape.get("tp"))


@dataclass(frozen=True)
class Plan:
    """One pipeline's step: ``order[slot]`` is the action list of that worker; ``start``/``end``
    the simulated times (stage s: forward ``costs[s]``, backward twice that)."""

    name: str
    replicas: tuple[int, ...]
    microbatches: int
    order: tuple[tuple[Action, ...], ...]
    start: dict
    end: dict
    costs: tuple[Fraction, ...]

    @property
    def makespan(self) -> Fraction:
        return max(self.end.values())

    def busy(self, slot: int) -> Fraction:
        return sum((self.end[a] - self.start[a] for a in self.order[slot]), Fraction(0))

    @property
    def bubble(self) -> Fraction:
        """Idle share of all the pipeline's workers over the step."""
        total = self.makespan * len(self.order)
        return 1 - sum((self.busy(i) for i in range(len(self.order))), Fraction(0)) / total

    def peak_in_flight(self) -> list[int]:
        """Per slot, the most microbatches between a forward and its backward at once."""
        peaks = []
        for acts in self.order:
            live = peak = 0
            for a in acts:
                live += 1 if a.kind == "F" else -1
                peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def __str__(self) -> str:
        rows = []
        for slot, acts in enumerate(self.order):
            s, j = stage_of(self.replicas, slot)
            rows.append(f"stage {s}.{j}: " + " ".join(str(a) for a in acts))
        return "\n".join(rows)


def in_flight_cap(replicas: Sequence[int], stage: int) -> int:
    """How many microbatches a worker of ``stage`` keeps between forward and backward (1f1b)."""
    return math.ceil(sum(replicas[stage:]) / replicas[stage])


def plan(name: str, replicas: Sequence[int], microbatches: int,
         costs: Optional[Sequence[float | Fraction]] = None) -> Plan:
    """The action lists and simulated timing of schedule ``name`` (gpipe or 1f1b) for one
    pipeline with ``replicas[s]`` workers on stage s and ``microbatches`` microbatches;
    ``costs[s]``: stage s's forward time per microbatch (default 1), its backward 2x.

    1f1b starts from PipeDream's caps (:func:`in_flight_cap`) and, stage by stage, keeps one
    more microbatch in flight where that shortens the simulated step (unequal stages fill and
    drain unevenly: stage costs 1, 2, 1 on [1, 2, 1] at M = 8 take 36 units at caps [4, 2, 1]
    and 33 at [5, 2, 1]).  Cached: every worker, the timeline and the metrics ask for it."""
    return _plan(name, tuple(int(r) for r in replicas), int(microbatches),
                 None if costs is None else tuple(Fraction(c).limit_denominator(10**6) for c in costs))


@functools.lru_cache(maxsize=512)
def _plan(name: str, replicas: tuple, microbatches: int, costs: Optional[tuple]) -> Plan:
    if name not in SCHEDULES:
        raise ValueError(f"replicated stages run the schedules {', '.join(SCHEDULES)}, not {name!r}: set "
                         "parallelism.schedule to one of them, or leave parallelism.replicas out")
    replicas = tuple(int(r) for r in replicas)
    check(replicas, len(replicas))
    if microbatches < 1:
        raise ValueError(f"a schedule needs at least 1 microbatch, got {microbatches}")
    pp = len(replicas)
    fc = tuple(costs or [Fraction(1)] * pp)
    if len(fc) != pp or any(c <= 0 for c in fc):
        raise ValueError(f"costs must be {pp} positive numbers, got {costs}")
    if name == "gpipe":
        return _simulate(name, replicas, microbatches, fc, [microbatches] * pp)
    caps = [min(in_flight_cap(replicas, s), microbatches) for s in range(pp)]
    best = _simulate(name, replicas, microbatches, fc, caps)
    for s in range(pp):
        if caps[s] >= microbatches:
            continue
        more = _simulate(name, replicas, microbatches, fc, caps[:s] + [caps[s] + 1] + caps[s + 1:])
        if more.makespan < best.makespan:
            best, caps = more, caps[:s] + [caps[s] + 1] + caps[s + 1:]
    return best


def _simulate(name: str, replicas: tuple, microbatches: int, fc: tuple, caps: list) -> Plan:
    """List scheduling of one pipeline's step with ``caps[s]`` microbatches in flight per
    worker of stage s (see :func:`plan`)."""
    pp = len(replicas)
    scale = math.lcm(*(c.denominator for c in fc))  # whole numbers: exact, and fast
    ic = tuple(int(c * scale) for c in fc)
    dur = {"F": ic, "B": tuple(2 * c for c in ic)}
    slots = [(s, j) for s in range(pp) for j in range(replicas[s])]
    mine = [[k for k in range(microbatches) if replica_of(k, replicas[s]) == j] for s, j in slots]
    cap = [caps[s] for s, _ in slots]
    start: dict = {}
    end: dict = {}
    order: list[list[Action]] = [[] for _ in slots]
    free = [0] * len(slots)
    nxt = [0] * len(slots)            # index of the next forward in mine[i]
    flight: list[list[int]] = [[] for _ in slots]   # forwarded, not yet backward, in order
    total = 2 * microbatches * pp
    while len(end) < total:
        best = None
        for i, (s, _) in enumerate(slots):
            for a in _candidates(name, s, i, mine, nxt, flight, cap):
                deps = dependencies(a, pp)
                if any(d not in end for d in deps):
                    continue
                t0 = max([free[i]] + [end[d] for d in deps])
                key = (t0, a.kind != "B", s, a.mb)
                if best is None or key < best[0]:
                    best = (key, i, a)
        if best is None:
            raise ScheduleError(f"replicated plan {name} {label(replicas)} M={microbatches} deadlocks")
        (t0, *_), i, a = best
        start[a], end[a] = t0, t0 + dur[a.kind][a.stage]
        free[i] = end[a]
        order[i].append(a)
        if a.kind == "F":
            nxt[i] += 1
            flight[i].append(a.mb)
        else:
            flight[i].remove(a.mb)
    return Plan(name, replicas, microbatches, tuple(tuple(o) for o in order),
                {a: Fraction(t, scale) for a, t in start.items()}, {a: Fraction(t, scale) for a, t in end.items()}, fc)


def _candidates(name: str, s: int, i: int, mine: list, nxt: list, flight: list, cap: list) -> list[Action]:
    """What worker ``i`` (of stage s) may run next: its next forward (within its in-flight
    cap; GPipe: until all are done) and its oldest backward (GPipe: only after every forward)."""
    out = []
    if nxt[i] < len(mine[i]) and len(flight[i]) < cap[i]:
        out.append(Action(s, "F", mine[i][nxt[i]]))
    if flight[i] and (name != "gpipe" or nxt[i] == len(mine[i])):
        out.append(Action(s, "B", flight[i][0]))
    return out


def check_orders(replicas: Sequence[int], microbatches: int, order: Sequence[Sequence[Action]]) -> None:
    """Raise ScheduleError unless the slots' lists run each stage's F and B of every
    microbatch once, on the replica ``replica_of`` names, F before B, without deadlock."""
    pp = len(replicas)
    for slot, acts in enumerate(order):
        s, j = stage_of(replicas, slot)
        want = {Action(s, k, mb) for k in "FB" for mb in range(microbatches) if replica_of(mb, replicas[s]) == j}
        if set(acts) != want or len(acts) != len(want):
            raise ScheduleError(f"slot {slot} (stage {s} replica {j}) does not run exactly {sorted(map(str, want))}")
    pos, done = [0] * len(order), set()
    while any(p < len(o) for p, o in zip(pos, order)):
        moved = False
        for i, acts in enumerate(order):
            while pos[i] < len(acts) and all(d in done for d in dependencies(acts[pos[i]], pp)):
                done.add(acts[pos[i]])
                pos[i] += 1
                moved = True
        if not moved:
            raise ScheduleError("the replicated plan deadlocks")


def relative(costs: Optional[Sequence[float]]) -> Optional[tuple[Fraction, ...]]:
    """Stage costs as exact fractions of the largest (each at least 1/1000), the form the
    orders are planned with, the same on every worker; None (equal costs) when none is positive."""
    if not costs or max(costs) <= 0:
        return None
    top = max(costs)
    return tuple(Fraction(max(c / top, 1e-3)).limit_denominator(10**4) for c in costs)


def modelled_step(seconds: Sequence[float], replicas: Sequence[int], microbatches: int) -> float:
    """The planner's step for stages of ``seconds`` (forward + backward of one microbatch on one
    worker) and ``replicas``: the slowest stage's pace, seconds / replicas, for each of the m
    microbatches, plus the fill and drain, one microbatch through the other stages.  Plain 1F1B's
    (m + pp - 1) x slot when the stages are equal; for costs 1, 2, 1 on [1, 2, 1] at M = 8 the
    simulated plans' 33 units (tests/test_replicas_plan.py compares the two)."""
    pace = max(c / r for c, r in zip(seconds, replicas))
    return microbatches * pace + sum(seconds) - pace


def heaviest_first(seconds: Sequence[float], workers: int) -> tuple[int, ...]:
    """Replica counts for stages of ``seconds`` (per microbatch) on ``workers`` workers: one
    each, then each further worker to the stage with the largest seconds per replica."""
    if workers < len(seconds):
        raise ValueError(f"{workers} workers cannot run {len(seconds)} stages")
    reps = [1] * len(seconds)
    heap = [(-c, s) for s, c in enumerate(seconds)]
    heapq.heapify(heap)
    for _ in range(workers - len(seconds)):
        _, s = heapq.heappop(heap)
        reps[s] += 1
        heapq.heappush(heap, (-seconds[s] / reps[s], s))
    return tuple(reps)


def render_grid(p: Plan) -> str:
    """Worker x time grid of a replicated plan (one row per worker, ``stage s.j``: replica j of
    stage s; one cell = the greatest common unit of the actions' durations), and a last line
    with the bubble and each worker's peak microbatches in flight."""
    unit = schedules.unit_of([p.end[a] - p.start[a] for acts in p.order for a in acts])
    rows = [("stage {}.{:<2}".format(*stage_of(p.replicas, slot)), acts) for slot, acts in enumerate(p.order)]
    lines = schedules.grid_lines(rows, p.start, p.end, unit, p.makespan)
    costs = " ".join(f"F{s}={float(c):g}" for s, c in enumerate(p.costs))
    lines.append(f"{p.name} replicas={label(p.replicas)} microbatches={p.microbatches} {costs} (B = 2F)  "
                 f"makespan={float(p.makespan):g}  bubble={float(p.bubble):.1%}  "
                 f"peak in flight={p.peak_in_flight()}")
    return "\n".join(lines)
