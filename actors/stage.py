"""One cell's part of a step: its forwards and backwards in the schedule's order, the
activations and gradients through the transport, the gradient sum among the stage's
replicas.  The worker (actors/worker.py) owns the state and the commits; this module only
runs a step's actions over a configured ``Cell``.

A stage's last backward of the step computes and sends the gradient of its input before its
weight gradients, so the stage before it, which waits for that gradient to run the step's
final backward, starts sooner: the pipeline drains earlier.  Every call that talks to a peer
runs inside ``talking_to_peers``: whatever fails there is a lost peer (``PeerLost``), and
whatever fails elsewhere (the user's model, data or loss) is the user's error.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint



def _split_backward():
    """torch's split backward (input gradient first, weight gradients after), as its zero-bubble
    schedules use: ``(stage_backward_input, stage_backward_weight)``, or Nones on a torch without it.

    Loaded from its file alone: importing ``torch.distributed.pipelining`` runs the package's
    ``__init__`` (its schedules, tracer, DTensor and dynamo), 1.3 s of CPU in every worker's
    start for two functions that need none of it.  The module is registered under a private
    package name, so a real ``import torch.distributed.pipelining`` elsewhere is untouched."""
    import importlib.util
    import os
    import sys
    import types

    try:
        import torch.distributed as _dist

        folder = os.path.join(os.path.dirname(_dist.__file__), "pipelining")
        pkg = "_relaytrain_torch_pipelining"
        if pkg not in sys.modules:
            stub = types.ModuleType(pkg)
            stub.__path__ = [folder]
            sys.modules[pkg] = stub
        name = f"{pkg}._backward"
        mod = sys.modules.get(name)
        if mod is None:
            spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "_backward.py"))
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        return mod.stage_backward_input, mod.stage_backward_weight, mod._get_grad_fn_or_grad_acc
    except Exception:  # another torch: every backward stays whole
        return None, None, None


stage_backward_input, _stage_backward_weight, _grad_acc = _split_backward()


def stage_backward_weight(params, groups) -> None:
    """torch's W (``stage_backward_weight``), noting each weight it writes a gradient into.  It
    writes ``weight.grad += dw`` (or a fresh ``.grad``) outside autograd's AccumulateGrad, so
    the hooks that note a parameter's use this step (actors/collectives.py ``got_gradient``)
    never fire: with replicas, every weight of a chunk under torch's split counted as unused on
    every replica and lost its ``.grad`` before the optimizer (found by a user trial: from the
    split trial's first step a 2x2 ZB-V GPT's last stage was not updated, half the gradient
    norm).  The weights it writes are those of each group with a gradient to pass back (its
    ``params`` are the weights' gradient accumulators), known before the call, which consumes
    the groups; not read from ``.grad`` afterwards: the gradients of a bucket are views of one
    buffer, whose version any of them bumps."""
    params = list(params)
    by_node = {_grad_acc(w): w for w in params}
    written = [by_node[node] for g in groups
               if any(x is not None for grads in g["grads"] for x in grads)
               for node in g["params"] if node in by_node]
    _stage_backward_weight(iter(params), groups)
    for w in written:
        got_gradient(w)

from actors import deferred, portals
from actors.collectives import got_gradient
from actors.batchnorm import RunningStats
from actors.failures import StageAborted, talking_to_peers, waiting_on_peers
from actors.globalnorm import Lockstep
from service import replicas as replicas_
from service import schedules
from service.loading import cross_entropy_sum, forward_seed
from service import tracing
from service.tracing import changes_input_in_place, norms_of
from relaytrain import skip


class Transport(Protocol):
    """How activations and their gradients move between the workers of a replica (actors/transport.py);
    ``stage`` is the receiving or sending worker's pipeline rank."""

    name: str
    fixed_shapes: bool  # every microbatch's activation must keep the first one's shape

    def begin_step(self, step: int, expected: list) -> None: ...
    def send_to(self, stage: int, step: int, kind: str, key: int, tensor: torch.Tensor) -> None: ...
    def recv_from(self, stage: int, step: int, kind: str, key: int, like: tuple) -> torch.Tensor: ...
    def finish_step(self) -> None: ...
    def drop(self) -> None: ...


class GradientReducer(Protocol):
    """How a stage's replicas sum their gradients (actors/collectives.py)."""

    overlap: bool  # launched during the last backward (hooks), not after it

    def attach(self) -> None: ...
    def arm(self) -> None: ...
    def finish(self) -> None: ...
    def close(self) -> None: ...


def _meta(m) -> Optional[tuple]:
    """(shape, dtype) from the scheduler's (shape, dtype name) (actors/layerfacts.py)."""
    return (tuple(m[0]), tracing.dtype_named(m[1])) if m else None


def _has_grad(meta: Optional[tuple]) -> bool:
    """Does an activation of this (shape, dtype) get a gradient back?  Not one of integers
    (token ids): the next chunk's input then needs none, and sends none."""
    return meta is None or not isinstance(meta[1], torch.dtype) or meta[1].is_floating_point


@dataclass(frozen=True)
class Cell:
    """Where a worker stands in a shape: its (dp_rank, pp_rank), its model chunks (virtual
    stages: one for gpipe, 1f1b and zb_h1; several for interleaved_1f1b and zbv), its actions.

    A tensor crossing the boundary after virtual stage b for microbatch g travels under the
    key ``g * virtual + b`` (activations forward, their gradients back); between two chunks
    of one worker (a V's turn) it is handed over in memory."""

    gen: int
    dp_rank: int
    pp_rank: int
    dp: int
    pp: int
    chunks: tuple                     # its virtual stages, in model order
    ranges: tuple                     # [lo, hi) of each of its chunks, in the same order
    mb0: int                          # its replica's first global microbatch
    m: int                            # microbatches per replica
    actions: list
    boundary: tuple                   # (shape, dtype) each virtual stage sends on (the last: None)
    virtual: int                      # virtual stages of the pipeline
    where: str                        # chunk placement (service/schedules.py: "loop" or "v")
    split: bool                       # backward split into B (input gradient) and W (weight gradient)
    receives: list = field(default_factory=list)  # the step's receives, in the order its actions take them
    routes: tuple = ()                # skips that cross chunks (actors/portals.py), of the whole pipeline
    skips: int = 0                    # the model's skips (crossing chunks or not)
    replicas: tuple = ()              # workers per stage (service/replicas.py); (): one each
    rep: int = 0                      # which replica of its stage this worker is
    slot: int = -1                    # its index among its pipeline's workers (pp_rank without replicas)
    tp: int = 1                       # workers of its stage's tensor-parallel group (actors/tensorpar.py)
    tp_rank: int = 0                  # its rank in that group: it talks to the same rank of other stages
    weight_group: int = 1             # W's of that many microbatches computed together (split schedules)

    @property
    def index(self) -> int:
        """Its index in its pipeline's row of workers (the slot)."""
        return self.pp_rank if self.slot < 0 else self.slot

    @property
    def width(self) -> int:
        """Workers of its pipeline."""
        return sum(self.replicas) if self.replicas else self.pp * self.tp

    def peer(self, vs: int, g: int) -> int:
        """The worker (index in the pipeline's row) that runs virtual stage ``vs`` for global
        microbatch ``g`` (evaluation microbatches too): the stage's owner, or with replicated
        stages its replica ``replicas.replica_of`` names."""
        s = self.owner(vs)
        if self.tp > 1:  # its own TP rank of that stage (every rank of a TP group runs every microbatch)
            return s * self.tp + self.tp_rank
        if not self.replicas:
            return s
        return replicas_.slot_of(self.replicas, s, replicas_.replica_of(g - self.mb0, self.replicas[s]))

    def mine(self, g: int) -> bool:
        """Does this worker run its stage's actions for global microbatch ``g``?"""
        return not self.replicas or self.peer(self.chunks[0], g) == self.index

    @property
    def layers(self) -> tuple[int, int]:
        """[lo, hi) spanning its layers (its only chunk's, for one chunk per worker)."""
        return self.ranges[0][0], self.ranges[-1][1]

    @property
    def first(self) -> bool:
        """It runs virtual stage 0 (reads the inputs)."""
        return 0 in self.chunks

    @property
    def last(self) -> bool:
        """It runs the last virtual stage (reads the targets, computes the loss)."""
        return self.virtual - 1 in self.chunks

    def owner(self, vs: int) -> int:
        return schedules.owner(vs, self.pp, self.where)

    def local(self, vs: int) -> bool:
        return 0 <= vs < self.virtual and self.owner(vs) == self.pp_rank

    def key(self, g: int, b: int) -> int:
        """The transport key of what crosses boundary ``b`` (after virtual stage b) for microbatch g."""
        return g * self.virtual + b

    @property
    def last_backward(self):
        return [a for a in self.actions if a.kind == "B"][-1]

    @classmethod
    def from_config(cls, cfg: dict, microbatches: int) -> "Cell":
        dp, pp, r, s = cfg["dp"], cfg["pp"], cfg["dp_rank"], cfg["pp_rank"]
        v, name = cfg.get("chunks", 1), cfg["schedule"]
        m = microbatches // dp
        # (service/spec.py: weight_group above 1 on zb_h1 and zbv only; the plan takes at most m)
        plan = schedules.build(name, pp, m, v, cfg.get("weight_group") or 1)
        where = schedules.placement(name)
        V = pp * v
        mine = tuple(schedules.chunks_of(s, pp, v, where))
        bounds = cfg["bounds"]
        boundary = tuple(_meta(b) if i < V - 1 else None for i, b in enumerate(cfg["boundary"]))
        skips = cfg.get("skips", [])
        reps = tuple(cfg.get("replicas") or ())
        reps = reps if any(k > 1 for k in reps) else ()
        slot = cfg.get("slot", s)
        tp = cfg.get("tp", 1)
        if tp > 1:
            s = slot // tp
            mine = tuple(schedules.chunks_of(s, pp, v, where))
        if reps:  # replicated stages: this worker's list of its pipeline's step (service/replicas.py)
            s, rep = replicas_.stage_of(reps, slot)
            mine = (s,)
            actions = list(replicas_.plan(name, reps, m, replicas_.relative(cfg.get("stage_costs"))).order[slot])
        else:
            rep, actions = 0, list(plan.order[s])
        cell = cls(cfg["gen"], r, s, dp, pp, mine, tuple(tuple(bounds[vs]) for vs in mine), r * m, m,
                   actions, boundary, V, where, name in schedules.SPLIT,
                   routes=portals.routes(skips, bounds), skips=len(skips), replicas=reps, rep=rep,
                   slot=slot if reps or tp > 1 else -1, tp=tp, tp_rank=slot % tp if tp > 1 else 0,
                   weight_group=plan.weight_group)
        for a in cell.actions:
            g = cell.mb0 + a.mb
            if a.kind == "F" and a.stage > 0 and not cell.local(a.stage - 1):
                cell.receives.append(("act", cell.key(g, a.stage - 1), boundary[a.stage - 1], cell.peer(a.stage - 1, g)))
            elif a.kind == "B" and a.stage < V - 1 and not cell.local(a.stage + 1) and _has_grad(boundary[a.stage]):
                cell.receives.append(("grad", cell.key(g, a.stage), boundary[a.stage], cell.peer(a.stage + 1, g)))
            # then the skips this action pops (F) or whose gradients it needs (B), in route order
            for rt in cell.routes:
                if a.kind == "F" and rt.dst == a.stage and not cell.local(rt.src):
                    cell.receives.append(("skip", g * cell.skips + rt.k, rt.meta, cell.peer(rt.src, g)))
                elif a.kind == "B" and rt.src == a.stage and not cell.local(rt.dst) and rt.differentiable:
                    cell.receives.append(("skipgrad", g * cell.skips + rt.k, rt.meta, cell.peer(rt.dst, g)))
        return cell


@dataclass
class _Progress:
    """What a step's actions leave behind as they run."""

    stash: dict = field(default_factory=dict)   # (chunk, microbatch) -> (input, output) until its backward
    weights: dict = field(default_factory=dict)  # (chunk, microbatch) -> what its W needs (split schedules)
    handed: dict = field(default_factory=dict)  # (kind, key) -> a tensor passed between two chunks of this worker
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    busy: float = 0.0
    live: int = 0
    peak: int = 0
    timeline: list = field(default_factory=list)
    received: dict = field(default_factory=dict)  # kind -> bytes received from other workers this step
    # (a schedule without W) the step's last backward sent its input gradient before its weight
    # gradients, or had none to send (schedules.simulate's ``last_early``)
    last_early: bool = False


@dataclass(frozen=True)
class Recipe:
    """How a stage computes (the spec's training recipe, service/spec.py TrainingSpec)."""

    bf16: bool = False            # forward and loss under bf16 autocast
    checkpointing: bool = False   # each layer's forward recomputed in its backward
    global_norm: bool = False     # sum the gradient norm over every worker (clipping, skipping)
    device: torch.device = torch.device("cpu")
    seed: int = 0                 # training.seed: each layer's forward draws from forward_seed(...)
    batch_norm: str = "deferred"  # training.batch_norm (actors/batchnorm.py)


class StepRunner:
    """Runs a cell's actions for one step; built anew whenever the worker's wiring changes."""

    def __init__(self, cell: Cell, stage: nn.Module, transport: Transport, reducer: Optional[GradientReducer],
                 loss_fn: Optional[Callable], scale: float, ties=None, recipe: Recipe = Recipe(),
                 norm_params: Optional[list] = None, parts: Optional[dict] = None, stats_group=None, tp=None):
        """``stage``: every layer the worker holds; ``parts``: virtual stage -> its chunk's layers
        (default: the one chunk is the whole stage); ``stats_group``: the stage's replicas'
        process group (dp > 1), where BatchNorm statistics are summed; ``tp``: the stage's
        tensor-parallel group (actors/tensorpar.py), told when the step's backwards are done."""
        self.cell, self.stage, self.tr, self.reduce = cell, stage, transport, reducer
        self.tp, self.named = tp, list(stage.named_parameters())
        self.parts = parts or {cell.chunks[0]: stage}
        self.params = {vs: [q for q in part.parameters() if q.requires_grad] for vs, part in self.parts.items()}
        self.loss_fn, self.scale, self.ties = loss_fn, scale, ties  # ties: actors/ties.TiedGrads
        self.counted: Optional[int] = None  # this step's counted targets (``run``), when the loss is their mean
        self.recipe = recipe
        # the parameters whose gradients count in the model's norm: a tie's copies but its first
        # name's are left out (one parameter), and only replica 0 counts (the replicas agree)
        self.norm_params = (norm_params if norm_params is not None else list(stage.parameters())) \
            if cell.dp_rank == 0 and cell.rep == 0 else []
        # the action after which this step's weight gradients are final (the gradient sum is armed before it)
        grads = [a for a in cell.actions if a.kind == ("W" if cell.split else "B")]
        self.final = grads[-1] if grads else None
        # the chunks whose plain Linear layers compute their weight gradients themselves
        # (actors/deferred.py: one addmm_ into .grad each, where autograd makes a new gradient and
        # adds it): in a split schedule W does them; in the others each backward does them right
        # after its input gradient is sent.  Chunks without plain Linears split with torch's
        # stage_backward_input/weight.  Not under bf16 autocast, not on tensor-parallel (DTensor)
        # weights, and not where gradient hooks start the all-reduce during backward (GPU)
        self.pending, self.deferred = deferred.Pending(), set()
        own_grads = not recipe.bf16 and tp is None and not (reducer is not None and reducer.overlap)
        for vs, part in self.parts.items():
            deferred.uninstall(part)
            if own_grads and deferred.install(part, self.pending):
                self.deferred.add(vs)
        # split schedules: the first step counts the rows each module of a deferred chunk sees,
        # after which _keep_split_whole weighs what the Linears' own products leave for W, and
        # the chunks where that is too little try both splits (service/schedules.py SPLIT_TRIAL)
        # (a chunk with weights but no plain Linear tries both too: "own" is then its whole backward
        # in B; the first chunk has no input gradient, so its whole backward is its W, unless W's are grouped)
        self.splittable = {vs for vs in self.parts if own_grads and self.params[vs] and (vs > 0 or cell.weight_group > 1)
                           } if cell.split else set()
        # every backward sends its input gradient before its weight gradients: the step runs as
        # service/schedules.py sends_early models it (reported with each step: the plan's bubble)
        # ... where their Linears' own products hold the chunk's weight-gradient work: a layer that
        # keeps an nn.Linear for its weight and calls F.linear itself defers nothing, and its
        # backward runs whole before the send, as textbook 1F1B's (_check_early, after the first step)
        self.sends_early = not cell.split and all(vs in self.deferred or not self.params[vs] for vs in self.parts)
        # the first step counts the rows each module of a deferred chunk sees (for either check)
        self.checked_cover = not (self.splittable or self.sends_early)
        self.rows: dict = {}
        self.trial: list = []  # the modes still to try, in order
        self.trying: dict = {}  # the chunks under trial -> the share of their weight-gradient work the Linears hold
        self.awaiting = False  # the trial ended; the scheduler's choice has not come yet
        if not self.checked_cover:
            for vs in self.deferred:
                deferred.count_rows(self.parts[vs], self.rows)
        sharers = cell.dp * (cell.replicas[cell.pp_rank] if cell.replicas else 1)  # workers of this stage
        self.stats_group = stats_group if sharers > 1 else None
        self.norms = RunningStats([m for vs in cell.chunks for m in norms_of(self.parts[vs])],
                                  recipe.batch_norm, cell.m * cell.dp, self.stats_group)
        # global BatchNorm: the forwards of a chunk meet at each BatchNorm (actors/globalnorm.py);
        # layers holding one are not checkpointed (a recomputation would meet nobody)
        self.together = recipe.batch_norm == "global" and bool(self.norms.modules)
        self.unchecked = {id(layer) for part in self.parts.values() for layer in part
                          if self.together and norms_of(layer)}
        # layers that stash or pop skips: recomputed with the pops of their first forward
        self.skippers = {id(layer) for part in self.parts.values() for layer in part if skip.declarations(layer)}
        self.portals = portals.Portals(cell.routes, self.parts, {vs: self.parts_range(vs) for vs in self.parts},
                                       cell.skips)
        self.norm_update = None  # the step's BatchNorm update, applied at its commit (take_norm_update)
        self.blocks = self._blocks()  # the step's actions as they run (the cell's list is fixed)

    def run(self, step: int, xs: Optional[list], ys: Optional[list], aborted: Callable[[], bool],
            counted: Optional[int] = None, split: Optional[str] = None) -> dict:
        """``counted``: the step's counted targets when the loss is a mean over them
        (service/loading.py ``counted_targets``); None: each microbatch's mean scaled by mbs / B.
        ``split``: how the chunks that tried both splits of the backward split it from now on
        ("own" or "torch", chosen by the scheduler from the trial's step times; ``_keep_split_whole``)."""
        self.counted = counted
        c, tr, reduce = self.cell, self.tr, self.reduce
        trial = None
        if self.trial:
            trial = {"mode": self.trial.pop(0), "left": len(self.trial), "chunks": sorted(self.trying),
                     "cover": [round(self.trying[vs], 3) for vs in sorted(self.trying)]}
            self._split_mode(trial["mode"])
        elif self.awaiting and split is not None:
            self._split_mode(split)
            self.awaiting = False
        t_begin = time.time()
        with talking_to_peers(f"starting step {step + 1}"):
            tr.begin_step(step, c.receives)
            if reduce is not None:
                reduce.attach()  # this step's gradients accumulate in the all-reduce's buffers
        p = _Progress()
        self.norms.begin()
        for block in self.blocks:
            if block[0].kind == "W":  # one W, or a group's together (parallelism.weight_group)
                self.norms.g = c.mb0 + block[0].mb
                spans = self._weights(block, p)
            elif len(block) > 1:  # a chunk's forwards (or backwards) together: global BatchNorm
                self.norms.g = c.mb0
                spans = (self._forwards_together(block, step, xs, ys, p) if block[0].kind == "F"
                         else self._backwards_together(block, step, p))
            else:
                a = block[0]
                g = self.norms.g = c.mb0 + a.mb
                spans = [self._forward(a, step, g, xs, ys, p) if a.kind == "F" else self._backward(a, step, g, p)]
            for a, (t0, t1) in zip(block, spans):
                p.busy += t1 - t0
                p.timeline.append((f"{a.stage}{a.kind}{c.mb0 + a.mb}", t0, t1))  # global microbatch id
        with talking_to_peers(f"finishing the sends of step {step + 1}"):
            tr.finish_step()
        t_pipe = time.time()
        if trial is not None and not self.trial:  # its last step: torch's split until the choice comes
            self._split_mode("torch")
            self.awaiting = True
        if not self.checked_cover:
            self._keep_split_whole() if c.split else self._check_early()
        if self.tp is not None:
            with talking_to_peers(f"summing the gradients of step {step + 1} over the stage's tensor-parallel group"):
                self.tp.after_backward(self.named)
        if reduce is not None:
            with talking_to_peers(f"summing the gradients of step {step + 1} with the stage's replicas"):
                reduce.finish()
        if self.ties:
            with talking_to_peers(f"summing the gradients of tied parameters of step {step + 1} with other stages"):
                self.ties.finish(step, tr)
        grad_sq, total = self._grad_norm(step)
        if self.norms.modules:
            with talking_to_peers(f"summing the BatchNorm statistics of step {step + 1} with the stage's replicas"):
                self.norm_update = (self.norms, self.norms.reduce())
        if aborted():
            raise StageAborted(f"step {step + 1} was discarded")
        t_end = time.time()
        return {"dp_rank": c.dp_rank, "pp_rank": c.pp_rank, "rep": c.rep,
                "loss": float(p.loss_sum) if c.last and c.tp_rank == 0 else None,  # a TP group's ranks agree
                "busy": p.busy, "start": p.timeline[0][1] if p.timeline else t_begin, "pipe_end": t_pipe,
                "end": t_end, "peak_live": p.peak, "allreduce_s": t_end - t_pipe, "timeline": p.timeline,
                "grad_sq": grad_sq, "grad_norm": total, "received": p.received, "sends_early": self.sends_early,
                "last_early": p.last_early,
                **({"split_trial": trial} if trial else {})}

    def _keep_split_whole(self) -> None:
        """After the first step of a split schedule: a chunk whose Linears that ran hold less than
        ``deferred.LINEAR_COVER`` of its weight-gradient work (``deferred.covered``: a layer that
        keeps an ``nn.Linear`` for its weight and calls ``F.linear`` itself, convolutions before
        a Linear head that has most of the weights but little of the work) has two ways to split
        its backward: torch's, where every weight gradient waits for W at the cost of more
        compute, and the Linears' own products, with the other weight gradients in B.  Such
        chunks try both in the next steps (``schedules.SPLIT_TRIAL``, reported as ``split_trial`` with
        each step); the scheduler times the steps and sends its choice (``run``'s ``split``)."""
        cover = {vs: 0.0 for vs in self.splittable}  # no plain Linear ran: nothing for W but torch's split
        cover.update(self._covers())
        self.trying = {vs: cover[vs] for vs in sorted(self.splittable) if cover[vs] < deferred.LINEAR_COVER}
        self._split_mode("torch")
        self.trial = list(schedules.SPLIT_TRIAL) if self.trying else []

    def _check_early(self) -> None:
        """After the first step of a schedule without W actions: its backwards send their input
        gradients early only where each chunk's Linears that ran hold ``deferred.LINEAR_COVER`` of
        its weight-gradient work (``deferred.covered``); otherwise the steps report textbook
        1F1B's plan (its bubble), as they run.  A chunk whose Linears hold under
        ``deferred.FEW_LINEARS`` of it (layers that call ``F.linear``, a Linear head after them)
        defers nothing worth the while, and stops deferring: it runs as a chunk without plain
        Linears, whose last backward of a step splits torch's way and sends its input gradient
        before all its weight gradients (deferring, that backward ran whole before the send).
        Between the two shares the products stay deferred: a CNN whose Linears hold 18% ran its
        1F1B 5-10% slower at 16-32 rows with torch's split of its last backward (its second pass
        through the convolutions costs more than the send it brings forward saves), while the
        paced F.linear layers' (4%) ran about 5% faster."""
        covers = self._covers()
        self.sends_early = all(covers[vs] >= deferred.LINEAR_COVER for vs in self.deferred if self.params[vs])
        for vs, share in covers.items():
            if share < deferred.FEW_LINEARS and self.params[vs]:
                deferred.uninstall(self.parts[vs])
                self.deferred.discard(vs)

    def _covers(self) -> dict:
        """After the first step: each deferred chunk -> the share of its weight-gradient work its
        Linears that ran hold (``deferred.covered``, by the rows counted); the counting ends."""
        self.checked_cover = True
        covers = {}
        for vs in sorted(self.deferred):
            deferred.forget_rows(self.parts[vs])
            covers[vs] = deferred.covered(self.parts[vs], self.rows)
        self.rows = {}
        return covers

    def _split_mode(self, mode: str) -> None:
        """The chunks under trial split their backward torch's way ("torch") or with the Linears'
        own products ("own": in a chunk with no plain Linear, its whole backward in B)."""
        for vs in self.trying:
            if mode == "own" and vs not in self.deferred:
                deferred.install(self.parts[vs], self.pending)  # (none, where it holds no plain Linear)
                self.deferred.add(vs)
            elif mode == "torch" and vs in self.deferred:
                deferred.uninstall(self.parts[vs])
                self.deferred.discard(vs)

    def _blocks(self) -> list:
        """The step's actions as they run: one at a time, or with global BatchNorm each run of
        one chunk's forwards (its backwards) together (GPipe: all of them); with
        ``parallelism.weight_group`` k > 1 each run of one chunk's W's, k at most, together
        (the plan stands them together: schedules.group_weights)."""
        blocks: list = []
        k = self.cell.weight_group
        for a in self.cell.actions:
            prev = blocks[-1][-1] if blocks else None
            same = prev is not None and (prev.kind, prev.stage) == (a.kind, a.stage)
            if same and ((self.together and a.kind in "FB") or (a.kind == "W" and len(blocks[-1]) < k)):
                blocks[-1].append(a)
            else:
                blocks.append([a])
        return blocks

    def _forwards_together(self, block: list, step: int, xs, ys, p: _Progress) -> list:
        """A chunk's forwards of ``block``'s microbatches, meeting at each BatchNorm: each starts
        as its input arrives, and its output goes on as soon as it ends.  Drawn on the timeline
        one after another, each as long as it ran (they ran interleaved, a layer at a time)."""
        c = self.cell
        took: dict = {}

        def finished(j: int, result) -> None:
            a, (inp, received) = block[j], took.pop(j)
            self._give_output(a, step, c.mb0 + a.mb, inp, result[0], received, result[1], p)

        lock = Lockstep(self.norms.together, finished)
        self.norms.lockstep = lock
        start = None
        try:
            for j, a in enumerate(block):
                g = c.mb0 + a.mb
                took[j] = self._take_input(a, step, g, xs, p)
                start = start or time.time()
                lock.start(j, functools.partial(self._run_forward, a, *took[j], step, g, ys))
            lock.go_on()
        finally:
            self.norms.lockstep = None
            lock.abort()
        spans, t = [], start
        for j in range(len(block)):
            spans.append((t, t + lock.busy.get(j, 0.0)))
            t = spans[-1][1]
        return spans

    def _backwards_together(self, block: list, step: int, p: _Progress) -> list:
        """One backward of a chunk for all of ``block``'s microbatches (their BatchNorm nodes hold
        every microbatch), once every output gradient is there; drawn as equal parts."""
        c, vs = self.cell, block[0].stage
        outs, grads, done = [], [], []
        for a in block:
            g = c.mb0 + a.mb
            inp, out, received, stashed = p.stash.pop((vs, a.mb))
            grad = self._out_grad(a, step, g, p, out)
            back = self._receive_skips(vs, step, g, "skipgrad", p)
            outs += [out] + [x for k, x in stashed.items() if k in back]
            grads += [grad] + [back[k] for k in stashed if k in back]
            done.append((g, inp, received))
        if self.reduce is not None and self.final in block:
            with talking_to_peers("arming the gradient sum"):
                self.reduce.arm()
        t0 = time.time()
        wanted = [(o, gr) for o, gr in zip(outs, grads) if o.requires_grad]
        if wanted:
            torch.autograd.backward([o for o, _ in wanted], [gr for _, gr in wanted])
        t1 = time.time()
        for g, inp, received in done:
            p.live -= 1
            if vs > 0 and inp.requires_grad:
                self._send_grads(step, g, vs, inp, received, p)
        part = (t1 - t0) / len(block)
        return [(t0 + k * part, t0 + (k + 1) * part) for k in range(len(block))]

    def _loss(self, out: torch.Tensor, y: torch.Tensor, counted: Optional[int]) -> torch.Tensor:
        """A microbatch's share of its batch's loss: its mean scaled by mbs / B, or with
        ``counted`` (the batch's counted targets) its sum over its counted targets / ``counted``."""
        if counted is None:
            return self.loss_fn(out, y) * self.scale
        return cross_entropy_sum(out, y) / counted

    def evaluate(self, step: int, xs: Optional[list], ys: Optional[list], batches: int,
                 aborted: Callable[[], bool], counted: Optional[list] = None) -> dict:
        """Forwards only, with no gradients and the layers in eval mode, of this replica's
        microbatches of ``batches`` evaluation batches (``xs[b][j]``, ``ys[b][j]``), pipelined
        like a step's forwards: each of the worker's chunks in model order, over every
        microbatch.  The last stage returns its sum of microbatch losses, each scaled by
        microbatch / batch size: the sum over replicas is the sum of batch means."""
        c, tr, m = self.cell, self.tr, self.cell.m
        ids = [b * m * c.dp + c.mb0 + j for b in range(batches) for j in range(m)]  # global eval microbatches
        expected = []
        for vs in c.chunks:
            for g in filter(c.mine, ids):
                if vs > 0 and not c.local(vs - 1):
                    expected.append(("eval", c.key(g, vs - 1), c.boundary[vs - 1], c.peer(vs - 1, g)))
                expected += [("evalskip", self.portals.key(g, r), r.meta, c.peer(r.src, g))
                             for r in self.portals.into[vs] if not c.local(r.src)]
        with talking_to_peers(f"starting the evaluation after step {step}"):
            tr.begin_step(step, expected)
        loss_sum = torch.zeros((), dtype=torch.float64)
        timeline, handed, skips = [], {}, _Progress()
        was_training = self.stage.training
        self.stage.eval()
        try:
            with torch.no_grad():
                for vs in c.chunks:
                    for k, g in enumerate(ids):
                        if not c.mine(g):  # another replica of this stage evaluates it
                            continue
                        b, j = divmod(k, m)
                        if vs == 0:
                            inp = xs[b][j]
                        elif c.local(vs - 1):
                            inp = handed.pop((vs - 1, g))
                        else:
                            with talking_to_peers(f"receiving the evaluation activation of microbatch {g}"):
                                inp = tr.recv_from(c.peer(vs - 1, g), step, "eval", c.key(g, vs - 1), c.boundary[vs - 1])
                        received = self._receive_skips(vs, step, g, "evalskip", skips)
                        tracker = self.portals.tracker(received)
                        t0 = time.time()
                        with self._autocast(), skip.use_tracker(tracker):
                            out = self.parts[vs](inp)
                            if vs == c.virtual - 1:
                                loss_sum += (self._loss(out, ys[b][j], counted[b] if counted else None)
                                             .double()).cpu()
                        t1 = time.time()
                        self._send_skips(vs, step, g, "evalskip", self.portals.stashed(vs, tracker), skips)
                        timeline.append((f"{vs}E{g}", t0, t1))
                        if vs == c.virtual - 1:
                            continue
                        self._check_shape(out, g, vs)
                        if c.local(vs + 1):
                            handed[(vs, g)] = out
                        else:
                            with talking_to_peers(f"sending the evaluation activation of microbatch {g}"):
                                tr.send_to(c.peer(vs + 1, g), step, "eval", c.key(g, vs), out)
            with talking_to_peers(f"finishing the sends of the evaluation after step {step}"):
                tr.finish_step()
        finally:
            self.stage.train(was_training)
        if aborted():
            raise StageAborted(f"the evaluation after step {step} was discarded")
        return {"loss_sum": float(loss_sum) if c.last and c.tp_rank == 0 else None, "timeline": timeline}

    def take_norm_update(self):
        """The last step's BatchNorm buffer update (a callable), or None; applied at the commit."""
        got, self.norm_update = self.norm_update, None
        if got is None:
            return None
        stats, updates = got
        return lambda: stats.apply(updates)

    def _grad_norm(self, step: int) -> tuple[float, Optional[float]]:
        """This worker's share of the squared gradient norm, and with ``global_norm`` the whole
        model's norm (summed over every worker of the shape: every worker gets the same)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.recipe.device)
        for q in self.norm_params:
            if q.grad is not None:  # each tensor's norm in its dtype (no copy), as clip_grad_norm_
                g = q.grad.to_local() if hasattr(q.grad, "to_local") else q.grad  # a TP rank's slice
                sq += torch.linalg.vector_norm(g).double() ** 2
        if not self.recipe.global_norm:
            return float(sq), None
        with talking_to_peers(f"summing the gradient norm of step {step + 1} over every worker"):
            mine = float(sq)
            with waiting_on_peers():
                dist.all_reduce(sq)
        return mine, float(sq.sqrt())

    def _autocast(self):
        """Forward and loss under bf16 autocast with training.precision bf16 (a no-op otherwise)."""
        return torch.autocast(self.recipe.device.type, dtype=torch.bfloat16, enabled=self.recipe.bf16)

    def _compute(self, vs: int, inp: torch.Tensor, step: int, g: int) -> torch.Tensor:
        """A chunk's layers on microbatch g, each after seeding torch's generator with
        ``forward_seed(seed, step + 1, g, layer)`` (a recomputation in backward, with
        checkpointing, restores that state and draws the same masks)."""
        h, lo = inp, self.parts_range(vs)[0]
        if inp.requires_grad and inp.is_leaf and len(self.parts[vs]) and changes_input_in_place(self.parts[vs][0]):
            h = inp.clone()  # ReLU(inplace=True) first: the received leaf keeps its values for its gradient
        cuda = self.recipe.device.type == "cuda"
        for i, layer in enumerate(self.parts[vs]):
            s = forward_seed(self.recipe.seed, step + 1, g, lo + i)
            torch.random.default_generator.manual_seed(s)
            if cuda:
                torch.cuda.manual_seed(s)
            if self.recipe.checkpointing and id(layer) not in self.unchecked:
                run = skip.recomputable(layer) if id(layer) in self.skippers else layer
                h = checkpoint(run, h, use_reentrant=False)
            else:
                h = layer(h)
        return h

    def _forward(self, a, step: int, g: int, xs, ys, p: _Progress) -> tuple[float, float]:
        inp, received = self._take_input(a, step, g, xs, p)
        t0 = time.time()
        out, stashed = self._run_forward(a, inp, received, step, g, ys)
        t1 = time.time()
        self._give_output(a, step, g, inp, out, received, stashed, p)
        return t0, t1

    def _take_input(self, a, step: int, g: int, xs, p: _Progress) -> tuple:
        """A forward's input and the skips it pops (received, or handed over in memory)."""
        c, vs = self.cell, a.stage
        if vs == 0:
            inp = xs[a.mb]
        else:
            if c.local(vs - 1):  # a V's turn: the other chunk's output, cut from its graph
                inp = p.handed.pop(("act", c.key(g, vs - 1))).detach()
            else:
                with talking_to_peers(f"receiving the activation of microbatch {g}"):
                    inp = self._recv(p, c.peer(vs - 1, g), step, "act", c.key(g, vs - 1), c.boundary[vs - 1])
            if inp.is_floating_point():
                inp.requires_grad_()
        received = self._receive_skips(vs, step, g, "skip", p)
        for x in received.values():
            if x.is_floating_point():
                x.requires_grad_()
        return inp, received

    def _run_forward(self, a, inp: torch.Tensor, received: dict, step: int, g: int, ys) -> tuple:
        """The chunk's layers (and the loss, on the last) on microbatch g: (output, skips stashed)."""
        vs = a.stage
        last = vs == self.cell.virtual - 1
        tracker = self.portals.tracker(received)
        with self._autocast(), skip.use_tracker(tracker):
            out = self._compute(vs, inp, step, g)
            if last:
                out = self._loss(out, ys[a.mb], self.counted)
        if not last and out._is_view():  # a split backward detaches its output in place, which a view refuses
            out = out.clone()
        return out, self.portals.stashed(vs, tracker)

    def _give_output(self, a, step: int, g: int, inp, out, received: dict, stashed: dict, p: _Progress) -> None:
        """Keep what a forward's backward needs; send its output and the skips it stashed on."""
        c, tr, vs = self.cell, self.tr, a.stage
        last = vs == c.virtual - 1
        if last:
            p.loss_sum += out.detach().double().cpu()
        p.stash[(vs, a.mb)] = (inp, out, received, stashed)
        self._send_skips(vs, step, g, "skip", stashed, p)
        if not last:
            self._check_shape(out, g, vs)
            if c.local(vs + 1):
                p.handed[("act", c.key(g, vs))] = out
            else:
                with talking_to_peers(f"sending the activation of microbatch {g}"):
                    tr.send_to(c.peer(vs + 1, g), step, "act", c.key(g, vs), out)
        p.live += 1
        p.peak = max(p.peak, p.live)

    def _check_shape(self, out: torch.Tensor, g: int, vs: int) -> None:
        c = self.cell
        want = c.boundary[vs]
        if self.tr.fixed_shapes and not c.local(vs + 1) and (tuple(out.shape), out.dtype) != want:
            lo, hi = self.parts_range(vs)
            raise ValueError(
                f"stage {vs} (layers {lo}-{hi - 1}) produced an activation of shape "
                f"{tuple(out.shape)} {out.dtype} for microbatch {g}, but the pipeline was set up for "
                f"{want[0]} {want[1]} (the shape of the first microbatch): transport 'collective' needs "
                "every microbatch's activation to keep one shape; set parallelism.transport: object_store for "
                "activations whose shape varies")

    def parts_range(self, vs: int) -> tuple[int, int]:
        c = self.cell
        return c.ranges[c.chunks.index(vs)]

    def _out_grad(self, a, step: int, g: int, p: _Progress, out: torch.Tensor) -> Optional[torch.Tensor]:
        """The gradient of a chunk's output: none for the loss, nor for an output of integers
        (token ids: the next chunk's input needs no gradient, so it sends none), else from the
        next chunk."""
        c, vs = self.cell, a.stage
        if vs == c.virtual - 1 or not out.is_floating_point():
            return None
        if c.local(vs + 1):
            return p.handed.pop(("grad", c.key(g, vs)))
        with talking_to_peers(f"receiving the gradient of microbatch {g}"):
            return self._recv(p, c.peer(vs + 1, g), step, "grad", c.key(g, vs), c.boundary[vs])

    def _backward(self, a, step: int, g: int, p: _Progress) -> tuple[float, float]:
        """B: the gradient of the chunk's input (sent on as soon as it is known); in a schedule
        without W actions also its weight gradients.  Skip tensors the chunk stashed for later
        chunks are outputs too (with the gradients their poppers sent); the ones it popped are
        inputs (their gradients go back to the stasher)."""
        c, reduce, vs = self.cell, self.reduce, a.stage
        inp, out, received, stashed = p.stash.pop((vs, a.mb))
        grad = self._out_grad(a, step, g, p, out)
        back = self._receive_skips(vs, step, g, "skipgrad", p)
        outs = [out] + [x for k, x in stashed.items() if k in back]
        grads = [grad] + [back[k] for k in stashed if k in back]
        ins = [inp] + [x for x in received.values() if x.requires_grad]
        t0 = time.time()
        needs_input = vs > 0 and inp.requires_grad
        wants = any(t.requires_grad for t in outs)
        if c.split:
            # the first chunk's input needs no gradient: its whole backward is its W (as torch's
            # schedules do); but with W's grouped, its B is the backward through the chunk and W
            # only its Linear weight products, which a group computes together
            if wants and vs in self.deferred and (needs_input or c.weight_group > 1):
                p.weights[(vs, a.mb)] = ("deferred", self._input_backward(outs, grads))
            elif needs_input and wants and self.params[vs]:
                _, groups = stage_backward_input(outs, grads, ins, iter(self.params[vs]))
                p.weights[(vs, a.mb)] = ("groups", groups)
            elif needs_input and wants:  # no weights: the input gradient is the whole backward
                torch.autograd.backward(outs, grads)
                p.weights[(vs, a.mb)] = ("done", None)
            else:
                p.weights[(vs, a.mb)] = ("whole", (outs, grads))
            t1 = time.time()
            if needs_input:
                self._send_grads(step, g, vs, inp, received, p)
            return t0, t1
        final = a == self.final
        if reduce is not None and final:
            with talking_to_peers("arming the gradient sum"):
                reduce.arm()  # the gradients become final in this backward: all-reduce as they do
        own = wants and vs in self.deferred  # plain Linears: their weight products after the send
        split = (not own and final and needs_input and wants and not self.recipe.checkpointing
                 and stage_backward_input is not None and not (reduce is not None and reduce.overlap))
        # with the weight gradients computed apart (own, or torch's split of the step's last
        # backward), the input gradient is sent before them: the previous chunk waits for it
        early = own or split
        if final:  # (the own products of a chunk they do not cover come after most of its weight gradients)
            p.last_early = split or not needs_input
        if own:
            what = self._input_backward(outs, grads)
        elif split:
            _, groups = stage_backward_input(outs, grads, ins, iter(self.params[vs]))
        elif wants:
            torch.autograd.backward(outs, grads)
        if early and needs_input:
            self._send_grads(step, g, vs, inp, received, p)
        if own:
            deferred.weight_grads(what)
        elif split:
            stage_backward_weight(iter(self.params[vs]), groups)
        t1 = time.time()
        p.live -= 1
        if not early and needs_input:
            self._send_grads(step, g, vs, inp, received, p)
        return t0, t1

    def _weights(self, block: list, p: _Progress) -> list:
        """W: the weight gradients of a chunk for the microbatches of ``block`` (split
        schedules; one, or a group of ``parallelism.weight_group``): the Linear weight products
        as one product per layer over their rows together (deferred.weight_grads_grouped);
        whatever else a W holds runs on its own.  On the timeline each W of a group gets an
        equal share of the group's time."""
        if self.reduce is not None and self.final in block:
            with talking_to_peers("arming the gradient sum"):
                self.reduce.arm()
        t0 = time.time()
        together = []
        for a in block:
            how, what = p.weights.pop((a.stage, a.mb))
            if how == "deferred":
                together.append(what)
            elif how == "groups":
                stage_backward_weight(iter(self.params[a.stage]), what)
            elif how == "whole" and any(t.requires_grad for t in what[0]):
                torch.autograd.backward(what[0], what[1])
            p.live -= 1
        deferred.weight_grads_grouped(together)
        t1 = time.time()
        n = len(block)
        return [(t0 + (t1 - t0) * i / n, t0 + (t1 - t0) * (i + 1) / n) for i in range(n)]

    def _input_backward(self, outs: list, grads: list) -> list:
        """A backward in which the chunk's plain Linears leave their weight products out
        (actors/deferred.py); returns what ``deferred.weight_grads`` needs for them."""
        self.pending.into = []
        try:
            torch.autograd.backward(outs, grads)
        finally:
            what, self.pending.into = self.pending.into, None
        return what

    def _recv(self, p: _Progress, src: int, step: int, kind: str, key: int, meta) -> torch.Tensor:
        t = self.tr.recv_from(src, step, kind, key, meta)
        p.received[kind] = p.received.get(kind, 0) + t.numel() * t.element_size()
        return t

    def _receive_skips(self, vs: int, step: int, g: int, kind: str, p: _Progress) -> dict:
        """k -> the skip tensors chunk vs pops (kind "skip"/"evalskip": from their stashers) or
        the gradients of those it stashed ("skipgrad": from their poppers)."""
        c, got = self.cell, {}
        back = kind == "skipgrad"
        for r in (self.portals.out_of if back else self.portals.into)[vs]:
            if back and not r.differentiable:
                continue
            other = r.dst if back else r.src
            if c.local(other):
                got[r.k] = p.handed.pop((kind, r.k, g))
                if not back:
                    got[r.k] = got[r.k].detach()
            else:
                with talking_to_peers(f"receiving {'the gradient of ' if back else ''}skip {r.name!r} of microbatch {g}"):
                    got[r.k] = self._recv(p, c.peer(other, g), step, kind, self.portals.key(g, r), r.meta)
        return got

    def _send_skips(self, vs: int, step: int, g: int, kind: str, tensors: dict, p: _Progress) -> None:
        """The skips chunk vs stashed to their poppers ("skip"/"evalskip"), or the gradients of
        those it popped to their stashers ("skipgrad")."""
        c = self.cell
        back = kind == "skipgrad"
        for r in (self.portals.into if back else self.portals.out_of)[vs]:
            if back and not r.differentiable:
                continue
            x = tensors[r.k]
            if back:
                x = x.grad if x.grad is not None else torch.zeros_like(x)
            other = r.src if back else r.dst
            if c.local(other):
                p.handed[(kind, r.k, g)] = x
            else:
                with talking_to_peers(f"sending {'the gradient of ' if back else ''}skip {r.name!r} of microbatch {g}"):
                    self.tr.send_to(c.peer(other, g), step, kind, self.portals.key(g, r), x)

    def _send_grads(self, step: int, g: int, vs: int, inp: torch.Tensor, received: dict, p: _Progress) -> None:
        """The gradient of the chunk's input to the previous chunk, then those of the skips it
        popped (``received``) to their stashers."""
        c = self.cell
        grad = inp.grad if inp.grad is not None else torch.zeros_like(inp)
        if c.local(vs - 1):
            p.handed[("grad", c.key(g, vs - 1))] = grad
        else:
            with talking_to_peers(f"sending the gradient of microbatch {g}"):
                self.tr.send_to(c.peer(vs - 1, g), step, "grad", c.key(g, vs - 1), grad)
        self._send_skips(vs, step, g, "skipgrad", received, p)
