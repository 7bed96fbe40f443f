"""Pipeline schedules as data.

A schedule is one ordered list of actions per stage, for one step of one replica.
An action is written like ``1F3`` (stage 1, forward, microbatch 3) and round-trips
through :meth:`Action.parse`.  Runners (``actors/worker.py``) execute the lists;
everything here is pure and tested without Ray.

GPipe (all-forward-all-backward), 2 stages, 3 microbatches, backward = forward::

    stage 0: 0F0 0F1 0F2         0B0 0B1 0B2
    stage 1:     1F0 1F1 1F2 1B0 1B1 1B2

1F1B keeps at most ``p - i`` microbatches in flight on stage ``i``::

    stage 0: 0F0 0F1     0B0 0F2 0B1     0B2
    stage 1:     1F0 1B0 1F1 1B1 1F2 1B2
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

SCHEDULES = ("gpipe", "1f1b")

_ACTION_RE = re.compile(r"^(\d+)([FBE])(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: str  # "F" or "B"; "E" in a measured timeline: a forward of the evaluation after the step
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ValueError(f"not an action: {text!r} (write it like '1F3')")
        return cls(int(m.group(1)), m.group(2), int(m.group(3)))


@dataclass(frozen=True)
class Schedule:
    """Per-stage ordered action lists for one replica's step."""

    name: str
    stages: int
    microbatches: int
    order: tuple[tuple[Action, ...], ...]

    def __str__(self) -> str:
        return "\n".join(" ".join(str(a) for a in acts) for acts in self.order)

    @classmethod
    def from_text(cls, text: str, name: str = "custom") -> "Schedule":
        rows = [line.split() for line in text.strip().splitlines()]
        order = tuple(tuple(Action.parse(a) for a in row) for row in rows)
        mbs = {a.mb for row in order for a in row}
        return cls(name, len(order), len(mbs), order)


def gpipe(stages: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards (in microbatch order), on every stage."""
    _check_sizes(stages, microbatches)
    order = tuple(
        tuple(Action(i, "F", j) for j in range(microbatches))
        + tuple(Action(i, "B", j) for j in range(microbatches))
        for i in range(stages)
    )
    return Schedule("gpipe", stages, microbatches, order)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B: ``p - i - 1`` warm-up forwards on stage i, then alternate, then drain."""
    _check_sizes(stages, microbatches)
    order = []
    for i in range(stages):
        warm = min(stages - i - 1, microbatches)
        acts = [Action(i, "F", j) for j in range(warm)]
        for k in range(microbatches - warm):
            acts += [Action(i, "F", warm + k), Action(i, "B", k)]
        acts += [Action(i, "B", j) for j in range(microbatches - warm, microbatches)]
        order.append(tuple(acts))
    return Schedule("1f1b", stages, microbatches, tuple(order))


def build(name: str, stages: int, microbatches: int) -> Schedule:
    if name == "gpipe":
        return gpipe(stages, microbatches)
    if name == "1f1b":
        return one_f_one_b(stages, microbatches)
    raise ValueError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULES)}")


def _check_sizes(stages: int, microbatches: int) -> None:
    if stages < 1:
        raise ValueError(f"a schedule needs at least 1 stage, got {stages}")
    if microbatches < 1:
        raise ValueError(f"a schedule needs at least 1 microbatch, got {microbatches}")


def dependencies(a: Action, stages: int) -> list[Action]:
    """Actions that must finish before ``a`` may start (within one replica)."""
    if a.kind == "F":
        return [Action(a.stage - 1, "F", a.mb)] if a.stage > 0 else []
    deps = [Action(a.stage, "F", a.mb)]
    if a.stage < stages - 1:
        deps.append(Action(a.stage + 1, "B", a.mb))
    return deps


class ScheduleError(ValueError):
    """A plan that cannot run; the message holds the grid with the stuck cells marked."""


@dataclass(frozen=True)
class Timing:
    """Start and end of every action in a simulated run (time units: forward = 1)."""

    start: dict[Action, Fraction]
    end: dict[Action, Fraction]
    makespan: Fraction
    busy: tuple[Fraction, ...]  # per stage

    @property
    def utilization(self) -> Fraction:
        total = self.makespan * len(self.busy)
        return sum(self.busy, Fraction(0)) / total if total else Fraction(1)

    @property
    def bubble(self) -> Fraction:
        return 1 - self.utilization


def simulate(schedule: Schedule, backward_cost: Fraction | float | int = 2) -> Timing:
    """Validate ``schedule`` and time it: each stage runs its list in order, each action
    starts when the stage is free and its dependencies have ended.  Raises
    :class:`ScheduleError` for a plan that is incomplete, repeats an action, runs a B
    before its F, or deadlocks across stages."""
    cost_b = Fraction(backward_cost).limit_denominator(1000)
    if cost_b <= 0:
        raise ValueError(f"backward cost must be positive, got {backward_cost}")
    _validate(schedule)
    start, end = _clock(schedule, cost_b)
    busy = tuple(sum((end[a] - start[a] for a in acts), Fraction(0)) for acts in schedule.order)
    return Timing(start, end, max(end.values()), busy)


def _validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless every stage runs the F and the B of each
    microbatch exactly once, the F first."""
    p, m = schedule.stages, schedule.microbatches
    if len(schedule.order) != p:
        raise ScheduleError(f"plan has {len(schedule.order)} stage rows, expected {p}")
    for i, acts in enumerate(schedule.order):
        want = {Action(i, k, j) for k in "FB" for j in range(m)}
        got = list(acts)
        if len(set(got)) != len(got):
            dup = sorted({str(a) for a in got if got.count(a) > 1})
            raise ScheduleError(f"stage {i} repeats {', '.join(dup)}\n{render_plan(schedule)}")
        if set(got) != want:
            missing = sorted(str(a) for a in want - set(got))
            extra = sorted(str(a) for a in set(got) - want)
            raise ScheduleError(
                f"stage {i} must run F and B of each of {m} microbatches once; "
                f"missing {missing or 'none'}, unexpected {extra or 'none'}\n{render_plan(schedule)}"
            )
        seen_f: set[int] = set()
        for a in got:
            if a.kind == "F":
                seen_f.add(a.mb)
            elif a.mb not in seen_f:
                raise ScheduleError(f"{a} comes before {i}F{a.mb} on stage {i}\n{render_plan(schedule)}")


def _clock(schedule: Schedule, cost_b: Fraction) -> tuple[dict[Action, Fraction], dict[Action, Fraction]]:
    """Start and end of each action of a valid plan (forward = 1, backward = ``cost_b``):
    sweep the stages, running each one's next actions while their dependencies have ended,
    until all have run.  Raises :class:`ScheduleError` with the stuck cells marked when a
    sweep runs nothing."""
    p = schedule.stages
    start: dict[Action, Fraction] = {}
    end: dict[Action, Fraction] = {}
    pos = [0] * p
    free = [Fraction(0)] * p
    remaining = 2 * schedule.microbatches * p
    while remaining:
        progressed = False
        for i in range(p):
            while pos[i] < len(schedule.order[i]):
                a = schedule.order[i][pos[i]]
                deps = dependencies(a, p)
                if any(d not in end for d in deps):
                    break
                t0 = max([free[i]] + [end[d] for d in deps])
                start[a] = t0
                end[a] = t0 + (1 if a.kind == "F" else cost_b)
                free[i] = end[a]
                pos[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [schedule.order[i][pos[i]] for i in range(p) if pos[i] < len(schedule.order[i])]
            raise ScheduleError(
                "plan deadlocks: " + ", ".join(
                    f"{a} waits for {', '.join(str(d) for d in dependencies(a, p) if d not in end)}"
                    for a in stuck
                ) + "\n" + render_plan(schedule, mark=set(stuck))
            )
    return start, end


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most microbatches whose activations are held (F done, B not yet)."""
    peaks = []
    for acts in schedule.order:
        live = peak = 0
        for a in acts:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def render_plan(schedule: Schedule, mark: set[Action] | None = None) -> str:
    """The plan's order per stage (no timing), with ``mark``ed actions in brackets."""
    mark = mark or set()
    return "\n".join(
        f"stage {i}: " + " ".join(f"[{a}]" if a in mark else str(a) for a in acts)
        for i, acts in enumerate(schedule.order)
    )


def render_grid(schedule: Schedule, backward_cost: Fraction | float | int = 2) -> str:
    """Stage x time grid of the simulated plan; an action fills as many cells as it
    lasts (one cell = the greatest common unit of the forward and backward costs),
    idle cells are blank.  Last line: bubble fraction and utilization."""
    timing = simulate(schedule, backward_cost)
    cost_b = Fraction(backward_cost).limit_denominator(1000)
    unit = Fraction(1, cost_b.denominator)  # largest cell that both costs fill exactly
    cells = int(timing.makespan / unit)
    width = max(len(str(a)) for acts in schedule.order for a in acts)
    lines = []
    header = " " * 9 + " ".join(f"{t:<{width}}" for t in range(cells))
    lines.append(header.rstrip())
    for i, acts in enumerate(schedule.order):
        row = [" " * width] * cells
        for a in acts:
            first = int(timing.start[a] / unit)
            last = int(timing.end[a] / unit)
            for c in range(first, last):
                row[c] = f"{str(a):<{width}}"
        lines.append(f"stage {i:<2} " + " ".join(row).rstrip())
    lines.append(
        f"{schedule.name}: stages={schedule.stages} microbatches={schedule.microbatches} "
        f"backward_cost={float(cost_b):g}  bubble={float(timing.bubble):.1%}  "
        f"utilization={float(timing.utilization):.1%}"
    )
    return "\n".join(lines)
