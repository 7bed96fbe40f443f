"""The elastic planner: which shape to train in, given the worker slots alive now.

Pure: plain numbers in, a ``Decision`` out, tested without Ray.  The global batch B and the
microbatch size never change; the planner picks (dp, pp), the stage partition and the
microbatches per replica (M / dp) that maximise modelled throughput among the shapes that
fit the slots, the elastic range and each worker's memory.

The model is cut into pp x v virtual stages (model chunks; v = ``chunks`` =
``parallelism.stages_per_worker``: 1 for gpipe, 1f1b and zb_h1, v for interleaved_1f1b, 2 for
zbv), placed on the pp workers as the schedule says (service/schedules.py ``placement``: "loop",
chunk k on worker k mod pp, or zbv's "v", worker i holds chunks i and 2pp-1-i).  The model of
one step, per replica, for every schedule::

    step = units * slot + allreduce
    units = makespan of the schedule's plan for (pp, m, v) simulated with a forward of 1, a
            backward of 2 (split schedules: B 1 + W 1; each action of a chunked schedule 1/v),
            divided by 3 (one microbatch's forward + backward on one worker)
          = m + pp - 1 for gpipe and 1f1b; about m + (pp - 1) / v for interleaved_1f1b;
            about m + (pp - 1) / 3 for zb_h1 (the deferred W fills most of the bubble).
            Where the workers send each input gradient before the weight gradients (every
            chunk with parameters holds a plain Linear; not under bf16, tensor parallelism,
            replicated stages or a GPU's gradient sum during backward: ``LayerFacts.early``),
            the unsplit schedules are timed as ``schedules.sends_early`` plans (B 1 then W 1
            at once): 1f1b at pp = 2, m = 8 takes 26/3 units, not 9
    slot = max over workers of (forward+backward seconds of the layers of all its chunks for one
           microbatch + one hop per chunk boundary that crosses workers, activation out or
           gradient back: 2 per chunk with pp > 1, less the model's two ends; zbv's turn at
           worker pp-1 is local; and one hop for each skip connection whose stasher and popper
           are on different workers, charged to both)
    allreduce = ring all-reduce of the largest worker's parameters among dp replicas

i.e. the plan's makespan in units of the slowest worker's forward+backward, scaled to its
seconds (gpipe and 1f1b use the closed form, the others a cached simulation).  Hop costs per
transport and the all-reduce bandwidth were measured on the development machine (see README:
"How the planner decides").  Memory of a worker: parameters of all its chunks x (2 + optimizer
slots) plus the activations it holds at the plan's peak: the most (chunk, microbatch) pairs
between a forward and the backward that frees them (the W of split schedules), as a fraction of
one microbatch's activations of its whole share (``schedules.peak_activation_fraction``; 1F1B:
pp - stage microbatches at most; GPipe: all m), each what autograd saves of its layers (traced),
or with activation checkpointing only each layer's input, plus one layer's recomputation;
checkpointing costs one more forward (compute x 4/3).  With ``training.batch_norm: global``
(GPipe only) a stage holding a BatchNorm waits for all its microbatches there, forward and
backward, which cuts the pipeline into segments run one after another (``gathered_units``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Optional, Sequence, Union

from service import partition, schedules
from service import replicas as replicas_

# seconds = latency + bytes * per_byte, measured between two actors on one machine
HOP_COST = {"object_store": (3.0e-3, 8.0e-3 / 2**20), "collective": (0.3e-3, 0.55e-3 / 2**20)}
ALLREDUCE_LATENCY_S = 0.5e-3
ALLREDUCE_BYTES_PER_S = 1.0e9
OPTIMIZER_SLOTS = {"sgd": 1, "adam": 2, "adamw": 2}  # state tensors per parameter (sgd: momentum buffer)


@dataclass(frozen=True)
class LayerFacts:
    """What the planner knows about the model, one entry per layer (Sequential child)."""

    seconds: Sequence[float]          # forward + backward of one microbatch
    param_bytes: Sequence[int]
    activation_bytes: Sequence[int]   # the layer's output for one microbatch
    # what autograd keeps of a layer for its backward, one microbatch (None: its output only)
    saved_bytes: Optional[Sequence[int]] = None
    checkpointing: bool = False       # training.activation_checkpointing: each layer recomputed in backward
    # skip connections (relaytrain.skip): (stashing layer, popping layer, bytes for one microbatch)
    skips: Sequence[tuple] = ()
    # training.batch_norm: global: the layers holding a BatchNorm, where a stage waits for all its microbatches
    gathers: frozenset = frozenset()
    # each layer's weight-gradient work (service/tracing.py weighed): (its plain Linears', which the
    # workers compute after sending the input gradient; all of it); None: not known, or not so
    # computed (bf16), and the plans are the textbook ones
    linear_work: Optional[Sequence[tuple[float, float]]] = None
    gpu: bool = False                 # the workers start the gradient sum during backward when dp > 1 (no early sends)

    def early(self, bounds: Sequence[tuple[int, int]], dp: int = 1, chunks: int = 1) -> bool:
        """Whether workers holding the chunks ``bounds`` send each input gradient before their
        weight gradients (actors/stage.py ``sends_early``): in every chunk with parameters, plain
        Linears hold ``schedules.LINEAR_COVER`` of the weight-gradient work (the workers' own rule,
        actors/deferred.py ``covered``), and the gradient sum does not start during backward (GPU,
        dp > 1, one chunk)."""
        if self.linear_work is None or (self.gpu and dp > 1 and chunks == 1):
            return False
        return all(mine >= schedules.LINEAR_COVER * total for mine, total in self._linear_shares(bounds))

    def _linear_shares(self, bounds: Sequence[tuple[int, int]]):
        """(its plain Linears' weight-gradient work, all of it) of each chunk of ``bounds`` that
        holds parameters and has such work."""
        for lo, hi in bounds:
            mine, total = (sum(w[k] for w in self.linear_work[lo:hi]) for k in (0, 1))
            if any(self.param_bytes[lo:hi]) and total:
                yield mine, total

    def last_early(self, bounds: Sequence[tuple[int, int]], dp: int = 1, chunks: int = 1) -> bool:
        """Whether each worker's last backward of the step sends its input gradient before its
        weight gradients where the others do not (actors/stage.py ``_check_early``): in every
        chunk with parameters plain Linears hold under ``schedules.FEW_LINEARS`` of the
        weight-gradient work, so the workers split that backward torch's way; not with
        activation checkpointing, nor where the gradient sum starts during backward."""
        if self.linear_work is None or self.checkpointing or (self.gpu and dp > 1 and chunks == 1):
            return False
        return all(mine < schedules.FEW_LINEARS * total for mine, total in self._linear_shares(bounds))

    def held_bytes(self, lo: int, hi: int, input_bytes: int) -> int:
        """Bytes one microbatch in flight holds on a stage of layers [lo, hi) between its
        forward and its backward.  With checkpointing: each layer's input (``input_bytes`` for
        the first), the rest is recomputed one layer at a time in backward."""
        if self.checkpointing:
            return input_bytes + sum(self.activation_bytes[lo:hi - 1])
        return sum((self.saved_bytes or self.activation_bytes)[lo:hi])

    def recompute_bytes(self, lo: int, hi: int) -> int:
        """With checkpointing, the most one layer's recomputed forward holds during backward."""
        return max((self.saved_bytes or self.activation_bytes)[lo:hi]) if self.checkpointing else 0

    def __post_init__(self):
        if not (len(self.seconds) == len(self.param_bytes) == len(self.activation_bytes)) or not self.seconds:
            raise ValueError("LayerFacts needs one cost, parameter size and activation size per layer")

    @property
    def layers(self) -> int:
        return len(self.seconds)


@dataclass(frozen=True)
class Shape:
    dp: int
    pp: int
    sizes: tuple[int, ...]             # layers per virtual stage (model chunk): pp x chunks entries
    microbatches_per_replica: int
    step_s: float                      # modelled seconds per step
    memory_bytes: int                  # modelled peak bytes of the fullest worker
    chunks: int = 1                    # model chunks per worker (parallelism.stages_per_worker)
    placement: str = "loop"            # how chunks sit on workers (service/schedules.py: placement)
    replicas: tuple[int, ...] = ()     # workers per stage (parallelism.replicas); (): one each
    stage_costs: tuple[float, ...] = ()  # with replicas: each stage's modelled seconds per microbatch (orders the plan)
    tp: int = 1                        # workers of each stage's tensor-parallel group (parallelism.tp)

    @property
    def reps(self) -> tuple[int, ...]:
        """Workers per stage: its replicas, or its tensor-parallel group (1 each by default)."""
        return self.replicas or (self.tp,) * self.pp

    @property
    def width(self) -> int:
        """Workers (slots) of one pipeline: pp, or sum(replicas)."""
        return sum(self.reps)

    def slot(self, stage: int, rep: int = 0) -> int:
        """The slot (a pipeline's worker index) of replica (or TP rank) ``rep`` of ``stage``."""
        return replicas_.slot_of(self.reps, stage, rep)

    def stage_of(self, slot: int) -> int:
        return replicas_.stage_of(self.reps, slot)[0]

    @property
    def cells(self) -> list[tuple[int, int]]:
        """Every worker's (dp rank, slot)."""
        return [(r, s) for r in range(self.dp) for s in range(self.width)]

    @property
    def virtual(self) -> int:
        """Virtual stages: pp x chunks."""
        return self.pp * self.chunks

    def owner(self, vs: int) -> int:
        """The pipeline rank that holds virtual stage ``vs``."""
        return schedules.owner(vs, self.pp, self.placement)

    def ranges(self, slot: int) -> list[tuple[int, int]]:
        """[lo, hi) of each model chunk the worker of ``slot`` holds (its stage's), in model order."""
        b = self.bounds
        return [b[vs] for vs in schedules.chunks_of(self.stage_of(slot), self.pp, self.chunks, self.placement)]

    @property
    def layers(self) -> int:
        return sum(self.sizes)

    def layers_of(self, slot: int) -> set[int]:
        return {i for lo, hi in self.ranges(slot) for i in range(lo, hi)}

    @property
    def workers(self) -> int:
        return self.dp * self.width

    @property
    def bounds(self) -> list[tuple[int, int]]:
        return partition.bounds(self.sizes)

    @property
    def key(self) -> tuple:
        """What names the shape to the policy: (dp, pp), and its replicas when a stage has several."""
        return (self.dp, self.pp, self.replicas) if self.replicas else (self.dp, self.pp) + ((self.tp,) if self.tp > 1
                                                                                            else ())

    def label(self) -> str:
        return replicas_.shape_label(self.dp, self.pp, self.replicas, self.tp)


@dataclass(frozen=True)
class Decision:
    """The planner's answer: a shape to train in, or ``shape is None`` and the job waits."""

    shape: Optional[Shape]
    reason: str
    slots: int
    considered: tuple[Shape, ...] = field(default=(), repr=False)

    @property
    def wait(self) -> bool:
        return self.shape is None

    def as_dict(self) -> dict:
        s = self.shape
        return {"wait": self.wait, "reason": self.reason, "slots": self.slots,
                **({"dp": s.dp, "pp": s.pp, "partition": list(s.sizes), "microbatches_per_replica":
                    s.microbatches_per_replica, "modelled_step_s": s.step_s} if s else {})}


def too_big_for_any_node(facts: LayerFacts, shape: Shape, node_bytes: float) -> Optional[str]:
    """Why ``shape`` cannot train on nodes of at most ``node_bytes`` of memory, or None: a worker
    holding the model's largest chunk keeps at least its parameters and their gradients (its
    share of them under tensor parallelism), before any optimizer state or activation. Only a
    certain misfit is refused: the modelled peak (``shape.memory_bytes``) is an estimate."""
    if not node_bytes:
        return None
    lo, hi = max(shape.bounds, key=lambda b: sum(facts.param_bytes[b[0]:b[1]]))
    need = 2 * sum(facts.param_bytes[lo:hi]) / shape.tp
    if need <= node_bytes:
        return None
    return (f"the model cannot fit on this cluster's nodes in shape {shape.label()}: the worker holding layers "
            f"{lo}-{hi - 1} needs at least {need / 2**30:,.1f} GiB for their parameters and gradients alone "
            f"(before optimizer state and activations), and the largest node offers {node_bytes / 2**30:,.1f} GiB "
            "(Ray's memory resource); raise parallelism.pp (or tp) to split the model over more workers, or make "
            "it smaller")


def hop_seconds(transport: str, nbytes: int) -> float:
    latency, per_byte = HOP_COST[transport]
    return latency + nbytes * per_byte


def model_shape(facts: LayerFacts, dp: int, pp: int, microbatches: int, *, schedule: str = "1f1b",
                transport: str = "collective", optimizer: str = "adam",
                partition_rule: Union[str, list[int]] = "balanced", chunks: int = 1,
                replicas: Sequence[int] = (), tp: int = 1, weight_group: int = 1) -> Shape:
    """Modelled step time and memory of one shape (assumed valid: M % dp == 0, pp x chunks <=
    layers); ``chunks``: model chunks per worker, as the schedule requires (see the module's
    docstring); ``replicas``: workers per stage (replicated stages, service/replicas.py); ``tp``:
    each stage's layers split over tp workers (modelled as 1/tp of the compute and of the
    parameters: the planner does not know which layers have a plan); ``weight_group``: the
    split schedules' W's grouped (``schedules.group_weights``: the plan's order, not its
    faster products, is modelled)."""
    _check_chunks(schedule, chunks)
    replicas = tuple(replicas) if any(r > 1 for r in replicas) else ()
    m = microbatches // dp
    virtual = pp * chunks
    if isinstance(partition_rule, list) and len(partition_rule) == virtual:
        sizes = list(partition_rule)
    elif partition_rule == "uniform":
        sizes = partition.uniform(facts.layers, virtual)
    else:
        sizes = partition.balanced(facts.seconds, virtual)
    where = schedules.placement(schedule)
    bounds = partition.bounds(sizes)
    early = not replicas and tp == 1 and facts.early(bounds, dp, chunks)
    last = not replicas and tp == 1 and not early and facts.last_early(bounds, dp, chunks)
    units, peaks = _plan_model(schedule, pp, m, chunks, early, weight_group, last)
    if facts.gathers and schedule == "gpipe":
        units = gathered_units(m, [any(i in facts.gathers for i in range(lo, hi)) for lo, hi in bounds])
    slot, ar, mem = 0.0, 0.0, 0
    slots_per_param = 2 + OPTIMIZER_SLOTS.get(optimizer, 2)
    per_stage: list[float] = []
    if replicas:
        peaks = [m if schedule == "gpipe" else min(m, replicas_.in_flight_cap(replicas, s) + 1) for s in range(pp)]
    for rank in range(pp):
        compute = comm = 0.0
        params = held = recompute = 0
        for vs in schedules.chunks_of(rank, pp, chunks, where):
            lo, hi = bounds[vs]
            compute += sum(facts.seconds[lo:hi]) * (4 / 3 if facts.checkpointing else 1)  # + one more forward
            if vs < virtual - 1 and schedules.owner(vs + 1, pp, where) != rank:
                comm += hop_seconds(transport, facts.activation_bytes[hi - 1])
            if vs > 0 and schedules.owner(vs - 1, pp, where) != rank:
                comm += hop_seconds(transport, facts.activation_bytes[lo - 1])
            params += sum(facts.param_bytes[lo:hi])
            held += facts.held_bytes(lo, hi, facts.activation_bytes[lo - 1] if lo > 0 else 0)
            recompute = max(recompute, facts.recompute_bytes(lo, hi))
        for stasher, popper, nbytes in facts.skips:  # a portal: straight from its stasher to its popper
            src, dst = (schedules.owner(partition.chunk_of(bounds, i), pp, where) for i in (stasher, popper))
            if src != dst and rank in (src, dst):
                comm += hop_seconds(transport, nbytes)  # the tensor one way, its gradient the other
            if rank == dst and src != dst:
                held += nbytes  # the popper holds what it received until its backward
        slot = max(slot, compute + comm)
        per_stage.append(compute + comm)
        n = dp * (replicas[rank] if replicas else 1)  # the workers that sum this stage's gradients
        if n > 1:
            ar = max(ar, 2 * (n - 1) * ALLREDUCE_LATENCY_S + 2 * (n - 1) / n * params / ALLREDUCE_BYTES_PER_S)
        mem = max(mem, params * slots_per_param + math.ceil(peaks[rank] * held) + recompute)
    if replicas:  # each stage at its own pace (service/replicas.py; the closed form of its simulated plans)
        step = replicas_.modelled_step(per_stage, replicas, m) + ar
        costs = tuple(per_stage) if any(facts.seconds) else ()  # no layer costs known: the orders assume equal stages
        return Shape(dp, pp, tuple(sizes), m, step, mem, chunks=chunks, placement=where, replicas=replicas,
                     stage_costs=costs)
    if tp > 1:
        return Shape(dp, pp, tuple(sizes), m, (units * slot + ar) / tp, mem // tp, chunks=chunks, placement=where, tp=tp)
    return Shape(dp, pp, tuple(sizes), m, units * slot + ar, mem, chunks=chunks, placement=where)


def gathered_units(m: int, gathers: Sequence[bool]) -> float:
    """GPipe's makespan (units as ``_plan_model``'s) when the stages marked in ``gathers`` hold a
    BatchNorm under ``training.batch_norm: global``: such a stage sends nothing on before all m
    microbatches have reached it (and back: no input gradient before all m output gradients),
    so it cuts the pipeline into segments that run one after another, each of L stages taking
    m + L - 1 (a gathering stage is a segment of its own: m).  Without one: m + pp - 1."""
    units, run = 0, 0
    for g in gathers:
        if g:
            units += (m + run - 1 if run else 0) + m
            run = 0
        else:
            run += 1
    return float(units + (m + run - 1 if run else 0))


def _check_chunks(schedule: str, chunks: int) -> None:
    """Raise ValueError unless ``chunks`` model chunks per worker suit ``schedule``."""
    if schedule == "zbv" and chunks != 2:
        raise ValueError(f"zbv places 2 model chunks on each worker, not {chunks} "
                         f"(parallelism.stages_per_worker must be 2)")
    if schedule not in schedules.CHUNKED and chunks != 1:
        raise ValueError(f"{schedule} places 1 model chunk on each worker, not {chunks} "
                         f"(parallelism.stages_per_worker must be 1)")
    if chunks < 1:
        raise ValueError(f"parallelism.stages_per_worker must be at least 1, got {chunks}")


@functools.lru_cache(maxsize=4096)
def _plan_model(schedule: str, pp: int, m: int, chunks: int, early: bool = False,
                weight_group: int = 1, last: bool = False) -> tuple[float, tuple[Fraction, ...]]:
    """``(units, peaks)`` of the plan of ``schedule`` for ``pp`` workers, ``m`` microbatches and
    ``chunks`` chunks per worker: its makespan in units of one microbatch's forward+backward on a
    worker (forward 1, backward 2), and per worker its peak held activations in units of one
    microbatch's activations of the worker's whole share.  ``early``: timed as the workers run
    it when each input gradient is sent before the weight gradients (``schedules.sends_early``,
    the same order and activations); ``last``: only each worker's last backward of the step so
    (``schedules.simulate``'s ``last_early``).  GPipe and 1F1B in closed form (what their
    simulation gives), the others simulated; cached, as the planner models many shapes."""
    if schedule == "gpipe" and chunks == 1 and not early:  # (``last`` changes nothing in GPipe: its stage before is busy)
        return float(m + pp - 1), tuple(Fraction(m) for _ in range(pp))
    if schedule == "1f1b" and chunks == 1 and not early and not last:
        return float(m + pp - 1), tuple(Fraction(min(m, pp - i)) for i in range(pp))
    plan = schedules.build(schedule, pp, m, chunks, weight_group)
    units = float(Fraction(schedules.simulate(schedules.sends_early(plan) if early else plan,
                                              last_early=last).makespan) / 3)
    return units, tuple(Fraction(f).limit_denominator(10**6) for f in schedules.peak_activation_fraction(plan))


def _closeness(s: Shape, preferred: tuple) -> tuple:
    return (abs(s.pp - preferred[1]), abs(s.dp - preferred[0]), s.key != tuple(preferred))


def plan(slots: int, facts: LayerFacts, global_batch: int, microbatch: int, *,
         preferred: tuple[int, int], min_workers: int = 1, max_workers: int = 16,
         schedule: str = "1f1b", transport: str = "collective", optimizer: str = "adam",
         partition_rule: Union[str, list[int]] = "balanced", memory_bytes: Optional[float] = None,
         current: Optional[tuple] = None, min_gain: float = 0.10, chunks: int = 1,
         replicas: Union[str, Sequence[int], None] = None, previous: Optional[Shape] = None,
         tp: int = 1, weight_group: int = 1) -> Decision:
    """Choose the shape for ``slots`` alive worker slots (``chunks``: model chunks per worker,
    ``parallelism.stages_per_worker``; ``tp``: each stage's tensor-parallel group, kept by every
    shape: a shape has dp x pp x tp workers, and ``slots`` count whole TP groups).

    - Only shapes with dp x pp in [min_workers, min(slots, max_workers)], M % dp == 0,
      pp x chunks <= layers and (when ``memory_bytes`` is given) a fitting stage are considered.
    - The fastest modelled shape wins, except that the preferred shape is kept when it is
      within ``min_gain`` of the fastest, and so is ``current`` (a voluntary reshape, e.g. a
      scale-up, must gain at least ``min_gain``; ``current`` is None after a loss).
    - ``replicas`` (the spec's ``parallelism.replicas``: a list or "auto"; None: never): shapes
      whose pipelines replicate their slowest stages (:func:`replica_shapes`) are candidates too.
      After a loss, the shape that was running (``previous``) with fewer replicas on the stages
      that lost workers (its partition: no state moves) is kept when within ``min_gain`` of the
      fastest.  A shape is named by :attr:`Shape.key` (``preferred`` and ``current`` too).
    """
    _check_chunks(schedule, chunks)
    M = global_batch // microbatch
    cap = min(slots, max_workers)
    if cap < min_workers:
        return Decision(None, f"waiting for workers: {slots} slot{'s' if slots != 1 else ''} alive, "
                              f"the job needs at least elastic.min_workers={min_workers}", slots)
    if cap < tp:
        return Decision(None, f"waiting for workers: {slots} slot{'s' if slots != 1 else ''} alive in whole "
                              f"tensor-parallel groups, the job needs a group of parallelism.tp={tp} workers on one "
                              "node", slots)
    model = dict(schedule=schedule, transport=transport, optimizer=optimizer, weight_group=weight_group)
    shapes, too_big = _candidates(facts, M, min_workers, cap, memory_bytes, partition_rule=partition_rule,
                                  chunks=chunks, tp=tp, **model)
    if replicas is not None:
        more = _replica_candidates(facts, M, min_workers, cap, replicas, previous, partition_rule, **model)
        shapes += [s for s in more if memory_bytes is None or s.memory_bytes <= memory_bytes]
        too_big += [s for s in more if memory_bytes is not None and s.memory_bytes > memory_bytes]
    if not shapes:
        return _wait_for_a_fit(slots, M, min_workers, cap, memory_bytes, too_big)
    if previous is not None and previous.replicas and current is None:
        shrunk = [s for s in shapes if s.sizes == previous.sizes and s.dp <= previous.dp
                  and all(a <= b for a, b in zip(s.reps, previous.reps))]
        best = min(shapes, key=lambda s: s.step_s)
        keep = max(shrunk, key=lambda s: (s.workers, -s.step_s), default=None)
        if keep is not None and keep.step_s <= best.step_s * (1 + min_gain):
            return Decision(keep, f"{keep.label()}: the shape that ran, less the workers lost (no state moves; "
                                  f"modelled {keep.step_s * 1e3:.1f} ms/step, the fastest {best.label()} "
                                  f"{best.step_s * 1e3:.1f} ms)", slots, tuple(sorted(shapes, key=lambda s: s.step_s)))
    return _choose(shapes, slots, preferred, current, min_gain)


def _replica_candidates(facts: LayerFacts, M: int, min_workers: int, cap: int, replicas, previous: Optional[Shape],
                        partition_rule: Union[str, list[int]] = "balanced", **model) -> list[Shape]:
    """Shapes with replicated stages on ``min_workers..cap`` workers: for each dp and workers
    per pipeline, :func:`replica_shapes`' (those with a replicated stage); the spec's list on
    its own partition; and ``previous`` (the shape that ran before a loss) with one worker
    fewer on any of its replicated stages."""
    out: dict = {}
    for dp in range(1, cap + 1):
        if M % dp:
            continue
        for w in range(2, cap // dp + 1):
            if dp * w < min_workers or M // dp < 2:
                continue
            for s in replica_shapes(facts, dp, w, M, **model):  # equal counts everywhere: that is dp, modelled already
                if s.replicas and len(set(s.replicas)) > 1 and M // dp >= max(s.replicas):
                    out.setdefault(s.key, s)
    fixed = [tuple(replicas)] if not isinstance(replicas, str) else []
    if previous is not None and previous.replicas:
        fixed += [tuple(r - (i == k) for i, r in enumerate(previous.replicas))
                  for k, r in enumerate(previous.replicas) if r > 1]
        fixed.append(previous.replicas)
    for reps in fixed:
        sizes = list(previous.sizes) if previous is not None and len(previous.sizes) == len(reps) else None
        if sizes is None and isinstance(partition_rule, list) and len(partition_rule) == len(reps):
            sizes = list(partition_rule)
        if sizes is None:
            sizes = partition.balanced(facts.seconds, len(reps))
        for dp in range(1, cap // max(sum(reps), 1) + 1):
            m = M // dp
            if M % dp or dp * sum(reps) < min_workers or m < max(reps):
                continue
            s = model_shape(facts, dp, len(reps), M, partition_rule=sizes, replicas=reps, **model)
            out.setdefault(s.key, s)
    return list(out.values())


def _candidates(facts: LayerFacts, M: int, min_workers: int, cap: int, memory_bytes: Optional[float],
                chunks: int = 1, tp: int = 1, **model) -> tuple[list[Shape], list[Shape]]:
    """Every shape of ``min_workers..cap`` workers whose replicas share the ``M`` microbatches
    evenly and whose pp x ``chunks`` virtual stages each get a layer, modelled (``model``:
    :func:`model_shape`'s other keywords): those that fit ``memory_bytes`` and those too big.
    With ``tp`` > 1 every stage has tp workers (dp x pp x tp in all)."""
    shapes, too_big = [], []
    for pp in range(1, min(facts.layers // chunks, cap // tp) + 1):
        for dp in range(1, cap // (pp * tp) + 1):
            if M % dp or dp * pp * tp < min_workers:
                continue
            s = model_shape(facts, dp, pp, M, chunks=chunks, tp=tp, **model)
            (too_big if memory_bytes is not None and s.memory_bytes > memory_bytes else shapes).append(s)
    return shapes, too_big


def _wait_for_a_fit(slots: int, M: int, min_workers: int, cap: int, memory_bytes: Optional[float],
                    too_big: list[Shape]) -> Decision:
    """Wait, saying why no shape can run: none fits the memory (and what the least needs), or
    none divides the step's microbatches."""
    if too_big:
        least = min(too_big, key=lambda s: s.memory_bytes)
        return Decision(None, f"waiting for workers: no shape of at most {cap} workers fits "
                              f"resources.memory_per_worker_mb={memory_bytes / 2**20:g} (the smallest stage, of "
                              f"shape {least.label()}, needs {least.memory_bytes / 2**20:.3g} MB)", slots,
                        tuple(too_big))
    return Decision(None, f"waiting for workers: no shape of {min_workers}..{cap} workers divides the "
                          f"{M} microbatches of a step", slots)


def _choose(shapes: list[Shape], slots: int, preferred: tuple[int, int], current: Optional[tuple[int, int]],
            min_gain: float) -> Decision:
    """The fastest of ``shapes`` (ties: closest to ``current``, else to ``preferred``; then the
    fewest workers), unless ``current`` (or, when there is none, ``preferred``) is within
    ``min_gain`` of it."""
    pref = preferred if current is None else current
    best = min(shapes, key=lambda s: (s.step_s, _closeness(s, pref), s.workers))
    considered = tuple(sorted(shapes, key=lambda s: s.step_s))
    if current is not None:
        cur = next((s for s in shapes if s.key == tuple(current)), None)
        if cur is not None and cur.step_s <= best.step_s * (1 + min_gain):
            gain = cur.step_s / best.step_s - 1
            return Decision(cur, f"kept {cur.label()}: the fastest shape for {slots} slots "
                                 f"({best.label()}) is modelled only {gain:.0%} faster", slots, considered)
    else:
        pre = next((s for s in shapes if s.key == tuple(preferred)), None)
        if pre is not None and pre.step_s <= best.step_s * (1 + min_gain):
            return Decision(pre, f"preferred shape {pre.label()} fits {slots} slots "
                                 f"(modelled {pre.step_s * 1e3:.1f} ms/step)", slots, considered)
    runner_up = next((s for s in considered if s is not best), None)
    why = f"fastest modelled shape for {slots} slots: {best.label()} ({best.step_s * 1e3:.1f} ms/step"
    why += f"; next {runner_up.label()} {runner_up.step_s * 1e3:.1f} ms)" if runner_up else ")"
    return Decision(best, why, slots, considered)


def replica_shapes(facts: LayerFacts, dp: int, workers: int, microbatches: int, **model) -> list[Shape]:
    """The shapes that run a pipeline on ``workers`` workers (``parallelism.replicas: auto``):
    for each stage count pp <= workers, the balanced partition into pp stages and the spare
    workers given one by one to the stage with the most seconds per replica
    (``replicas.heaviest_first``); pp = workers is the plain pipeline.  ``model``: the other
    keywords of :func:`model_shape` (schedule gpipe or 1f1b)."""
    out = []
    for pp in range(1, min(facts.layers, workers) + 1):
        sizes = partition.balanced(facts.seconds, pp)
        seconds = [sum(facts.seconds[lo:hi]) for lo, hi in partition.bounds(sizes)]
        reps = replicas_.heaviest_first(seconds, workers) if pp < workers else ()
        if pp == 1 and reps:  # one stage on every worker is data parallelism: dp x workers
            if microbatches % (dp * workers) == 0:
                out.append(model_shape(facts, dp * workers, 1, microbatches, **model))
            continue
        out.append(model_shape(facts, dp, pp, microbatches, partition_rule=sizes, replicas=reps, **model))
    return out


def choose_replicas(facts: LayerFacts, dp: int, workers: int, microbatches: int,
                    memory_bytes: Optional[float] = None, **model) -> tuple[Shape, str]:
    """The fastest modelled of :func:`replica_shapes` that fit ``memory_bytes`` per worker (when
    given) and a sentence that says why, beside the plain pipeline (pp = workers) and data
    parallelism (dp x workers replicas of the whole model)."""
    shapes = replica_shapes(facts, dp, workers, microbatches, **model)
    fits = [s for s in shapes if memory_bytes is None or s.memory_bytes <= memory_bytes]
    if not fits:
        least = min(shapes, key=lambda s: s.memory_bytes)
        raise ValueError(f"parallelism.replicas auto: no use of {workers} workers per pipeline fits "
                         f"resources.memory_per_worker_mb={memory_bytes / 2**20:g} (the smallest, {least.label()}, "
                         f"needs {least.memory_bytes / 2**20:.3g} MB): add workers (pp) or memory")
    best = min(fits, key=lambda s: (s.step_s, s.pp))
    pp_only = next((s for s in shapes if s.pp == workers and not s.replicas), None)
    dp_only = next((s for s in shapes if s.pp == 1), None)
    beside = [f"{name} {s.label()} {s.step_s * 1e3:.1f} ms" for name, s in (("pp only", pp_only),
                                                                            ("dp only", dp_only)) if s is not None]
    why = (f"parallelism.replicas auto: {best.label()} is the fastest modelled use of {workers} workers per pipeline "
           f"({best.step_s * 1e3:.1f} ms/step" + (f"; {', '.join(beside)}" if beside else "") + ")")
    return best, why
