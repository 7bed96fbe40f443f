"""JobScheduler: one per job.  Plans the shape (stage partition from a layer profile),
spawns one StageWorker per (dp_rank, pp_rank), drives one call per worker per step,
commits steps, writes checkpoints, and keeps the job's metrics and events for whoever
polls it (the CLI today, the control plane later).
"""
from __future__ import annotations

import collections
import os
import re
import sys
import threading
import time
import traceback
from typing import Any, Optional

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.worker import StageWorker
from service import checkpoint, partition, schedules
from service.loading import build_data, build_model, preflight
from service.sampling import step_indices
from service.spec import JobSpec, SpecError
from service.states import JobState

NAMESPACE = "relaytrain"


class JobFailure(RuntimeError):
    """A job stopped; ``str()`` is the one sentence a person reads first."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


def placement_group_name(job_id: str) -> str:
    return f"relaytrain:{job_id}:workers"


def _worker_failure(name: str, step: Optional[int], err: Exception) -> JobFailure:
    cause = getattr(err, "cause", None) or err
    where = f" at step {step + 1}" if step is not None else " while starting"
    if isinstance(err, ray.exceptions.RayTaskError):
        what = f"raised {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        if isinstance(cause, ray.exceptions.RayTaskError) or type(cause).__name__.startswith("RayTaskError"):
            what = str(err).strip().splitlines()[-1]
    elif isinstance(err, ray.exceptions.ActorDiedError) and "__init__" in str(err):
        lines = [ln for ln in str(err).splitlines() if ln.strip()]
        what = "failed to start: " + (lines[-1].strip() if lines else "its constructor raised")
    elif isinstance(err, ray.exceptions.RayActorError):
        what = "died (its process or node was lost)"
    else:
        what = f"raised {type(err).__name__}: {err}"
    return JobFailure(f"worker {name}{where} {what}", detail=_traceback_text(name, err))


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _traceback_text(name: str, err: Exception) -> str:
    """The remote traceback as a person reads it, without terminal colours."""
    lines = _ANSI.sub("", str(err)).strip().splitlines()
    if lines and lines[0].startswith("ray::"):
        return f"Traceback from worker {name} ({lines[0]}), most recent call last:\n" + "\n".join(lines[1:])
    return f"Traceback from worker {name}:\n" + "\n".join(lines)


class StoreSink:
    """Writes a job's progress to the job store as it happens.  A store that is briefly
    unreachable does not stop training: rows wait and go with the next write."""

    def __init__(self, url: str, job_id: str):
        from service.store import Store

        self.store, self.job_id = Store(url), job_id
        self._events: list[dict] = []
        self._metrics: list[dict] = []
        self._fields: dict[str, Any] = {}
        self._state: Optional[tuple[JobState, Optional[str]]] = None
        self._lock = threading.Lock()

    def write(self, events=(), metrics=(), state: Optional[JobState] = None, error: Optional[str] = None,
              **fields) -> None:
        """Queue rows, job fields and a state change, then try to write everything queued."""
        with self._lock:
            self._events += list(events)
            self._metrics += list(metrics)
            self._fields.update(fields)
            if state is not None:
                self._state = (state, error)
            try:
                if self._events:
                    self.store.add_events(self.job_id, [_jsonable(e) for e in self._events])
                    self._events = []
                if self._metrics:
                    self.store.add_metrics(self.job_id, self._metrics)
                    self._metrics = []
                if self._fields:
                    self.store.update_job(self.job_id, **self._fields)
                    self._fields = {}
                if self._state is not None:
                    self.store.set_state(self.job_id, self._state[0], error=self._state[1])
                    self._state = None
            except Exception as e:  # keep training; what is queued goes with the next write
                print(f"relaytrain: job store write failed, will retry: {e}", file=sys.stderr)


def _jsonable(row: dict) -> dict:
    return {k: (v if isinstance(v, (str, int, float, bool, list, dict, type(None))) else str(v)) for k, v in row.items()}


class JobScheduler:
    def __init__(self, job_id: str, spec: dict, search: list[str], checkpoint_root: Optional[str] = None,
                 resume: Optional[str] = None, timeout: float = 300.0, start_timeout: float = 120.0,
                 store_url: Optional[str] = None, detached: bool = False, preflight: bool = False):
        self.job_id = job_id
        self.detached = detached
        self.run_preflight = preflight
        self.sink = StoreSink(store_url, job_id) if store_url else None
        self.spec = JobSpec.model_validate(spec)
        self.search = search
        self.checkpoint_root = checkpoint_root
        self.resume = resume
        self.timeout, self.start_timeout = timeout, start_timeout
        self.state = JobState.PENDING
        self.metrics: list[dict] = []
        self.events: list[dict] = []
        self.error: Optional[str] = None
        self.step = 0
        self.shape: dict[str, Any] = {}
        self.workers: dict[tuple[int, int], Any] = {}
        self.pg = None
        self._final: Optional[dict] = None
        self.timelines: collections.deque = collections.deque(maxlen=16)  # recent steps only
        self._cancel = threading.Event()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"relaytrain:{self.job_id}:scheduler"

    # ---------------------------------------------------------------- reporting

    def _event(self, kind: str, message: str, **fields) -> None:
        row = {"time": time.time(), "type": kind, "message": message, **fields}
        with self._lock:
            self.events.append(row)
        if self.sink:
            self.sink.write(events=[row])

    def _set_state(self, state: JobState, error: Optional[str] = None) -> None:
        with self._lock:
            self.state = state
            if error is not None:
                self.error = error
        if self.sink:
            self.sink.write(state=state, error=error)

    def start(self) -> bool:
        """Run the job in a thread of this actor and return at once (the control plane
        does not wait on a call that its own restart would cut)."""
        threading.Thread(target=self._run_detached, name="relaytrain-job", daemon=True).start()
        return True

    def _run_detached(self) -> None:
        self.run()
        if self.detached:  # everything is in the store: leave nothing behind
            time.sleep(1.0)
            ray.actor.exit_actor()

    def poll(self, metrics_from: int = 0, events_from: int = 0) -> dict:
        with self._lock:
            return {"state": self.state.value, "step": self.step, "steps": self.spec.training.steps,
                    "shape": dict(self.shape), "error": self.error,
                    "metrics": self.metrics[metrics_from:], "events": self.events[events_from:]}

    def cancel(self) -> bool:
        self._cancel.set()
        return True

    def model_state(self) -> Optional[dict]:
        return self._final

    def timeline(self, step: Optional[int] = None) -> Optional[dict]:
        """Measured (action, start, end) per worker for a recent step (the newest by default)."""
        with self._lock:
            for entry in reversed(self.timelines):
                if step is None or entry["step"] == step:
                    return entry
        return None

    # ---------------------------------------------------------------- the job

    def run(self) -> dict:
        try:
            self._run()
        except (JobFailure, SpecError) as e:
            self._event("failed", str(e), detail=getattr(e, "detail", ""))
            self._set_state(JobState.FAILED, str(e))
        except Exception as e:  # a bug or an unexpected Ray error: still say why
            msg = f"the scheduler raised {type(e).__name__}: {e}"
            self._event("failed", msg, detail=traceback.format_exc())
            self._set_state(JobState.FAILED, msg)
        finally:
            self._teardown()
        final = self.poll(len(self.metrics), len(self.events))
        final["timelines"] = list(self.timelines)
        return final

    def _run(self) -> None:
        spec = self.spec
        self._event("started", f"job {self.job_id} started")
        if self.run_preflight:  # user code is imported here, never in the API server
            preflight(spec, [os.getcwd(), *self.search])
        p = spec.parallelism
        bounds, boundary, costs = self._plan()
        gpus = self._gpus_per_worker()
        self.shape = {"dp": p.dp, "pp": p.pp, "partition": [b - a for a, b in bounds], "schedule": p.schedule,
                      "transport": p.transport, "microbatches": spec.microbatches, "gpus_per_worker": gpus}
        if self.sink:
            self.sink.write(shape=self.shape)
        self._event("shape", f"shape dp={p.dp} x pp={p.pp}, layers per stage {self.shape['partition']}, "
                    f"{p.schedule} with {spec.microbatches // p.dp} microbatches per replica, transport {p.transport}",
                    **self.shape, layer_costs_s=costs)
        self._spawn(bounds, boundary, gpus)
        start = self._maybe_resume()
        self._set_state(JobState.RUNNING)
        self._train(start)
        if self.state is JobState.RUNNING:
            if self.sink and self.detached:
                self._save_model()
            self._event("finished", f"job finished: {spec.training.steps} steps, last loss "
                        f"{self.metrics[-1]['loss']:.6g}" if self.metrics else "job finished")
            self._set_state(JobState.SUCCEEDED)

    def _plan(self):
        """Stage bounds, the (shape, dtype) at each stage boundary, and the layer costs."""
        spec, p = self.spec, self.spec.parallelism
        search = [os.getcwd(), *self.search]
        model = build_model(spec, search)
        samples = build_data(spec, search)
        t = spec.training
        idx = step_indices(0, len(samples), t.global_batch_size, t.seed, t.shuffle)[: t.microbatch_size]
        x, _ = samples.batch(idx)
        costs = None
        if p.partition == "balanced" and p.pp > 1:
            costs = partition.profile_layers(model, x, threads=max(1, int(spec.resources.cpus_per_worker)))
        sizes = partition.choose(p.partition, len(model), p.pp, costs)
        bounds = partition.bounds(sizes)
        metas = []
        with torch.no_grad():
            h = x
            for layer in model:
                h = layer(h)
                metas.append((tuple(h.shape), h.dtype))
        boundary = [metas[hi - 1] for _, hi in bounds]
        return bounds, boundary, costs

    def _gpus_per_worker(self) -> float:
        g = self.spec.resources.gpus_per_worker
        if g is not None:
            return g
        workers = self.spec.parallelism.dp * self.spec.parallelism.pp
        return 1.0 if ray.cluster_resources().get("GPU", 0) >= workers else 0.0

    def _spawn(self, bounds, boundary, gpus: float) -> None:
        spec, p = self.spec, self.spec.parallelism
        cpus = spec.resources.cpus_per_worker
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        self.pg = placement_group([dict(bundle) for _ in range(p.dp * p.pp)], strategy="PACK",
                                  name=placement_group_name(self.job_id),
                                  lifetime="detached" if self.detached else None)
        if not self.pg.wait(self.start_timeout):
            total = ray.cluster_resources()
            raise JobFailure(
                f"could not place {p.dp * p.pp} workers of {bundle} within {self.start_timeout:.0f} s "
                f"(the cluster has {total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs in all); "
                "lower dp x pp or the resources per worker, or add nodes")
        Worker = ray.remote(StageWorker)
        spec_dict = spec.model_dump(mode="json")
        for r in range(p.dp):
            for s in range(p.pp):
                self.workers[(r, s)] = Worker.options(
                    name=f"relaytrain:{self.job_id}:w{r}.{s}", namespace=NAMESPACE,
                    num_cpus=cpus, num_gpus=gpus, max_concurrency=4,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, r * p.pp + s),
                ).remote(self.job_id, spec_dict, r, s, p.dp, p.pp, bounds, boundary, self.search, p.schedule,
                         self.timeout)
        self._gather({k: w.__ray_ready__.remote() for k, w in self.workers.items()}, None, self.start_timeout)
        need_group = p.transport == "collective" or p.dp > 1
        rdzv = ray.get(self.workers[(0, 0)].rendezvous_address.remote()) if need_group else None
        calls = {}
        for (r, s), w in self.workers.items():
            prev_w = self.workers.get((r, s - 1))
            next_w = self.workers.get((r, s + 1))
            calls[(r, s)] = w.connect.remote(p.transport, (prev_w, next_w), rdzv, p.dp * p.pp)
        self._gather(calls, None, self.start_timeout)

    def _maybe_resume(self) -> int:
        if not self.resume:
            return 0
        state = checkpoint.load(self.resume)
        step = int(state["step"])
        ref = ray.put({"model": state["model"], "optim": state["optim"]})
        self._gather({k: w.load_state.remote(ref) for k, w in self.workers.items()}, None, self.timeout)
        self.step = step
        self._event("resumed", f"resumed from {state['path']} at step {step}", checkpoint=state["path"], step=step)
        return step

    def _gather(self, refs: dict, step: Optional[int], timeout: float) -> dict:
        """Results of one call per worker; the first failure stops the job at once."""
        by_ref = {ref: key for key, ref in refs.items()}
        pending = list(by_ref)
        out = {}
        deadline = time.monotonic() + timeout
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                names = ", ".join(f"w{r}.{s}" for r, s in sorted(by_ref[x] for x in pending))
                what = f"step {step + 1}" if step is not None else "start-up"
                raise JobFailure(f"workers {names} did not finish {what} within {timeout:.0f} s")
            key = by_ref[done[0]]
            try:
                out[key] = ray.get(done[0])
            except Exception as e:
                raise _worker_failure(f"w{key[0]}.{key[1]}", step, e) from None
        return out

    def _train(self, start: int) -> None:
        spec = self.spec
        steps, B = spec.training.steps, spec.training.global_batch_size
        every = spec.checkpoint.every_steps
        for step in range(start, steps):
            if self._cancel.is_set():
                self._event("cancelled", f"job cancelled after {step} committed steps")
                self._set_state(JobState.CANCELLED)
                return
            t0 = time.time()
            stats = self._gather({k: w.run_step.remote(step) for k, w in self.workers.items()}, step, self.timeout)
            t1 = time.time()
            row = self._metrics_row(step, stats, t1 - t0, B)
            with self._lock:
                self.timelines.append({"step": step + 1, "workers": {
                    f"w{r}.{s}": st.pop("timeline") for (r, s), st in sorted(stats.items())}})
                self.metrics.append(row)
                self.step = step + 1
            if self.sink:
                self.sink.write(metrics=[row])
            if every and ((step + 1) % every == 0 or step + 1 == steps) and self.checkpoint_root:
                path = checkpoint.save(self.checkpoint_root, step + 1, *self._collect_state(),
                                       {"job_id": self.job_id, "name": spec.name}, keep=spec.checkpoint.keep)
                self._event("checkpoint", f"checkpoint of step {step + 1} at {path}", step=step + 1, path=str(path))
        model, _ = self._collect_state()
        self._final = model

    def _metrics_row(self, step: int, stats: dict, wall: float, B: int) -> dict:
        p = self.spec.parallelism
        loss = sum(s["loss"] for s in stats.values() if s["loss"] is not None)
        utils = []
        for r in range(p.dp):
            cells = [stats[(r, s)] for s in range(p.pp)]
            span = max(c["pipe_end"] for c in cells) - min(c["start"] for c in cells)
            utils.append(sum(c["busy"] for c in cells) / (p.pp * span) if span > 0 else 1.0)
        ideal = float(schedules.simulate(schedules.build(p.schedule, p.pp, self.spec.microbatches // p.dp)).bubble)
        return {"step": step + 1, "loss": loss, "time": time.time(), "samples_per_s": B / wall,
                "step_time_s": wall, "dp": p.dp, "pp": p.pp,
                "bubble": max(0.0, 1.0 - sum(utils) / len(utils)), "bubble_plan": ideal,
                "peak_live": [max(stats[(r, s)]["peak_live"] for r in range(p.dp)) for s in range(p.pp)],
                "allreduce_s": max(s["allreduce_s"] for s in stats.values())}

    def _save_model(self) -> None:
        """The trained state_dict into the job store (served by GET /v1/jobs/{id}/model)."""
        import io

        buf = io.BytesIO()
        torch.save(self._final, buf)
        self.sink.store.put_artifact(self.job_id, "model.pt", buf.getvalue())

    def _collect_state(self) -> tuple[dict, dict]:
        """The whole model's state_dict and name-keyed optimizer state, from replica 0."""
        p = self.spec.parallelism
        parts = self._gather({(0, s): self.workers[(0, s)].get_state.remote() for s in range(p.pp)},
                             None, self.timeout)
        model, optim = {}, {"state": {}, "groups": None}
        for s in range(p.pp):
            model.update(parts[(0, s)]["model"])
            optim["state"].update(parts[(0, s)]["optim"]["state"])
            optim["groups"] = optim["groups"] or parts[(0, s)]["optim"]["groups"]
        return model, optim

    def _teardown(self) -> None:
        for w in self.workers.values():
            try:
                ray.kill(w)
            except Exception:
                pass
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
        self.workers = {}
