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
        return mod.stage_backward_input, mod.stage_backward_weight
    except Exception:  # another torch: every backward stays whole
        return None, None


stage_backward_input, stage_backward_weight = _split_backward()

from actors.failures import StageAborted, talking_to_peers
from service import schedules


class Transport(Protocol):
    """How activations and their gradients move between neighbouring stages (actors/transport.py)."""

    name: str
    fixed_shapes: bool  # every microbatch's activation must keep the first one's shape

    def begin_step(self, step: int, expected: list) -> None: ...
    def send(self, step: int, kind: str, mb: int, tensor: torch.Tensor) -> None: ...
    def recv(self, step: int, kind: str, mb: int, like: tuple) -> torch.Tensor: ...
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
    return (tuple(m[0]), m[1]) if m else None


@dataclass(frozen=True)
class Cell:
    """Where a worker stands in a shape: its (dp_rank, pp_rank), its layers, its actions."""

    gen: int
    dp_rank: int
    pp_rank: int
    dp: int
    pp: int
    layers: tuple[int, int]           # [lo, hi) of the whole model
    mb0: int                          # its replica's first global microbatch
    actions: list
    in_meta: Optional[tuple]          # (shape, dtype) of the activation it receives
    out_meta: Optional[tuple]         # ... and sends
    receives: list = field(default_factory=list)  # the step's receives, in the order its actions take them

    @property
    def first(self) -> bool:
        return self.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def last_backward(self):
        return [a for a in self.actions if a.kind == "B"][-1]

    @classmethod
    def from_config(cls, cfg: dict, microbatches: int) -> "Cell":
        dp, pp, r, s = cfg["dp"], cfg["pp"], cfg["dp_rank"], cfg["pp_rank"]
        m = microbatches // dp
        actions = schedules.build(cfg["schedule"], pp, m).order[s]
        boundary = cfg["boundary"]
        in_meta = _meta(boundary[s - 1]) if s > 0 else None
        out_meta = _meta(boundary[s]) if s < pp - 1 else None
        mb0 = r * m
        receives = [("act", mb0 + a.mb, in_meta) if a.kind == "F" else ("grad", mb0 + a.mb, out_meta)
                    for a in actions if (a.kind == "F" and s > 0) or (a.kind == "B" and s < pp - 1)]
        return cls(cfg["gen"], r, s, dp, pp, tuple(cfg["bounds"][s]), mb0, actions, in_meta, out_meta, receives)


@dataclass
class _Progress:
    """What a step's actions leave behind as they run."""

    stash: dict = field(default_factory=dict)   # microbatch -> (input, output) until its backward
    loss_sum: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    busy: float = 0.0
    live: int = 0
    peak: int = 0
    timeline: list = field(default_factory=list)


@dataclass(frozen=True)
class Recipe:
    """How a stage computes (the spec's training recipe, service/spec.py TrainingSpec)."""

    bf16: bool = False            # forward and loss under bf16 autocast
    checkpointing: bool = False   # each layer's forward recomputed in its backward
    global_norm: bool = False     # sum the gradient norm over every worker (clipping, skipping)
    device: torch.device = torch.device("cpu")


class StepRunner:
    """Runs a cell's actions for one step; built anew whenever the worker's wiring changes."""

    def __init__(self, cell: Cell, stage: nn.Module, transport: Transport, reducer: Optional[GradientReducer],
                 loss_fn: Optional[Callable], scale: float, ties=None, recipe: Recipe = Recipe(),
                 norm_params: Optional[list] = None):
        self.cell, self.stage, self.tr, self.reduce = cell, stage, transport, reducer
        self.loss_fn, self.scale, self.ties = loss_fn, scale, ties  # ties: actors/ties.TiedGrads
        self.recipe = recipe
        # the parameters whose gradients count in the model's norm: a tie's copies but its first
        # name's are left out (one parameter), and only replica 0 counts (the replicas agree)
        self.norm_params = (norm_params if norm_params is not None else list(stage.parameters())) \
            if cell.dp_rank == 0 else []

    def run(self, step: int, xs: Optional[list], ys: Optional[list], aborted: Callable[[], bool]) -> dict:
        c, tr, reduce = self.cell, self.tr, self.reduce
        t_begin = time.time()
        with talking_to_peers(f"starting step {step + 1}"):
            tr.begin_step(step, c.receives)
            if reduce is not None:
                reduce.attach()  # this step's gradients accumulate in the all-reduce's buffers
        p = _Progress()
        for a in c.actions:
            g = c.mb0 + a.mb
            t0, t1 = self._forward(a, step, g, xs, ys, p) if a.kind == "F" else self._backward(a, step, g, p)
            p.busy += t1 - t0
            p.timeline.append((f"{a.stage}{a.kind}{g}", t0, t1))  # global microbatch id
        with talking_to_peers(f"finishing the sends of step {step + 1}"):
            tr.finish_step()
        t_pipe = time.time()
        if reduce is not None:
            with talking_to_peers(f"summing the gradients of step {step + 1} with the stage's replicas"):
                reduce.finish()
        if self.ties:
            with talking_to_peers(f"summing the gradients of tied parameters of step {step + 1} with other stages"):
                self.ties.finish(step, tr)
        grad_sq, total = self._grad_norm(step)
        if aborted():
            raise StageAborted(f"step {step + 1} was discarded")
        t_end = time.time()
        return {"dp_rank": c.dp_rank, "pp_rank": c.pp_rank, "loss": float(p.loss_sum) if c.last else None,
                "busy": p.busy, "start": p.timeline[0][1] if p.timeline else t_begin, "pipe_end": t_pipe,
                "end": t_end, "peak_live": p.peak, "allreduce_s": t_end - t_pipe, "timeline": p.timeline,
                "grad_sq": grad_sq, "grad_norm": total}

    def evaluate(self, step: int, xs: Optional[list], ys: Optional[list], batches: int,
                 aborted: Callable[[], bool]) -> dict:
        """Forwards only, with no gradients and the layers in eval mode, of this replica's
        microbatches of ``batches`` evaluation batches (``xs[b][j]``, ``ys[b][j]``), pipelined
        like a step's forwards.  The last stage returns its sum of microbatch losses, each
        scaled by microbatch / batch size: the sum over replicas is the sum of batch means."""
        c, tr = self.cell, self.tr
        m = len(c.actions) // 2
        ids = [b * m * c.dp + c.mb0 + j for b in range(batches) for j in range(m)]  # global eval microbatches
        with talking_to_peers(f"starting the evaluation after step {step}"):
            tr.begin_step(step, [("eval", g, c.in_meta) for g in ids] if not c.first else [])
        loss_sum = torch.zeros((), dtype=torch.float64)
        timeline = []
        was_training = self.stage.training
        self.stage.eval()
        try:
            with torch.no_grad():
                for k, g in enumerate(ids):
                    b, j = divmod(k, m)
                    if c.first:
                        inp = xs[b][j]
                    else:
                        with talking_to_peers(f"receiving the evaluation activation of microbatch {g}"):
                            inp = tr.recv(step, "eval", g, c.in_meta)
                    t0 = time.time()
                    with self._autocast():
                        out = self.stage(inp)
                        if c.last:
                            loss_sum += (self.loss_fn(out, ys[b][j]).double() * self.scale).cpu()
                    t1 = time.time()
                    timeline.append((f"{c.pp_rank}E{g}", t0, t1))
                    if not c.last:
                        self._check_shape(out, g)
                        with talking_to_peers(f"sending the evaluation activation of microbatch {g}"):
                            tr.send(step, "eval", g, out)
            with talking_to_peers(f"finishing the sends of the evaluation after step {step}"):
                tr.finish_step()
        finally:
            self.stage.train(was_training)
        if aborted():
            raise StageAborted(f"the evaluation after step {step} was discarded")
        return {"loss_sum": float(loss_sum) if c.last else None, "timeline": timeline}

    def _grad_norm(self, step: int) -> tuple[float, Optional[float]]:
        """This worker's share of the squared gradient norm, and with ``global_norm`` the whole
        model's norm (summed over every worker of the shape: every worker gets the same)."""
        sq = torch.zeros((), dtype=torch.float64, device=self.recipe.device)
        for q in self.norm_params:
            if q.grad is not None:  # each tensor's norm in its dtype (no copy), as clip_grad_norm_
                sq += torch.linalg.vector_norm(q.grad).double() ** 2
        if not self.recipe.global_norm:
            return float(sq), None
        with talking_to_peers(f"summing the gradient norm of step {step + 1} over every worker"):
            mine = float(sq)
            dist.all_reduce(sq)
        return mine, float(sq.sqrt())

    def _autocast(self):
        """Forward and loss under bf16 autocast with training.precision bf16 (a no-op otherwise)."""
        return torch.autocast(self.recipe.device.type, dtype=torch.bfloat16, enabled=self.recipe.bf16)

    def _compute(self, inp: torch.Tensor) -> torch.Tensor:
        """The stage's layers on one microbatch, each recomputed in backward with checkpointing."""
        if not self.recipe.checkpointing:
            return self.stage(inp)
        h = inp
        for layer in self.stage:
            h = checkpoint(layer, h, use_reentrant=False)
        return h

    def _forward(self, a, step: int, g: int, xs, ys, p: _Progress) -> tuple[float, float]:
        c, tr = self.cell, self.tr
        if c.first:
            inp = xs[a.mb]
        else:
            with talking_to_peers(f"receiving the activation of microbatch {g}"):
                inp = tr.recv(step, "act", g, c.in_meta)
            if inp.is_floating_point():
                inp.requires_grad_()
        t0 = time.time()
        with self._autocast():
            out = self._compute(inp)
            if c.last:
                out = self.loss_fn(out, ys[a.mb]) * self.scale
        if c.last:
            p.loss_sum += out.detach().double().cpu()
        t1 = time.time()
        p.stash[a.mb] = (inp, out)
        if not c.last:
            self._check_shape(out, g)
            with talking_to_peers(f"sending the activation of microbatch {g}"):
                tr.send(step, "act", g, out)
        p.live += 1
        p.peak = max(p.peak, p.live)
        return t0, t1

    def _check_shape(self, out: torch.Tensor, g: int) -> None:
        c = self.cell
        if self.tr.fixed_shapes and (tuple(out.shape), out.dtype) != c.out_meta:
            raise ValueError(
                f"stage {c.pp_rank} (layers {c.layers[0]}-{c.layers[1] - 1}) produced an activation of shape "
                f"{tuple(out.shape)} {out.dtype} for microbatch {g}, but the pipeline was set up for "
                f"{c.out_meta[0]} {c.out_meta[1]} (the shape of the first microbatch): transport 'collective' needs "
                "every microbatch's activation to keep one shape; set parallelism.transport: object_store for "
                "activations whose shape varies")

    def _backward(self, a, step: int, g: int, p: _Progress) -> tuple[float, float]:
        c, tr, reduce = self.cell, self.tr, self.reduce
        inp, out = p.stash.pop(a.mb)
        grad = None
        if not c.last:
            with talking_to_peers(f"receiving the gradient of microbatch {g}"):
                grad = tr.recv(step, "grad", g, c.out_meta)
        t0 = time.time()
        final = a == c.last_backward
        if reduce is not None and final:
            with talking_to_peers("arming the gradient sum"):
                reduce.arm()  # the gradients become final in this backward: all-reduce as they do
        split = (final and not c.first and inp.requires_grad and out.requires_grad and not self.recipe.checkpointing
                 and stage_backward_input is not None and not (reduce is not None and reduce.overlap))
        if split:
            # the previous stage's last backward waits for this input gradient: send it
            # before computing the weight gradients, so the pipeline drains sooner
            _, groups = stage_backward_input([out], None if grad is None else [grad], [inp], self.stage.parameters())
            self._send_grad(step, g, inp)
            stage_backward_weight(self.stage.parameters(), groups)
        elif out.requires_grad:
            torch.autograd.backward(out, grad)
        t1 = time.time()
        p.live -= 1
        if not split and not c.first and inp.requires_grad:
            self._send_grad(step, g, inp)
        return t0, t1

    def _send_grad(self, step: int, g: int, inp: torch.Tensor) -> None:
        with talking_to_peers(f"sending the gradient of microbatch {g}"):
            self.tr.send(step, "grad", g, inp.grad)
