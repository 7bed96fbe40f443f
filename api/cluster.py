"""ClusterScheduler: the one decision-maker over the shared cluster.  It owns admission and every
job's allotment of workers: the policy (service/fairshare.py, pure) decides from the jobs in the
store, the cluster's capacity and the tenants' weights; this carries the decisions out.

- a queued job the policy admits goes QUEUED -> PENDING and its scheduler actor is started
  (``launch``), allotted its workers; a preempted one resumes from its newest checkpoint;
- a running elastic job is told its allotment (``JobScheduler.set_allocation``): above it the
  job shrinks at its next step boundary (the reshape that exists: state moved, no step lost),
  below it the job may grow;
- a preemptible job the policy preempts is asked to stop after a checkpoint
  (``JobScheduler.preempt``); it goes back to QUEUED itself.

Each decision is an event on the job it touches (``queued``, ``admitted``, ``shrink``,
``grow``, ``preempt``).  The queue is the jobs in state QUEUED in the store, so it outlives
this process: a restarted control plane sends every running job its allotment again.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Union

from pydantic import ValidationError

from actors import launch
from service import fairshare
from service.settings import Settings
from service.spec import JobSpec
from service.states import JobState
from service.store import Store

log = logging.getLogger("relaytrain.cluster")

ACTIVE = [s.value for s in JobState if not s.is_terminal]
PREEMPT_AGAIN_S = 60.0   # a preemption that did not happen (its checkpoint failed) is asked again after this


def demand(job: dict, spec: JobSpec, workers: int) -> fairshare.JobDemand:
    """What the policy needs of one job (``workers``: what it holds now; 0 when queued)."""
    p, e = spec.parallelism, spec.elastic
    size = p.dp * p.pipeline_workers
    lo, hi = (e.min_workers, e.max_workers) if e.enabled else (size, size)
    usable = (job.get("shape") or {}).get("usable_workers")
    return fairshare.JobDemand(
        id=job["id"], tenant=job["tenant"], order=job["created_at"], min_workers=lo, max_workers=hi,
        preferred=size, per_worker=spec.resources.cpus_per_worker, priority=spec.scheduling.priority,
        preemptible=spec.scheduling.preemptible, running=workers, sizes=tuple(usable) if usable else None)


def placed(job: dict) -> int:
    """Workers of the job's placed shape (every worker of it: replicated stages' and TP groups'
    too); 0 before it has one (queued, or admitted and waiting for or starting its workers)."""
    shape = job.get("shape") or {}
    if not shape.get("dp"):
        return 0
    return int(shape["dp"]) * (sum(shape.get("replicas") or ()) or int(shape["pp"]) * int(shape.get("tp") or 1))


def allotment_message(job: dict, a: fairshare.Allocation) -> str:
    """A shrink or grow event's message: the policy's reason, and for a job with no workers
    placed yet (waiting for slots) that only its allotment changes."""
    if placed(job):
        return a.reason
    return f"{a.reason} (it has no workers placed yet: only its allotment changes, nothing stops)"


class ClusterScheduler:
    def __init__(self, settings: Settings, store: Store, weights: Union[dict[str, float], Callable[[], dict]],
                 admit: Callable[[dict, int, bool], None]):
        """``admit(job, workers, resume)`` starts an admitted job's scheduler (api/jobs.py);
        ``weights``: the tenants' weights, or what gives them as they are now (service/auth.py
        ``Weights.current``: read again when their files change)."""
        self.settings, self.store, self.admit = settings, store, admit
        self._weights = weights if callable(weights) else (lambda fixed=dict(weights): fixed)
        self.policy = settings.queue_policy
        self._lock = threading.Lock()
        self.queue: dict[str, fairshare.Allocation] = {}   # queued job -> its place and reason
        self.allotted: dict[str, int] = {}                 # admitted job -> workers last allotted to it
        self.preempting: dict[str, float] = {}             # job -> when it was asked to give its slots back
        self.capacity = 0.0
        self.unreadable: set[str] = set()                   # jobs left out (logged once)

    # ---------------------------------------------------------------- the cluster

    def measure_capacity(self) -> float:
        """CPU slots for jobs: the live cluster's, or the autoscaler's ceiling when higher."""
        import ray

        cpus = float(ray.cluster_resources().get("CPU", 0))
        if self.settings.cluster_max_cpus is not None:
            cpus = max(cpus, self.settings.cluster_max_cpus)
        return cpus

    def holding(self, job: dict, spec: Optional[JobSpec] = None) -> int:
        """Workers a job holds (or is starting) now (``spec``: the job's, when already read)."""
        if job["state"] == JobState.QUEUED.value:
            return 0
        n = placed(job)
        if n:
            return n
        if job["id"] in self.allotted:
            return self.allotted[job["id"]]
        spec = spec or JobSpec.model_validate(job["spec"])   # admitted by an earlier control plane, not placed
        return spec.elastic.min_workers if spec.elastic.enabled else spec.parallelism.dp * spec.parallelism.pipeline_workers

    def _demands(self) -> list[tuple[dict, JobSpec, fairshare.JobDemand]]:
        """The active jobs, each with its spec (read once) and what it asks for; a job whose spec
        this version cannot read (an older relaytrain's) is left out, said once in the log."""
        rows, _ = self.store.list_jobs(states=ACTIVE, limit=100000)
        out = []
        for j in rows:
            try:
                spec = JobSpec.model_validate(j["spec"])
            except ValidationError as e:
                if j["id"] not in self.unreadable:
                    self.unreadable.add(j["id"])
                    log.warning("cluster scheduler: job %s left out, its spec is not readable: %s", j["id"],
                                str(e).splitlines()[0])
                continue
            out.append((j, spec, demand(j, spec, self.holding(j, spec))))
        return out

    # ---------------------------------------------------------------- one pass

    def tick(self, fresh: Optional[str] = None) -> dict[str, fairshare.Allocation]:
        """Decide and act once; ``fresh``: a job just submitted (its ``queued`` event is written
        here when it must wait)."""
        with self._lock:
            jobs = self._demands()
            self.capacity = self.measure_capacity()
            decisions = fairshare.allocate(self.capacity, [d for _, _, d in jobs], self.weights, self.policy)
            self.queue = {k: a for k, a in decisions.items() if a.workers == 0 and a.action == "queue"}
            for job, spec, _ in sorted(jobs, key=lambda x: x[0]["created_at"]):
                try:
                    self._act(job, spec, decisions[job["id"]], fresh == job["id"])
                except Exception as e:  # one job's trouble must not stop the others' decisions
                    log.warning("cluster scheduler: job %s: %s: %s", job["id"], type(e).__name__, e)
            gone = set(self.allotted) - {j["id"] for j, _, _ in jobs}
            for k in gone:
                self.allotted.pop(k, None)
                self.preempting.pop(k, None)
            return decisions

    def _act(self, job: dict, spec: JobSpec, a: fairshare.Allocation, fresh: bool) -> None:
        job_id = job["id"]
        if a.action == "queue":
            if fresh:
                self.store.add_events(job_id, [{"type": "queued", "message": f"queued: {a.reason}",
                                                "position": a.position}])
            return
        if a.action == "admit":
            resumes = bool(self.store.events_of(job_id, ["preempted"]))
            if not self.store.set_state(job_id, JobState.PENDING):
                return  # cancelled meanwhile
            self.allotted[job_id] = a.workers
            self.preempting.pop(job_id, None)
            self.store.add_events(job_id, [{"type": "admitted", "message": a.reason, "workers": a.workers}])
            self.admit(job, a.workers, resumes)
            return
        if a.action == "preempt":
            if time.monotonic() - self.preempting.get(job_id, -1e9) < PREEMPT_AGAIN_S:
                return
            sched = launch.find_scheduler(job_id)
            if sched is not None:
                sched.preempt.remote(a.reason)
                self.preempting[job_id] = time.monotonic()
                self.store.add_events(job_id, [{"type": "preempt", "message": a.reason}])
            return
        if not spec.elastic.enabled or self.allotted.get(job_id) == a.workers:
            return
        sched = launch.find_scheduler(job_id)
        if sched is None:
            return  # still starting (it was given its allotment) or lost (reconcile's business)
        import ray

        changed = ray.get(sched.set_allocation.remote(a.workers, a.reason), timeout=10)
        self.allotted[job_id] = a.workers
        if changed and a.action in ("shrink", "grow"):
            self.store.add_events(job_id, [{"type": a.action, "message": allotment_message(job, a), "workers": a.workers}])

    # ---------------------------------------------------------------- what clients see

    @property
    def weights(self) -> dict[str, float]:
        return self._weights()

    def queued(self, job_id: str) -> Optional[dict]:
        a = self.queue.get(job_id)
        return {"position": a.position, "reason": a.reason} if a else None

    def view(self, tenant: str) -> dict:
        """The cluster as the policy sees it: capacity, each tenant's weight, share and use,
        and the queue (other tenants' jobs without their names)."""
        jobs, weights = self._demands(), self.weights
        tenants: dict[str, dict] = {}
        for j, _, d in jobs:
            t = tenants.setdefault(j["tenant"], {"tenant": j["tenant"], "weight": weights.get(j["tenant"], 1.0),
                                                 "using": 0.0, "starting": 0.0, "running": 0, "queued": 0})
            n = placed(j)
            t["using"] += n * d.per_worker
            t["starting"] += (d.running - n) * d.per_worker  # allotted, its workers not placed yet
            t["queued" if j["state"] == JobState.QUEUED.value else "running"] += 1
        total_w = sum(t["weight"] for t in tenants.values()) or 1.0
        for t in tenants.values():
            t["share"] = round(self.capacity * t["weight"] / total_w, 3)
        queue = sorted(({"position": a.position, "reason": a.reason, "tenant": j["tenant"],
                         "job": j["id"] if j["tenant"] == tenant else None}
                        for j, _, _ in jobs for a in [self.queue.get(j["id"])] if a), key=lambda q: q["position"])
        return {"policy": self.policy, "capacity": self.capacity, "tenants": sorted(tenants.values(),
                key=lambda t: t["tenant"]), "queue": queue}
