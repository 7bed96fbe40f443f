"""Contestants that run in plain processes, driven over a pipe by bench/peers.py:

- ``single``: one process, one thread, the step's microbatches one after another with
  their gradients accumulated (the same matrix shapes a pipeline stage computes);
- ``torch_pp``: torch.distributed.pipelining, p processes over gloo, manual
  ``PipelineStage``s: one per process for ``Schedule1F1B`` and ``ScheduleGPipe``, a list of v
  per process for the multi-stage schedules (``ScheduleInterleaved1F1B`` and
  ``ScheduleInterleavedZeroBubble``: loop placement, rank r holds stages r, r + p, ...;
  ``ScheduleZBVZeroBubble``: V placement, rank r holds stages r and 2p-1-r), each stage
  the entries of one chunk of ``peers_spec.chunk_bounds(p x v)`` (the chunks relaytrain
  cuts); ``ScheduleInterleavedZeroBubble`` with one stage per process is ZB-H1 (its
  backward split into input and weight gradients, the weight gradients filling the
  bubble).  The loss is the microbatch mean and ``scale_grads=True`` divides the summed
  gradients by M, so the gradient is that of the mean loss over the global batch, as in
  relaytrain.

Each process takes commands ``("run", n)`` (and ``("params",)``) and answers, per step, the wall time at which
it ended (after the optimizer step), its loss (last stage), and the compute it measured:
``busy`` (seconds inside forward_one_chunk, backward_one_chunk, backward_weight_one_chunk
and the loss, over all of the process's stages), ``start``
(the first of those) and ``pipe_end`` (when the schedule's step returned, before the
optimizer step).  The driver turns these into step times and the measured bubble the
way relaytrain's scheduler does: 1 - sum(busy) / (p x span).
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])


# torch schedule name -> (class name in torch.distributed.pipelining, stages per process, placement)
TORCH_SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "zb_h1": ("ScheduleInterleavedZeroBubble", 1, "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
}


def serve(conn, kind: str, rank: int, world: int, port: int, m: int, schedule: str, mbs: int = 64) -> None:
    """Process entry point: set up, then answer commands until ``("stop",)``."""
    sys.path.insert(0, ROOT)
    os.environ["OMP_NUM_THREADS"] = "1"
    if kind == "single_heap":  # malloc as relaytrain's workers tune theirs, before torch allocates anything
        from actors.heap import keep_freed

        keep_freed()
    import torch

    torch.set_num_threads(1)
    try:
        runner = (Single if kind in ("single", "single_heap") else TorchPipeline)(rank, world, port, m, schedule, mbs)
        conn.send(("ready", os.getpid()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            runner.close()
            conn.send(("stopped", None))
            return
        try:
            conn.send(("ok", runner.params() if cmd[0] == "params" else runner.run(cmd[1])))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            return


class _Base:
    def __init__(self, m: int, mbs: int):
        from peers_spec import spec

        from service.loading import build_optimizer, load_job

        self.spec = spec(m, mbs=mbs)
        self.job = load_job(self.spec)
        self.m = m
        self.step = 0
        self.build_optimizer = build_optimizer

    def batch(self, g: int):
        from service.sampling import step_indices

        t = self.spec.training
        return self.job.samples.batch(step_indices(g, len(self.job.samples), t.global_batch_size, t.seed, t.shuffle))

    def params(self) -> dict:
        """This process's parameters, keyed as in the whole model's state_dict."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def close(self) -> None:
        pass


class Single(_Base):
    def __init__(self, rank: int, world: int, port: int, m: int, schedule: str, mbs: int):
        super().__init__(m, mbs)
        self.model = self.module = self.job.model
        self.opt = self.build_optimizer(self.spec, self.model.parameters())

    def run(self, n: int) -> list[dict]:
        out = []
        mbs = self.spec.training.microbatch_size
        for _ in range(n):
            x, y = self.batch(self.step)
            self.opt.zero_grad(set_to_none=True)
            total, t0 = 0.0, time.time()
            for xm, ym in zip(x.split(mbs), y.split(mbs)):
                loss = self.job.loss(self.model(xm), ym)
                (loss / self.m).backward()
                total += loss.item()
            t1 = time.time()
            self.opt.step()
            self.step += 1
            out.append({"end": time.time(), "loss": total / self.m, "busy": t1 - t0, "start": t0, "pipe_end": t1})
        return out


class TorchPipeline(_Base):
    def __init__(self, rank: int, world: int, port: int, m: int, schedule: str, mbs: int):
        import torch
        import torch.distributed as dist
        from torch.distributed import pipelining

        from peers_spec import chunk_bounds, chunks_of

        super().__init__(m, mbs)
        self.rank = rank
        cls_name, v, placement = TORCH_SCHEDULES[schedule]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        full = self.job.model
        bounds = chunk_bounds(world * v)
        mine = chunks_of(rank, world, v, placement)
        # slicing an nn.Sequential keeps the entries' names: the stages' state_dicts are keyed as the whole model's
        self.chunks = [full[lo:hi] for lo, hi in (bounds[k] for k in mine)]
        self.opt = self.build_optimizer(self.spec, [q for c in self.chunks for q in c.parameters()])
        stages = [pipelining.PipelineStage(c, k, world * v, torch.device("cpu")) for c, k in zip(self.chunks, mine)]
        for st in stages:
            self._timed(st)
        loss_fn = self._timed_loss(self.job.loss)
        cls = getattr(pipelining, cls_name)
        multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)
        self.schedule = cls(stages if multi else stages[0], n_microbatches=m, loss_fn=loss_fn, scale_grads=True)
        self.first = 0 in mine             # feeds the input
        self.last = world * v - 1 in mine  # computes the loss

    def params(self) -> dict:
        out = {}
        for c in self.chunks:
            out.update({k: t.detach().clone() for k, t in c.state_dict().items()})
        return out

    def _timed(self, stage) -> None:
        """Count the seconds spent computing (not waiting on the peer)."""
        fwd, bwd = stage.forward_one_chunk, stage.backward_one_chunk

        def timed(fn):
            def call(*a, **k):
                t0 = time.time()
                try:
                    return fn(*a, **k)
                finally:
                    self._busy += time.time() - t0
                    self._start = t0 if self._start is None else self._start
            return call

        stage.forward_one_chunk, stage.backward_one_chunk = timed(fwd), timed(bwd)
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk)  # (zero-bubble schedules)

    def _timed_loss(self, fn):
        def loss(pred, target):
            t0 = time.time()
            try:
                return fn(pred, target)
            finally:
                self._busy += time.time() - t0
        return loss

    def run(self, n: int) -> list[dict]:
        import torch.distributed as dist

        out = []
        dist.barrier()
        for _ in range(n):
            x, y = self.batch(self.step)
            self.opt.zero_grad(set_to_none=True)
            self._busy, self._start = 0.0, None
            losses: list = []
            self.schedule.step(*((x,) if self.first else ()), **({"target": y, "losses": losses} if self.last else {}),
                               return_outputs=False)
            t1 = time.time()
            self.opt.step()
            self.step += 1
            loss = sum(v.item() for v in losses) / len(losses) if losses else None
            out.append({"end": time.time(), "loss": loss, "busy": self._busy, "start": self._start, "pipe_end": t1})
        return out

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()
