"""StageWorker: one (dp_rank, pp_rank) cell of a job.

It holds its stage's layers and optimizer state, builds its own microbatches from the
deterministic sample order, and runs a whole step's action list in one call
(``run_step``): forwards and backwards in the schedule's order, activations and their
gradients through the transport, and the gradient sum among the replicas of its stage:
through shared memory when they share a node (CPU), else a gloo/NCCL all-reduce in buckets
the gradients accumulate into (launched during the last backward on a GPU, as DDP does;
right after it on a CPU).  A stage's last backward of the step computes and sends the
gradient of its input before its weight gradients, so the stage before it, which waits for
that gradient to run the step's final backward, starts sooner: the pipeline drains earlier.

Steps are two-phase.  ``run_step(s)`` leaves step s's summed gradients *pending*; the
optimizer applies them only once the scheduler has seen every worker finish step s, which
it says by sending ``run_step(s + 1)`` (or ``commit``, ``export``, ``configure`` with
``committed = s + 1``).  A step interrupted by a failure is therefore discarded on every
worker: its pending gradients are dropped and the parameters stay at the last committed
step.  ``configure`` gives a live worker a new cell (another stage, another replica, another
shape) without restarting it: layers it already holds stay in memory, the others arrive
from a surviving replica or an off-node copy through the object store.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from collections import OrderedDict
from typing import Any, Optional

import torch
from torch import nn

try:  # torch's split backward (input gradient first, weight gradients after), as its zero-bubble schedules use
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
except ImportError:  # another torch: every backward stays whole
    stage_backward_input = stage_backward_weight = None

from actors.collectives import GradBuckets, Group, SharedMemorySum
from actors.output import OutputTap
from actors.transport import CollectiveTransport, Inbox, ObjectStoreTransport
from service import schedules
from service.loading import build_data, build_loss, build_model, build_optimizer
from service.sampling import step_indices
from service.spec import JobSpec


# Gradient buckets of the data-parallel all-reduce (see actors/collectives.GradBuckets).
BUCKET_BYTES = int(float(os.environ.get("RELAYTRAIN_BUCKET_MB", "8")) * 2**20)
# Launch buckets during the last backward (as DDP) or after it.  Overlap pays where the
# all-reduce has its own engine (NCCL on a GPU); a CPU worker's compute threads already use
# its cores, and gloo's reduction then only competes with backward for them (measured on 2
# cores: slower, see README "Against the peers").  RELAYTRAIN_OVERLAP_ALLREDUCE=1/0 forces it.
_OVERLAP = os.environ.get("RELAYTRAIN_OVERLAP_ALLREDUCE")
# Replicas of a stage on one node sum through shared memory (actors/collectives.SharedMemorySum);
# RELAYTRAIN_SHM_ALLREDUCE=0 makes them use gloo like replicas on different nodes.
_SHM = os.environ.get("RELAYTRAIN_SHM_ALLREDUCE", "1") == "1"


def optimizer_state_by_name(opt: torch.optim.Optimizer, names: list[str]) -> dict:
    """The optimizer's state keyed by parameter name, so any partition can load it."""
    sd = opt.state_dict()
    return {"state": {names[i]: v for i, v in sd["state"].items() if i < len(names)},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]}


def load_optimizer_state(opt: torch.optim.Optimizer, names: list[str], saved: dict) -> None:
    state = {i: saved["state"][n] for i, n in enumerate(names) if n in saved["state"]}
    group = dict(saved["groups"][0], params=list(range(len(opt.param_groups[0]["params"]))))
    opt.load_state_dict({"state": state, "param_groups": [group]})


def _clone(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu", copy=True)
    if isinstance(v, dict):
        return {k: _clone(x) for k, x in v.items()}
    return v


def layer_of(name: str) -> int:
    """The layer index of a state key of the whole model ('3.0.weight' -> 3)."""
    return int(name.split(".", 1)[0])


def has_state(layer: nn.Module) -> bool:
    """Does ``layer`` carry state that must move with it (parameters or persistent buffers)?
    A layer without any (an activation, a reshape, a dropout) is complete once it is built,
    at any step; non-persistent buffers are made again by its constructor."""
    return bool(layer.state_dict())


class StageAborted(RuntimeError):
    """The scheduler discarded the step this worker was running (a peer was lost)."""


class StageWorker:
    def __init__(self, job_id: str, spec: dict, search: list[str], timeout: float = 300.0):
        self.output = OutputTap.install()  # what user code prints goes to the job's log too
        self.job_id = job_id
        self.spec = JobSpec.model_validate(spec)
        self.search = [os.getcwd(), *search]
        self.timeout = timeout
        torch.set_num_threads(max(1, int(self.spec.resources.cpus_per_worker)))
        gpus = self.spec.resources.gpus_per_worker or 0
        self.device = torch.device("cuda") if gpus > 0 and torch.cuda.is_available() else torch.device("cpu")
        t = self.spec.training
        self.mbs, self.B = t.microbatch_size, t.global_batch_size
        self.dp_rank = self.pp_rank = None
        self.dp = self.pp = 0
        self.layers: dict[int, nn.Module] = {}   # layer index of the whole model -> module held here
        self.stage = nn.Sequential()
        self.param_names: list[str] = []
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.applied = 0                 # committed steps whose updates are in the parameters
        self.pending: Optional[int] = None  # 0-based step whose summed gradients wait for its commit
        self.gen = -1                    # the scheduler's configuration generation
        self.samples = None
        self.loss_fn = None
        self.actions: list = []
        self.inbox = Inbox()
        self.transport = None
        self.stage_group = None
        self.buckets = None               # the stage's gradient sum (dp > 1): SharedMemorySum or GradBuckets
        self.group = Group()
        self._lock = threading.RLock()   # commits, state copies and reconfiguration
        self._child_names: Optional[list[str]] = None
        self._aborted: Optional[int] = None

    def __repr__(self) -> str:
        if self.dp_rank is None:  # started for a scale-up or a new shape, before it took a cell
            return f"relaytrain:{self.job_id}: a joining worker (pid {os.getpid()}, no cell yet)"
        return f"relaytrain:{self.job_id}:w{self.dp_rank}.{self.pp_rank}"

    # ---------------------------------------------------------------- commits

    def _settle(self, committed: int) -> None:
        """Bring the parameters to ``committed`` steps: apply the pending update if its step
        is committed, drop it otherwise (a discarded step)."""
        if self.pending is not None and self.optimizer is not None:
            if self.pending == committed - 1:
                self.optimizer.step()
                self.applied = committed
            self.pending = None
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def commit(self, committed: int) -> int:
        with self._lock:
            self._settle(committed)
            return self.applied

    def _state(self, layers: Optional[set[int]] = None) -> dict:
        names = self.param_names
        opt = optimizer_state_by_name(self.optimizer, names) if self.optimizer else {"state": {}, "groups": None}
        keep = (lambda n: True) if layers is None else (lambda n: layer_of(n) in layers)
        return {"step": self.applied,
                "model": {k: _clone(v) for k, v in self.stage.state_dict().items() if keep(k)},
                "optim": {"state": {k: _clone(v) for k, v in opt["state"].items() if keep(k)},
                          "groups": opt["groups"]}}

    def export(self, layers: list[int], committed: int) -> dict:
        """Committed parameters and optimizer state of ``layers`` (for another worker)."""
        with self._lock:
            if self.pending == committed - 1:
                self._settle(committed)
            if self.applied != committed:
                raise RuntimeError(f"{self!r} holds step {self.applied}, not the committed step {committed}")
            return self._state(set(layers))

    def snapshot(self, committed: int) -> Optional[dict]:
        """A copy of this stage's committed state, or None if the worker has moved on."""
        with self._lock:
            if self.pending == committed - 1:
                self._settle(committed)
            return self._state() if self.applied == committed else None

    def get_state(self, committed: Optional[int] = None) -> dict:
        with self._lock:
            if committed is not None:
                self._settle(committed)
            return self._state()

    def load_state(self, state: dict) -> bool:
        with self._lock:
            own = self.stage.state_dict()
            self.stage.load_state_dict({k: state["model"][k] for k in own})
            if state.get("optim") and state["optim"].get("groups"):
                load_optimizer_state(self.optimizer, self.param_names, state["optim"])
            self.applied = int(state.get("step", self.applied))
            self.pending = None
            return True

    # ---------------------------------------------------------------- wiring

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
        does not hold; they override anything held.  At step 0 a layer may also be built
        from the seeded model."""
        import ray

        with self._lock:
            committed = cell["committed"]
            self._settle(committed)
            incoming: dict = {"model": {}, "optim": {"state": {}, "groups": None}}
            for src in sources:
                part = ray.get(src, timeout=self.timeout) if isinstance(src, ray.ObjectRef) else src
                incoming["model"].update(part["model"])
                incoming["optim"]["state"].update(part["optim"]["state"])
                incoming["optim"]["groups"] = incoming["optim"]["groups"] or part["optim"]["groups"]
            dp, pp, r, s = cell["dp"], cell["pp"], cell["dp_rank"], cell["pp_rank"]
            lo, hi = cell["bounds"][s]
            old_optim = optimizer_state_by_name(self.optimizer, self.param_names) if self.optimizer else None
            covered = {layer_of(k) for k in incoming["model"]}
            full = None
            layers = {}
            for i in range(lo, hi):
                if i in self.layers:
                    if self.applied != committed and i not in covered and has_state(self.layers[i]):
                        raise RuntimeError(f"{self!r} holds layer {i} at step {self.applied}, not at the "
                                           f"committed step {committed}, and no copy was sent")
                    layers[i] = self.layers[i]
                    continue
                if full is None:
                    full = self._build_model()
                if i not in covered and committed > 0 and has_state(full[i]):
                    raise RuntimeError(f"{self!r} got no copy of layer {i} at step {committed}")
                layers[i] = full[i].to(self.device)
            if self._child_names is None:
                self._build_model()
            self.layers = layers
            self.stage = nn.Sequential(OrderedDict((self._child_names[i], layers[i]) for i in range(lo, hi)))
            if incoming["model"]:
                mine = self.stage.state_dict()
                with torch.no_grad():
                    for k, v in incoming["model"].items():
                        if k in mine:
                            mine[k].copy_(v.to(self.device))
            self.param_names = [n for n, _ in self.stage.named_parameters()]
            self.optimizer = build_optimizer(self.spec, self.stage.parameters())
            state = dict((old_optim or {}).get("state", {}))
            state.update(incoming["optim"]["state"])
            groups = incoming["optim"]["groups"] or (old_optim or {}).get("groups")
            if groups and any(n in state for n in self.param_names):
                load_optimizer_state(self.optimizer, self.param_names, {"state": state, "groups": groups})
            self.applied, self.pending = committed, None
            self.dp_rank, self.pp_rank, self.dp, self.pp = r, s, dp, pp
            self.first, self.last = s == 0, s == pp - 1
            if (self.first or self.last) and self.samples is None:
                self.samples = build_data(self.spec, self.search)
            if self.last and self.loss_fn is None:
                self.loss_fn = build_loss(self.spec, self.search)
            m = self.spec.microbatches // dp
            self.mb0 = r * m
            self.actions = schedules.build(cell["schedule"], pp, m).order[s]
            self.last_backward = [a for a in self.actions if a.kind == "B"][-1]
            boundary = cell["boundary"]
            self.in_meta = tuple(boundary[s - 1]) if s > 0 else None
            self.out_meta = tuple(boundary[s]) if s < pp - 1 else None
            if self.in_meta:
                self.in_meta = (tuple(self.in_meta[0]), self.in_meta[1])
            if self.out_meta:
                self.out_meta = (tuple(self.out_meta[0]), self.out_meta[1])
            # the step's receives, in the order the actions take them (the transport posts them ahead)
            self.receives = [("act", self.mb0 + a.mb, self.in_meta) if a.kind == "F" else
                             ("grad", self.mb0 + a.mb, self.out_meta) for a in self.actions
                             if (a.kind == "F" and not self.first) or (a.kind == "B" and not self.last)]
            self.gen = cell["gen"]
            self.inbox.reset(self.gen)
            self.transport = None
            self._aborted = None
            return {"node": self.node_id(), "pid": os.getpid(), "layers": [lo, hi]}

    def _build_model(self) -> nn.Sequential:
        full = build_model(self.spec, self.search)
        self._child_names = [n for n, _ in full.named_children()]
        return full

    def rendezvous_address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def connect(self, transport: str, neighbours: tuple, rdzv: Optional[tuple], world: int) -> bool:
        """Join the shape's process group (when one is needed) and set up the transport."""
        rank = self.dp_rank * self.pp + self.pp_rank
        self._leave_group()
        if rdzv is not None:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            self.group.init(backend, rdzv[0], rdzv[1], rank, world, self.timeout)
            if self.dp > 1:
                for s in range(self.pp):  # every rank creates every group, in the same order
                    g = self.group.new_group([r * self.pp + s for r in range(self.dp)])
                    if s == self.pp_rank:
                        self.stage_group = g
                params = list(self.stage.parameters())
                self.buckets = (SharedMemorySum.create(params, self.stage_group, self.dp_rank, self.dp, self.node_id(),
                                                       f"{self.job_id}-g{self.gen}-s{self.pp_rank}")
                                if _SHM else None)
                if self.buckets is None:  # replicas on several nodes (or GPUs): gloo / NCCL
                    overlap = self.device.type == "cuda" if _OVERLAP is None else _OVERLAP == "1"
                    self.buckets = GradBuckets(params, self.stage_group, BUCKET_BYTES, overlap)
        if transport == "collective":
            self.transport = CollectiveTransport(None if self.first else rank - 1,
                                                 None if self.last else rank + 1, self.device)
        else:
            prev_actor, next_actor = neighbours
            self.transport = ObjectStoreTransport(self.inbox, prev_actor, next_actor, self.device, self.timeout,
                                                  self.gen)
        return True

    def _leave_group(self) -> None:
        self.stage_group = None
        if self.buckets is not None:
            self.buckets.close()
            self.buckets = None
        if self.transport is not None:
            self.transport.drop()  # pending sends and posted receives hold the old group
        self.group.leave()

    def deliver(self, gen: int, step: int, kind: str, mb: int, shape: tuple, *parts) -> None:
        self.inbox.put(gen, (step, kind, mb), (shape, parts))

    def abort(self, gen: int, reason: str = "the step was discarded: a peer was lost") -> bool:
        """Wake this worker's step from any wait on its peers (another thread calls this)."""
        if gen == self.gen:
            self._aborted = gen
            self.inbox.close(reason)
            self.group.abort()  # a step blocked in gloo fails at once, and so do its peers
        return True

    # ---------------------------------------------------------------- one step

    def _my_batch(self, step: int):
        n = len(self.samples)
        idx = step_indices(step, n, self.B, self.spec.training.seed, self.spec.training.shuffle)
        m = len(self.actions) // 2
        idx = idx[self.mb0 * self.mbs:(self.mb0 + m) * self.mbs]
        x, y = self.samples.batch(idx)
        xs = list(x.to(self.device).split(self.mbs)) if self.first else None
        ys = list(y.to(self.device).split(self.mbs)) if self.last else None
        return xs, ys

    def run_step(self, step: int) -> dict:
        """Run this worker's actions for ``step`` (0-based; steps before it are committed),
        all-reduce the gradients, and leave the update pending until step is committed."""
        called = time.time()
        with self._lock:
            self._settle(step)
            if self.applied != step:
                raise RuntimeError(f"{self!r} is at step {self.applied} but was asked to run step {step + 1}")
        try:
            return dict(self._run_step(step), called=called, output=self.output.take())
        except BaseException:
            self.pending = None
            # peers may wait on us: close our side of the group so they fail fast too
            self._leave_group()
            raise

    def _run_step(self, step: int) -> dict:
        settled = time.time()  # the previous step's update applied
        self.inbox.drop_before(step)
        xs, ys = self._my_batch(step) if (self.first or self.last) else (None, None)
        scale = self.mbs / self.B
        stash: dict[int, tuple] = {}
        loss_sum = torch.zeros((), dtype=torch.float64)
        busy = 0.0
        live = peak = 0
        timeline = []
        tr = self.transport
        tr.begin_step(step, self.receives)
        reduce = self.buckets  # None without replicas
        if reduce is not None:
            reduce.attach()  # this step's gradients accumulate in the all-reduce's buffers
        t_begin = time.time()
        for a in self.actions:
            g = self.mb0 + a.mb
            if a.kind == "F":
                if self.first:
                    inp = xs[a.mb]
                else:
                    inp = tr.recv(step, "act", g, self.in_meta)
                    if inp.is_floating_point():
                        inp.requires_grad_()
                t0 = time.time()
                out = self.stage(inp)
                if self.last:
                    out = self.loss_fn(out, ys[a.mb]) * scale
                    loss_sum += out.detach().double().cpu()
                t1 = time.time()
                stash[a.mb] = (inp, out)
                if not self.last:
                    if tr.name == "collective" and (tuple(out.shape), out.dtype) != self.out_meta:
                        raise ValueError(
                            f"stage {self.pp_rank} (layers {min(self.layers)}-{max(self.layers)}) produced an "
                            f"activation of shape {tuple(out.shape)} {out.dtype} for microbatch {g}, but the "
                            f"pipeline was set up for {self.out_meta[0]} {self.out_meta[1]} (the shape of the "
                            "first microbatch): transport 'collective' needs every microbatch's activation to keep "
                            "one shape; set parallelism.transport: object_store for activations whose shape varies")
                    tr.send(step, "act", g, out)
                live += 1
                peak = max(peak, live)
            else:
                inp, out = stash.pop(a.mb)
                grad = None if self.last else tr.recv(step, "grad", g, self.out_meta)
                t0 = time.time()
                if reduce is not None and a == self.last_backward:
                    reduce.arm()  # the gradients become final in this backward: all-reduce as they do
                split = (a == self.last_backward and not self.first and inp.requires_grad and out.requires_grad
                         and stage_backward_input is not None and not getattr(reduce, "overlap", False))
                if split:
                    # the previous stage's last backward waits for this input gradient: send it
                    # before computing the weight gradients, so the pipeline drains sooner
                    _, groups = stage_backward_input([out], None if grad is None else [grad], [inp],
                                                     self.stage.parameters())
                    tr.send(step, "grad", g, inp.grad)
                    stage_backward_weight(self.stage.parameters(), groups)
                elif out.requires_grad:
                    torch.autograd.backward(out, grad)
                t1 = time.time()
                live -= 1
                if not split and not self.first and inp.requires_grad:
                    tr.send(step, "grad", g, inp.grad)
            busy += t1 - t0
            timeline.append((f"{a.stage}{a.kind}{g}", t0, t1))  # global microbatch id
        tr.finish_step()
        t_pipe = time.time()
        if reduce is not None:
            reduce.finish()
        if self._aborted is not None:
            raise StageAborted(f"{self!r}: step {step + 1} was discarded")
        self.pending = step
        t_end = time.time()
        return {"dp_rank": self.dp_rank, "pp_rank": self.pp_rank, "loss": float(loss_sum) if self.last else None,
                "busy": busy, "start": timeline[0][1] if timeline else t_begin, "pipe_end": t_pipe,
                "end": t_end, "peak_live": peak, "allreduce_s": t_end - t_pipe, "settled": settled,
                "timeline": timeline}

    def shutdown(self) -> None:
        self.inbox.close("the job is stopping")
        self._leave_group()
