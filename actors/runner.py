"""``relaytrain run``: train one job in the foreground and write its outputs.

DIR/model/         the final model: a safetensors shard per stage and its index (service/shards.py)
DIR/model.pt       the same in one file (the model's state_dict), up to RELAYTRAIN_MODEL_PT_MAX_MB (1024)
DIR/metrics.jsonl  one row per committed step, flushed as it commits
DIR/events.jsonl   started, shape, checkpoints, restarts, finished, failures

A job whose scheduler actor is lost restarts from its newest complete checkpoint while the
spec's ``restarts.max`` allows (service/restarts.py), as a submitted job does.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

from actors import launch, layerfacts
from service import checkpoint, restarts, shards
from service.loading import search_dirs
from service.replicas import shape_label_of
from service.spec import JobSpec, SpecError, load_spec
from service.states import JobState


class JobFailed(RuntimeError):
    """The job ran and failed; ``str()`` is one sentence, ``detail`` the worker's traceback."""

    def __init__(self, message: str, detail: str = "", result: Optional[dict] = None):
        super().__init__(message)
        self.detail, self.result = detail, result


class _Outputs:
    def __init__(self, out: Path, append: bool):
        """A new run starts the files anew; a resumed one continues them."""
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        mode = "a" if append else "w"
        # a resumed run's steps up to the newest the file holds are run again: their rows say so
        # ("rerun": true, as a restart's are), beside the first run's (a user trial found two
        # unmarked rows of steps 16 and 17 after a --resume from step 15's checkpoint)
        self.rerun_through = _newest_step(out / "metrics.jsonl") if append else 0
        self.metrics = open(out / "metrics.jsonl", mode)
        self.events = open(out / "events.jsonl", mode)
        for f in (self.metrics, self.events):  # after a torn last line (a run killed mid-write): a line of its own
            if append and f.tell() and not _ends_a_line(Path(f.name)):
                f.write("\n")

    def write(self, f, rows: list[dict]) -> None:
        for r in rows:
            if f is self.metrics and r.get("step", 0) <= self.rerun_through and not r.get("rerun"):
                r = {**r, "rerun": True}
            f.write(json.dumps(r) + "\n")
        if rows:
            f.flush()

    def end_at(self, step: int) -> None:
        """The job finished early after ``step``, having gone back to an older copy on the way:
        the rows of later steps it had committed before that go from metrics.jsonl."""
        self.metrics.close()
        path = self.out / "metrics.jsonl"
        kept = [ln for ln in path.read_text().splitlines(keepends=True) if json.loads(ln)["step"] <= step]
        part = path.with_name(path.name + ".part")  # whole or not at all: a crash here leaves the old file
        part.write_text("".join(kept))
        os.replace(part, path)
        self.metrics = open(path, "a")

    def event(self, kind: str, message: str, **fields) -> dict:
        row = {"time": time.time(), "type": kind, "message": message, **fields}
        self.write(self.events, [row])
        return row

    def close(self) -> None:
        self.metrics.close()
        self.events.close()


def _ends_a_line(path: Path) -> bool:
    """The file's last byte is a newline (read alone: a long run's metrics.jsonl is large)."""
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _newest_step(path: Path) -> int:
    """The highest step of a metrics.jsonl (0: none, or no file)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return 0
    steps = []
    for ln in lines:
        try:
            steps.append(int(json.loads(ln)["step"]))
        except (ValueError, KeyError, TypeError):  # a torn last line of a run that was killed
            continue
    return max(steps, default=0)


def run_job(spec_path: Optional[str] = None, out: str = "out", *, spec: Optional[JobSpec] = None,
            spec_dir: Optional[str] = None, ray_address: Optional[str] = None, resume: Optional[str] = None,
            progress: bool = True, timeout: float = 300.0, record: bool = True,
            local_cpus: Optional[int] = None) -> dict:
    """Train ``spec`` to completion; returns the scheduler's final report.  Raises
    :class:`SpecError` before anything starts for a spec that cannot work, and
    :class:`JobFailed` when the job fails while running.  With ``record`` the job and its
    progress also go to the job store (SQLite under RELAYTRAIN_HOME by default), where
    ``relaytrain serve`` shows them."""
    if spec is None:
        spec = load_spec(spec_path)
        spec_dir = spec_dir or str(Path(spec_path).resolve().parent)
    search = search_dirs(spec_dir)
    traced = layerfacts.learn(spec, search)  # the pre-flight check; its trace spares the scheduler one
    ckpt_root = restarts.checkpoint_root(spec)
    restarts.check_storage(ckpt_root)
    resume_path = None
    if resume is not None:
        try:
            found = checkpoint.resolve(resume or spec.checkpoint.path)
            # a local path is where this command runs: the scheduler may run in the spec's
            # uploaded folder (user code), where a relative one would name nothing
            resume_path = str(found.resolve()) if isinstance(found, Path) else found
        except FileNotFoundError as e:
            raise SpecError(f"--resume: {e}") from None
        try:
            checkpoint.check_fits(resume_path, traced.state, "--resume: ")
        except ValueError as e:
            raise SpecError(str(e)) from None

    import ray

    started_ray = launch.connect(ray_address, local_cpus)
    try:  # a job this Ray can never hold is refused before anything in ``out`` is touched
        launch.check_fits(spec)
    except BaseException as e:
        if started_ray:
            ray.shutdown()
        if isinstance(e, SpecError) and started_ray and not ray_address and "CPU slots" in str(e):
            raise SpecError(f"{e}; on this machine `--local-cpus N` gives the local Ray N worker slots (they "
                            "are logical: more than its cores run, sharing them)") from None
        raise
    outputs = _Outputs(Path(out), append=resume_path is not None)
    model_dir = (Path(out) / "model").resolve()
    # no shard of an earlier run with another pp stays, and no model.pt of an earlier run beside
    # this run's files: the model is written when this job succeeds
    shutil.rmtree(model_dir, ignore_errors=True)
    (Path(out) / "model.pt").unlink(missing_ok=True)
    job_id = f"{spec.name}-{uuid.uuid4().hex[:8]}".lower()
    store = _record_in_store(job_id, spec) if record else None
    sched = None
    seen = _Seen(spec, progress)
    try:
        rerun_through, used, origin = 0, 0, resume_path
        while True:
            sched = launch.start_scheduler(
                job_id, spec.model_dump(mode="json"), search,
                runtime_env=launch.upload_runtime_env(launch.job_runtime_env(spec, spec_dir)),
                checkpoint_root=ckpt_root, resume=resume_path, timeout=timeout,
                store_url=store.url if store else None, model_dir=str(model_dir), rerun_through=rerun_through,
                traced=traced, restarts_used=used + seen.restarts, finish_asked=seen.finishing)
            seen.cursor = (0, 0)  # this scheduler's rows and events copied so far
            try:
                with _Interrupts(seen):
                    final = _follow(sched, sched.run.remote(), outputs, seen)
                break
            except ray.exceptions.RayActorError:  # the scheduler was lost: restart it, or say why not
                resume_path = _restart_from(spec, ckpt_root, used + seen.restarts, seen, outputs, store, job_id,
                                            origin)
                rerun_through, used = seen.committed, used + 1
                launch.wait_actors_gone(job_id, timeout=30.0)
                launch.release_placement_group(job_id)
        if final["state"] != JobState.SUCCEEDED.value:
            detail = next((e.get("detail", "") for e in reversed(final["events"]) if e["type"] == "failed"), "")
            raise JobFailed(final["error"] or f"job ended {final['state']}", detail, final)
        index = ray.get(sched.model_index.remote())
        where = _save_model(index, model_dir, Path(out) / "model.pt")
        if store:
            store.update_job(job_id, model_path=str(where.resolve()))
        final["events"].append(outputs.event("saved", f"model saved to {where}"))  # the report says all events.jsonl does
        final["model"] = str(where)
        return final
    except BaseException as e:
        # the job's row ends too (a run that failed before its scheduler ran left it PENDING, and a
        # server's reconcile later failed it as "the job's scheduler actor was lost": a user trial);
        # a row the scheduler ended keeps its end
        stopped = isinstance(e, KeyboardInterrupt)
        if stopped and sched is not None:  # the steps it committed since the last poll: in the files too
            _drain(sched, job_id, outputs, seen)
        why = "stopped with Ctrl-C" if stopped else str(e) if isinstance(e, (JobFailed, SpecError)) \
            else f"{type(e).__name__}: {e}"
        if not isinstance(e, JobFailed):
            outputs.event("cancelled" if stopped else "failed", why)
        try:
            if store and store.set_state(job_id, JobState.CANCELLED if stopped else JobState.FAILED,
                                         error=None if stopped else why):
                store.add_events(job_id, [{"type": "cancelled" if stopped else "failed", "message": why}])
        except Exception as err:  # store trouble costs a warning, never the run's own error
            print(f"relaytrain: warning: could not record the job's end in the job store: {err}", file=sys.stderr)
        raise
    finally:
        seen.close()
        outputs.close()
        if sched is not None:
            launch.stop(sched, job_id)
        if started_ray:
            ray.shutdown()


def _restart_from(spec: JobSpec, root: Optional[str], used: int, seen: "_Seen", outputs: "_Outputs", store,
                  job_id: str, origin: Optional[str]) -> str:
    """The checkpoint a job whose scheduler was lost restarts from (a ``restarted`` event says
    so, in the files, the store and the run's report): its newest own, else ``origin``, the one
    ``--resume`` started it from; raises :class:`JobFailed` when it does not restart
    (service/restarts.py).  Storage that does not answer is tried again for
    ``RELAYTRAIN_STORAGE_WAIT_S`` (a ``waiting`` event says so once), as the control plane does."""
    from service.settings import Settings

    committed = seen.committed
    reason = "the job's scheduler actor was lost (killed, out of memory, or its node went)"
    wait_s = Settings().storage_wait_s

    def said(message: str) -> None:
        _record({"time": time.time(), "type": "waiting", "reason": "storage", "message": message}, seen, outputs,
                store, job_id)
        print(f"relaytrain: {message}", file=sys.stderr)

    def pause() -> bool:
        time.sleep(min(5.0, max(0.5, wait_s / 20)))
        return True

    try:
        _, (d, newest) = restarts.read_waiting(
            lambda: checkpoint.restart_decision(spec, root, job_id, used=used, committed=committed, reason=reason,
                                                origin=origin),
            why=f"{reason}, and its checkpoints at {root} could not be read", wait_s=wait_s, said=said, pause=pause)
    except restarts.StorageUnreadable as e:
        d, newest = restarts.Decision(False, str(e)), None
    if not d.restart:
        if store:
            store.set_state(job_id, JobState.FAILED, error=d.message)
        _record({"time": time.time(), "type": "failed", "message": d.message}, None, outputs, store, job_id)
        raise JobFailed(d.message)
    row = {"time": time.time(), "type": "restarted", "message": d.message, **d.fields, "checkpoint": str(newest)}
    _record(row, seen, outputs, store, job_id)
    print(f"relaytrain: {d.message}", file=sys.stderr)
    return str(newest)


def _record(row: dict, seen: Optional["_Seen"], outputs: "_Outputs", store, job_id: str) -> None:
    """An event of the run itself, not of its scheduler: in events.jsonl, the job store and
    (``seen``) the run's report."""
    outputs.write(outputs.events, [row])
    if seen is not None:
        seen.ours.append(row)
    if store:
        store.add_events(job_id, [row])


def _record_in_store(job_id: str, spec: JobSpec):
    """The job's row in the embedded job store, as tenant 'local'; a store that cannot be
    opened costs a warning, not the run."""
    from service.auth import LOCAL_TENANT
    from service.settings import Settings
    from service.store import Store

    try:
        store = Store(Settings().db_url)
        store.create_job(job_id, LOCAL_TENANT, spec.model_dump(mode="json"))
        return store
    except Exception as e:
        print(f"relaytrain: warning: not recording the job in the job store: {e}", file=sys.stderr)
        return None


class _Seen:
    """What the schedulers of a run reported so far (a restarted run has several), and the
    progress bar."""

    def __init__(self, spec: JobSpec, progress: bool):
        self.events: list[dict] = []  # the schedulers'
        self.ours: list[dict] = []    # this command's own (a restart of a lost scheduler)
        self.metrics: list[dict] = []
        self.committed = 0   # the most steps ever committed
        self.cursor = (0, 0)  # the current scheduler's metrics rows and events copied to the files
        self.stop_asked = False  # a second Ctrl-C (or one before any step): _follow stops the job
        self.finishing: Optional[str] = None  # who asked the job to finish early (a first Ctrl-C)
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=spec.training.steps, desc=spec.name, unit="step", file=sys.stderr,
                            dynamic_ncols=True)

    @property
    def restarts(self) -> int:
        """Restarts its schedulers made themselves (a fixed-shape job that lost a worker)."""
        return sum(e["type"] == "restarted" for e in self.events)

    def add(self, snap: dict) -> None:
        self.events += snap["events"]
        self.metrics += snap["metrics"]
        self.committed = max([self.committed] + [m["step"] for m in snap["metrics"]])
        bar = self.bar
        if bar is not None:
            if snap["metrics"]:
                last = snap["metrics"][-1]
                bar.n = last["step"]
                shape = shape_label_of(last)
                bar.set_postfix(loss=f"{last['loss']:.4f}" if last["loss"] is not None else "skipped",
                                samples_s=f"{last['samples_per_s']:.0f}", shape=shape)
            elif bar.n == 0 and snap["step"]:  # a resumed run: the bar starts at the step it resumed from
                bar.n = snap["step"]
                bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Interrupts:
    """Ctrl-C while a job trains (in the main thread): the first, once a step has committed,
    asks the job to finish after the step under way, keeping its model (``_follow`` tells the
    scheduler); the next, or one before any step, stops it as before (KeyboardInterrupt)."""

    def __init__(self, seen: "_Seen"):
        self.seen, self.before = seen, None

    def __enter__(self) -> "_Interrupts":
        if threading.current_thread() is threading.main_thread():
            self.before = signal.signal(signal.SIGINT, self._on)
        return self

    def _on(self, signum, frame) -> None:
        if self.seen.finishing or not self.seen.committed:
            # raised by ``_follow`` between two polls, never between a write to the files and its
            # cursor (which would copy rows twice when the stop drains the rest)
            self.seen.stop_asked = True
            return
        self.seen.finishing = "its user (Ctrl-C)"

    def __exit__(self, *exc) -> None:
        if self.before is not None:
            signal.signal(signal.SIGINT, self.before)


def _drain(sched, job_id: str, outputs: _Outputs, seen: _Seen) -> None:
    """A stopped run's last rows: the scheduler is stopped at its step boundary (``launch.stop``
    would do it next), then what it committed since the last poll goes to the files.  A second
    Ctrl-C left steps the job store holds out of metrics.jsonl (a user trial: 17 rows in the
    file, 19 in the store).  Best effort: a scheduler that does not answer is killed as before."""
    import ray

    patient = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGINT, signal.SIG_IGN) if patient else None  # the store's end is written next
    try:
        launch.stop_at_boundary(sched)
        snap = ray.get(sched.poll.remote(*seen.cursor), timeout=5)
    except Exception:
        return
    finally:
        if patient:
            signal.signal(signal.SIGINT, before)
    outputs.write(outputs.metrics, snap["metrics"])
    outputs.write(outputs.events, snap["events"])
    seen.add(snap)


def _follow(sched, done_ref, outputs: _Outputs, seen: _Seen) -> dict:
    """Copy the scheduler's new metrics and events to the files until it ends; raises Ray's
    actor error when the scheduler is lost."""
    import ray

    m_seen, e_seen = seen.cursor
    unavailable_since = None
    told = bool(seen.finishing)  # a restarted scheduler was told when it was started
    while True:
        if seen.stop_asked:
            raise KeyboardInterrupt
        try:
            finished = bool(ray.wait([done_ref], timeout=0.2)[0])
            snap = ray.get(sched.poll.remote(m_seen, e_seen))
            unavailable_since = None
        except ray.exceptions.ActorUnavailableError:  # maybe a passing network fault: dead only when it stays
            unavailable_since = unavailable_since or time.monotonic()
            if time.monotonic() - unavailable_since > 30.0:
                raise
            time.sleep(1.0)
            continue
        if seen.finishing and not told:  # a first Ctrl-C (see _Interrupts)
            try:
                committed = ray.get(sched.finish_early.remote(seen.finishing), timeout=10)
            except ray.exceptions.GetTimeoutError:  # busy: asked again at the next poll
                continue
            told = True
            print(f"\nrelaytrain: finishing after the step under way ({committed} committed), keeping the "
                  "model; Ctrl-C again stops it at its next step boundary", file=sys.stderr)
        outputs.write(outputs.metrics, snap["metrics"])
        outputs.write(outputs.events, snap["events"])
        seen.add(snap)
        m_seen += len(snap["metrics"])
        e_seen += len(snap["events"])
        seen.cursor = (m_seen, e_seen)
        if finished:
            final = ray.get(done_ref)  # the report, with the newest steps' timelines
            end = final.get("step") or 0
            if final.get("state") == "SUCCEEDED" and any(m["step"] > end for m in seen.metrics):  # finished early
                seen.metrics = [m for m in seen.metrics if m["step"] <= end]
                outputs.end_at(end)
            final.update(metrics=seen.metrics, events=sorted(seen.events + seen.ours, key=lambda e: e["time"]))
            return final


def _save_model(index: dict, model_dir: Path, path: Path) -> Path:
    """The model as one ``model.pt`` too (its state_dict, in the model's order) when it fits
    ``shards.model_pt_max_bytes()``; returns where the model is (that file, or the shards' folder)."""
    path.unlink(missing_ok=True)
    if index["metadata"]["total_size"] > shards.model_pt_max_bytes():
        return model_dir
    shards.to_model_pt(model_dir, path)
    return path
