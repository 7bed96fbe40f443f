"""The elastic planner: which shape to train in, given the worker slots alive now.

Pure: plain numbers in, a ``Decision`` out, tested without Ray.  The global batch B and the
microbatch size never change; the planner picks (dp, pp), the stage partition and the
microbatches per replica (M / dp) that maximise modelled throughput among the shapes that
fit the slots, the elastic range and each worker's memory.

The model of one step, per replica, for both 1F1B and GPipe::

    step = (m + pp - 1) * slot + allreduce
    slot = max over stages of (forward+backward seconds of the stage's layers for one microbatch)
           + 2 hops (activation out, gradient back) when pp > 1
    allreduce = ring all-reduce of the largest stage's parameters among dp replicas

with per-transport hop costs and an all-reduce bandwidth measured on the development machine
(see README: "How the planner decides").  Memory of a worker: parameters x (2 + optimizer slots)
plus the activations it holds (1F1B: pp - stage microbatches at most; GPipe: all m), each what
autograd saves of its layers (traced), or with activation checkpointing only each layer's input,
plus one layer's recomputation; checkpointing costs one more forward (compute x 4/3).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from service import partition

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
    sizes: tuple[int, ...]             # layers per stage
    microbatches_per_replica: int
    step_s: float                      # modelled seconds per step
    memory_bytes: int                  # modelled peak bytes of the fullest worker

    @property
    def workers(self) -> int:
        return self.dp * self.pp

    @property
    def bounds(self) -> list[tuple[int, int]]:
        return partition.bounds(self.sizes)

    def label(self) -> str:
        return f"{self.dp}x{self.pp}"


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


def hop_seconds(transport: str, nbytes: int) -> float:
    latency, per_byte = HOP_COST[transport]
    return latency + nbytes * per_byte


def model_shape(facts: LayerFacts, dp: int, pp: int, microbatches: int, *, schedule: str = "1f1b",
                transport: str = "collective", optimizer: str = "adam",
                partition_rule: Union[str, list[int]] = "balanced") -> Shape:
    """Modelled step time and memory of one shape (assumed valid: M % dp == 0, pp <= layers)."""
    m = microbatches // dp
    if isinstance(partition_rule, list) and len(partition_rule) == pp:
        sizes = list(partition_rule)
    elif partition_rule == "uniform":
        sizes = partition.uniform(facts.layers, pp)
    else:
        sizes = partition.balanced(facts.seconds, pp)
    slot, ar, mem = 0.0, 0.0, 0
    slots_per_param = 2 + OPTIMIZER_SLOTS.get(optimizer, 2)
    for i, (lo, hi) in enumerate(partition.bounds(sizes)):
        compute = sum(facts.seconds[lo:hi]) * (4 / 3 if facts.checkpointing else 1)  # + one more forward
        comm = 0.0
        if pp > 1:
            if i < pp - 1:
                comm += hop_seconds(transport, facts.activation_bytes[hi - 1])
            if i > 0:
                comm += hop_seconds(transport, facts.activation_bytes[lo - 1])
        slot = max(slot, compute + comm)
        params = sum(facts.param_bytes[lo:hi])
        if dp > 1:
            ar = max(ar, 2 * (dp - 1) * ALLREDUCE_LATENCY_S + 2 * (dp - 1) / dp * params / ALLREDUCE_BYTES_PER_S)
        in_flight = m if schedule == "gpipe" else min(m, pp - i)
        held = facts.held_bytes(lo, hi, facts.activation_bytes[lo - 1] if lo > 0 else 0)
        mem = max(mem, params * slots_per_param + in_flight * held + facts.recompute_bytes(lo, hi))
    return Shape(dp, pp, tuple(sizes), m, (m + pp - 1) * slot + ar, mem)


def _closeness(s: Shape, preferred: tuple[int, int]) -> tuple:
    return (abs(s.pp - preferred[1]), abs(s.dp - preferred[0]))


def plan(slots: int, facts: LayerFacts, global_batch: int, microbatch: int, *,
         preferred: tuple[int, int], min_workers: int = 1, max_workers: int = 16,
         schedule: str = "1f1b", transport: str = "collective", optimizer: str = "adam",
         partition_rule: Union[str, list[int]] = "balanced", memory_bytes: Optional[float] = None,
         current: Optional[tuple[int, int]] = None, min_gain: float = 0.10) -> Decision:
    """Choose the shape for ``slots`` alive worker slots.

    - Only shapes with dp x pp in [min_workers, min(slots, max_workers)], M % dp == 0,
      pp <= layers and (when ``memory_bytes`` is given) a fitting stage are considered.
    - The fastest modelled shape wins, except that the preferred shape is kept when it is
      within ``min_gain`` of the fastest, and so is ``current`` (a voluntary reshape, e.g. a
      scale-up, must gain at least ``min_gain``; ``current`` is None after a loss).
    """
    M = global_batch // microbatch
    cap = min(slots, max_workers)
    if cap < min_workers:
        return Decision(None, f"waiting for workers: {slots} slot{'s' if slots != 1 else ''} alive, "
                              f"the job needs at least elastic.min_workers={min_workers}", slots)
    shapes, too_big = _candidates(facts, M, min_workers, cap, memory_bytes, schedule=schedule, transport=transport,
                                  optimizer=optimizer, partition_rule=partition_rule)
    if not shapes:
        return _wait_for_a_fit(slots, M, min_workers, cap, memory_bytes, too_big)
    return _choose(shapes, slots, preferred, current, min_gain)


def _candidates(facts: LayerFacts, M: int, min_workers: int, cap: int, memory_bytes: Optional[float],
                **model) -> tuple[list[Shape], list[Shape]]:
    """Every shape of ``min_workers..cap`` workers whose replicas share the ``M`` microbatches
    evenly, modelled (``model``: :func:`model_shape`'s keywords): those that fit
    ``memory_bytes`` and those too big."""
    shapes, too_big = [], []
    for pp in range(1, min(facts.layers, cap) + 1):
        for dp in range(1, cap // pp + 1):
            if M % dp or dp * pp < min_workers:
                continue
            s = model_shape(facts, dp, pp, M, **model)
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
        cur = next((s for s in shapes if (s.dp, s.pp) == tuple(current)), None)
        if cur is not None and cur.step_s <= best.step_s * (1 + min_gain):
            gain = cur.step_s / best.step_s - 1
            return Decision(cur, f"kept {cur.label()}: the fastest shape for {slots} slots "
                                 f"({best.label()}) is modelled only {gain:.0%} faster", slots, considered)
    else:
        pre = next((s for s in shapes if (s.dp, s.pp) == tuple(preferred)), None)
        if pre is not None and pre.step_s <= best.step_s * (1 + min_gain):
            return Decision(pre, f"preferred shape {pre.label()} fits {slots} slots "
                                 f"(modelled {pre.step_s * 1e3:.1f} ms/step)", slots, considered)
    runner_up = next((s for s in considered if s is not best), None)
    why = f"fastest modelled shape for {slots} slots: {best.label()} ({best.step_s * 1e3:.1f} ms/step"
    why += f"; next {runner_up.label()} {runner_up.step_s * 1e3:.1f} ms)" if runner_up else ")"
    return Decision(best, why, slots, considered)
