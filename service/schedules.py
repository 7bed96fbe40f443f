"""Pipeline schedules as data.

A schedule is one ordered list of actions per worker (pipeline rank), for one step of one
replica.  An action is written like ``1F3`` (virtual stage 1, forward, microbatch 3) and
round-trips through :meth:`Action.parse`.  Runners (``actors/worker.py``) execute the lists;
everything here is pure and tested without Ray.

Words: p workers, M microbatches, v model chunks (virtual stages) per worker, p x v virtual
stages in all; an action's ``stage`` is its virtual stage, which is the worker's rank when
v = 1.  Kinds: F forward, B backward (the input gradient only in a split schedule, what the
previous stage waits for), W weight gradient (split schedules: zb_h1, zbv; it needs only its
own B, so it can wait to fill a bubble).  Diagrams below: one cell = the shortest action.

GPipe (all-forward-all-backward), 2 stages, 3 microbatches, backward = forward::

    stage 0: 0F0 0F1 0F2         0B0 0B1 0B2
    stage 1:     1F0 1F1 1F2 1B0 1B1 1B2

1F1B keeps at most ``p - i`` microbatches in flight on stage ``i``; it idles (p-1)(F+B)
per worker (B: the whole backward)::

    stage 0: 0F0 0F1     0B0 0F2 0B1     0B2
    stage 1:     1F0 1B0 1F1 1B1 1F2 1B2

ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Figure 3 top): 1F1B's
order, each backward split into B and W, worker i's W lagging its B by i microbatches; the
later workers' W's fill the tail, so with M >= p it idles (p-1)(F+B-W) per worker when W <= F
(a third of 1F1B's at F = B = W; (p-1)B when W > F), with 1F1B's peak memory (p microbatches,
now on every worker)::

    stage 0: 0F0 0F1     0B0 0W0 0F2 0B1 0W1 0B2 0W2
    stage 1:     1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1W2

Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM, section 2.2.2 and Figure 4 lower): v
chunks per worker in loop placement (chunk k on worker k mod p); forwards by rounds of p
microbatches, chunk 0 then chunk 1 ...; each action 1/v as long; it idles (p-1)(F+B)/v per
worker (any M >= p), for p + (p-1)/v microbatches' activations on worker 0 (M a multiple of
p).  Any M: when p does not divide it, the M // p rounds differ by one microbatch (torch
refuses M that its round count does not divide).  p=2, v=2, M=4, backward = forward::

    stage 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1     2B2     2B3 0B2 0B3
    stage 1:     1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3

ZB-V (Qi et al., arXiv 2401.10241 section 6, on the V-shape of their "Pipeline Parallelism
with Controllable Memory"; the zero-bubble repository's handcrafted schedule, torch's
ScheduleZBVZeroBubble): 2 chunks per worker in a V (worker i holds chunks i and 2p-1-i, so
the first and the last chunk sit on worker 0), split backward.  At F = B = W and M >= 2p-1
no worker stalls between its first and its last action; what idles is the start-up skew,
p-1 chunk forwards, (p-1)F/2 per worker; peak memory p microbatches on every worker, as
1F1B's worker 0.  p=2, M=4 (one cell: a chunk's action, half a worker's forward)::

    stage 0: 0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0F3 0B0 0W0 3F2 3B2 3W2 0B1 0W1 3F3 3B3 3W3 0B2 0W2 0B3 0W3
    stage 1:     1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1F3 1B1 1W1 2F3 2B2 2W2 1B2 2B3 1B3 1W2 2W3 1W3

The orders of interleaved_1f1b, zb_h1 and zbv are torch.distributed.pipelining's
(ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble on one stage per worker,
ScheduleZBVZeroBubble) wherever torch defines them; tests/test_schedules.py compares them.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")
CHUNKED = ("interleaved_1f1b", "zbv")     # schedules that place several model chunks on each worker
SPLIT = ("zb_h1", "zbv")                  # schedules whose backward is split into B (input) and W (weight)


def placement(name: str) -> str:
    """How a schedule's model chunks (virtual stages) sit on the workers: ``"v"`` for ZB-V
    (worker i holds chunks i and 2p-1-i), ``"loop"`` for the others (chunk k on worker k mod p)."""
    return "v" if name == "zbv" else "loop"


def owner(vs: int, workers: int, where: str = "loop") -> int:
    """The worker (pipeline rank) that holds virtual stage ``vs`` of ``where`` placement."""
    k, i = divmod(vs, workers)
    return workers - 1 - i if where == "v" and k % 2 else i


def chunks_of(rank: int, workers: int, chunks: int, where: str = "loop") -> list[int]:
    """The virtual stages of pipeline rank ``rank``, in model order."""
    return [vs for vs in range(workers * chunks) if owner(vs, workers, where) == rank]

_ACTION_RE = re.compile(r"^(\d+)([FBWE])(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    stage: int  # the virtual stage (model chunk) 0..p*v-1; the worker's rank when v = 1
    kind: str   # "F", "B" (input gradient; the whole backward if not split), "W" (weight gradient);
                # "E" in a measured timeline: a forward of the evaluation after the step
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
    """Per-worker ordered action lists for one replica's step: ``order[rank]`` is what pipeline
    rank ``rank`` runs (several virtual stages' actions interleaved when ``chunks`` > 1)."""

    name: str
    stages: int          # p: workers (pipeline ranks), one row of ``order`` each
    microbatches: int
    order: tuple[tuple[Action, ...], ...]
    chunks: int = 1      # v: model chunks (virtual stages) per worker
    weight_group: int = 1  # its W's in groups of this many microbatches (group_weights)

    @property
    def virtual(self) -> int:
        """Virtual stages (model chunks) of the whole pipeline: p x v."""
        return self.stages * self.chunks

    @property
    def where(self) -> str:
        """Chunk placement: ``"v"`` (zbv) or ``"loop"``; see :func:`placement`."""
        return placement(self.name)

    @property
    def split(self) -> bool:
        """Its backward is split into B and W (a split schedule, or a plan that has W actions)."""
        return self.name in SPLIT or any(a.kind == "W" for acts in self.order for a in acts)

    def __str__(self) -> str:
        return "\n".join(" ".join(str(a) for a in acts) for acts in self.order)

    @classmethod
    def from_text(cls, text: str, name: str = "custom", chunks: int | None = None) -> "Schedule":
        """One line per worker; ``chunks`` defaults to what the highest virtual stage implies."""
        rows = [line.split() for line in text.strip().splitlines()]
        order = tuple(tuple(Action.parse(a) for a in row) for row in rows)
        mbs = {a.mb for row in order for a in row}
        if chunks is None:
            top = max((a.stage for row in order for a in row), default=0)
            chunks = max(1, -(-(top + 1) // max(len(order), 1)))
        return cls(name, len(order), len(mbs), order, chunks)


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


def microbatch_groups(microbatches: int, stages: int) -> list[range]:
    """The rounds of interleaved 1F1B: ``max(1, M // p)`` runs of consecutive microbatches,
    as even as possible, the longer first (all of length p when p divides M; torch's
    ``microbatches_per_round``, which needs M to be a multiple of the round count)."""
    rounds = max(1, microbatches // stages)
    size, longer = divmod(microbatches, rounds)
    out, lo = [], 0
    for k in range(rounds):
        hi = lo + size + (k < longer)
        out.append(range(lo, hi))
        lo = hi
    return out


def interleaved_one_f_one_b(stages: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM's virtual pipeline): worker r holds
    chunks r, r+p, ..., r+(v-1)p.  Its forwards go round by round (a round: p microbatches),
    each round through chunk 0, then chunk 1, ...; its backwards the same rounds, the chunks
    in reverse.  ``(v-1) x round + 2(p-1-r)`` warm-up forwards, then one forward and one
    backward, then the remaining backwards.  With ``chunks`` 1 it is plain 1F1B."""
    _check_sizes(stages, microbatches)
    if chunks < 1:
        raise ValueError(f"interleaved_1f1b needs stages_per_worker >= 1; got {chunks}")
    if chunks == 1:
        return Schedule("interleaved_1f1b", stages, microbatches, one_f_one_b(stages, microbatches).order)
    p, m, v = stages, microbatches, chunks
    groups = microbatch_groups(m, p)
    fwd = [(c, j) for g in groups for c in range(v) for j in g]
    bwd = [(v - 1 - c, j) for g in groups for c in range(v) for j in g]
    n = m * v
    order = []
    for r in range(p):
        f = [Action(c * p + r, "F", j) for c, j in fwd]
        b = [Action(c * p + r, "B", j) for c, j in bwd]
        warm = min((v - 1) * len(groups[0]) + 2 * (p - 1 - r), n)
        acts = f[:warm]
        for k in range(n - warm):
            acts += [f[warm + k], b[k]]
        acts += b[n - warm:]
        order.append(tuple(acts))
    return Schedule("interleaved_1f1b", p, m, tuple(order), v)


def zb_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024): 1F1B's order with each backward split into B (input gradient,
    what the previous stage waits for) and W (weight gradient).  Worker r runs W of microbatch
    k right after B of microbatch k + r (W lags B by r microbatches), the last r W's at the
    end: the later workers' W's fill the tail 1F1B leaves idle."""
    base = one_f_one_b(stages, microbatches)
    order = []
    for r, row in enumerate(base.order):
        acts, w = [], 0
        for a in row:
            acts.append(a)
            if a.kind == "B" and a.mb >= r:
                acts.append(Action(r, "W", w))
                w += 1
        acts += [Action(r, "W", j) for j in range(w, microbatches)]
        order.append(tuple(acts))
    return Schedule("zb_h1", stages, microbatches, tuple(order))


def zbv(stages: int, microbatches: int) -> Schedule:
    """ZB-V (Qi et al., the zero-bubble repository's handcrafted ZB-V, torch's
    ``ScheduleZBVZeroBubble``): worker r holds chunks r (going down the V) and 2p-1-r (coming
    back up).  Warm-up: 2(p-r)-1 forwards of the down chunk, r pairs (F up, F down), p-r
    triples (F up, B up, W up); steady: F down, B down, W down, F up, B up, W up; cool-down:
    r pairs (B down, B up), p-r pairs (B down, W down), then the W's left.  Planned for at
    least 2p-1 microbatches (what fills the V); the actions of those beyond M are dropped."""
    _check_sizes(stages, microbatches)
    p, m = stages, microbatches
    n = max(2 * p - 1, m)
    order = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        count = {(vs, k): 0 for vs in (down, up) for k in "FBW"}
        acts: list[Action] = []

        def run(vs: int, kind: str) -> None:
            acts.append(Action(vs, kind, count[vs, kind]))
            count[vs, kind] += 1

        for _ in range(2 * (p - r) - 1):
            run(down, "F")
        for _ in range(r):
            run(up, "F"), run(down, "F")
        for _ in range(p - r):
            run(up, "F"), run(up, "B"), run(up, "W")
        while count[up, "F"] < count[down, "F"] or count[down, "F"] < n:
            if count[down, "F"] < n:
                run(down, "F")
            run(down, "B"), run(down, "W"), run(up, "F"), run(up, "B"), run(up, "W")
        for _ in range(r):
            run(down, "B"), run(up, "B")
        for _ in range(p - r):
            run(down, "B"), run(down, "W")
        for vs in (up, down):
            while count[vs, "W"] < count[vs, "B"]:
                run(vs, "W")
        order.append(tuple(a for a in acts if a.mb < m))
    return Schedule("zbv", p, m, tuple(order), 2)


def group_weights(schedule: Schedule, group: int) -> Schedule:
    """``schedule`` with its W actions in groups of ``group`` microbatches: on each worker, each
    chunk's W's (in their order) are taken ``group`` at a time, and every W of a group moves
    to where the group's last W was, so the group's W's stand together (the last group may be
    shorter).  The workers then compute a group's weight gradients as one matrix product per
    Linear layer over the group's rows (actors/stage.py): fewer, larger products, which read
    and write each weight's gradient once per group instead of once per microbatch.  The W's
    only move later, so every dependency still holds; what each moved W needs (the Linear
    inputs and output gradients of its microbatch) is held that much longer, which
    :func:`peak_in_flight` counts.  ``group`` 1 (or a schedule without W's) returns it unchanged."""
    if group < 1:
        raise ValueError(f"a weight-gradient group holds at least 1 microbatch; got {group}")
    if group == 1 or not any(a.kind == "W" for acts in schedule.order for a in acts):
        return schedule
    order = []
    for acts in schedule.order:
        ws: dict[int, list[int]] = {}  # chunk -> positions of its W's, in order
        for i, a in enumerate(acts):
            if a.kind == "W":
                ws.setdefault(a.stage, []).append(i)
        at: dict[int, list[Action]] = {}  # position -> the W's that run there
        for pos in ws.values():
            for k in range(0, len(pos), group):
                members = pos[k:k + group]
                at[members[-1]] = [acts[i] for i in members]
        row = []
        for i, a in enumerate(acts):
            if a.kind != "W":
                row.append(a)
            elif i in at:
                row += at[i]
        order.append(tuple(row))
    return Schedule(schedule.name, schedule.stages, schedule.microbatches, tuple(order), schedule.chunks, group)


def build(name: str, stages: int, microbatches: int, chunks: int = 1, weight_group: int = 1) -> Schedule:
    """The plan of schedule ``name`` for ``stages`` workers, ``microbatches`` microbatches and
    ``chunks`` model chunks per worker (1 for gpipe, 1f1b and zb_h1; any v >= 1 for
    interleaved_1f1b; 2 for zbv); ``weight_group`` > 1 (split schedules only): the W's in
    groups of that many microbatches (:func:`group_weights`; more than ``microbatches``: all
    of them)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULES)}")
    if weight_group != 1:
        if name not in SPLIT:
            raise ValueError(f"weight_group {weight_group} needs a schedule with W actions (zb_h1 or zbv), "
                             f"not {name}: its weight gradients are computed in each backward; set weight_group 1")
        return group_weights(build(name, stages, microbatches, chunks), min(weight_group, microbatches))
    if name == "zbv":
        if chunks != 2:
            raise ValueError(f"zbv needs stages_per_worker 2 (its V placement puts 2 chunks on each worker); "
                             f"got {chunks}")
        return zbv(stages, microbatches)
    if name == "interleaved_1f1b":
        return interleaved_one_f_one_b(stages, microbatches, chunks)
    if chunks != 1:
        raise ValueError(f"{name} puts 1 chunk on each worker; got stages_per_worker {chunks} "
                         f"(interleaved_1f1b and zbv place several)")
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zb_h1": zb_h1}[name](stages, microbatches)


def sends_early(schedule: Schedule) -> Schedule:
    """``schedule`` (one without W actions) as relaytrain's workers run it where every chunk's
    weights sit in plain Linear layers (actors/deferred.py): each backward computes the
    chunk's input gradient, sends it to the chunk before, and only then its weight gradients.
    Each B becomes that B (the input gradient, what the stage before waits for) followed at
    once by its W: the order and the activations held are the schedule's, but the stage before
    gets its gradient a W earlier, so the fill and drain shrink (1F1B at p = 2, M = 8 and
    F = B = W: 1/13 of the step idle, 7.7%, against 1/9).  A split schedule is returned as it is."""
    if schedule.split:
        return schedule
    order = tuple(tuple(x for a in acts for x in ((a, Action(a.stage, "W", a.mb)) if a.kind == "B" else (a,)))
                  for acts in schedule.order)
    return Schedule(schedule.name, schedule.stages, schedule.microbatches, order, schedule.chunks)


# the share of a chunk's weight-gradient work its plain Linears must hold for the chunk's weight
# gradients to wait until after its input gradient is sent (actors/deferred.py computes those
# Linears' products itself): the workers weigh each chunk so after their first step
# (deferred.covered), the planner the traced layers (service/tracing.py weighed; planner.LayerFacts.early)
LINEAR_COVER = 0.9
# under this share a chunk of 1F1B, GPipe or interleaved defers nothing worth the while (its
# layers call F.linear, a Linear head after them): it runs as a chunk without plain Linears,
# its last backward of a step split torch's way (actors/stage.py ``_check_early``; ``simulate``'s
# ``last_early``; the planner's ``LayerFacts.last_early``)
FEW_LINEARS = 0.1

# a chunk of a split schedule whose Linears hold too little of its weight-gradient work
# (under LINEAR_COVER) has two ways to split its backward: torch's (all its weight gradients wait for W,
# at the cost of a second pass through the graph: 12-31 % more compute for convolutions on a CPU,
# bench/split_backward.py) or the Linears' own products (no extra compute, the rest of its weight
# gradients in B).  Which makes the faster step depends on the device and on how much bubble
# the split fills, so the steps after the first try both, in this order: torch's first, not
# counted (its first step pays a one-time start-up, about 200 ms on a CPU), then three of each,
# their order weighing drift in the machine's speed on both alike
SPLIT_TRIAL = ("torch", "own", "torch", "torch", "own", "own", "torch")
SPLIT_WARM = 1  # the trial's first steps, not counted
OWN_SPLIT_MARGIN = 0.02


def choose_split(tried: dict) -> str:
    """The split the chunks under trial keep, from the trial's step times (``tried``: mode ->
    seconds of each counted step): the one whose fastest step was faster (the noise of a
    shared machine only adds time); the own products must win by
    ``OWN_SPLIT_MARGIN``, or the split the schedule means (torch's, every weight gradient in W) stays."""
    return "own" if min(tried["own"]) < (1.0 - OWN_SPLIT_MARGIN) * min(tried["torch"]) else "torch"


def _check_sizes(stages: int, microbatches: int) -> None:
    if stages < 1:
        raise ValueError(f"a schedule needs at least 1 stage, got {stages}")
    if microbatches < 1:
        raise ValueError(f"a schedule needs at least 1 microbatch, got {microbatches}")


def dependencies(a: Action, virtual: int) -> list[Action]:
    """Actions that must finish before ``a`` may start (within one replica); ``virtual``: the
    pipeline's virtual stages (p x v; p when each worker holds one stage)."""
    if a.kind in "FE":
        return [Action(a.stage - 1, a.kind, a.mb)] if a.stage > 0 else []
    if a.kind == "W":
        return [Action(a.stage, "B", a.mb)]
    deps = [Action(a.stage, "F", a.mb)]
    if a.stage < virtual - 1:
        deps.append(Action(a.stage + 1, "B", a.mb))
    return deps


class ScheduleError(ValueError):
    """A plan that cannot run; the message holds the grid with the stuck cells marked."""


@dataclass(frozen=True)
class Timing:
    """Start and end of every action in a simulated run (time units: one microbatch's forward
    through a worker's whole share of the model = 1)."""

    start: dict[Action, Fraction]
    end: dict[Action, Fraction]
    makespan: Fraction
    busy: tuple[Fraction, ...]  # per worker
    spans: tuple[tuple[Fraction, Fraction], ...] = ()  # per worker: its first start, its last end

    @property
    def utilization(self) -> Fraction:
        total = self.makespan * len(self.busy)
        return sum(self.busy, Fraction(0)) / total if total else Fraction(1)

    @property
    def bubble(self) -> Fraction:
        return 1 - self.utilization


def idle_per_worker(timing: Timing) -> tuple[Fraction, ...]:
    """Per worker, the step's idle time: makespan - busy."""
    return tuple(timing.makespan - b for b in timing.busy)


def stall_per_worker(timing: Timing) -> tuple[Fraction, ...]:
    """Per worker, idle time between its first start and its last end (what is left of the
    bubble when consecutive steps overlap, as with the zero-bubble papers' optimizer post
    validation: the skew of a parallelogram-shaped step does not count)."""
    return tuple(hi - lo - b for (lo, hi), b in zip(timing.spans, timing.busy))


def _cost(value: Fraction | float | int, what: str) -> Fraction:
    cost = Fraction(value).limit_denominator(1000)
    if cost <= 0:
        raise ValueError(f"{what} cost must be positive, got {value}")
    return cost


def action_costs(schedule: Schedule, backward_cost: Fraction | float | int = 2,
                 weight_cost: Fraction | float | int | None = None) -> dict[str, Fraction]:
    """Duration of one action of each kind of ``schedule``.  Per microbatch through a worker's
    whole share: forward 1; with ``weight_cost`` None, ``backward_cost`` is the whole backward
    (a split schedule's B and W each take half); else B takes ``backward_cost`` and W
    ``weight_cost`` (an unsplit schedule's B both).  A chunk's action takes 1/v of that."""
    b = _cost(backward_cost, "backward")
    w = None if weight_cost is None else _cost(weight_cost, "weight")
    if schedule.split:
        b, w = (b / 2, b / 2) if w is None else (b, w)
        costs = {"F": Fraction(1), "B": b, "W": w}
    else:
        costs = {"F": Fraction(1), "B": b if w is None else b + w}
    return {k: c / schedule.chunks for k, c in costs.items()}


def last_backwards(schedule: Schedule) -> frozenset:
    """Each worker's last B of the step (of a schedule without W actions)."""
    return frozenset(next(a for a in reversed(acts) if a.kind == "B") for acts in schedule.order
                     if any(a.kind == "B" for a in acts))


def simulate(schedule: Schedule, backward_cost: Fraction | float | int = 2,
             weight_cost: Fraction | float | int | None = None, last_early: bool = False) -> Timing:
    """Validate ``schedule`` and time it (costs: :func:`action_costs`): each worker runs its
    list in order, each action starts when the worker is free and its dependencies have
    ended.  ``last_early`` (a schedule without W): each worker's last backward of the step
    sends its input gradient before its weight gradients, as relaytrain's workers run the
    chunks whose weights are not in plain Linears (torch's split of that one backward): the
    stage before may start its own last backward once the input-gradient part (B of a split,
    ``backward_cost`` / 2 with no ``weight_cost``) has ended.  Raises :class:`ScheduleError`
    for a plan that is incomplete, repeats an action, runs a B before its F or a W before its
    B, or deadlocks across workers."""
    costs = action_costs(schedule, backward_cost, weight_cost)
    _validate(schedule)
    sent = {}
    if last_early and not schedule.split:
        b = _cost(backward_cost, "backward")
        part = (b / 2 if weight_cost is None else b) / schedule.chunks  # the input gradient's share
        sent = {a: part for a in last_backwards(schedule)}
    start, end = _clock(schedule, costs, sent)
    busy = tuple(sum((end[a] - start[a] for a in acts), Fraction(0)) for acts in schedule.order)
    spans = tuple((min(start[a] for a in acts), max(end[a] for a in acts)) if acts else (Fraction(0), Fraction(0))
                  for acts in schedule.order)
    return Timing(start, end, max(end.values()), busy, spans)


def _validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless every worker runs, for each of its virtual stages,
    the F and the B (and the W, split) of each microbatch exactly once, F before B before W."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.chunks
    if v < 1:
        raise ScheduleError(f"plan has {v} chunks per worker, expected at least 1")
    if len(schedule.order) != p:
        raise ScheduleError(f"plan has {len(schedule.order)} stage rows, expected {p}")
    kinds = "FBW" if schedule.split else "FB"
    for i, acts in enumerate(schedule.order):
        mine = chunks_of(i, p, v, schedule.where)
        want = {Action(vs, k, j) for vs in mine for k in kinds for j in range(m)}
        counts = Counter(acts)
        dup = sorted(str(a) for a, c in counts.items() if c > 1)
        if dup:
            raise ScheduleError(f"stage {i} repeats {', '.join(dup)}\n{render_plan(schedule)}")
        if set(counts) != want:
            missing = sorted(str(a) for a in want - set(counts))
            extra = sorted(str(a) for a in set(counts) - want)
            each = "F, B and W" if schedule.split else "F and B"
            of = f" on each of its virtual stages {mine}" if v > 1 else ""
            raise ScheduleError(
                f"stage {i} must run {each} of each of {m} microbatches once{of}; "
                f"missing {missing or 'none'}, unexpected {extra or 'none'}\n{render_plan(schedule)}"
            )
        seen: set[Action] = set()
        for a in acts:
            before = {"B": "F", "W": "B"}.get(a.kind)
            if before and Action(a.stage, before, a.mb) not in seen:
                raise ScheduleError(
                    f"{a} comes before {a.stage}{before}{a.mb} on stage {i}\n{render_plan(schedule)}")
            seen.add(a)


def _clock(schedule: Schedule, costs: dict[str, Fraction],
           sent: dict | None = None) -> tuple[dict[Action, Fraction], dict[Action, Fraction]]:
    """Start and end of each action of a valid plan: sweep the workers, running each one's
    next actions while their dependencies have ended (``sent``: actions whose dependents may
    start that long after the action starts, before it ends), until all have run.  Raises
    :class:`ScheduleError` with the stuck cells marked when a sweep runs nothing."""
    p, virtual = schedule.stages, schedule.virtual
    sent = sent or {}
    start: dict[Action, Fraction] = {}
    end: dict[Action, Fraction] = {}
    ready: dict[Action, Fraction] = {}  # when what depends on the action may start
    pos = [0] * p
    free = [Fraction(0)] * p
    remaining = sum(len(acts) for acts in schedule.order)
    while remaining:
        progressed = False
        for i in range(p):
            acts = schedule.order[i]
            while pos[i] < len(acts):
                a = acts[pos[i]]
                deps = dependencies(a, virtual)
                if any(d not in end for d in deps):
                    break
                t0 = max([free[i]] + [ready[d] for d in deps])
                start[a] = t0
                end[a] = t0 + costs[a.kind]
                ready[a] = t0 + sent[a] if a in sent else end[a]
                free[i] = end[a]
                pos[i] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [schedule.order[i][pos[i]] for i in range(p) if pos[i] < len(schedule.order[i])]
            raise ScheduleError(
                "plan deadlocks: " + ", ".join(
                    f"{a} waits for {', '.join(str(d) for d in dependencies(a, virtual) if d not in end)}"
                    for a in stuck
                ) + "\n" + render_plan(schedule, mark=set(stuck))
            )
    return start, end


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per worker, the most (chunk, microbatch) activations held at once: +1 at each F, -1 at
    the W of a split schedule (the weight gradient still needs the layer inputs), at the B
    otherwise."""
    release = "W" if schedule.split else "B"
    peaks = []
    for acts in schedule.order:
        live = peak = 0
        for a in acts:
            if a.kind == "F":
                live += 1
                peak = max(peak, live)
            elif a.kind == release:
                live -= 1
        peaks.append(peak)
    return peaks


def peak_activation_fraction(schedule: Schedule) -> list[Fraction]:
    """Per worker, :func:`peak_in_flight` in units of one microbatch's activations of the
    worker's whole share (a chunk holds 1/v of them): peak / v."""
    return [Fraction(k, schedule.chunks) for k in peak_in_flight(schedule)]


def render_plan(schedule: Schedule, mark: set[Action] | None = None) -> str:
    """The plan's order per stage (no timing), with ``mark``ed actions in brackets."""
    mark = mark or set()
    return "\n".join(
        f"stage {i}: " + " ".join(f"[{a}]" if a in mark else str(a) for a in acts)
        for i, acts in enumerate(schedule.order)
    )


def unit_of(values) -> Fraction:
    """The greatest common unit of positive fractions (each is a whole number of it)."""
    den = math.lcm(*(x.denominator for x in values))
    return Fraction(math.gcd(*(x.numerator * (den // x.denominator) for x in values)), den)


MAX_GRID_CELLS = 2000  # columns of a drawn grid: beyond, the costs' ratios are too fine to draw


def grid_lines(rows: list, start: dict, end: dict, unit: Fraction, makespan: Fraction) -> list[str]:
    """A time header and one line per ``(label, actions)`` row: each action fills the cells of
    ``unit`` it lasts (``start``/``end``), idle cells are blank.  A grid wider than
    ``MAX_GRID_CELLS`` is refused (ValueError), saying why."""
    cells = int(makespan / unit)
    if cells > MAX_GRID_CELLS:
        wide = f"the grid would be {cells if cells < 10**6 else 'over a million'} columns wide"
        longest = max(((end[a] - start[a]) / unit for _, acts in rows for a in acts), default=0)
        if longest > 50:  # an action spans many columns: the costs' ratios, not the plan's length
            raise ValueError(f"{wide} (one column per {unit} of forward time, the costs' common unit): give costs "
                             f"in coarser ratios (e.g. 2 or 1.5, not 1000000), at most {MAX_GRID_CELLS} columns")
        raise ValueError(f"{wide}, more than the {MAX_GRID_CELLS} drawn: fewer microbatches or stages draw it "
                         "(the bubble of a long plan is what `relaytrain plan` and the README's formulas give)")
    width = max([len(str(a)) for _, acts in rows for a in acts] + [len(str(cells - 1))])
    pad = max(len(name) for name, _ in rows) + 1
    lines = [(" " * pad + " ".join(f"{t:<{width}}" for t in range(cells))).rstrip()]
    for name, acts in rows:
        row = [" " * width] * cells
        for a in acts:
            for c in range(int(start[a] / unit), int(end[a] / unit)):
                row[c] = f"{str(a):<{width}}"
        lines.append(f"{name} " + " ".join(row).rstrip())
    return lines


def render_grid(schedule: Schedule, backward_cost: Fraction | float | int = 2,
                weight_cost: Fraction | float | int | None = None, title: str | None = None,
                last_early: bool = False) -> str:
    """Worker x time grid of the simulated plan (one row per worker, ``stage i``); an action
    fills as many cells as it lasts (one cell = the greatest common unit of the actions'
    durations), idle cells are blank.  Last line: the plan, its costs per microbatch through
    a worker's whole share (F = 1), bubble fraction and utilization; ``title`` names the plan
    there (default: the schedule's name); ``last_early``: see :func:`simulate`."""
    timing = simulate(schedule, backward_cost, weight_cost, last_early)
    costs = action_costs(schedule, backward_cost, weight_cost)
    lines = grid_lines([(f"stage {i:<2}", acts) for i, acts in enumerate(schedule.order)], timing.start, timing.end,
                       unit_of(costs.values()), timing.makespan)
    share = " ".join(f"{k}={c * schedule.chunks}" for k, c in costs.items())
    lines.append(
        f"{title or schedule.name}: stages={schedule.stages} microbatches={schedule.microbatches} "
        f"chunks={schedule.chunks} {share}  bubble={float(timing.bubble):.1%}  "
        f"utilization={float(timing.utilization):.1%}"
    )
    return "\n".join(lines)
