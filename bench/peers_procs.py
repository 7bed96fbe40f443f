"""Contestants that run in plain processes, driven over a pipe by bench/peers.py:

- ``single``: one process, one thread, the step's microbatches one after another with
  their gradients accumulated (the same matrix shapes a pipeline stage computes);
- ``torch_pp``: torch.distributed.pipelining, two processes (one stage each) over gloo,
  manual ``PipelineStage``s and ``Schedule1F1B`` or ``ScheduleGPipe``; the loss is the
  microbatch mean and ``scale_grads=True`` divides the summed gradients by M, so the
  gradient is that of the mean loss over the global batch, as in relaytrain.

Each process takes commands ``("run", n)`` (and ``("params",)``) and answers, per step, the wall time at which
it ended (after the optimizer step), its loss (last stage), and the compute it measured:
``busy`` (seconds inside forward_one_chunk, backward_one_chunk and the loss), ``start``
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


def serve(conn, kind: str, rank: int, world: int, port: int, m: int, schedule: str) -> None:
    """Process entry point: set up, then answer commands until ``("stop",)``."""
    sys.path.insert(0, ROOT)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    try:
        runner = (Single if kind == "single" else TorchPipeline)(rank, world, port, m, schedule)
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
    def __init__(self, m: int):
        from peers_spec import spec

        from service.loading import build_optimizer, load_job

        self.spec = spec(m)
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
    def __init__(self, rank: int, world: int, port: int, m: int, schedule: str):
        super().__init__(m)
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
    def __init__(self, rank: int, world: int, port: int, m: int, schedule: str):
        import torch
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        from peers_spec import CUT

        super().__init__(m)
        self.rank = rank
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        full = self.job.model
        self.module = full[:CUT] if rank == 0 else full[CUT:]
        self.opt = self.build_optimizer(self.spec, self.module.parameters())
        stage = PipelineStage(self.module, rank, world, torch.device("cpu"))
        self._timed(stage)
        loss_fn = self._timed_loss(self.job.loss)
        cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
        self.schedule = cls(stage, n_microbatches=m, loss_fn=loss_fn, scale_grads=True)

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
            if self.rank == 0:
                self.schedule.step(x)
            else:
                self.schedule.step(target=y, losses=losses, return_outputs=False)
            t1 = time.time()
            self.opt.step()
            self.step += 1
            loss = sum(v.item() for v in losses) / len(losses) if losses else None
            out.append({"end": time.time(), "loss": loss, "busy": self._busy, "start": self._start, "pipe_end": t1})
        return out

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()
