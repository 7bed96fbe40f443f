"""StageWorker: one (dp_rank, pp_rank) cell of a job.

It holds its stage's layers and optimizer state, builds its own microbatches from the
deterministic sample order, and runs a whole step's action list in one call
(``run_step``): forwards and backwards in the schedule's order, activations and their
gradients through the transport, then the gradient all-reduce among the replicas of
its stage, then the optimizer update.
"""
from __future__ import annotations

import os
import socket
import time
from collections import OrderedDict
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from actors.transport import CollectiveTransport, Inbox, ObjectStoreTransport
from service import schedules
from service.loading import build_loss, build_model, build_optimizer, build_data
from service.sampling import step_indices
from service.spec import JobSpec


def optimizer_state_by_name(opt: torch.optim.Optimizer, names: list[str]) -> dict:
    """The optimizer's state keyed by parameter name, so any partition can load it."""
    sd = opt.state_dict()
    return {"state": {names[i]: v for i, v in sd["state"].items() if i < len(names)},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]}


def load_optimizer_state(opt: torch.optim.Optimizer, names: list[str], saved: dict) -> None:
    state = {i: saved["state"][n] for i, n in enumerate(names) if n in saved["state"]}
    group = dict(saved["groups"][0], params=list(range(len(opt.param_groups[0]["params"]))))
    opt.load_state_dict({"state": state, "param_groups": [group]})


class StageWorker:
    def __init__(self, job_id: str, spec: dict, dp_rank: int, pp_rank: int, dp: int, pp: int,
                 bounds: list[tuple[int, int]], boundary: list[tuple], search: list[str],
                 schedule: str, timeout: float = 300.0):
        self.job_id, self.dp_rank, self.pp_rank, self.dp, self.pp = job_id, dp_rank, pp_rank, dp, pp
        self.spec = JobSpec.model_validate(spec)
        self.timeout = timeout
        threads = max(1, int(self.spec.resources.cpus_per_worker))
        torch.set_num_threads(threads)
        gpus = self.spec.resources.gpus_per_worker or 0
        self.device = torch.device("cuda") if gpus > 0 and torch.cuda.is_available() else torch.device("cpu")
        search = [os.getcwd(), *search]
        model = build_model(self.spec, search)
        lo, hi = bounds[pp_rank]
        children = list(model.named_children())[lo:hi]
        self.stage = nn.Sequential(OrderedDict(children)).to(self.device)
        del model
        self.param_names = [n for n, _ in self.stage.named_parameters()]
        self.optimizer = build_optimizer(self.spec, self.stage.parameters())
        self.first, self.last = pp_rank == 0, pp_rank == pp - 1
        self.samples = build_data(self.spec, search) if (self.first or self.last) else None
        self.loss_fn = build_loss(self.spec, search) if self.last else None
        t = self.spec.training
        self.mbs, self.B = t.microbatch_size, t.global_batch_size
        m = self.spec.microbatches // dp
        self.mb0 = dp_rank * m
        self.actions = schedules.build(schedule, pp, m).order[pp_rank]
        # (shape, dtype) of the activation entering this stage and of the one leaving it
        self.in_meta = boundary[pp_rank - 1] if pp_rank > 0 else None
        self.out_meta = boundary[pp_rank] if pp_rank < pp - 1 else None
        self.inbox = Inbox()
        self.transport = None
        self.stage_group = None

    def __repr__(self) -> str:
        return f"relaytrain:{self.job_id}:w{self.dp_rank}.{self.pp_rank}"

    # ---------------------------------------------------------------- wiring

    def rendezvous_address(self) -> tuple[str, int]:
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def connect(self, transport: str, neighbours: tuple, rdzv: Optional[tuple], world: int) -> bool:
        """Join the job's process group (when one is needed) and set up the transport."""
        rank = self.dp_rank * self.pp + self.pp_rank
        if rdzv is not None:
            if dist.is_initialized():
                dist.destroy_process_group()
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{rdzv[0]}:{rdzv[1]}", world_size=world,
                                    rank=rank, timeout=timedelta(seconds=self.timeout))
            if self.dp > 1:
                for s in range(self.pp):  # every rank creates every group, in the same order
                    g = dist.new_group([r * self.pp + s for r in range(self.dp)])
                    if s == self.pp_rank:
                        self.stage_group = g
        if transport == "collective":
            self.transport = CollectiveTransport(None if self.first else rank - 1,
                                                 None if self.last else rank + 1, self.device)
        else:
            prev_actor, next_actor = neighbours
            self.transport = ObjectStoreTransport(self.inbox, prev_actor, next_actor, self.device, self.timeout)
        return True

    def deliver(self, step: int, kind: str, mb: int, array) -> None:
        self.inbox.put((step, kind, mb), array)

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
        """Run this worker's actions for ``step`` (0-based), all-reduce, update."""
        self.inbox.drop_before(step)
        xs, ys = self._my_batch(step) if (self.first or self.last) else (None, None)
        scale = self.mbs / self.B
        stash: dict[int, tuple] = {}
        loss_sum = torch.zeros((), dtype=torch.float64)
        busy = 0.0
        live = peak = 0
        timeline = []
        tr = self.transport
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
                    tr.send(step, "act", g, out)
                live += 1
                peak = max(peak, live)
            else:
                inp, out = stash.pop(a.mb)
                grad = None if self.last else tr.recv(step, "grad", g, self.out_meta)
                t0 = time.time()
                if out.requires_grad:
                    torch.autograd.backward(out, grad)
                t1 = time.time()
                live -= 1
                if not self.first and inp.requires_grad:
                    tr.send(step, "grad", g, inp.grad)
            busy += t1 - t0
            timeline.append((f"{a.stage}{a.kind}{g}", t0, t1))  # global microbatch id
        tr.finish_step()
        t_pipe = time.time()
        if self.stage_group is not None:
            self._allreduce_grads()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t_end = time.time()
        return {"dp_rank": self.dp_rank, "pp_rank": self.pp_rank, "loss": float(loss_sum) if self.last else None,
                "busy": busy, "start": timeline[0][1] if timeline else t_begin, "pipe_end": t_pipe,
                "end": t_end, "peak_live": peak, "allreduce_s": t_end - t_pipe,
                "timeline": timeline}

    def _allreduce_grads(self) -> None:
        params = [p for p in self.stage.parameters()]
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.stage_group)
        off = 0
        for p in params:
            n = p.numel()
            p.grad = flat[off:off + n].view_as(p)
            off += n

    # ---------------------------------------------------------------- state

    def get_state(self) -> dict:
        return {"model": {k: v.detach().cpu() for k, v in self.stage.state_dict().items()},
                "optim": optimizer_state_by_name(self.optimizer, self.param_names)}

    def load_state(self, state: dict) -> bool:
        own = self.stage.state_dict()
        self.stage.load_state_dict({k: state["model"][k] for k in own})
        if state.get("optim"):
            load_optimizer_state(self.optimizer, self.param_names, state["optim"])
        return True

    def shutdown(self) -> None:
        self.inbox.close("the job is stopping")
        if dist.is_initialized():
            dist.destroy_process_group()
