"""relaytrain as a contestant of bench/peers.py: a job run by its real JobScheduler and
StageWorkers, held at a step boundary between the bench's rounds.

``GatedScheduler`` is the engine's ``JobScheduler`` with one addition: after a step's
metrics row is made it publishes the row and waits until the bench allows the next step.
The row's ``time`` is taken by the scheduler when the step's results are in, so the
difference between two rows of one round is the whole cycle of a step as the scheduler
drives it: dispatch to both workers, their work (including the deferred optimizer step of
the previous step), the gather and the row.  The first step of each round (after the wait)
is the round's warm-up and is not timed.

The controller may queue a fixed-shape job's next step on the workers before the current
step's results are gathered (its prequeue); it asks ``controller.may_queue(step)`` first.
``GatedScheduler`` answers it from the gate (``step < allowed``), so a step beyond what the
bench allowed is never queued early and never runs during another contestant's round (an
engine without the prequeue ignores the attribute).
"""
from __future__ import annotations

import threading
import time
import uuid
from typing import Optional

import ray

from actors.scheduler import JobScheduler
from service.names import NAMESPACE
from actors.launch import scheduler_placement, stop as _stop
from service.states import JobState


def _pid(_actor) -> int:
    import os

    return os.getpid()


class GatedScheduler(JobScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._allowed = 0
        self._rows: list[dict] = []
        self._gate = threading.Condition()
        self._engine_commit = self.controller._commit
        self.controller._commit = self._gated_commit
        self.controller.may_queue = self._may_queue

    def _may_queue(self, step: int) -> bool:
        """May the controller queue step ``step`` (0-based) before the one running is gathered?
        Only if the bench already allowed it: steps [0, allowed) may run."""
        with self._gate:
            return step < self._allowed

    def engine(self) -> str:
        """Where this process imported the engine from (checks an A/B run uses what it says)."""
        import sys

        return sys.modules[JobScheduler.__module__].__file__

    def allow(self, steps: int) -> bool:
        """Let the job run until ``steps`` steps are done."""
        with self._gate:
            self._allowed = steps
            self._gate.notify_all()
        return True

    def rows(self, steps: int, timeout: float = 600.0) -> dict:
        """The rows of the first ``steps`` steps, once they are done (or the job ended)."""
        deadline = time.monotonic() + timeout
        with self._gate:
            while len(self._rows) < steps and time.monotonic() < deadline:
                if self.record.state in (JobState.FAILED, JobState.CANCELLED):
                    break
                self._gate.wait(0.5)
            return {"rows": list(self._rows[:steps]), "state": self.record.state.value, "error": self.record.error}

    def shape(self) -> dict:
        """The shape the job runs in: layers per virtual stage (model chunk), chunks per worker
        and their placement (an engine without chunks: one per worker, "loop")."""
        s = self.group.shape
        return {"dp": s.dp, "pp": s.pp, "sizes": list(s.sizes), "chunks": getattr(s, "chunks", 1),
                "placement": getattr(s, "placement", "loop")}

    def pids(self) -> list[int]:
        """The workers' process ids (the bench reads their page faults from /proc)."""
        return ray.get([w.__ray_call__.remote(_pid) for w in self.group.workers.values()])

    def params(self) -> dict:
        """The whole model's parameters at the step the job is held at."""
        with self._gate:
            committed = len(self._rows)
        g, out = self.group, {}
        for s in range(g.shape.pp):
            state = ray.get(g.workers[(0, s)].export.remote(sorted(g.layers_of((0, s))), committed))
            out.update(state["model"])
        return out

    def _gated_commit(self, step: int, stats: dict, wall: float, *more, **kw) -> None:
        span = max(s["end"] for s in stats.values()) - min(s["start"] for s in stats.values())
        extra = {"work_span_s": span,
                 "dispatched": time.time() - wall,  # ~ when the scheduler sent the step's calls
                 "workers": {f"w{r}.{s}": {k: st.get(k) for k in ("called", "settled", "busy", "start", "pipe_end",
                                                                   "end", "allreduce_s")}
                             for (r, s), st in sorted(stats.items())}}
        self._engine_commit(step, stats, wall, *more, **kw)  # (more: e.g. the evaluation's loss)
        row = self.record.metrics[-1]
        with self._gate:
            self._rows.append({**row, **extra})
            self._gate.notify_all()
            while (self._allowed <= step + 1 < self.spec.training.steps
                   and not self.controller.cancelled.is_set()):
                self._gate.wait(1.0)


class Relaytrain:
    """One relaytrain job of ``steps`` steps whose steps the bench releases a few at a time."""

    def __init__(self, spec, steps: int, engine: Optional[str] = None):
        self.spec = spec.model_copy(update={"training": spec.training.model_copy(update={"steps": steps})})
        self.engine = engine  # a folder holding another version of actors/ (and service/), for A/B runs
        self.job_id = f"peers-{uuid.uuid4().hex[:8]}"
        self.done = 0
        self.sched = None
        self.run_ref = None

    def start(self) -> None:
        self.sched = ray.remote(GatedScheduler).options(
            name=f"relaytrain:{self.job_id}:scheduler", namespace=NAMESPACE, num_cpus=0, max_concurrency=4,
            **scheduler_placement(),
            **({"runtime_env": {"env_vars": {"PYTHONPATH": self.engine}}} if self.engine else {}),
        ).remote(self.job_id, self.spec.model_dump(mode="json"), [], None, None, 300.0)
        self.run_ref = self.sched.run.remote()
        self.where = where = ray.get(self.sched.engine.remote())
        if self.engine and not where.startswith(self.engine.rstrip("/") + "/"):
            raise RuntimeError(f"the A/B engine {self.engine} was asked for but the scheduler imported {where}")

    def run(self, n: int) -> list[dict]:
        self.done += n
        ray.get(self.sched.allow.remote(self.done))
        got = ray.get(self.sched.rows.remote(self.done))
        if len(got["rows"]) < self.done:
            raise RuntimeError(f"relaytrain job {self.job_id} stopped at step {len(got['rows'])} "
                               f"({got['state']}): {got['error']}")
        rows = got["rows"][self.done - n:]
        return [{"end": r["time"], "loss": r["loss"], "bubble": r["bubble"] if r["pp"] > 1 else None,
                 "bubble_plan": r["bubble_plan"] if r["pp"] > 1 else None, "scheduler_wall_s": r["step_time_s"],
                 "work_span_s": r["work_span_s"], "allreduce_s": r["allreduce_s"], "workers": r["workers"],
                 "dispatched": r["dispatched"]}
                for r in rows]

    def params(self) -> dict:
        return ray.get(self.sched.params.remote())

    def pids(self) -> list[int]:
        return ray.get(self.sched.pids.remote())

    def scheduler_pid(self) -> int:
        return ray.get(self.sched.__ray_call__.remote(_pid))

    def shape(self) -> dict:
        return ray.get(self.sched.shape.remote())

    def stop(self, finish: bool = True) -> Optional[dict]:
        """Let the job run its last steps and end (or cancel it), then remove its actors."""
        final = None
        if self.sched is None:
            return None
        try:
            if finish:
                ray.get(self.sched.allow.remote(self.spec.training.steps))
                final = ray.get(self.run_ref, timeout=120)
            else:
                ray.get(self.sched.cancel.remote())
        except Exception:
            pass
        _stop(self.sched, self.job_id)
        self.sched = None
        return final
