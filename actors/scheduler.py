"""JobScheduler: one per job.  Plans the shape (stage partition from a layer profile),
spawns one StageWorker per (dp_rank, pp_rank), drives one call per worker per step,
commits steps, writes checkpoints, and keeps the job's metrics and events for whoever
polls it (the CLI today, the control plane later).  What it does when nodes join, drain or
die is in actors/elastic.py; why a step failed, in actors/failures.py.
"""
from __future__ import annotations

import collections
import os
import threading
import time
import traceback
from typing import Any, Optional

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.cluster import NodeWatch
from actors.elastic import Elasticity, merge_states, subset_state
from actors.failures import JobFailure, WorkerLost, is_comm_error, lost_actor, worker_failure
from actors.metrics import JobMetrics
from actors.output import OutputTap
from actors.store_sink import StoreSink
from actors.worker import StageWorker, has_state
from service import checkpoint, partition, planner, schedules, timeline
from service.loading import build_data, build_model, preflight
from service.sampling import step_indices
from service.spec import JobSpec, SpecError
from service.states import JobState

NAMESPACE = "relaytrain"


def placement_group_name(job_id: str) -> str:
    return f"relaytrain:{job_id}:workers"


class JobScheduler(Elasticity):
    def __init__(self, job_id: str, spec: dict, search: list[str], checkpoint_root: Optional[str] = None,
                 resume: Optional[str] = None, timeout: float = 300.0, start_timeout: float = 120.0,
                 store_url: Optional[str] = None, detached: bool = False, preflight: bool = False):
        self.output = OutputTap.install()  # user code runs here too (preflight, the layer profile)
        self.job_id = job_id
        self.detached = detached
        self.run_preflight = preflight
        self.sink = StoreSink(store_url, job_id) if store_url else None
        self.job_metrics = JobMetrics(job_id)  # ray.util.metrics, tagged by job
        self.spec = JobSpec.model_validate(spec)
        self.elastic = self.spec.elastic.enabled
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
        self.cur: Optional[planner.Shape] = None
        self.workers: dict[tuple[int, int], Any] = {}
        self.where: dict[tuple[int, int], dict] = {}     # cell -> {node, layers, name}
        self.names: dict[str, str] = {}                  # actor id -> actor name
        self.gen = 0
        self.pg = None
        self.watch: Optional[NodeWatch] = None
        self.snap: Optional[dict] = None                 # off-node copy of every stage: {step, model, optim}
        self._snap_busy = 0                              # snapshot fetches in flight
        self._snap_wanted: Optional[int] = None          # the step of the newest copy asked for
        self._snap_thread: Optional[threading.Thread] = None
        self.snapshot_s: Optional[float] = None          # seconds from a commit to its copy landing here
        self._snap_cond = threading.Condition()
        self._incoming: Optional[dict] = None            # workers being started for a scale-up
        self._scale_backoff = 0.0
        self._reshaping: Optional[dict] = None           # the reshape whose first committed step is awaited
        self._phases: dict[str, float] = {}              # where the last reshape's seconds went
        self.reshapes = 0
        self._high = 0                                   # the highest step ever committed
        self._suspect: set[str] = set()                  # nodes that lost workers, until Ray marks them dead
        self._final: Optional[dict] = None
        self.stateless: set[int] = set()                 # layers with no parameters and no persistent buffers
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

    def _end(self, state: JobState, kind: str, message: str, **fields) -> None:
        """The job's last event and state, after what its actors printed (a follower of the
        log, who stops at the end, sees every line, and the output before why the job ended)."""
        self._drain_output()
        self._event(kind, message, **fields)
        self._set_state(state, message if state is JobState.FAILED else None)

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
            self._end(JobState.FAILED, "failed", str(e), detail=getattr(e, "detail", ""))
        except Exception as e:  # a bug or an unexpected Ray error: still say why
            msg = f"the scheduler raised {type(e).__name__}: {e}"
            self._end(JobState.FAILED, "failed", msg, detail=traceback.format_exc())
        finally:
            self._teardown()
        final = self.poll(len(self.metrics), len(self.events))
        final["timelines"] = list(self.timelines)
        return final

    def _log_output(self, by_cell: dict) -> None:
        """Send what the workers (by cell) and this actor printed to the job's log."""
        rows = [{"time": t, "source": "scheduler", "stream": st, "line": line} for t, st, line in self.output.take()]
        for (r, s), lines in sorted(by_cell.items()):
            rows += [{"time": t, "source": f"w{r}.{s}", "stream": st, "line": line} for t, st, line in lines]
        if rows and self.sink:
            rows.sort(key=lambda row: row["time"])
            self.sink.write(logs=rows)

    def _drain_output(self) -> None:
        """At the end (a failure above all): what the workers printed since their last result."""
        refs = {c: w.take_output.remote() for c, w in self.workers.items()}
        if refs:
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=2.0)
        got = {}
        for c, ref in refs.items():
            try:
                got[c] = ray.get(ref, timeout=0)
            except Exception:
                continue  # gone, or still busy: its lines stay in Ray's log files
        self._log_output(got)

    def _run(self) -> None:
        spec = self.spec
        self._event("started", f"job {self.job_id} started")
        if self.run_preflight:  # user code is imported here, never in the API server
            preflight(spec, [os.getcwd(), *self.search])
        self.facts, self.metas = self._plan()
        self.gpus = self._gpus_per_worker()
        copy = self._resume_copy()
        start = copy["step"] if copy else 0
        if self.elastic:
            self.watch = NodeWatch().start()
            shape, why = self._decide(reusable=0, exclude=set(), current=None)
            self._install(shape, why, {}, start, copy=copy, donors={})
        else:
            p = spec.parallelism
            sizes = partition.choose(p.partition, self.facts.layers, p.pp,
                                     self.facts.seconds if self._profiled else None)
            shape = self._model(p.dp, p.pp, sizes)
            self._install(shape, "the spec's shape", {}, start, copy=copy, donors={})
        if copy:
            self.step = start
            self._event("resumed", f"resumed from {copy['path']} at step {start}", checkpoint=copy["path"], step=start)
        self._set_state(JobState.RUNNING)
        self._train(start)
        if self.state is JobState.RUNNING:
            if self.sink and self.detached:
                self._save_model()
            self._end(JobState.SUCCEEDED, "finished", f"job finished: {spec.training.steps} steps, last loss "
                      f"{self.metrics[-1]['loss']:.6g}" if self.metrics else "job finished")

    # ---------------------------------------------------------------- planning

    def _plan(self):
        """The planner's facts about each layer, and the (shape, dtype) of each layer's output."""
        spec, p = self.spec, self.spec.parallelism
        search = [os.getcwd(), *self.search]
        model = build_model(spec, search)
        samples = build_data(spec, search)
        t = spec.training
        idx = step_indices(0, len(samples), t.global_batch_size, t.seed, t.shuffle)[: t.microbatch_size]
        x, _ = samples.batch(idx)
        self._profiled = self.elastic or (p.partition == "balanced" and p.pp > 1) or bool(p.layer_costs_ms)
        if p.layer_costs_ms:
            if len(p.layer_costs_ms) != len(model):
                raise SpecError(f"parallelism.layer_costs_ms lists {len(p.layer_costs_ms)} costs but the model has "
                                f"{len(model)} layers; give one cost per entry of its nn.Sequential")
            seconds = [c / 1000.0 for c in p.layer_costs_ms]
        elif self._profiled:
            seconds = partition.profile_layers(model, x, threads=max(1, int(spec.resources.cpus_per_worker)))
        else:
            seconds = [0.0] * len(model)
        metas, act_bytes = [], []
        with torch.no_grad():
            h = x
            for layer in model:
                h = layer(h)
                metas.append((tuple(h.shape), h.dtype))
                act_bytes.append(h.numel() * h.element_size())
        params = [sum(q.numel() * q.element_size() for q in layer.parameters()) for layer in model]
        self.stateless = {i for i, layer in enumerate(model) if not has_state(layer)}  # built whole at any step
        return planner.LayerFacts(seconds, params, act_bytes), metas

    def _model(self, dp: int, pp: int, sizes) -> planner.Shape:
        p = self.spec.parallelism
        return planner.model_shape(self.facts, dp, pp, self.spec.microbatches, schedule=p.schedule,
                                   transport=p.transport, optimizer=self.spec.optimizer.name,
                                   partition_rule=list(sizes))

    def _gpus_per_worker(self) -> float:
        g = self.spec.resources.gpus_per_worker
        if g is not None:
            return g
        workers = self.spec.parallelism.dp * self.spec.parallelism.pp
        if self.elastic:
            workers = self.spec.elastic.min_workers
        return 1.0 if ray.cluster_resources().get("GPU", 0) >= workers else 0.0

    def _absorb_incoming(self, keep: dict) -> None:
        """Workers started for a scale-up that are up by now join ``keep``."""
        inc = self._incoming
        if inc is None:
            return
        ready, _ = ray.wait(inc["ready"], num_returns=len(inc["ready"]), timeout=0)
        for i, (h, ref) in enumerate(zip(inc["handles"], inc["ready"])):
            if ref in ready:
                try:
                    ray.get(ref, timeout=0)
                    keep[("joining", self.gen, i)] = h
                except Exception:
                    ray.kill(h)
        inc["handles"] = [h for h, ref in zip(inc["handles"], inc["ready"]) if ref not in ready]
        inc["ready"] = [ref for ref in inc["ready"] if ref not in ready]
        if not inc["ready"]:
            self._incoming = None

    def _decide(self, reusable: int, exclude: set, current: Optional[tuple],
                keep: Optional[dict] = None) -> tuple[planner.Shape, str]:
        """Ask the planner for a shape over the slots alive now; wait (RESHAPING) while it says
        wait, up to elastic.wait_timeout_s.  Workers started for a scale-up join ``keep``
        as they come up."""
        e, p, spec = self.spec.elastic, self.spec.parallelism, self.spec
        mem = spec.resources.memory_per_worker_mb
        deadline = time.monotonic() + e.wait_timeout_s
        waited = False
        while True:
            if keep is not None:
                self._absorb_incoming(keep)
                reusable = len(keep)
            view = self.watch.refresh()
            self._suspect &= view.alive
            slots = reusable + view.free_slots(spec.resources.cpus_per_worker, self.gpus, exclude | self._suspect)
            d = planner.plan(slots, self.facts, spec.training.global_batch_size, spec.training.microbatch_size,
                             preferred=(p.dp, p.pp), min_workers=e.min_workers, max_workers=e.max_workers,
                             schedule=p.schedule, transport=p.transport, optimizer=spec.optimizer.name,
                             partition_rule=p.partition, memory_bytes=mem * 2**20 if mem else None,
                             current=current, min_gain=e.min_gain)
            if not d.wait:
                return d.shape, d.reason
            if not waited:
                waited = True
                self._set_state(JobState.RESHAPING)
                self._event("waiting", d.reason, slots=slots)
            if time.monotonic() > deadline or self._cancel.is_set():
                raise JobFailure(f"{d.reason}; gave up after elastic.wait_timeout_s={e.wait_timeout_s:g} s")
            time.sleep(1.0)

    def _resume_copy(self) -> Optional[dict]:
        if not self.resume:
            return None
        state = checkpoint.load(self.resume)
        return {"step": int(state["step"]), "model": state["model"], "optim": state["optim"],
                "path": str(state["path"])}

    # ---------------------------------------------------------------- placing workers

    def _spawn(self, cells: list, names: Optional[list[str]] = None) -> dict:
        """New worker actors for ``cells`` (not configured yet)."""
        spec = self.spec
        cpus = spec.resources.cpus_per_worker
        Worker = ray.remote(StageWorker)
        spec_dict = spec.model_dump(mode="json")
        opts: dict[str, Any] = {"num_cpus": cpus, "num_gpus": self.gpus, "max_concurrency": 4,
                                "namespace": NAMESPACE}
        if not self.elastic:  # a fixed shape is placed all at once, packed
            bundle = {"CPU": cpus, **({"GPU": self.gpus} if self.gpus else {})}
            self.pg = placement_group([dict(bundle) for _ in cells], strategy="PACK",
                                      name=placement_group_name(self.job_id),
                                      lifetime="detached" if self.detached else None)
            if not self.pg.wait(self.start_timeout):
                total = ray.cluster_resources()
                raise JobFailure(
                    f"could not place {len(cells)} workers of {bundle} within {self.start_timeout:.0f} s "
                    f"(the cluster has {total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs in all); "
                    "lower dp x pp or the resources per worker, or add nodes")
        out = {}
        for i, (r, s) in enumerate(cells):
            name = (names[i] if names else f"relaytrain:{self.job_id}:w{r}.{s}" + (f"-{self.gen + 1}" if self.gen else ""))
            extra = ({"scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, i)} if self.pg else {})
            h = Worker.options(name=name, **opts, **extra).remote(self.job_id, spec_dict, self.search, self.timeout)
            self.names[h._actor_id.hex()] = name
            out[(r, s)] = h
        return out

    def _wait_ready(self, handles: dict, timeout: float) -> None:
        self._gather({k: h.__ray_ready__.remote() for k, h in handles.items()}, None, timeout)

    def _install(self, shape: planner.Shape, why: str, assign: dict, committed: int, *, copy: Optional[dict],
                 donors: dict, copy_layers: Optional[set] = None) -> None:
        """Configure workers into ``shape`` at ``committed`` steps and connect them.

        ``assign`` maps cells to live workers that keep their memory; the other cells get new
        workers.  Layers a worker lacks come from ``donors`` (cell -> live worker holding the
        committed state) or, for ``copy_layers`` (every layer when None and ``copy`` is given),
        from ``copy``: a snapshot or checkpoint held here."""
        cells = [(r, s) for r in range(shape.dp) for s in range(shape.pp)]
        new = [c for c in cells if c not in assign]
        spawned = self._spawn(new) if new else {}
        try:
            if spawned:
                self._wait_ready(spawned, self.start_timeout)
            self._configure(shape, why, {**assign, **spawned}, committed, copy, donors, copy_layers)
        except BaseException:
            for h in spawned.values():
                try:
                    ray.kill(h)
                except Exception:
                    pass
            raise

    def _configure(self, shape: planner.Shape, why: str, assign: dict, committed: int, copy: Optional[dict],
                   donors: dict, copy_layers: Optional[set]) -> None:
        p = self.spec.parallelism
        bounds = shape.bounds
        boundary = [self.metas[hi - 1] for _, hi in bounds]
        old_layers = {h._actor_id.hex(): set(range(*self.where[c]["layers"])) for c, h in donors.items()}
        if copy is not None and copy_layers is None:
            copy_layers = set(range(self.facts.layers))
        copy_layers = copy_layers or set()
        copy_refs: dict = {}
        calls = {}
        self.gen += 1
        for (r, s), h in assign.items():
            need = set(range(*bounds[s]))
            held = set() if copy_layers == set(range(self.facts.layers)) else old_layers.get(h._actor_id.hex(), set())
            sources = []
            from_copy = sorted(need & copy_layers)
            if from_copy and committed > 0:
                key = tuple(from_copy)
                if key not in copy_refs:
                    copy_refs[key] = ray.put(subset_state(copy, set(from_copy)))
                sources.append(copy_refs[key])
            missing = need - held - copy_layers - self.stateless
            if missing and committed > 0:
                by_donor: dict = {}
                for layer in sorted(missing):
                    donor = next((d for c, d in donors.items() if layer in old_layers[d._actor_id.hex()]), None)
                    if donor is None:
                        raise JobFailure(f"no live copy of layer {layer} at step {committed}")
                    by_donor.setdefault(donor._actor_id.hex(), (donor, []))[1].append(layer)
                for donor, layers in by_donor.values():
                    sources.append(donor.export.remote(layers, committed))
            cell = {"gen": self.gen, "dp_rank": r, "pp_rank": s, "dp": shape.dp, "pp": shape.pp,
                    "bounds": bounds, "boundary": boundary, "schedule": p.schedule, "committed": committed}
            calls[(r, s)] = (h, cell, sources)
        # every copy is taken before any donor reconfigures (and drops layers it no longer keeps)
        exports = [src for _, _, sources in calls.values() for src in sources]
        if exports:  # (a failed copy surfaces in the configure call that reads it)
            ray.wait(exports, num_returns=len(exports), timeout=self.start_timeout, fetch_local=False)
        calls = {c: h.configure.remote(cell, sources) for c, (h, cell, sources) in calls.items()}
        phase = "while taking its cell" if self.gen > 1 else "while starting"
        t_conf = time.time()
        infos = self._gather(calls, None, self.start_timeout, phase)
        self._phases["configure_s"] = time.time() - t_conf
        self.workers = dict(assign)
        self.where = {c: {"node": infos[c]["node"], "layers": tuple(infos[c]["layers"]),
                          "name": self.names.get(h._actor_id.hex(), "")} for c, h in assign.items()}
        need_group = p.transport == "collective" or shape.dp > 1
        rdzv = ray.get(self.workers[(0, 0)].rendezvous_address.remote()) if need_group else None
        conns = {}
        for (r, s), w in self.workers.items():
            conns[(r, s)] = w.connect.remote(p.transport, (self.workers.get((r, s - 1)), self.workers.get((r, s + 1))),
                                             rdzv, shape.workers)
        self._gather(conns, None, self.start_timeout, phase)
        self._phases["connect_s"] = time.time() - t_conf - self._phases["configure_s"]
        self.cur = shape
        self.shape = {"dp": shape.dp, "pp": shape.pp, "partition": list(shape.sizes), "schedule": p.schedule,
                      "transport": p.transport, "microbatches": self.spec.microbatches,
                      "microbatches_per_replica": shape.microbatches_per_replica, "gpus_per_worker": self.gpus,
                      "workers": {f"w{r}.{s}": self.where[(r, s)]["node"] for r, s in sorted(self.workers)}}
        if self.sink:
            self.sink.write(shape=self.shape)
        self._event("shape", f"shape dp={shape.dp} x pp={shape.pp}, layers per stage {list(shape.sizes)}, "
                    f"{p.schedule} with {shape.microbatches_per_replica} microbatches per replica, "
                    f"transport {p.transport} ({why})", **self.shape, reason=why,
                    layer_costs_s=list(self.facts.seconds) if self._profiled else None)

    # ---------------------------------------------------------------- steps

    def _gather(self, refs: dict, step: Optional[int], timeout: float, phase: str = "while starting") -> dict:
        """Results of one call per worker.  On a failure, wait briefly for the others so the
        cause is reported (a user error beats the peers' broken connections), then raise:
        ``WorkerLost`` when workers died in an elastic job, else ``JobFailure``."""
        by_ref = {ref: key for key, ref in refs.items()}
        pending = list(by_ref)
        out, errors = {}, {}
        deadline = time.monotonic() + timeout
        first_error = None
        pings: dict = {}
        while pending:
            limit = deadline if first_error is None else min(deadline, first_error + 3.0)
            if pings and time.monotonic() > first_error + 0.3:
                # the workers still running answer pings (threaded actors) or are gone: a call to
                # an actor on a crashed node hangs until Ray marks the node dead, not waited for
                answered, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=0)
                if all(pings[by_ref[x]] not in answered for x in pending):
                    break
            done, pending = ray.wait(pending, num_returns=1,
                                     timeout=max(0.0, min(limit, time.monotonic() + 0.1) - time.monotonic()))
            if not done:
                if first_error is not None and time.monotonic() >= limit:
                    break
                if first_error is not None or time.monotonic() < limit:
                    continue
                names = ", ".join(f"w{r}.{s}" for r, s in sorted(by_ref[x] for x in pending))
                what = f"step {step + 1}" if step is not None else "start-up"
                raise JobFailure(f"workers {names} did not finish {what} within {timeout:.0f} s")
            key = by_ref[done[0]]
            try:
                out[key] = ray.get(done[0])
            except Exception as e:
                errors[key] = e
                if not is_comm_error(e) and not lost_actor(e):
                    break  # user code raised: that is the cause
                if first_error is None:
                    first_error = time.monotonic()
                    t_error = time.time()
                    if self.elastic and step is not None:  # wake every worker blocked on the lost one
                        for k, w in self.workers.items():
                            w.abort.remote(self.gen)
                            pings[k] = w.ping.remote()
        if not errors:
            return out
        self._log_output({k: r.pop("output", []) for k, r in out.items() if isinstance(r, dict)})  # step discarded
        if first_error is None:
            t_error = time.time()
        user = {k: e for k, e in errors.items() if not is_comm_error(e) and not lost_actor(e)}
        lost = {k for k, e in errors.items() if lost_actor(e)}
        if user:
            k = min(user)
            raise worker_failure(f"w{k[0]}.{k[1]}", step, user[k], phase) from None
        k = min(lost) if lost else min(errors)
        failure = worker_failure(f"w{k[0]}.{k[1]}", step, errors[k], phase)
        if self.elastic and step is not None:
            answered, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=0) if pings else ([], [])
            silent = {k for k, ref in pings.items() if ref not in answered and k not in out and k not in errors}
            raise WorkerLost(failure, lost, t_error, silent - lost)
        raise failure from None

    def _train(self, start: int) -> None:
        spec = self.spec
        steps, B = spec.training.steps, spec.training.global_batch_size
        every = spec.checkpoint.every_steps
        snap_every = spec.elastic.snapshot_every_steps if self.elastic else 0
        step = start
        while step < steps:
            if self._cancel.is_set():
                self._end(JobState.CANCELLED, "cancelled", f"job cancelled after {step} committed steps")
                return
            if self.elastic:
                step = self._at_boundary(step)  # a reshape may go back to an older copy
            t0 = time.time()
            refs = {k: w.run_step.remote(step) for k, w in self.workers.items()}
            try:
                stats = self._gather(refs, step, self.timeout)
            except WorkerLost as lost:
                step = self._recover(step, refs, lost)
                continue
            if snap_every and not self._snapshot_landed():
                failure = JobFailure(f"the off-node copy of step {self._snap_wanted} could not be fetched from "
                                     "the workers (a node is going)")
                step = self._recover(step, refs, WorkerLost(failure, set(), time.time()))
                continue
            t1 = time.time()
            self._log_output({c: st.pop("output", []) for c, st in stats.items()})
            row = self._metrics_row(step, stats, t1 - t0, B)
            with self._lock:
                self.timelines.append({"step": step + 1, "workers": {
                    f"w{r}.{s}": st.pop("timeline") for (r, s), st in sorted(stats.items())}})
                self.metrics.append(row)
                self.step = step + 1
                self._high = max(self._high, self.step)
            if self.sink:
                self.sink.write(metrics=[row], timeline_entry=timeline.record(step + 1, self.shape,
                                                                              self.timelines[-1]["workers"]))
            self.job_metrics.committed(row)
            if self._reshaping:
                self._reshaped(step + 1)
            if snap_every and (step + 1) % snap_every == 0:
                self._take_snapshot(step + 1)
            if every and ((step + 1) % every == 0 or step + 1 == steps) and self.checkpoint_root:
                try:
                    state = self._collect_state(step + 1)
                except JobFailure as e:
                    if not self.elastic:
                        raise
                    # a worker went: the next step notices and recovers; this checkpoint is skipped
                    self._event("checkpoint_skipped", f"checkpoint of step {step + 1} skipped: {e}")
                else:
                    path = checkpoint.save(self.checkpoint_root, step + 1, *state,
                                           {"job_id": self.job_id, "name": spec.name}, keep=spec.checkpoint.keep)
                    self._event("checkpoint", f"checkpoint of step {step + 1} at {path}", step=step + 1,
                                path=str(path))
            step += 1
        for attempt in range(3):
            try:
                self._final, _ = self._collect_state(steps)
                return
            except JobFailure:
                if not self.elastic or attempt == 2:
                    raise
                # a worker went after the last commit: re-place the state, then copy it out
                alive = dict(self.workers)
                self._drop_dead(alive)
                self._reshape(steps, "a worker was lost after the last step", keep=alive, donors=alive,
                              exclude=set(), forced=True, detected=time.time())
                self._reshaping = None
                self._set_state(JobState.RUNNING)

    def _metrics_row(self, step: int, stats: dict, wall: float, B: int) -> dict:
        dp, pp, sched = self.cur.dp, self.cur.pp, self.spec.parallelism.schedule
        loss = sum(s["loss"] for s in stats.values() if s["loss"] is not None)
        utils = []
        for r in range(dp):
            cells = [stats[(r, s)] for s in range(pp)]
            span = max(c["pipe_end"] for c in cells) - min(c["start"] for c in cells)
            utils.append(sum(c["busy"] for c in cells) / (pp * span) if span > 0 else 1.0)
        ideal = float(schedules.simulate(schedules.build(sched, pp, self.spec.microbatches // dp)).bubble)
        return {"step": step + 1, "loss": loss, "time": time.time(), "samples_per_s": B / wall,
                "step_time_s": wall, "dp": dp, "pp": pp,
                "bubble": max(0.0, 1.0 - sum(utils) / len(utils)), "bubble_plan": ideal,
                "peak_live": [max(stats[(r, s)]["peak_live"] for r in range(dp)) for s in range(pp)],
                "allreduce_s": max(s["allreduce_s"] for s in stats.values()), "reshapes": self.reshapes,
                **({"snapshot_s": self.snapshot_s} if self.snapshot_s is not None else {}),
                **({"rerun": True} if step + 1 <= self._high else {})}

    def _save_model(self) -> None:
        """The trained state_dict into the job store (served by GET /v1/jobs/{id}/model)."""
        import io

        buf = io.BytesIO()
        torch.save(self._final, buf)
        self.sink.store.put_artifact(self.job_id, "model.pt", buf.getvalue())

    def _collect_state(self, committed: int) -> tuple[dict, dict]:
        """The whole model's state_dict and name-keyed optimizer state at ``committed`` steps,
        from replica 0 (in the model's layer order)."""
        parts = self._gather({(0, s): self.workers[(0, s)].get_state.remote(committed) for s in range(self.cur.pp)},
                             None, self.timeout, phase=f"while copying its state at step {committed}")
        merged = merge_states(parts[(0, s)] for s in range(self.cur.pp))
        return merged["model"], merged["optim"]

    def _teardown(self) -> None:
        if self.watch:
            self.watch.stop()
        handles = list(self.workers.values()) + (self._incoming["handles"] if self._incoming else [])
        for w in handles:
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
