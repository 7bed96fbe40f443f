"""StageWorker: one (dp_rank, pp_rank) cell of a job.

It holds its stage's layers and optimizer state, builds its own microbatches from the
deterministic sample order, and runs a whole step's action list in one call (``run_step``,
carried out by actors/stage.py): forwards and backwards in the schedule's order, activations
and their gradients through the transport, and the gradient sum among the replicas of its
stage: through shared memory when they share a node (CPU), else a gloo/NCCL all-reduce in
buckets the gradients accumulate into (launched during the last backward on a GPU, as DDP
does; right after it on a CPU).

Steps are two-phase.  ``run_step(s)`` leaves step s's summed gradients *pending*; the
optimizer applies them only once the scheduler has seen every worker finish step s, which
it says by sending ``run_step(s + 1)`` (or ``commit``, ``export``, ``configure`` with
``committed = s + 1``).  A step interrupted by a failure is therefore discarded on every
worker: its pending gradients are dropped and the parameters stay at the last committed
step.  ``configure`` gives a live worker a new cell (another stage, another replica, another
shape) without restarting it: layers it already holds stay in memory, the others arrive
from a surviving replica or an off-node copy through the object store, and a layer with no
state (actors/state.py: ``has_state``) is simply built.
"""
from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Optional

import torch
from torch import nn

from actors import failures, nodeenv
from actors.copies import KeptCopies, Uploads
from actors.failures import PeerLost, StageAborted, talking_to_peers
from actors.heap import StepThread, keep_freed
from actors.output import OutputTap
from actors.stage import Cell, Recipe, StepRunner
from actors.tensorpar import CollectiveBytes, local
from actors.state import (clone, empty, has_state, layer_of, load_optimizer_state, merge_states,
                          optimizer_state_by_name)
from actors.transport import Inbox
from actors.ties import TiedGrads
from actors.wiring import Wiring, rendezvous_address
from service import checkpoint, lazydynamo, shards
from service.loading import ModelRecipe, build_data, build_loss, build_optimizer, counted_targets, model_recipe
from service.replicas import stage_of
from service.recipe import check_precision, lr_at, needs_global_norm, step_update
from service.sampling import microbatches, step_indices
from service.spec import JobSpec


# an aborted step still parked in a wait on its peers this long after the abort shut the group's
# sockets (gloo fails the others within about 10 ms) is in a wait gloo does not end: given up on
PARKED_S = 1.5
# how long after an abort the worker watches its step for that (then the scheduler's rule holds:
# still running after 10 s, stuck)
ABORT_WATCH_S = 20.0


def device_for(gpus_per_worker: Optional[float], given: list, cuda: bool) -> torch.device:
    """A worker's device: CUDA when it is to use GPUs and this process sees one.  With
    ``resources.gpus_per_worker`` unset, it uses GPUs when Ray gave it some (``given``, from
    ``ray.get_gpu_ids()``): the scheduler asks for one per worker when the cluster has a GPU per
    worker (actors/workergroup.py), and the transport follows the device (NCCL or gloo)."""
    gpus = len(given) if gpus_per_worker is None else gpus_per_worker
    return torch.device("cuda") if gpus > 0 and cuda else torch.device("cpu")


class StageWorker:
    def __init__(self, job_id: str, spec: dict, search: list[str], timeout: float = 300.0):
        self.heap = keep_freed()  # a step's freed gradients and activations stay mapped for the next (actors/heap.py)
        self.output = OutputTap.install()  # what user code prints goes to the job's log too
        lazydynamo.defer()  # building layers and optimizers would import torch._dynamo: 1.3-2.3 s of CPU, 140 MB
        self.job_id = job_id
        self.spec = JobSpec.model_validate(spec)
        slow = nodeenv.priority_note(self.spec.resources.nice)  # its node did not give it the job's niceness
        if slow:
            print(slow, file=sys.stderr)  # to the job's log (OutputTap)
        self.search = [os.getcwd(), *search]
        self.timeout = timeout
        torch.set_num_threads(max(1, int(self.spec.resources.cpus_per_worker)))
        import ray

        self.device = device_for(self.spec.resources.gpus_per_worker, ray.get_gpu_ids(), torch.cuda.is_available())
        check_precision(self.spec, gpus=self.device.type == "cuda")  # this node's hardware runs the recipe
        t = self.spec.training
        self.mbs, self.B = t.microbatch_size, t.global_batch_size
        self.cell: Optional[Cell] = None   # where this worker stands in the current shape
        self.layers: dict[int, nn.Module] = {}   # layer index of the whole model -> module held here
        self.stage = nn.Sequential()
        self.parts: dict = {}            # virtual stage -> its chunk's layers (the same modules as stage's)
        self._split_later = None         # a tensor-parallel stage's (layers, step, state) until its group exists
        self.param_names: list[str] = []
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.applied = 0                 # committed steps whose updates are in the parameters
        self.pending: Optional[int] = None  # 0-based step whose summed gradients wait for its commit
        self.samples = None
        self.eval_samples = None
        self.loss_fn = None
        self.inbox = Inbox()
        self.wiring = Wiring()             # process group, transport, the stage's gradient sum
        self.runner: Optional[StepRunner] = None
        self._lock = threading.RLock()   # commits, state copies and reconfiguration
        self.recipe: Optional[ModelRecipe] = None   # builds any layer of the model (user code, imported once)
        self.bounds: list = []
        self.copies = KeptCopies()  # other stages' state (this worker is their peer) and its own, by step
        self.uploads = Uploads()    # checkpoint parts being written in the background
        self._aborted: Optional[int] = None
        self.update: tuple[float, bool] = (1.0, False)  # the pending step's (clip factor, skipped)
        self.norms_update = None  # the pending step's BatchNorm buffer update (actors/batchnorm.py)
        self._turn = threading.Condition()  # steps queue on the step thread in order (a step's call may come early)
        self._started = -1                  # the newest step queued in this cell
        # Every step and evaluation runs on this one thread, whichever of Ray's threads took the
        # call: glibc gives each thread its own heap (arena), so on Ray's rotating threads a step
        # found none of the memory the step before freed, and faulted it in anew (actors/heap.py).
        self._compute = StepThread(torch.get_num_threads())
        gc.collect()  # the imports' garbage goes; what lives on (torch's, Ray's objects) is frozen:
        gc.freeze()   # later collections skip it (see Group.leave)

    @property
    def gen(self) -> int:
        """The scheduler's configuration generation this worker is wired for (-1: none yet)."""
        return self.cell.gen if self.cell else -1

    def __repr__(self) -> str:
        if self.cell is None:  # started for a scale-up or a new shape, before it took a cell
            return f"relaytrain:{self.job_id}: a joining worker (pid {os.getpid()}, no cell yet)"
        c = self.cell
        return f"relaytrain:{self.job_id}:w{c.dp_rank}.{c.index}" + (f" (stage {c.pp_rank} replica {c.rep})"
                                                                     if c.replicas else "")

    # ---------------------------------------------------------------- commits

    def _settle(self, committed: int) -> None:
        """Bring the parameters to ``committed`` steps: apply the pending update if its step
        is committed, drop it otherwise (a discarded step)."""
        if self.pending is not None and self.optimizer is not None:
            if self.pending == committed - 1:
                self._update(self.pending)
                if self.norms_update is not None:  # the step's BatchNorm buffer update (None when it was skipped)
                    self.norms_update()
                self.applied = committed
            self.pending = None
        self.norms_update = None
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def _update(self, step: int) -> None:
        """The optimizer step of 0-based ``step``: skipped when its gradient norm was not
        finite (training.skip_nonfinite), else clipped and at the step's learning rate."""
        coef, skip = self.update
        if skip:
            return
        self.uploads.wait_copied()  # a checkpoint's copy of the parameters is taken first
        if coef < 1.0:
            for q in self.stage.parameters():
                if q.grad is not None:
                    q.grad.mul_(coef)
        lr = lr_at(self.spec, step + 1)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()

    def commit(self, committed: int) -> int:
        with self._lock:
            self._settle(committed)
            return self.applied

    @property
    def tp(self):
        """The stage's tensor-parallel group (actors/tensorpar.py), or None."""
        return self.wiring.tp

    def _whole(self, optim: bool = True) -> tuple[dict, dict]:
        """A tensor-parallel stage's state dict and optimizer state by name, whole on TP rank 0
        (split entries gathered there: every rank of the group calls this; the others get
        None for them).  The entries that are not gathered are the live tensors."""
        model = self.tp.full_state(dict(self.stage.state_dict()), to_first=True)
        opt = {"state": {}, "groups": None}
        if optim:
            opt = self.tp.full_optim(optimizer_state_by_name(self.optimizer, self.param_names), to_first=True)
        return model, opt

    def _state(self, layers: Optional[set[int]] = None) -> dict:
        """A copy of this stage's committed state (of ``layers``), by name.  A tensor-parallel
        rank's is its own slices of the split parameters (and of their optimizer state), with
        the whole ones: what the same rank of another shape with the same tp takes (elastic
        reshapes keep tp); checkpoints and the final model are gathered whole instead (_whole)."""
        names = self.param_names
        model = dict(self.stage.state_dict())
        opt = optimizer_state_by_name(self.optimizer, names) if self.optimizer else {"state": {}, "groups": None}
        keep = (lambda n: True) if layers is None else (lambda n: layer_of(n) in layers)
        return {"step": self.applied,
                "model": {k: clone(local(v)) for k, v in model.items() if keep(k)},
                "optim": {"state": {k: clone(local(v)) for k, v in opt["state"].items() if keep(k)},
                          "groups": opt["groups"]}}

    def export(self, layers: list[int], committed: int) -> dict:
        """Committed parameters and optimizer state of ``layers`` (for another worker)."""
        with self._lock:
            self._committed(committed)
            return self._state(set(layers))

    def snapshot(self, committed: int, keep: bool = False, layers: Optional[tuple] = None) -> Optional[dict]:
        """A copy of this stage's committed state, or None if the worker has moved on.  With
        ``keep`` the copy also stays here until a newer one is complete (``drop_copies``): if
        another stage is lost before its copy of this step lands, every stage goes back to
        the previous step, and this one's is then here.  ``layers``: only the chunk [lo, hi)."""
        lo, hi = layers or self.cell.layers
        with self._lock:
            if self.pending == committed - 1:
                self._settle(committed)
            state = self._state(set(range(lo, hi)) if layers else None) if self.applied == committed else None
        if state is not None and keep:
            self.copies.keep((lo, hi), committed, state, self.cell.tp_rank)
        return state

    # ---------------------------------------------------------------- peer copies

    def keep_copy(self, layers: tuple, state: Optional[dict], committed: int, plane: int = 0) -> int:
        """Keep ``state``, a copy of layers [lo, hi) at step ``committed`` (``plane``: the TP rank
        whose slices these are), as their off-node copy: the scheduler passes the source
        worker's ``snapshot`` call as this call's argument, so Ray moves the state to this node
        before the call runs, and it outlives the source.  Returns the step kept, or -1 when the
        source had moved on (``state`` None).

        (Not ``ray.get`` of the snapshot here: on a simulated 3-node cluster about one fetch in
        three that way waited for Ray's 1 s re-check of a blocked get (1,017-2,033 ms against
        10-40 ms), where an argument is pulled before the call: README, "Elasticity".)"""
        if state is None:
            return -1
        self.copies.keep(tuple(layers), committed, state, plane)
        return committed

    def export_copy(self, layers: list[int], committed: int, plane: int = 0) -> dict:
        """The kept copy of ``layers`` (TP rank ``plane``'s slices) at step ``committed`` (for a
        worker that takes them)."""
        return self.copies.export(layers, committed, repr(self), plane)

    def drop_copies(self, before: int) -> int:
        """Forget kept copies older than step ``before`` (a newer copy is complete)."""
        return self.copies.drop(before)

    def _committed(self, committed: int) -> None:
        """Bring the parameters to ``committed`` steps, or say why they cannot be."""
        if self.pending == committed - 1:
            self._settle(committed)
        if self.applied != committed:
            raise RuntimeError(f"{self!r} holds step {self.applied}, not the committed step {committed}")

    def save_part(self, folder: str, committed: int) -> float:
        """Start writing this stage's part of the checkpoint of step ``committed`` into
        ``folder`` (a path or a URL; service/checkpoint.py): its parameters, buffers and
        optimizer state, by name.  Buffers are copied here (a forward may change them); the
        parameters and the optimizer state are copied in the upload's thread while the next
        step computes (the next optimizer step waits for that copy), then written in the
        background.  ``part_written(committed)`` returns the part's entry.  Returns the
        seconds this call took."""
        t0 = time.perf_counter()
        with self._lock:
            self._committed(committed)
            params = {n for n, _ in self.stage.named_parameters()}
            if self.cell.tp > 1:  # gathered on TP rank 0 now, which writes the stage's part
                with talking_to_peers("gathering the stage's split state on its TP rank 0"):
                    model, optim = self._whole()
                if self.cell.tp_rank > 0:
                    return time.perf_counter() - t0
                whole = {n for n in model if n in self.tp.splits}  # new tensors; the others live: copied now
                live = {"model": {k: v if k in whole else clone(v) for k, v in model.items()},
                        "optim": {"state": {n: {k: v if n in whole else clone(v) for k, v in st.items()}
                                            for n, st in optim["state"].items()}, "groups": optim["groups"]}}
            else:
                live = {"model": {k: v if k in params else clone(v) for k, v in self.stage.state_dict().items()},
                        "optim": optimizer_state_by_name(self.optimizer, self.param_names)}
        index, count = self.cell.pp_rank, self.cell.pp
        copy = clone if self.uploads.busy() else self.uploads.copy  # reused memory unless one still runs
        self.uploads.start(committed, lambda: copy(live),
                           lambda state: checkpoint.write_part(folder, index, count, state["model"], state["optim"]))
        return time.perf_counter() - t0

    def part_written(self, committed: int) -> Optional[dict]:
        """The entry of this stage's part of step ``committed``'s checkpoint, once written (None
        on a tensor-parallel rank other than 0: rank 0 writes the stage's whole part)."""
        if self.cell.tp_rank > 0:
            return None
        return self.uploads.wait(committed)

    def write_final(self, committed: int, out: dict) -> dict:
        """Write this stage's shard of the final model (safetensors, by the whole model's
        names): into the folder ``out["dir"]``, or into the job store (``out["store"]``, as the
        artifact ``model/<shard>``).  Returns its index entry."""
        c = self.cell
        with self._lock:
            self._committed(committed)
            if c.tp > 1:
                with talking_to_peers("gathering the stage's split parameters on its TP rank 0"):
                    tensors = self._whole(optim=False)[0]
            else:
                tensors = dict(self.stage.state_dict())
        if c.tp_rank > 0:  # TP rank 0 writes the stage's whole shard
            return None
        if out.get("dir"):
            return shards.write_shard(out["dir"], c.pp_rank, c.pp, tensors)
        name = shards.shard_name(c.pp_rank, c.pp)
        data = shards.to_bytes(tensors)
        from service.store import Store  # only a job whose model goes to the store (SQLAlchemy: 0.3 s)

        Store(out["store"]).put_artifact(self.job_id, f"model/{name}", data)
        return {"file": name, "names": list(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}

    # ---------------------------------------------------------------- wiring

    def trace(self, gpu: Optional[bool]) -> tuple:
        """The model's pre-flight check and trace (actors/layerfacts.py) in this worker, which
        builds its stage from the same imports next: (kind, what, detail) as
        ``layerfacts.outcome`` gives it, and the lines the user's code printed meanwhile, which
        the scheduler logs as its own (the trace is its, as when a task ran it)."""
        from actors import layerfacts

        earlier = self.output.take()
        try:
            got = layerfacts.outcome(self.spec, self.search, gpu)
        finally:
            printed = self.output.take()
            self.output.put(earlier)
        return (*got, printed)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def ping(self) -> bool:
        return True

    def take_output(self) -> list:
        """Lines printed in this process since the last step's result (see actors/output.py)."""
        return self.output.take()

    def configure(self, cell: dict, sources: list) -> dict:
        """Take the cell ``cell`` of a (new) shape at ``cell['committed']`` steps.

        ``sources`` are object refs (or dicts) of {model, optim} state for layers this worker
        does not hold; they override anything held.  A layer with no state is built, and at
        step 0 any layer may be built from the seeded model."""
        self.uploads.wait_copied()  # a checkpoint being written has its copy before layers change
        with self._lock:
            committed = cell["committed"]
            self._settle(committed)
            incoming = self._fetch(sources)
            old = self.cell
            new = Cell.from_config(cell, self.spec.microbatches)
            if old is not None and old.tp > 1:  # split under the old group: built anew
                if (old.tp, old.tp_rank) == (new.tp, new.tp_rank) and self.applied == committed:
                    # its own slices of the layers it keeps (what arrived overrides them)
                    mine = self._state({i for lo, hi in new.ranges for i in range(lo, hi)})
                    incoming = merge_states([mine, incoming])
                self.layers, self.optimizer, self.param_names = {}, None, []
            self.cell = new
            held = [i for lo, hi in self.cell.ranges for i in range(lo, hi)]
            self.bounds = [tuple(b) for b in cell["bounds"]]
            self._split_later = None
            if self.cell.tp > 1:  # built in connect, each layer split as soon as it is built (_shard)
                if self.recipe is None:
                    self.recipe = model_recipe(self.spec, self.search)
                self._split_later = (held, committed, incoming)
                self._assemble({})
            else:
                old_optim = optimizer_state_by_name(self.optimizer, self.param_names) if self.optimizer else None
                self._assemble(self._take_layers(held, committed, {layer_of(k) for k in incoming["model"]}))
                self._load_incoming(incoming["model"])
                self._new_optimizer(old_optim, incoming["optim"])
            self.applied, self.pending = committed, None
            with self._turn:
                self._started = committed - 1
            self._build_io()
            self.inbox.reset(self.gen)
            self.runner = None
            self._aborted = None
            return {"node": self.node_id(), "pid": os.getpid(), "layers": [list(r) for r in self.cell.ranges]}

    def _assemble(self, layers: dict) -> None:
        """Hold ``layers`` (index -> module) as the stage, and each model chunk's part of it."""
        self.layers = layers
        self.stage = nn.Sequential(OrderedDict((self.recipe.names[i], layers[i]) for i in sorted(layers)))
        # each model chunk's layers (the same modules): what a virtual stage's actions run
        self.parts = {vs: nn.Sequential(OrderedDict((self.recipe.names[i], layers[i]) for i in range(lo, hi)
                                                    if i in layers))
                      for vs, (lo, hi) in zip(self.cell.chunks, self.cell.ranges)}

    def _fetch(self, sources: list) -> dict:
        import ray

        parts = []
        for src in sources:
            if isinstance(src, ray.ObjectRef):
                with talking_to_peers("fetching layers' state from another worker"):
                    src = ray.get(src, timeout=self.timeout)
            elif "checkpoint" in src:  # read straight from storage: only these layers' parts
                layers = set(src["layers"])
                src = checkpoint.load(src["checkpoint"], names=lambda n: layer_of(n) in layers)
            parts.append(src)
        return merge_states(parts) if parts else empty()

    def _take_layers(self, wanted: list[int], committed: int, covered: set[int]) -> dict[int, nn.Module]:
        """The modules of layers ``wanted``: kept if held here, else built (only these: a layer
        list builds each layer alone); a layer with state built after step 0 must have a copy
        among ``covered``."""
        if self.recipe is None:
            self.recipe = model_recipe(self.spec, self.search)
        layers = {}
        for i in wanted:
            if i in self.layers:
                if self.applied != committed and i not in covered and has_state(self.layers[i]):
                    raise RuntimeError(f"{self!r} holds layer {i} at step {self.applied}, not at the "
                                       f"committed step {committed}, and no copy was sent")
                layers[i] = self.layers[i]
        built = self.recipe.build([i for i in wanted if i not in layers])
        for i, layer in built.items():
            if i not in covered and committed > 0 and has_state(layer):
                raise RuntimeError(f"{self!r} got no copy of layer {i} at step {committed}")
            layers[i] = layer.to(self.device)
        if committed == 0:
            self.recipe.copy_tied_init(layers)  # tied copies start from the tie's first name's value
        return layers

    def _load_incoming(self, model: dict) -> None:
        if not model:
            return
        mine = self.stage.state_dict()
        extra = {}  # a module's get_extra_state (any object): given back through load_state_dict
        with torch.no_grad():
            for k, v in model.items():
                if k not in mine:
                    continue
                if not isinstance(mine[k], torch.Tensor) or not isinstance(v, torch.Tensor):
                    extra[k] = v
                    continue
                if v.shape != mine[k].shape:  # copy_ would broadcast some shapes without a word
                    raise ValueError(f"the state that arrived for {k} has shape {list(v.shape)} and the model's "
                                     f"{k} has {list(mine[k].shape)}: a checkpoint of another model?")
                mine[k].copy_(v.to(self.device))
        if extra:
            self.stage.load_state_dict(extra, strict=False)

    def _new_optimizer(self, old: Optional[dict], incoming: dict) -> None:
        """An optimizer over the stage's parameters, with the state of the layers kept here
        (``old``) overridden by what arrived."""
        self.param_names = [n for n, _ in self.stage.named_parameters()]
        self.optimizer = build_optimizer(self.spec, self.stage.parameters())
        state = dict((old or {}).get("state", {}))
        state.update(incoming["state"])
        groups = incoming["groups"] or (old or {}).get("groups")
        if groups and any(n in state for n in self.param_names):
            load_optimizer_state(self.optimizer, self.param_names, {"state": state, "groups": groups})

    def _build_io(self) -> None:
        """The first stage reads inputs and the last targets and computes the loss."""
        c = self.cell
        if (c.first or c.last) and self.samples is None:
            self.samples = build_data(self.spec, self.search)
        if c.last and self.loss_fn is None:
            self.loss_fn = build_loss(self.spec, self.search)

    def rendezvous_address(self) -> tuple[str, int]:
        return rendezvous_address()

    def connect(self, transport: str, row: tuple, rdzv: Optional[tuple], world: int) -> bool:
        """Join the shape's process group (when one is needed) and set up the transport;
        ``row``: the actors of every stage of this worker's replica."""
        c = self.cell
        self.wiring.connect(c, self.stage, self.device, transport, row, rdzv, world, inbox=self.inbox,
                            timeout=self.timeout, node=self.node_id(), tag=f"{self.job_id}-g{self.gen}-s{c.pp_rank}",
                            shard=self._shard)
        t = self.spec.training
        recipe = Recipe(bf16=t.precision == "bf16", checkpointing=t.activation_checkpointing,
                        global_norm=needs_global_norm(self.spec), device=self.device, seed=t.seed,
                        batch_norm=t.batch_norm)
        copies = {n for group in self.recipe.tied for n in group[1:]}  # a tie counts once: its first name
        # a TP group's ranks each count their slices of split parameters, the others once (rank 0)
        norm_params = [q for n, q in self.stage.named_parameters()
                       if n not in copies and (c.tp_rank == 0 or not self.tp.replicated(n))]
        # the worker holding each layer, as the transport names it: its stage, or with replicated
        # stages its slot (a tie's stages have one worker each: replica 0's)
        holder = {i: c.peer(vs, c.mb0) for vs, (lo, hi) in enumerate(self.bounds) for i in range(lo, hi)}
        ties = TiedGrads(self.recipe.tied, self.stage, holder, c.index)
        if c.replicas and any(len(h.stages) > 1 and any(c.replicas[stage_of(c.replicas, w)[0]] > 1 for w in h.stages)
                              for h in ties.held):
            raise ValueError(
                "the model ties parameters across pipeline stages (e.g. a token embedding and the output head) and "
                f"a stage holding them is replicated (parallelism.replicas {list(c.replicas)}): relaytrain does not "
                "sum a tie's gradients between replicated stages yet; give those stages 1 replica, or cut the "
                "model so that the tied layers share a stage")
        self.runner = StepRunner(c, self.stage, self.wiring.transport, self.wiring.buckets, self.loss_fn,
                                 self.mbs / self.B, ties,
                                 recipe, norm_params, parts=self.parts, stats_group=self.wiring.stage_group,
                                 tp=self.tp)
        return True

    def _shard(self, tp) -> nn.Module:
        """Build the stage's layers split over its tensor-parallel group (actors/tensorpar.py):
        one layer at a time, its whole state loaded, then split, so a rank never holds more
        than its slices and one whole layer; the optimizer's state is split with them.
        Returns the stage."""
        if self._split_later is None:
            raise RuntimeError(f"{self!r}: its layers are split already (a new group needs a new configure)")
        held, committed, incoming = self._split_later
        self._split_later = None
        covered = {layer_of(k) for k in incoming["model"]}
        model = incoming["model"]
        layers = {}
        for i in held:
            layers[i] = self._take_layers([i], committed, covered)[i]
            one = nn.Sequential(OrderedDict([(self.recipe.names[i], layers[i])]))
            mine = one.state_dict()
            slices = {}  # this rank's slices (from a copy of the same rank of an earlier shape)
            with torch.no_grad():
                for k in [k for k in model if k in mine]:
                    v = model.pop(k)
                    if v.shape == mine[k].shape:
                        mine[k].copy_(v.to(self.device))  # each whole tensor goes once copied
                    else:
                        slices[k] = v
            tp.shard(one)
            if slices:
                mine = one.state_dict()
                with torch.no_grad():
                    for k, v in slices.items():
                        part = local(mine[k])
                        if part.shape != v.shape:
                            raise RuntimeError(f"{self!r}: the state of {k} that arrived has shape {tuple(v.shape)}, "
                                               f"neither the whole {tuple(mine[k].shape)} nor this TP rank's "
                                               f"{tuple(part.shape)}")
                        part.copy_(v.to(self.device))
        self._assemble(layers)
        self.param_names = [n for n, _ in self.stage.named_parameters()]
        self.optimizer = build_optimizer(self.spec, self.stage.parameters())
        if incoming["optim"]["state"]:
            load_optimizer_state(self.optimizer, self.param_names,
                                 tp.local_optim(incoming["optim"], dict(self.stage.named_parameters())))
        incoming["optim"]["state"] = {}
        gc.collect()
        return self.stage

    def _leave_group(self) -> None:
        self.wiring.leave()

    def deliver(self, gen: int, step: int, kind: str, mb: int, shape: tuple, *parts) -> None:
        self.inbox.put(gen, (step, kind, mb), (shape, parts))

    def abort(self, gen: int, reason: str = "the step was discarded: a peer was lost") -> bool:
        """Wake this worker's step from any wait on its peers (another thread calls this)."""
        if gen == self.gen:
            self._aborted = gen
            self.inbox.close(reason)
            self.wiring.group.abort()  # a step blocked in gloo fails at once, and so do its peers
            if self._compute.busy():
                threading.Thread(target=self._give_up_if_parked, args=(gen, time.monotonic()), daemon=True,
                                 name="relaytrain-abort-watch").start()
        return True

    def _give_up_if_parked(self, gen: int, aborted: float) -> None:
        """A step still parked in a wait on its peers ``PARKED_S`` after the abort shut the
        group's sockets is in one that gloo does not end (actors/failures.py): it is given up
        on, so the scheduler hears of this worker at once and finds it alive, with its committed
        state, rather than counting it stuck after 10 s and stopping it.  The step thread's
        later wake-up (at the group's timeout) touches nothing."""
        why = StageAborted(f"the step was discarded; it still waited on its peers {PARKED_S:.1f} s after the abort "
                           f"(a wait gloo does not end): given up on")
        # given up on, its groups are kept when left, not destroyed under the old thread's wait
        if self._compute.give_up_if_parked(aborted, PARKED_S, ABORT_WATCH_S, why, still=lambda: self.gen == gen,
                                           first=self.wiring.group.strand):
            print(f"relaytrain: {self!r}: the aborted step still waited on its peers {time.monotonic() - aborted:.1f} s "
                  f"after the abort: given up on; a new step thread takes the next steps", file=sys.stderr, flush=True)

    # ---------------------------------------------------------------- one step

    def _my_batch(self, step: int):
        c, t = self.cell, self.spec.training
        idx = step_indices(step, len(self.samples), self.B, t.seed, t.shuffle)
        idx = idx[c.mb0 * self.mbs:(c.mb0 + c.m) * self.mbs]
        return microbatches(self.samples, idx, self.mbs, c.first, c.last, self.device)

    def _counted(self, step: int, ys: list) -> Optional[int]:
        """The step's counted targets over the whole global batch (every replica's), when the
        loss is their mean (service/loading.py ``counted_targets``): from this worker's own
        microbatches when they are the whole batch (dp 1), else read from the data."""
        if self.cell.m * self.mbs == self.B:
            return counted_targets(self.spec, torch.cat([y.reshape(-1) for y in ys]))
        t = self.spec.training
        return self._counted_in(self.samples, step_indices(step, len(self.samples), self.B, t.seed, t.shuffle))

    def _counted_in(self, samples, idx: torch.Tensor) -> Optional[int]:
        """``counted_targets`` of samples ``idx``, read from the data only for the loss that uses it."""
        return counted_targets(self.spec, samples.targets(idx)) if self.spec.loss == "cross_entropy" else None

    def run_step(self, step: int, split: Optional[str] = None) -> dict:
        """Run this worker's actions for ``step`` (0-based; steps before it are committed),
        all-reduce the gradients, and leave the update pending until step is committed.
        ``split``: the scheduler's choice after a trial of the backward's two splits
        (actors/stage.py ``StepRunner.run``).

        The call for a step may come while the step before still runs (a fixed-shape job's
        scheduler sends it early, actors/controller.py ``_may_queue``): its coming is that
        step's commit, and it queues on the step thread right behind it, which takes it up the
        moment that step ends (no wake-up of this call's thread in between)."""
        called = time.time()
        with self._turn:
            deadline = time.monotonic() + self.timeout
            while self._started < step - 1:  # the step before has not begun
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self!r} waited {self.timeout:.0f} s to run step {step + 1}: step "
                                       f"{step} did not begin here")
                self._turn.wait(0.5)
            # queued in the order the calls came: each step right behind the one before
            batch: Future = Future()
            done = self._compute.submit(self._run_step, step, called, batch, split)
            self._started = step
            self._turn.notify_all()
        # the step's microbatches are built here, on this call's thread, while the step before
        # may still run on the step thread: off the path between two steps (the first worker's
        # next forward waits for nothing but the update)
        c = self.cell
        try:
            batch.set_result(self._my_batch(step) if (c.first or c.last) else (None, None))
        except BaseException as e:  # raised by the step, as if it had been built there
            batch.set_exception(e)
        return done.result()

    def _run_step(self, step: int, called: float, batch: Future, split: Optional[str] = None) -> dict:
        with self._lock:
            self._settle(step)
            if self.applied != step:
                raise RuntimeError(f"{self!r} is at step {self.applied} but was asked to run step {step + 1}")
        settled = time.time()  # the previous step's update applied
        try:
            self.inbox.drop_before(step)
            xs, ys = batch.result()
            CollectiveBytes.take_failure()
            if self.tp is not None:
                CollectiveBytes.take()
            counted = self._counted(step, ys) if self.cell.last else None
            result = self.runner.run(step, xs, ys, aborted=lambda: self._aborted is not None, counted=counted,
                                     split=split)
            if self.tp is not None:  # what the layers' collectives moved this step (this rank's payload)
                result["tp_bytes"], result["tp_collectives"] = CollectiveBytes.take()
            self.update = step_update(self.spec, result["grad_norm"])
            result["skipped"] = self.update[1]
            self.norms_update = self.runner.take_norm_update()
            if result["skipped"]:  # changes nothing: BatchNorm's running statistics neither (they became NaN)
                self.norms_update = None
            self.pending = step
            return dict(result, called=called, settled=settled, output=self.output.take())
        except BaseException as e:
            if failures.abandoned():  # given up on: the worker has moved on without this thread
                raise
            self.pending = None
            lost = self._as_peer_loss(e)
            # peers may wait on us: close our side of the group so they fail fast too
            self._leave_group()
            if lost is not None:
                raise lost from e
            raise

    def _as_peer_loss(self, e: BaseException) -> Optional[PeerLost]:
        """``e`` as a lost peer when it is one though it came out of the user's layers: a
        tensor-parallel collective inside them failed (its peer's connection closed), or the
        step was discarded (the abort closes the connections under whatever ran)."""
        failed = CollectiveBytes.take_failure()
        if isinstance(e, PeerLost) or not isinstance(e, Exception) or (failed is None and not self._aborted):
            return None
        why = "the step was discarded" if self._aborted else "a tensor-parallel collective inside the layers failed"
        return PeerLost(f"{why}: {type(e).__name__}: {e}")

    def run_eval(self, committed: int) -> dict:
        """The evaluation (spec ``eval``) with the parameters of ``committed`` steps: this
        worker's forwards of every evaluation batch; the last stage's sum of batch-mean shares."""
        return self._compute.run(self._run_eval, committed)

    def _run_eval(self, committed: int) -> dict:
        with self._lock:
            self._settle(committed)
            if self.applied != committed:
                raise RuntimeError(f"{self!r} is at step {self.applied} but was asked to evaluate step {committed}")
        try:
            CollectiveBytes.take_failure()
            xs, ys = self._eval_batches()
            counted = ([self._counted_in(self.eval_samples, torch.arange(b * self.B, (b + 1) * self.B))
                        for b in range(self.spec.eval.batches)] if self.cell.last else None)
            result = self.runner.evaluate(committed, xs, ys, self.spec.eval.batches,
                                          aborted=lambda: self._aborted is not None, counted=counted)
            return dict(result, output=self.output.take())
        except BaseException as e:
            if failures.abandoned():  # given up on: the worker has moved on without this thread
                raise
            lost = self._as_peer_loss(e)
            self._leave_group()  # peers may wait on us: they fail fast too
            if lost is not None:
                raise lost from e
            raise

    def _eval_batches(self):
        """This replica's microbatches of each evaluation batch (the first eval.batches x B
        samples of eval.data, in order): inputs on the first stage, targets on the last."""
        c, m = self.cell, self.cell.m
        if not (c.first or c.last):
            return None, None
        if self.eval_samples is None:
            self.eval_samples = build_data(self.spec.model_copy(update={"data": self.spec.eval.data}), self.search)
        starts = [b * self.B + c.mb0 * self.mbs for b in range(self.spec.eval.batches)]
        got = [microbatches(self.eval_samples, torch.arange(lo, lo + m * self.mbs), self.mbs, c.first, c.last,
                            self.device) for lo in starts]
        return [x for x, _ in got], [y for _, y in got]

    def shutdown(self) -> None:
        self.inbox.close("the job is stopping")
        self._leave_group()
