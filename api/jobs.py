"""JobManager: the control plane's logic between the REST routes and Ray.

It validates and stores a job, starts its detached, named JobScheduler actor and
forgets it: the scheduler writes progress to the store itself, so this process holds no
training state and may restart at any time.  ``reconcile`` finds the active jobs whose
scheduler actor is gone (killed, out of memory, its node or the cluster lost): it restarts
them from their newest complete checkpoint while ``restarts.max`` allows, and marks the others
FAILED saying why, so none stays RUNNING forever.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
import uuid
from typing import Optional

from actors import launch, nodeenv
from actors.failures import lost_actor
from api.cluster import ClusterScheduler
from api.errors import Conflict, Invalid, NotFound, StorageTrouble, TooMany
from api.models import FinalModel
from service import checkpoint, logtext, packages, rayconnect, restarts
from service.loading import check_builtin_spec
from service.names import NAMESPACE
from service.settings import Settings
from service.spec import JobSpec, SpecError
from service.states import JobState
from service.store import Store

log = logging.getLogger("relaytrain.jobs")
_PREFLIGHT = threading.Lock()  # the server's checks of built-in specs, one at a time


def start_local_ray(cpus: Optional[int]) -> None:
    import os
    import shutil
    import subprocess
    import sys

    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    labels = nodeenv.prepare()  # its processes start with what a job's need (actors/nodeenv.py)
    cmd = [ray_bin, "start", "--head", "--disable-usage-stats", "--include-dashboard=true",
           "--dashboard-host=127.0.0.1", "--labels=" + ",".join(f"{k}={v}" for k, v in labels.items())]
    if cpus:
        cmd.append(f"--num-cpus={cpus}")
    log.info("starting a local Ray: %s", " ".join(cmd))
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"could not start a local Ray ({' '.join(cmd)}): {p.stderr.strip()[-500:]}")


def joined_ray_message(address: str, cpus: float, local_cpus: Optional[int]) -> str:
    """What ``serve`` says when it joins the Ray already running on its machine."""
    said = (f"relaytrain serve: using the Ray already running on this machine at {address} ({cpus:g} CPU slots): "
            "this server's own from before a restart, or another program's, whose end would end this server "
            "within a minute; pass --ray-address to choose a cluster")
    if local_cpus is not None and local_cpus != cpus:
        said += (f". --local-cpus {local_cpus} is not applied: it sizes a Ray that serve starts itself (stop this one "
                 "with `ray stop` first, if it is yours and no job of another server runs on it)")
    return said


class JobManager:
    def __init__(self, settings: Settings, store: Store, weights=None):
        """``weights``: the tenants' weights, or what gives them as they are now (api/cluster.py)."""
        self.settings, self.store = settings, store
        self.cluster = ClusterScheduler(settings, store, weights or {}, admit=self._admit)
        self.models = FinalModel(self.get, store)  # a SUCCEEDED job's model, for download
        self._stop = threading.Event()
        self._lost_lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._starting: set[str] = set()  # jobs whose scheduler actor is being created
        # the per-tenant limit is checked and the job inserted under one lock, so concurrent
        # submits cannot overrun it (one API process; the Kubernetes deployment runs one replica)
        self._admission = threading.Lock()
        self._requests = threading.Lock()  # a finish's check and its event, written together
        self._probe = None  # the readiness check's question to Ray, one at a time (ray_ok)
        self._probe_lock = threading.Lock()

    # ---------------------------------------------------------------- Ray

    def connect(self) -> None:
        import ray

        if ray.is_initialized():
            return
        kwargs = {"namespace": NAMESPACE, "logging_level": "WARNING", "log_to_driver": False}
        address = self.settings.ray_address
        if address and address.startswith("ray://"):  # Ray Client (the Kubernetes deployment)
            rayconnect.init(address, namespace=NAMESPACE)  # sends Ray's token; a refusal says why, at once
            return
        if address:
            rayconnect.init(address, **kwargs)
            return
        # The embedded default: a local Ray started as its own process (`ray start --head`),
        # so jobs keep training while this server restarts; stop it with `ray stop`.
        try:
            rayconnect.init("auto", **kwargs)
        except ConnectionError:
            start_local_ray(self.settings.local_cpus)
            rayconnect.init("auto", **kwargs)
            return
        # a Ray already running on this machine: this server's own from before a restart, or
        # anyone's (two servers would then admit jobs on the same slots): said, never silently
        print(joined_ray_message(ray.get_runtime_context().gcs_address, ray.cluster_resources().get("CPU", 0),
                                 self.settings.local_cpus), file=sys.stderr, flush=True)

    def ray_ok(self, timeout: float = 2.0) -> bool:
        """Ray answers within ``timeout`` s. A call to a Ray whose GCS is gone blocks (until the
        driver gives up on it after 60 s and ends this process): ``/readyz`` gave no answer
        at all (a user trial). One question is in flight at a time: while it is unanswered,
        later checks wait on it, and none piles up threads."""
        import concurrent.futures
        import ray

        def answers() -> bool:
            return ray.is_initialized() and bool(ray.cluster_resources())

        with self._probe_lock:
            if self._probe is None or self._probe.done():
                self._probe = concurrent.futures.Future()
                probe = self._probe

                def ask():
                    try:
                        probe.set_result(answers())
                    except Exception:
                        probe.set_result(False)

                threading.Thread(target=ask, name="relaytrain-ray-probe", daemon=True).start()
            probe = self._probe
        try:
            return probe.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            return False

    # ---------------------------------------------------------------- submit

    def _retry_of(self, tenant: str, key: Optional[str], spec: dict, resume_from: Optional[str]) -> Optional[dict]:
        """The job an Idempotency-Key was first used for, when this request is a retry of it
        (None for a new key); the key with a different spec or ``resume_from`` is a 409, not a
        silent answer about another job."""
        job = self.store.find_by_idempotency_key(tenant, key) if key else None
        if job is None:
            return None
        if job["spec"] != spec:
            raise Conflict(f"Idempotency-Key {key!r} was already used for job {job['id']} with a different spec; "
                           "a retry must send the same spec: use a new key for a new job")
        source = next((e["job"] for e in self.store.events_of(job["id"], ["resume_from"])), None)
        if source != resume_from:
            was = f"resume_from={source}" if source else "no resume_from"
            raise Conflict(f"Idempotency-Key {key!r} was already used for job {job['id']} with {was}; a retry must "
                           "send the same request: use a new key for a new job")
        return job

    def submit(self, tenant: str, spec: JobSpec, idempotency_key: Optional[str] = None,
               resume_from: Optional[str] = None) -> tuple[dict, bool]:
        """``resume_from``: an ended job of the tenant whose newest checkpoint this job starts
        from (any shape: checkpoints are by name), found now (422 if there is none)."""
        body = spec.model_dump(mode="json")
        earlier = self._retry_of(tenant, idempotency_key, body, resume_from)
        if earlier is not None:
            return self.get(tenant, earlier["id"]), False
        env = dict(spec.runtime_env)
        wd = env.get("working_dir")
        if wd is not None:
            m = packages.URI_RE.match(str(wd))
            if not m or not self.store.has_package(m.group(1), tenant):
                raise Invalid(f"runtime_env.working_dir {wd!r} is not a package you uploaded: upload your code "
                              "with POST /v1/packages (relaytrain submit does) and use the uri it returns")
        mods = env.get("py_modules") or []
        if not isinstance(mods, list):
            raise Invalid(f"runtime_env.py_modules must be a list of URIs, not a {type(mods).__name__}")
        local = [m for m in mods if not (isinstance(m, str) and "://" in m)]
        if local:
            raise Invalid(f"runtime_env.py_modules entry {local[0]!r} is not a URI the cluster can fetch (a local "
                          "path is on your machine, not the server's): upload your code with POST /v1/packages and "
                          "set runtime_env.working_dir to the uri it returns (relaytrain submit does both), or give "
                          "py_modules URIs (s3://..., https://....zip)")
        if wd is None and spec.uses_imports and "py_modules" not in env:
            raise Invalid("the spec imports user code (model.builder, data.builder or loss.builder) but names no "
                          "runtime_env.working_dir: upload the code with POST /v1/packages and set "
                          "runtime_env.working_dir to the uri it returns (relaytrain submit does both)")
        model_state = None
        if not spec.uses_imports:
            try:  # built-ins only (no user code runs here), the model on the meta device (no memory);
                with _PREFLIGHT:  # one at a time: a trace pushes torch's dispatch modes and RNG state
                    model_state = check_builtin_spec(spec)
            except SpecError as e:
                raise Invalid(str(e)) from None
        try:
            launch.check_fits(spec, self.settings.cluster_max_cpus, self.settings.cluster_max_gpus)
            path = spec.checkpoint.path
            restarts.check_local_root(spec, self.settings.home, self.settings.checkpoint_roots.split(":"))
            if spec.checkpoint.every_steps and restarts.is_url(path):  # a local folder is the server's own
                restarts.check_storage(path)
        except SpecError as e:
            raise Invalid(str(e)) from None
        resume = self._resume_source(tenant, resume_from, model_state) if resume_from is not None else None
        with self._admission:
            earlier = self._retry_of(tenant, idempotency_key, body, resume_from)  # a retry may have raced this one in
            if earlier is not None:
                return self.get(tenant, earlier["id"]), False
            if self.store.count_active(tenant) >= self.settings.max_active_jobs_per_tenant:
                raise TooMany(f"tenant {tenant!r} already has {self.settings.max_active_jobs_per_tenant} active jobs, "
                              "the limit; wait for one to end or cancel one")
            job_id = f"{spec.name}-{uuid.uuid4().hex[:8]}".lower()
            job, created = self.store.create_job(
                job_id, tenant, body, idempotency_key, state=JobState.QUEUED,
                first_events=[{"type": "submitted", "message": f"job {job_id} submitted by {tenant}"}]
                + ([resume] if resume else []))
        if created:
            self.cluster.tick(fresh=job_id)  # admitted now if it fits, else queued saying why
        return self.get(tenant, job["id"]), created

    def _resume_source(self, tenant: str, source: str, model_state: Optional[dict]) -> dict:
        """The ``resume_from`` event of a job that starts from ``source``'s newest checkpoint (read
        from its storage), which must hold the state ``model_state`` where that is known (a model
        of built-ins; the job's scheduler checks a user model's)."""
        src = self.store.get_job(source, tenant)
        if src is None:
            raise Invalid(f"resume_from: you have no job {source!r}")
        if not JobState(src["state"]).is_terminal:
            raise Conflict(f"resume_from: job {source} is {src['state']}; it still writes checkpoints: finish "
                           "or cancel it first (a finish keeps its model and writes a last checkpoint)")
        root = self.checkpoint_root(src)
        try:
            newest = checkpoint.latest(root, source) if root else None
        except Exception as e:
            raise Invalid(f"resume_from: job {source}'s checkpoints at {root} could not be read: "
                          f"{type(e).__name__}: {e}") from None
        if newest is None:
            raise Invalid(f"resume_from: job {source} has no complete checkpoint" + (
                f" under {root}" if root else " (its spec writes none: checkpoint.every_steps is 0)"))
        step = checkpoint.step_of(newest)
        try:
            checkpoint.check_fits(newest, model_state or {}, "resume_from: ")
        except ValueError as e:
            raise Invalid(str(e)) from None
        return {"type": "resume_from", "message": f"starts from job {source}'s checkpoint of step {step} at {newest}",
                "job": source, "checkpoint": str(newest), "step": step}

    def _admit(self, job: dict, workers: int, resumes: bool) -> None:
        """The cluster scheduler admitted ``job`` on ``workers``; a preempted job resumes from
        its newest checkpoint, once its old scheduler is gone; a job submitted with
        ``resume_from`` starts from that job's checkpoint."""
        if not resumes:
            self._launch(job, resume=self._origin(job["id"]), allocation=workers)
            return
        self._starting.add(job["id"])

        def later():  # its checkpoint was complete before it went back to the queue
            root, origin = self.checkpoint_root(job), self._origin(job["id"])
            read, newest = self._read_waiting(job["id"], "its checkpoints could not be read to resume it",
                                              lambda: checkpoint.newest_or_origin(root, job["id"], origin))
            if not read:
                self._starting.discard(job["id"])
                return
            self._restart(self.store.get_job(job["id"]) or job, str(newest) if newest else None)

        threading.Thread(target=later, daemon=True).start()

    def _origin(self, job_id: str) -> Optional[str]:
        """The checkpoint a job submitted with ``resume_from`` started from (None: step 0)."""
        source = self.store.events_of(job_id, ["resume_from"])
        return source[0]["checkpoint"] if source else None

    def _launch(self, job: dict, resume: Optional[str] = None, rerun_through: int = 0,
                allocation: Optional[int] = None) -> None:
        """Start the job's scheduler on ``allocation`` workers at most (an elastic job; for a
        restart: resuming from the checkpoint ``resume``, its steps up to ``rerun_through``
        marked as re-runs)."""
        now = self.store.get_job(job["id"])
        if now is None or JobState(now["state"]).is_terminal:  # cancelled meanwhile: start nothing
            self._starting.discard(job["id"])
            return
        spec = JobSpec.model_validate(job["spec"])
        env = dict(spec.runtime_env)
        self._starting.add(job["id"])  # until its actor is up (see reconcile)
        try:
            if env.get("working_dir"):
                packages.ensure_in_cluster(env["working_dir"], self.settings.packages_dir)
            past = self.store.events_of(job["id"], ["restarted", "finish_requested"])
            used = sum(e["type"] == "restarted" for e in past)  # its scheduler's restarts count too
            finish = next((e.get("by") or job["tenant"] for e in past if e["type"] == "finish_requested"), None)
            actor = launch.start_scheduler(
                job["id"], job["spec"], [], runtime_env=env, detached=True,
                checkpoint_root=self.checkpoint_root(job), resume=resume, rerun_through=rerun_through,
                start_timeout=self.settings.start_timeout_s, store_url=self.store.url, allocation=allocation,
                restarts_used=used, finish_asked=finish)
            ref = actor.start.remote()
        except Exception as e:
            self._starting.discard(job["id"])
            self._fail(job["id"], f"could not start the job's scheduler: {type(e).__name__}: {e}")
            return
        threading.Thread(target=self._watch_start, args=(job["id"], ref, actor, finish is not None),
                         daemon=True).start()

    def checkpoint_root(self, job: dict) -> Optional[str]:
        """Where a submitted job's checkpoints go (service/restarts.py)."""
        return restarts.checkpoint_root(JobSpec.model_validate(job["spec"]), home=self.settings.home,
                                        tenant=job["tenant"], job_id=job["id"])

    def _watch_start(self, job_id: str, ref, actor, told_to_finish: bool) -> None:
        import ray

        try:
            ray.get(ref, timeout=600)
        except Exception as e:
            self._starting.discard(job_id)
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            if lost_actor(e) and not e.actor_init_failed:  # killed, or its node lost, while it started
                log.warning("job %s: its scheduler was lost while it started (%s: %s)", job_id, type(e).__name__, reason)
                fresh = self.store.get_job(job_id)
                if fresh and not JobState(fresh["state"]).is_terminal:
                    self._scheduler_lost(fresh)  # restarted as any lost scheduler, while restarts.max allows
                return
            self._fail(job_id, f"the job's scheduler did not start: {reason}")
            return
        self._starting.discard(job_id)
        if not told_to_finish:  # a finish asked after _launch read the events, before the actor was found
            asked = self.store.events_of(job_id, ["finish_requested"])
            if asked:
                try:
                    ray.get(actor.finish_early.remote(asked[0].get("by") or "its tenant"), timeout=30)
                except Exception:  # ended or lost meanwhile: its restart reads the event
                    pass

    def _read_waiting(self, job_id: str, why: str, read):
        """``read()`` of a job's checkpoint storage, tried again while the storage does not answer
        (``restarts.read_waiting``, for ``storage_wait_s``; a ``waiting`` event says so):
        ``(True, what it returned)``, or ``(False, None)`` when the job is left: failed past the
        wait (saying why), ended meanwhile, or this server stops (the next one's reconcile takes
        it up)."""
        def said(message: str) -> None:
            self.store.add_events(job_id, [{"type": "waiting", "message": message, "reason": "storage"}])

        def pause() -> bool:
            now = self.store.get_job(job_id)
            return not (self._stop.wait(self.settings.reconcile_seconds) or now is None
                        or JobState(now["state"]).is_terminal)

        try:
            return restarts.read_waiting(read, why=why, wait_s=self.settings.storage_wait_s, said=said, pause=pause)
        except restarts.StorageUnreadable as e:
            self._fail(job_id, str(e))
            return False, None

    def _fail(self, job_id: str, reason: str) -> None:
        if self.store.set_state(job_id, JobState.FAILED, error=reason):
            self.store.add_events(job_id, [{"type": "failed", "message": reason}])

    # ---------------------------------------------------------------- queries

    def delete(self, tenant: str, job_id: str, checkpoints: bool = False) -> dict:
        """Delete an ended job: its row, events, metrics, logs, timelines and model files in the
        store, and with ``checkpoints`` its checkpoint folder (``<path>/<tenant>/<job>``, its own)
        first: storage that fails then keeps the job, saying so.  409 while it is active."""
        job = self.get(tenant, job_id)
        if not JobState(job["state"]).is_terminal:
            raise Conflict(f"job {job_id} is {job['state']}: cancel it first (relaytrain cancel {job_id}, or POST "
                           f"/v1/jobs/{job_id}/cancel), then delete it")
        try:
            root = self.checkpoint_root(job)
        except Exception:  # a spec this server no longer reads: the record can still go
            root = None
        if root and checkpoints and (users := self.store.resumed_by(job_id)):
            raise Conflict(f"job {job_id}'s checkpoints are where job {', '.join(users)} started from and would "
                           "restart from until it writes its own: delete them once it has ended, or delete this job "
                           "without its checkpoints")
        said = None
        if root and not self.store.events_of(job_id, ["submitted"]):
            # a `relaytrain run` job: its checkpoints are checkpoint.path itself, which its runs share
            root, checkpoints = None, False
            said = f"kept at {job['spec']['checkpoint']['path']} (relaytrain run's checkpoint.path, which its runs share)"
        if root and checkpoints:
            try:
                checkpoint.remove_tree(root)
            except Exception as e:
                raise StorageTrouble(f"job {job_id} is kept: its checkpoints at {root} could not be deleted "
                                     f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); try again, "
                                     "or delete the job without ?checkpoints=true") from None
            said = f"deleted {root}"
        elif root:
            said = f"kept at {root}"
        state = self.store.delete_job(job_id, tenant)
        if state is None:
            raise NotFound(f"no job {job_id!r}")
        if state:
            raise Conflict(f"job {job_id} is {state}: cancel it first, then delete it")
        return {"id": job_id, "deleted": True, "checkpoints": said}

    def get(self, tenant: str, job_id: str) -> dict:
        job = self.store.get_job(job_id, tenant)
        if job is None:
            raise NotFound(f"no job {job_id!r}")
        return self.with_durability([job])[0]

    def with_durability(self, rows: list[dict]) -> list[dict]:
        """Jobs with their restarts, newest checkpoint, place in the queue and allotted workers
        (for a page of them)."""
        got = self.store.durability([r["id"] for r in rows])
        out = [{**r, **got[r["id"]], "queue": self.cluster.queued(r["id"]),  # an ended job holds no allotment (the
                "allotted_workers": None if JobState(r["state"]).is_terminal  # cluster scheduler's next look drops it)
                else self.cluster.allotted.get(r["id"])} for r in rows]
        for j in out:  # an admitted job short of worker slots says so; a job past it does not
            if j["state"] not in (JobState.PENDING, JobState.RESHAPING):
                j["waiting"] = None
        return out

    def cancel(self, tenant: str, job_id: str, wait: float = 15.0) -> dict:
        import ray

        job = self.get(tenant, job_id)
        if JobState(job["state"]).is_terminal:
            if job["state"] == JobState.CANCELLED.value:
                # cancelled already (by this request's twin a moment ago, a retry after a lost
                # answer, or an earlier one): the same answer whichever came last, nothing written
                return job
            raise Conflict(f"job {job_id} already ended {job['state']}; only active jobs can be cancelled")
        # first on record: a job whose scheduler is lost while it stops is never restarted
        with self._requests:  # a second cancel of a job still stopping writes no second request
            if not self.store.events_of(job_id, ["cancel_requested"]):
                self.store.add_events(job_id, [{"type": "cancel_requested", "message": f"cancel requested by {tenant}"}])
        actor = launch.find_scheduler(job_id)
        # a scheduler still starting (importing, or waiting for a CPU) has placed nothing yet:
        # the job goes now, rather than after its scheduler came up only to stop (5-10 s).  Only a
        # job that has not run a step is judged so: a busy scheduler slow to answer must not
        # cost a running job its orderly stop
        early = job["state"] in (JobState.QUEUED.value, JobState.PENDING.value)
        starting = early and actor is not None and not ray.wait([actor.__ray_ready__.remote()], timeout=0.5)[0]
        if actor is not None and not starting:
            try:
                ray.get(actor.cancel.remote(), timeout=5)
            except ray.exceptions.GetTimeoutError:
                # alive but slow to answer (busy, niced, paused): the request waits in its queue and
                # it stops at its next step boundary; its workers keep their slots until then
                return self.get(tenant, job_id)
            except Exception:  # it is gone
                actor = None
        if actor is None or starting:
            steps = int(job.get("step") or 0)
            message = ("job cancelled while queued" if job["state"] == JobState.QUEUED.value
                       else f"job cancelled after {steps} committed steps; its scheduler was gone" if steps
                       else "job cancelled before it ran")
            if self.store.set_state(job_id, JobState.CANCELLED):
                self.store.add_events(job_id, [{"type": "cancelled", "message": message}])
            if starting:  # after the state: its start's watcher finds the job ended, not failed
                ray.kill(actor, no_restart=True)
                # gone before its slots are freed: a placement group it asked for just before the
                # kill would otherwise be made after the release, and held with nobody to free it
                launch.wait_actors_gone(job_id, timeout=5.0)
            launch.release_placement_group(job_id)
            return self.get(tenant, job_id)
        return self._until_ended(tenant, job_id, wait)

    def finish(self, tenant: str, job_id: str, wait: float = 15.0) -> dict:
        """End a training job after the step under way, keeping the model as trained so far:
        it is written out, evaluated when the spec says so, and the job SUCCEEDS.  The request
        is on record first: a scheduler lost meanwhile restarts from its newest checkpoint and
        finishes after one step."""
        import ray

        job = self.get(tenant, job_id)
        state = JobState(job["state"])
        if state.is_terminal:
            if state is JobState.SUCCEEDED and self.store.events_of(job_id, ["finish_requested"]):
                # it finished early as asked (by this request's twin a moment ago, or an earlier
                # one): the same answer whichever request came last, not a 409 decided by timing
                return job
            raise Conflict(f"job {job_id} already ended {state.value}; only a job that trains can be finished early")
        if state is JobState.QUEUED:
            raise Conflict(f"job {job_id} is QUEUED: it has no workers to write its model out; cancel it (its "
                           "checkpoints stay where they are) or finish it once it runs")
        if state is JobState.PENDING and not job.get("step"):  # (a restart starting again: it has a model)
            raise Conflict(f"job {job_id} has not started training: there is no model to keep yet; cancel it instead, "
                           "or finish it once it is RUNNING")
        with self._requests:  # two finishes at once write one request (one API process: see _admission)
            past = self.store.events_of(job_id, ["cancel_requested", "finish_requested"])
            if any(e["type"] == "cancel_requested" for e in past):
                raise Conflict(f"job {job_id} is being cancelled; a cancel cannot be turned into a finish")
            if not past:
                self.store.add_events(job_id, [{"type": "finish_requested",
                                                "message": f"finish requested by {tenant} after "
                                                           f"{int(job.get('step') or 0)} committed steps: it ends "
                                                           "after the step under way, keeping its model",
                                                "by": tenant}])
        actor = launch.find_scheduler(job_id)
        if actor is not None:
            try:
                ray.get(actor.finish_early.remote(tenant), timeout=5)
            except ray.exceptions.GetTimeoutError:  # busy: the request waits in its queue
                return self.get(tenant, job_id)
            except Exception:  # gone: reconcile restarts it, told to finish (see _launch)
                pass
        return self._until_ended(tenant, job_id, wait)

    def _until_ended(self, tenant: str, job_id: str, wait: float) -> dict:
        """The job once it has ended, or as it is after ``wait`` seconds."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            job = self.get(tenant, job_id)
            if JobState(job["state"]).is_terminal:
                return job
            time.sleep(0.2)
        return self.get(tenant, job_id)

    def log_text(self, tenant: str, job_id: str, source: str = "all", tail: Optional[int] = None) -> str:
        """The job's events and what its actors printed, merged by time, as text; ``source``:
        "all", "events" or "output"."""
        self.get(tenant, job_id)
        events = self.store.get_events(job_id, 0, 100000) if source in ("all", "events") else []
        output = self.store.get_logs(job_id) if source in ("all", "output") else []
        lines = logtext.merged(events, output)
        if tail is not None:
            lines = lines[-tail:]
        return "".join(ln + "\n" for ln in lines)

    # ---------------------------------------------------------------- reconcile

    def reconcile(self) -> int:
        """Restart (spec ``restarts``) or end each active job whose scheduler actor is gone;
        returns how many were found."""
        active = [s.value for s in JobState if not s.is_terminal and s is not JobState.QUEUED]  # queued: no actor
        jobs, _ = self.store.list_jobs(states=active, limit=10000)
        lost = 0
        for job in jobs:
            if job["id"] in self._starting or time.time() - job["created_at"] < 5:
                continue  # its actor is still being created (over ray:// the import alone takes seconds)
            if launch.find_scheduler(job["id"]) is None:
                fresh = self.store.get_job(job["id"])
                if fresh and not JobState(fresh["state"]).is_terminal:
                    self._scheduler_lost(fresh)
                    lost += 1
        self._release_leftover_slots(active={j["id"] for j in jobs})
        return lost

    def _release_leftover_slots(self, active: set) -> None:
        """Remove the placement groups still held by jobs of this store that ended and whose
        scheduler is gone: nothing else would free those worker slots (a cancel's release that
        raced the scheduler's own reservation left 2 CPUs held for good, found by the suite).
        ``active``: the jobs the reconcile just listed as active, whose groups are theirs to hold."""
        for job_id, pgs in launch.placement_groups_by_job().items():
            if job_id in active or job_id in self._starting:
                continue
            job = self.store.get_job(job_id)
            if job is None or not JobState(job["state"]).is_terminal:
                continue  # another store's job, or one that became active since the list
            if launch.find_scheduler(job_id) is not None:
                continue  # still tearing down: it removes its own
            log.warning("job %s ended %s, but %d placement group(s) of its workers were still held; "
                        "releasing them", job_id, job["state"], len(pgs))
            launch.remove_placement_groups(pgs)

    LOST = "the job's scheduler actor was lost (killed, out of memory, or its node or the Ray cluster went)"

    def _scheduler_lost(self, job: dict) -> None:
        """Restart the job from its newest complete checkpoint when its spec allows, else end it
        saying why.  A job its user was cancelling ends CANCELLED.  Found by the reconcile or by
        the watch of a scheduler lost while it started: once (the lock, and a job being decided
        or restarted is ``_starting``).  Decided in a thread of the job's own: reading its
        storage may take seconds a try, and minutes while it does not answer, which held the
        reconcile and the cluster scheduler's loop for every job (a review)."""
        with self._lost_lock:
            fresh = self.store.get_job(job["id"])
            if job["id"] in self._starting or fresh is None or JobState(fresh["state"]).is_terminal:
                return
            self._starting.add(job["id"])  # the reconcile leaves it while this is decided
        threading.Thread(target=self._restart_or_end, args=(fresh,), name=f"relaytrain-restart-{job['id']}",
                         daemon=True).start()

    def _restart_or_end(self, job: dict) -> None:
        job_id = job["id"]
        restarting = False
        try:
            spec = JobSpec.model_validate(job["spec"])
            launch.release_placement_group(job_id)
            past = self.store.events_of(job_id, ["restarted", "cancel_requested"])
            used = sum(e["type"] == "restarted" for e in past)
            cancelling = any(e["type"] == "cancel_requested" for e in past)
            root, origin = self.checkpoint_root(job), self._origin(job_id)
            read, decided = self._read_waiting(
                job_id, f"{self.LOST}, and its checkpoints at {root} could not be read",
                lambda: checkpoint.restart_decision(spec, root, job_id, used=used, committed=job["step"],
                                                    reason=self.LOST, cancelling=cancelling, origin=origin))
            if not read:
                return
            d, newest = decided
            if cancelling:
                if self.store.set_state(job_id, JobState.CANCELLED):
                    self.store.add_events(job_id, [{"type": "cancelled", "message": d.message}])
                return
            if not d.restart:
                self._fail(job_id, d.message)
                return
            self.store.add_events(job_id, [{"type": "restarted", "message": d.message, **d.fields,
                                            "checkpoint": str(newest)}])
            restarting = True
            self._restart(job, str(newest))
        finally:
            if not restarting:
                self._starting.discard(job_id)

    def _restart(self, job: dict, resume: Optional[str]) -> None:
        """Start ``job`` again from the checkpoint ``resume`` (its steps so far marked as re-runs),
        once its old scheduler and workers are gone (lost, or preempted) and their slots free."""
        try:  # still "starting" until _launch has its new actor up: reconcile must not find it lost meanwhile
            launch.wait_actors_gone(job["id"], timeout=30.0)
            self._launch(job, resume=resume, rerun_through=job["step"],
                         allocation=self.cluster.allotted.get(job["id"]))
        except BaseException:
            self._starting.discard(job["id"])
            raise

    def start_background(self) -> None:
        """Every ``queue_seconds`` the cluster scheduler decides; every ``reconcile_seconds``
        lost schedulers are found."""
        def loop():
            due = time.monotonic() + self.settings.reconcile_seconds
            while not self._stop.wait(min(self.settings.queue_seconds, self.settings.reconcile_seconds)):
                try:
                    self.cluster.tick()
                except Exception as e:
                    log.warning("the cluster scheduler failed: %s", e)
                if time.monotonic() < due:
                    continue
                due = time.monotonic() + self.settings.reconcile_seconds
                try:
                    self.reconcile()
                except Exception as e:
                    log.warning("reconcile failed: %s", e)

        self.reconcile()
        self.cluster.tick()
        self._thread = threading.Thread(target=loop, name="relaytrain-reconcile", daemon=True)
        self._thread.start()

    def stop_background(self) -> None:
        self._stop.set()
