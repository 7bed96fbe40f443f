"""JobScheduler: the actor that runs one job (named ``service.names.scheduler_name(job_id)``).

It puts the job's parts together and answers whoever polls it (the CLI, the control plane):

- ``JobRecord`` (actors/record.py): state, events, metrics, timelines, output; written to the job store;
- ``WorkerGroup`` (actors/workergroup.py): the workers, their placement and calls to all of them;
- ``StateKeeper`` (actors/statekeeper.py): snapshots, checkpoints, the resume copy, the final model;
- ``JobController`` (actors/controller.py): the loop and the job's state, with the elastic policy
  (service/elastic_policy.py) deciding and the ``Reshaper`` (actors/reshape.py) moving state.
"""
from __future__ import annotations

import json
import tempfile
import threading
import time
from typing import Optional

import ray

from actors import codepkg
from actors.controller import JobController
from actors.record import JobRecord
from actors.statekeeper import StateKeeper
from actors.workergroup import WorkerGroup
from service import shards
from service.spec import JobSpec


class JobScheduler:
    def __init__(self, job_id: str, spec: dict, search: list[str], checkpoint_root: Optional[str] = None,
                 resume: Optional[str] = None, timeout: float = 300.0, start_timeout: float = 120.0,
                 store_url: Optional[str] = None, detached: bool = False, model_dir: Optional[str] = None,
                 rerun_through: int = 0, allocation: Optional[int] = None, traced=None, restarts_used: int = 0,
                 finish_asked: Optional[str] = None, code: Optional[str] = None):
        self.job_id = job_id
        self.detached = detached
        self.spec = JobSpec.model_validate(spec)
        if self.spec.elastic.enabled:
            # An elastic job's scheduler receives its workers' state (the off-node copies a
            # reshape restores from), and unpickling it imports torch: done there, mid-reshape,
            # that 2-3 s import made the reshape test twice as slow and lost the scheduler to its
            # driver in 3 of 4 runs (2026-11-27; cause not pinned down). It is imported here.
            import torch  # noqa: F401
        self.record = JobRecord(job_id, self.spec.training.steps, store_url)
        self.record.high = rerun_through  # a restarted job: the steps its lost scheduler committed run again
        self.group = WorkerGroup(job_id, self.spec, search, timeout=timeout, start_timeout=start_timeout,
                                 detached=detached, log=self.record.log_output)
        self.group.on_wait = lambda why: self.record.event("waiting", why)
        self.group.shipped = codepkg.Shipped(code) if code else None  # the job's code package (actors/codepkg.py)
        self.keeper = StateKeeper(self.group, checkpoint_root, resume, timeout, job_id)
        if model_dir is None and not (self.record.sink and detached):
            model_dir = tempfile.mkdtemp(prefix=f"relaytrain-{job_id}-model-")
        self.model_out = {"dir": model_dir} if model_dir else {"store": store_url}
        self.controller = JobController(job_id, self.spec, search, self.record, self.group, self.keeper,
                                        model_out=self.model_out, save_index=self._save_index, cap=allocation,
                                        traced=traced, restarts_used=restarts_used, finish_asked=finish_asked)
        self._started = False
        if detached:  # started by its creation, which Ray completes even if the control plane dies meanwhile
            self.start()

    def __repr__(self) -> str:
        return f"relaytrain:{self.job_id}:scheduler"

    def start(self) -> bool:
        """Run the job in a thread of this actor and return at once (the control plane
        does not wait on a call that its own restart would cut); a second call does nothing."""
        if self._started:
            return True
        self._started = True
        threading.Thread(target=self._run_detached, name="relaytrain-job", daemon=True).start()
        return True

    def _run_detached(self) -> None:
        self.run()
        if self.detached:  # everything is in the store: leave nothing behind
            time.sleep(1.0)
            ray.actor.exit_actor()

    def run(self) -> dict:
        try:
            self.controller.run()
        finally:
            if self.controller.watch:
                self.controller.watch.stop()
            self.group.teardown()
        final = self.record.poll(len(self.record.metrics), len(self.record.events))
        final["timelines"] = list(self.record.timelines)
        return final

    def poll(self, metrics_from: int = 0, events_from: int = 0) -> dict:
        return self.record.poll(metrics_from, events_from)

    def cancel(self) -> bool:
        self.controller.cancelled.set()
        return True

    def finish_early(self, who: str) -> int:
        """End after the step under way, keeping the model as trained so far (SUCCEEDED);
        returns the steps committed so far."""
        self.controller.finish_early(who)
        return self.record.step

    def set_allocation(self, workers: int, reason: str) -> bool:
        """The cluster scheduler's allotment (api/cluster.py); True when it changed."""
        return self.controller.allot(workers, reason)

    def preempt(self, reason: str) -> bool:
        """Give the slots back at the next step boundary, after a checkpoint (back to QUEUED)."""
        self.controller.preempt(reason)
        return True

    def model_index(self) -> Optional[dict]:
        """The final model's index (its shards are where ``model_out`` says), once it is written."""
        return self.controller.final

    def timeline(self, step: Optional[int] = None) -> Optional[dict]:
        """Measured (action, start, end) per worker for a recent step (the newest by default)."""
        return self.record.timeline(step)

    def _save_index(self, index: dict) -> None:
        """The final model's index, last, beside the shards the workers wrote."""
        text = json.dumps(index, indent=1)
        if self.model_out.get("dir"):
            shards.write_text(self.model_out["dir"], shards.INDEX, text)
        else:  # served by GET /v1/jobs/{id}/model
            self.record.sink.store.put_artifact(self.job_id, f"model/{shards.INDEX}", text.encode())
