"""A job's workers: their actor handles by cell, names, nodes and layers, the configuration
generation, where they are placed, and every call made to all of them at once (with its
timeout, the pings that tell a slow worker from a dead one, and the abort that wakes the
others when one is lost).  It decides nothing: the controller tells it what to do."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.failures import JobCancelled, JobFailure, cell_name, kind_of, step_failure
from actors import codepkg, heap
from actors.workeractor import StageWorker
from service import names, planner
from service.recipe import needs_global_norm
from service.spec import JobSpec

Cell = tuple  # (dp_rank, pp_rank); workers started for a scale-up are keyed ("joining", gen, i)


@dataclass
class Joining:
    """Workers started in the background for a scale-up; the reshape waits for them."""

    handles: list
    ready: list
    deadline: float
    detected: float = field(default_factory=time.time)


class WorkerGroup:
    def __init__(self, job_id: str, spec: JobSpec, search: list[str], *, timeout: float, start_timeout: float,
                 detached: bool, log: Callable[[dict], None]):
        self.job_id, self.spec, self.search = job_id, spec, search
        self.timeout, self.start_timeout, self.detached = timeout, start_timeout, detached
        self.elastic = spec.elastic.enabled
        self.log = log                                   # what the workers of a discarded step printed
        self.workers: dict[Cell, Any] = {}
        self.where: dict[Cell, dict] = {}                # cell -> {node, layers, name}
        self.names: dict[str, str] = {}                  # actor id -> actor name
        self.gen = 0
        self.gpus = 0.0
        self.pg = None                                   # a fixed shape's placement group
        self.bundles: dict[Cell, int] = {}               # a fixed shape's cells -> their bundle in it
        # an elastic job's tensor-parallel groups: one placement group each (STRICT_PACK: one node), so a
        # worker's group is its placement group and its TP rank its bundle: actor id -> (group id, rank)
        self.tp_groups: dict[str, tuple[str, int]] = {}
        self._group_pgs: dict[str, Any] = {}
        self._groups_made = 0
        self.skips: list = []                            # the model's skips, from its trace (actors/portals.py)
        self.shape: Optional[planner.Shape] = None
        self.joining: Optional[Joining] = None
        self._joining_made = 0                           # workers started for scale-ups (their names' numbers)
        self.cancelled = threading.Event()               # set by JobScheduler.cancel: stop waiting for placement
        self.on_wait: Optional[Callable[[str], None]] = None  # told once when the placement waits (a waiting event)
        self.shipped: Optional[codepkg.Shipped] = None   # the job's code, when relaytrain ships it (not Ray)

    # ---------------------------------------------------------------- placing

    def gpus_per_worker(self) -> float:
        g = self.spec.resources.gpus_per_worker
        if g is not None:
            return g
        workers = self.spec.elastic.min_workers if self.elastic else self.spec.parallelism.dp * self.spec.parallelism.pipeline_workers
        return 1.0 if ray.cluster_resources().get("GPU", 0) >= workers else 0.0

    def said(self, cell: tuple) -> str:
        """A worker as events name it: its cell, and its Ray actor's name where that is another
        (a worker keeps the name it started with through reshapes: `ray list actors` shows
        ...:w0.3 for the process that holds cell w0.2 now, and a user matched the wrong one)."""
        h = self.workers.get(cell)
        actor = self.names.get(h._actor_id.hex(), "") if h is not None else ""
        base = f"w{cell[0]}.{cell[1]}"
        return base if not actor or actor.endswith(f":{base}") else f"{base} (Ray actor {actor})"

    def spawn(self, cells: list, actor_names: Optional[list[str]] = None) -> dict:
        """New worker actors for ``cells`` (not configured yet)."""
        if not cells:
            return {}
        cpus = self.spec.resources.cpus_per_worker
        Worker = ray.remote(StageWorker)
        spec_dict = self.spec.model_dump(mode="json")
        opts: dict[str, Any] = {"num_cpus": cpus, "num_gpus": self.gpus, "max_concurrency": 8,
                                "namespace": names.NAMESPACE,
                                **heap.runtime_env(codepkg.split(self.spec.runtime_env)[0] if self.shipped
                                                   else self.spec.runtime_env, self.spec.resources.nice,
                                                   ray.get_runtime_context().runtime_env)}
        code = self.shipped.for_workers if self.shipped else None
        tp = self.spec.parallelism.tp
        if not self.elastic and self.pg is None:  # a fixed shape is placed all at once, packed; a TP group in
            # one bundle (one node).  A restart keeps it: a new worker takes the bundle of the worker it replaces
            self._reserve(len(cells) // tp, {"CPU": cpus * tp, **({"GPU": self.gpus * tp} if self.gpus else {})})
            self.bundles = {c: i // tp for i, c in enumerate(cells)}
        out, pg = {}, None
        own_groups = self.elastic and tp > 1  # each TP group on one node, whatever node it gets
        for i, (r, s) in enumerate(cells):
            name = actor_names[i] if actor_names else names.worker_name(self.job_id, r, s, self.gen + 1 if self.gen else 0)
            extra = ({"scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, self.bundles[(r, s)])}
                     if self.pg else {})
            if own_groups:
                if i % tp == 0:
                    self._groups_made += 1
                    pg = placement_group([{"CPU": cpus, **({"GPU": self.gpus} if self.gpus else {})}] * tp,
                                         strategy="STRICT_PACK", lifetime="detached" if self.detached else None,
                                         name=names.tp_group_name(self.job_id, self._groups_made))
                    self._group_pgs[pg.id.hex()] = pg
                extra = {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, i % tp)}
            h = Worker.options(name=name, **opts, **extra).remote(self.job_id, spec_dict, self.search, self.timeout,
                                                           code=code)
            self.names[h._actor_id.hex()] = name
            if own_groups:
                self.tp_groups[h._actor_id.hex()] = (pg.id.hex(), i % tp)
            out[(r, s)] = h
        return out

    def whole_groups(self, handles: dict) -> dict:
        """Of ``handles`` (key -> worker), those whose whole tensor-parallel group is among them
        (all of them without TP), each group's workers in TP rank order."""
        tp = self.spec.parallelism.tp
        if tp == 1 or not self.elastic:
            return dict(handles)
        groups: dict = {}
        for k, h in handles.items():
            gid, rank = self.tp_groups.get(h._actor_id.hex(), (None, None))
            if gid is not None:
                groups.setdefault(gid, {})[rank] = k
        return {k: handles[k] for gid in sorted(groups) if len(groups[gid]) == tp
                for _, k in sorted(groups[gid].items())}

    def _live_groups(self, extra=(), workers=None) -> set:
        """The TP groups (placement group ids) with a worker that runs: of the current shape
        (``workers``, by default all of it), of a growth starting, or among ``extra`` (a growth's
        workers a reshape took in)."""
        workers = self.workers.values() if workers is None else workers
        return {self.tp_groups.get(h._actor_id.hex(), (None,))[0]
                for h in [*workers, *(self.joining.handles if self.joining else []), *extra]}

    def _release_groups(self, extra=()) -> None:
        """Remove the placement groups of TP groups none of whose workers runs any more (a
        group that lost a worker is stopped whole; its bundles would otherwise hold CPUs, or be
        placed again elsewhere when its node died).  ``extra``: workers outside the current
        shape that stay."""
        live = self._live_groups(extra)
        for gid in [gid for gid in self._group_pgs if gid not in live]:
            try:
                remove_placement_group(self._group_pgs.pop(gid))
            except Exception:
                pass

    def _reserve(self, n: int, bundle: dict) -> None:
        self.pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK",
                                  name=names.placement_group_name(self.job_id),
                                  lifetime="detached" if self.detached else None)
        start = time.monotonic()
        said = False
        while not self.pg.wait(0.5):
            if self.cancelled.is_set():
                raise JobCancelled(f"job cancelled while waiting for {n} worker slots")
            waited = time.monotonic() - start
            if waited < self.start_timeout:
                if waited > 3.0 and not said and self.on_wait is not None:  # what GET /v1/jobs/{id} shows meanwhile
                    said = True
                    self.on_wait(f"waiting for {n} worker slots of {bundle}: {_cpus()}; the job fails if they are "
                                 f"not placed within {self.start_timeout:.0f} s (RELAYTRAIN_START_TIMEOUT_S)")
                continue
            total = ray.cluster_resources()
            raise JobFailure(
                f"could not place {n} workers of {bundle} within {self.start_timeout:.0f} s ({_cpus(total)}, "
                f"{total.get('GPU', 0):g} GPUs in all); lower dp x pp or the resources per worker, wait for the "
                "other jobs, or add nodes")

    def start_joining(self, k: int, up: tuple = (), detected: Optional[float] = None) -> None:
        """Start ``k`` workers for a scale-up in the background; ``up``: workers started for it
        earlier and up already, which join with them (a growth that found more free slots by the
        time its first workers were up; ``detected``: when that growth began)."""
        handles = [*up, *self._spawn_joining(k)]
        self.joining = Joining(handles, [h.__ray_ready__.remote() for h in handles],
                               time.monotonic() + self.start_timeout, detected or time.time())

    def add_joining(self, k: int) -> None:
        """``k`` more workers for the scale-up whose workers start now: it waits for them too."""
        more = self._spawn_joining(k)
        self.joining.handles += more
        self.joining.ready += [h.__ray_ready__.remote() for h in more]
        self.joining.deadline = time.monotonic() + self.start_timeout

    def _spawn_joining(self, k: int) -> list:
        first = self._joining_made
        self._joining_made += k
        return list(self.spawn([("new", i) for i in range(k)],
                               actor_names=[names.joining_name(self.job_id, self.gen, first + i)
                                            for i in range(k)]).values())

    def take_joined(self, keep: dict) -> None:
        """Workers started for a scale-up that are up by now join ``keep``; failed ones are stopped."""
        inc = self.joining
        if inc is None:
            return
        ready, _ = ray.wait(inc.ready, num_returns=len(inc.ready), timeout=0)
        for h, ref in zip(inc.handles, inc.ready):
            if ref in ready:
                try:
                    ray.get(ref, timeout=0)
                    keep[("joining", self.gen, h._actor_id.hex())] = h
                except Exception:
                    kill(h)
        inc.handles = [h for h, ref in zip(inc.handles, inc.ready) if ref not in ready]
        inc.ready = [ref for ref in inc.ready if ref not in ready]
        if not inc.ready:
            self.joining = None

    def joined(self) -> Optional[dict]:
        """When every worker started for a scale-up is up: them, by a cell key of their own
        ({} if any failed to start or the deadline passed: all are stopped).  None while
        they start."""
        inc = self.joining
        if inc is None:
            return None
        ready, _ = ray.wait(inc.ready, num_returns=len(inc.ready), timeout=0)
        if len(ready) < len(inc.ready) and time.monotonic() < inc.deadline:
            return None
        self.joining = None
        try:
            ray.get(inc.ready, timeout=0)
        except Exception:
            for h in inc.handles:
                kill(h)
            self._release_groups()
            return {}
        return {("new", i): h for i, h in enumerate(inc.handles)}

    def wait_ready(self, handles: dict) -> None:
        self.gather({k: h.__ray_ready__.remote() for k, h in handles.items()}, None, self.start_timeout)

    # ---------------------------------------------------------------- configuring

    def configure(self, shape: planner.Shape, why: str, assign: dict, committed: int, sources: dict,
                  boundary: list) -> dict:
        """Give each worker of ``assign`` its cell of ``shape`` at ``committed`` steps, with the
        state ``sources`` (cell -> refs) of layers it lacks, then connect them.  Returns the
        seconds each phase took."""
        p = self.spec.parallelism
        self.gen += 1
        calls = {(r, s): h.configure.remote(
            {"gen": self.gen, "dp_rank": r, "pp_rank": shape.stage_of(s), "slot": s, "replicas": list(shape.replicas),
             "stage_costs": list(shape.stage_costs), "tp": shape.tp,
             "dp": shape.dp, "pp": shape.pp, "bounds": shape.bounds, "boundary": boundary, "schedule": p.schedule,
             "chunks": shape.chunks, "weight_group": p.weight_group, "committed": committed, "skips": self.skips},
            sources.get((r, s), []))
            for (r, s), h in assign.items()}
        phase = "while taking its cell" if self.gen > 1 else "while starting"
        t0 = time.time()
        infos = self.gather(calls, None, self.start_timeout, phase)
        t1 = time.time()
        self.workers = dict(assign)
        self.where = {c: {"node": infos[c]["node"], "layers": tuple(tuple(r) for r in infos[c]["layers"]),
                          "name": self.names.get(h._actor_id.hex(), "")} for c, h in assign.items()}
        self._connect(shape, phase)
        self.shape = shape
        return {"configure_s": t1 - t0, "connect_s": time.time() - t1}

    def _connect(self, shape: planner.Shape, phase: str) -> None:
        p = self.spec.parallelism
        need_group = (p.transport == "collective" or shape.dp > 1 or bool(shape.replicas) or shape.tp > 1
                      or needs_global_norm(self.spec))
        rdzv = ray.get(self.workers[(0, 0)].rendezvous_address.remote()) if need_group else None
        conns = {(r, s): w.connect.remote(p.transport, tuple(self.workers[(r, t)] for t in range(shape.width)),
                                          rdzv, shape.workers)
                 for (r, s), w in self.workers.items()}
        self.gather(conns, None, self.start_timeout, phase)

    def layers_of(self, c: Cell) -> set[int]:
        return {i for lo, hi in self.where[c]["layers"] for i in range(lo, hi)} if c in self.where else set()

    def tp_rank(self, c: Cell) -> int:
        """The tensor-parallel rank of the worker of cell ``c`` in the current shape (0 without TP)."""
        return c[1] % self.shape.tp if self.shape is not None and c in self.where else 0

    def pieces_of(self, c: Cell) -> set[tuple[int, int]]:
        """The state the worker of cell ``c`` holds, as (layer, TP rank) pieces: with tensor
        parallelism a worker holds its rank's slices of its layers (rank 0 only without)."""
        j = self.tp_rank(c)
        return {(i, j) for i in self.layers_of(c)}

    def node_of(self, c: Cell) -> Optional[str]:
        return self.where.get(c, {}).get("node")

    def describe(self) -> dict:
        return {f"w{r}.{s}": self.where[(r, s)]["node"] for r, s in sorted(self.workers)}

    # ---------------------------------------------------------------- calls to all

    def call_all(self, method: str, *args) -> dict:
        return {c: getattr(w, method).remote(*args) for c, w in self.workers.items()}

    def gather(self, refs: dict, step: Optional[int], timeout: float, phase: str = "while starting") -> dict:
        """Results of one call per worker.  On a failure, wait briefly for the others so the
        cause is reported (a user error beats the peers' broken connections), then raise:
        ``WorkerLost`` when workers died in an elastic job's step, else ``JobFailure``."""
        out, errors, pings, t_error = self._collect(refs, step, timeout)
        if not errors:
            return out
        self.log({k: r.pop("output", []) for k, r in out.items() if isinstance(r, dict)})  # the step is discarded
        silent = set()
        if pings:
            answered, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=0)
            silent = {c for c, ref in pings.items() if ref not in answered and c not in out and c not in errors}
        raise step_failure(errors, step, phase, elastic=self.elastic, t_error=t_error, silent=silent) from None

    def _collect(self, refs: dict, step: Optional[int], timeout: float):
        """Wait for ``refs``; after the first failure of a peer, abort the step everywhere and
        stop once the rest have answered or stay silent to pings."""
        by_ref = {ref: key for key, ref in refs.items()}
        pending = list(by_ref)
        out, errors, pings = {}, {}, {}
        deadline = time.monotonic() + timeout
        first_error, t_error = None, time.time()
        while pending:
            limit = deadline if first_error is None else min(deadline, first_error + 3.0)
            if pings and time.monotonic() > first_error + 0.3 and self._all_silent(pings, [by_ref[x] for x in pending]):
                break  # a call to an actor on a crashed node hangs until Ray marks the node dead: not waited for
            done, pending = ray.wait(pending, num_returns=1,
                                     timeout=max(0.0, min(limit, time.monotonic() + 0.1) - time.monotonic()))
            if not done:
                if time.monotonic() < limit:
                    continue
                if first_error is not None:
                    break
                names_ = ", ".join(cell_name(c) for c in sorted(by_ref[x] for x in pending))
                raise JobFailure(f"workers {names_} did not finish "
                                 f"{f'step {step + 1}' if step is not None else 'start-up'} within {timeout:.0f} s")
            key = by_ref[done[0]]
            try:
                out[key] = ray.get(done[0])
                continue
            except Exception as e:
                errors[key] = e
            if kind_of(errors[key]) == "user":
                break  # user code raised: that is the cause
            if first_error is None:
                first_error, t_error = time.monotonic(), time.time()
                if self.elastic and step is not None:  # wake every worker blocked on the lost one
                    pings = self.abort_all()
        if pending:
            _drain_quietly(pending)
        return out, errors, pings, t_error

    @staticmethod
    def _all_silent(pings: dict, cells: list) -> bool:
        """Do none of ``cells`` answer their ping (threaded actors answer even mid-step)?"""
        answered, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=0)
        return all(pings[c] not in answered for c in cells)

    def abort_all(self) -> dict:
        """Wake every worker from its step (a peer was lost); returns a ping per worker."""
        pings = {}
        for k, w in self.workers.items():
            w.abort.remote(self.gen)
            pings[k] = w.ping.remote()
        return pings

    def answering(self, handles: dict, timeout: float, silent: set = frozenset(),
                  silent_until: float = 0.0) -> tuple[dict, set]:
        """Which of ``handles`` answer a ping within ``timeout``: (alive by cell, silent cells).
        The cells in ``silent`` (already silent to an earlier ping) are waited for only until
        the time ``silent_until``."""
        pings = {c: h.ping.remote() for c, h in handles.items()}
        sure = [ref for c, ref in pings.items() if c not in silent]
        ray.wait(sure, num_returns=len(sure), timeout=timeout)
        rest = [ref for c, ref in pings.items() if c in silent]
        if rest:
            ray.wait(rest, num_returns=len(rest), timeout=max(0.0, silent_until - time.time()))
        alive, silent = {}, set()
        for c, ref in pings.items():
            try:
                ray.get(ref, timeout=0)
                alive[c] = handles[c]
            except Exception:
                silent.add(c)
        return alive, silent

    def drain_output(self) -> dict:
        """At the end (a failure above all): what the workers printed since their last result."""
        refs = self.call_all("take_output")
        if refs:
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=2.0)
        got = {}
        for c, ref in refs.items():
            try:
                got[c] = ray.get(ref, timeout=0)
            except Exception:
                continue  # gone, or still busy: its lines stay in Ray's log files
        return got

    def stop_others(self, handles) -> None:
        """Stop the actors among ``handles`` that are not workers of the current shape."""
        current = list(self.workers.values())
        for h in handles:
            if h not in current:
                kill(h)
        self._release_groups()

    def slots_freed(self, held: dict, dead: dict, stay=()) -> dict:
        """CPUs per node that stopping ``held`` (live workers, cell -> worker) and dropping ``dead``
        would give back: a live worker's own slot; with a TP group's placement group (an elastic
        TP job) every bundle of each group left with no worker that runs (``stay``: workers outside
        the current shape that stay), the dead members' too.  A dead worker outside a group
        holds nothing (Ray freed its slot)."""
        cpus = self.spec.resources.cpus_per_worker
        out: dict = {}
        if not self._group_pgs:
            for c in held:
                node = self.node_of(c)
                if node:
                    out[node] = out.get(node, 0.0) + cpus
            return out
        gone = set(held) | set(dead)
        live = self._live_groups(stay, workers=[h for c, h in self.workers.items() if c not in gone])
        tp = self.spec.parallelism.tp
        for c, h in {**dead, **held}.items():
            gid = self.tp_groups.get(h._actor_id.hex(), (None,))[0]
            node = self.node_of(c)
            if gid is not None and gid not in live and node:
                live.add(gid)  # (counted once, whole)
                out[node] = out.get(node, 0.0) + cpus * tp
        return out

    def stop_now(self, handles: dict, stay=()) -> None:
        """Stop these workers now (cell -> worker; those of the current shape leave it): their
        slots come free, and their TP groups' placement groups once no worker of a group runs
        (``stay``: workers outside the current shape that stay, such as a growth's taken into a
        reshape).  What they held stays described (``pieces_of``), for the reshape that
        replaces them."""
        ids = {h._actor_id.hex() for h in handles.values()}
        self.workers = {c: h for c, h in self.workers.items() if h._actor_id.hex() not in ids}
        for h in handles.values():
            kill(h)
        self._release_groups(extra=stay)

    def keep_survivors(self, calls: list[dict], wait_s: float = 10.0) -> dict:
        """After a fixed-shape job lost a worker: wake the others from the step (and from a step
        queued behind it; ``calls``: cell -> ref, per call), and keep those that answer a ping and
        whose calls have ended (cell -> worker).  The rest are stopped; the placement group stays,
        so a new worker takes the bundle of the one it replaces (on a lost node's, Ray places that
        bundle again wherever there is room)."""
        self.abort_all()
        alive, _ = self.answering(self.workers, timeout=2.0)
        ends = [r[c] for r in calls for c in alive if c in r]
        ended, _ = ray.wait(ends, num_returns=len(ends), timeout=wait_s)
        ended = set(ended)
        kept = {c: h for c, h in alive.items() if all(r[c] in ended for r in calls if c in r)}
        for c, h in self.workers.items():
            if c not in kept:
                kill(h)
        self.workers = kept
        self.where = {c: w for c, w in self.where.items() if c in kept}
        return kept

    def teardown(self) -> None:
        for w in list(self.workers.values()) + (self.joining.handles if self.joining else []):
            kill(w)
        if self.pg is not None:
            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
        self.workers, self.joining, self.pg = {}, None, None
        self._release_groups()


def _cpus(cluster: Optional[dict] = None) -> str:
    """The cluster's CPUs (``cluster``: its resources, when already read), and how many are
    free now (other jobs hold the rest)."""
    total, free = (cluster or ray.cluster_resources()).get("CPU", 0), ray.available_resources().get("CPU", 0)
    return f"{free:g} of the cluster's {total:g} CPUs free now" if free < total else f"the cluster has {total:g} CPUs"


def kill(handle) -> None:
    try:
        ray.kill(handle)
    except Exception:
        pass


def _drain_quietly(refs: list, timeout: float = 60.0) -> None:
    """Take, in a thread, the results of step calls left behind after a failure (the peers of
    a worker whose user code raised fail in turn, "receiving the gradient ... failed"): a call's
    error that nobody takes is printed by Ray, when its reference goes, as an "Unhandled error"
    traceback on the scheduler's stderr, which the job's log then shows after the real cause."""
    def drain() -> None:
        for ref in refs:
            try:
                ray.get(ref, timeout=timeout)
            except Exception:  # noqa: BLE001 - the step already failed with its cause
                pass
    threading.Thread(target=drain, name="relaytrain-drain", daemon=True).start()
