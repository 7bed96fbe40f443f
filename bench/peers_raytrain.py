"""Ray Train as a contestant of bench/peers.py: a v2 ``TorchTrainer`` with 2 workers,
``prepare_model`` (DDP over gloo, its default buckets), one thread per worker.

The train loop is a small command server: it waits on a ``Gate`` actor for the bench's
next command (set up for M microbatches, run n steps, stop) and answers there, so one
trainer serves every M and the bench can run the contestants in interleaved rounds.
A step matches relaytrain with dp = 2, pp = 1: replica r takes microbatches
[r*M/2, (r+1)*M/2) of the global batch, accumulates their gradients (``no_sync`` on all
but the last, so DDP's bucketed all-reduce overlaps the last backward), each microbatch's
mean loss scaled by 2/M, and DDP averages over the 2 replicas: the gradient of the mean
loss over the global batch.  Each answer holds, per step, the wall time at which the
step ended (after the optimizer step) and the replica's loss.
"""
from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import ray

BENCH = str(Path(__file__).resolve().parent)
GATE = "peers-raytrain-gate"
NAMESPACE = "relaytrain-peers"


@ray.remote(num_cpus=0)
class Gate:
    """Commands from the bench to the train workers, and their answers."""

    def __init__(self):
        self.commands: dict[int, Any] = {}
        self.answers: dict[int, dict[int, Any]] = {}
        self.cond = asyncio.Condition()

    async def post(self, seq: int, cmd) -> bool:
        async with self.cond:
            self.commands[seq] = cmd
            self.cond.notify_all()
        return True

    async def take(self, seq: int):
        async with self.cond:
            await self.cond.wait_for(lambda: seq in self.commands)
            return self.commands[seq]

    async def answer(self, seq: int, rank: int, result) -> bool:
        async with self.cond:
            self.answers.setdefault(seq, {})[rank] = result
            self.cond.notify_all()
        return True

    async def result(self, seq: int, world: int, timeout: float):
        async with self.cond:
            try:
                await asyncio.wait_for(self.cond.wait_for(lambda: len(self.answers.get(seq, {})) == world), timeout)
            except asyncio.TimeoutError:
                return None
            return self.answers[seq]


def train_loop(config: dict) -> None:
    sys.path[:0] = [config["root"], config["bench"]]
    import torch

    torch.set_num_threads(1)
    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    gate = ray.get_actor(GATE, namespace=NAMESPACE)
    runner = None
    seq = 0
    while True:
        cmd = ray.get(gate.take.remote(seq))
        try:
            if cmd[0] == "stop":
                result: Any = "stopped"
            elif cmd[0] == "params":
                result = {k: v.detach().clone() for k, v in runner.model.module.state_dict().items()}
            elif cmd[0] == "setup":
                runner = DDPReplica(cmd[1], rank, world)
                result = {"ready": True, "pid": os.getpid()}
            else:
                result = runner.run(cmd[1])
        except BaseException as e:
            import traceback

            ray.get(gate.answer.remote(seq, rank, {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}))
            raise
        ray.get(gate.answer.remote(seq, rank, result))
        seq += 1
        if cmd[0] == "stop":
            return


class DDPReplica:
    def __init__(self, m: int, rank: int, world: int):
        import ray.train.torch
        from peers_spec import spec

        from service.loading import build_optimizer, load_job

        self.spec = spec(m, dp=world)
        self.job = load_job(self.spec)
        self.model = ray.train.torch.prepare_model(self.job.model)  # DDP, gloo, default buckets
        self.opt = build_optimizer(self.spec, self.model.parameters())
        self.m, self.rank, self.world = m, rank, world
        self.step = 0

    def run(self, n: int) -> list[dict]:
        import contextlib

        import torch.distributed as dist

        from service.sampling import step_indices

        t = self.spec.training
        per = self.m // self.world
        mbs = t.microbatch_size
        out = []
        dist.barrier()
        for _ in range(n):
            idx = step_indices(self.step, len(self.job.samples), t.global_batch_size, t.seed, t.shuffle)
            x, y = self.job.samples.batch(idx[self.rank * per * mbs:(self.rank + 1) * per * mbs])
            self.opt.zero_grad(set_to_none=True)
            total = 0.0
            for j, (xm, ym) in enumerate(zip(x.split(mbs), y.split(mbs))):
                sync = contextlib.nullcontext() if j == per - 1 else self.model.no_sync()
                with sync:
                    loss = self.job.loss(self.model(xm), ym)
                    (loss / per).backward()
                total += loss.item()
            self.opt.step()
            self.step += 1
            out.append({"end": time.time(), "loss": total / per})
        return out


class RayTrainDDP:
    """The trainer, run in a thread of the bench; ``setup``/``run`` talk to its workers."""

    def __init__(self, workers: int = 2):
        self.world = workers
        self.seq = 0
        self.fit_error: list = []
        self.scratch = tempfile.mkdtemp(prefix="peers-raytrain-")
        self.gate = Gate.options(name=GATE, namespace=NAMESPACE).remote()
        self.thread = None
        self.worker_pids: list[int] = []

    def start(self) -> None:
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        root = str(Path(BENCH).parent)
        trainer = TorchTrainer(
            train_loop, train_loop_config={"root": root, "bench": BENCH},
            scaling_config=ScalingConfig(num_workers=self.world, use_gpu=False, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name=f"peers-{os.getpid()}", storage_path=self.scratch))

        def fit():
            try:
                trainer.fit()
            except BaseException as e:  # reported by the next command that waits
                self.fit_error.append(f"{type(e).__name__}: {e}")

        self.thread = threading.Thread(target=fit, name="raytrain-fit", daemon=True)
        self.thread.start()

    def _call(self, cmd, timeout: float) -> dict:
        seq = self.seq
        self.seq += 1
        ray.get(self.gate.post.remote(seq, cmd))
        deadline = time.monotonic() + timeout
        while True:
            got = ray.get(self.gate.result.remote(seq, self.world, 2.0))
            if got is not None:
                break
            if self.fit_error or time.monotonic() > deadline:
                raise RuntimeError(f"Ray Train did not answer {cmd}: {self.fit_error or 'timed out'}")
        errors = [a["error"] for a in got.values() if isinstance(a, dict) and "error" in a]
        if errors:
            raise RuntimeError(f"Ray Train worker failed: {errors[0]}")
        return got

    def setup(self, m: int, timeout: float = 300.0) -> None:
        got = self._call(("setup", m), timeout)
        self.worker_pids = [got[r]["pid"] for r in range(self.world)]

    def pids(self) -> list[int]:
        """Its train workers' processes and its controller's (``--pause-idle`` stops them between
        its turns; the controller's health checks of the workers, every 2 s, stop with them)."""
        controllers = [a["Pid"] for a in ray._private.state.actors().values()
                       if a.get("State") == "ALIVE" and "TrainController" in (a.get("ActorClassName") or "")
                       and a.get("Pid")]
        return self.worker_pids + controllers

    def run(self, n: int) -> list[dict]:
        got = self._call(("run", n), 600.0)
        per_rank = [got[r] for r in range(self.world)]
        return [{"end": max(p[i]["end"] for p in per_rank),
                 "loss": sum(p[i]["loss"] for p in per_rank) / self.world} for i in range(n)]

    def params(self) -> dict:
        return self._call(("params",), 120.0)[0]

    def stop(self) -> None:
        try:
            self._call(("stop",), 60.0)
        except Exception:
            pass
        if self.thread is not None:
            self.thread.join(60)
        try:
            ray.kill(self.gate)
        except Exception:
            pass
