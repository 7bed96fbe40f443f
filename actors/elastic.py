"""The scheduler's elasticity: what ``JobScheduler`` does when nodes join, drain or die.

Between steps it moves off draining nodes and grows onto free slots (``_at_boundary``); when a
step fails because workers died it discards the step everywhere and re-plans over the workers
left (``_recover``).  Either way ``_reshape`` chooses the new shape (the planner decides), gives
kept workers the cells whose layers they hold, copies the committed state from live donors or
from the newest off-node copy (the scheduler's snapshot or a checkpoint), and installs it.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

import ray

from actors.failures import JobFailure, WorkerLost
from actors.worker import layer_of
from service import checkpoint, planner
from service.states import JobState


def merge_states(parts) -> dict:
    model, optim = {}, {"state": {}, "groups": None}
    for part in parts:
        model.update(part["model"])
        optim["state"].update(part["optim"]["state"])
        optim["groups"] = optim["groups"] or part["optim"]["groups"]
    return {"model": model, "optim": optim}


def subset_state(state: dict, layers: set[int]) -> dict:
    keep = lambda k: layer_of(k) in layers  # noqa: E731
    return {"model": {k: v for k, v in state["model"].items() if keep(k)},
            "optim": {"state": {k: v for k, v in state["optim"]["state"].items() if keep(k)},
                      "groups": state["optim"]["groups"]}}


class Elasticity:
    """Mixed into ``JobScheduler``; uses its workers, shape and state (see actors/scheduler.py)."""

    def _take_snapshot(self, committed: int) -> None:
        """Ask every stage for a copy of its committed state (before the next step is sent, so
        it is served first) and keep it in this actor's memory, off the workers' nodes.  A
        thread fetches it while the next step runs, and that step commits only once it is here
        (``_snapshot_landed``), so the copy is never more than one step behind."""
        if self._snap_thread is not None:
            self._snap_thread.join(30.0)
        with self._snap_cond:
            self._snap_busy += 1
            self._snap_wanted = committed
        t0 = time.monotonic()
        refs = [[self.workers[(0, s)].snapshot.remote(committed)] for s in range(self.cur.pp)]

        def fetch():
            try:
                self._fetch_snapshot(committed, refs, t0, self.timeout)
            finally:
                with self._snap_cond:
                    self._snap_busy -= 1
                    self._snap_cond.notify_all()

        self._snap_thread = threading.Thread(target=fetch, name="relaytrain-snapshot", daemon=True)
        self._snap_thread.start()

    def _fetch_snapshot(self, committed: int, refs: list, t0: float, timeout: float) -> bool:
        """Keep the copy of step ``committed`` from ``refs`` (per stage, the snapshot calls of
        one or more of its replicas: the first good answer counts).  False if a stage gave none."""
        deadline = time.monotonic() + timeout
        parts = []
        for stage_refs in refs:
            for ref in stage_refs:
                try:
                    part = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
                except Exception:
                    continue  # that worker was lost (or its node's object store is gone)
                if part is not None and part["step"] == committed:
                    parts.append(part)
                    break
            else:
                return False
        with self._snap_cond:
            self.snapshot_s = time.monotonic() - t0
            if self.snap is None or self.snap["step"] < committed:
                self.snap = {"step": committed, **merge_states(parts)}
        return True

    def _snapshot_landed(self) -> bool:
        """Before a step commits: is the copy asked for after the previous commit here?  Waits
        for a fetch in flight and, if it failed, asks every replica of each stage once more.
        False means the workers cannot hand out their state (their node is going): the step
        must not commit, or a lost stage would go back more than one step."""
        wanted = self._snap_wanted
        if wanted is None or (self.snap is not None and self.snap["step"] >= wanted):
            return True
        self._snapshot_settled()
        if self.snap is not None and self.snap["step"] >= wanted:
            return True
        refs = [[self.workers[(r, s)].snapshot.remote(wanted) for r in range(self.cur.dp)]
                for s in range(self.cur.pp)]
        return self._fetch_snapshot(wanted, refs, time.monotonic(), timeout=3.0)

    def _snapshot_settled(self, timeout: float = 5.0) -> None:
        """Let a snapshot being fetched land (or fail) before choosing a copy."""
        deadline = time.monotonic() + timeout
        with self._snap_cond:
            while self._snap_busy and time.monotonic() < deadline:
                self._snap_cond.wait(deadline - time.monotonic())

    def _node_of(self, cell) -> Optional[str]:
        return self.where.get(cell, {}).get("node")

    def _at_boundary(self, step: int) -> int:
        """Between steps: move off draining nodes, or grow when nodes joined.  Returns the
        step to run next (earlier than ``step`` when a worker lost meanwhile took the only
        current copy of some layers, and the state went back to an older copy)."""
        view = self.watch.view
        draining = {c for c in self.workers if self._node_of(c) in view.draining}
        if draining:
            nodes = sorted({self._node_of(c) for c in draining})
            deadlines = [view.draining[n] for n in nodes if view.draining[n]]
            left = f", deadline in {min(deadlines) - time.time():.0f} s" if deadlines else ""
            reason = f"node{'s' if len(nodes) > 1 else ''} {', '.join(n[:12] for n in nodes)} draining{left}"
            self._phases = {}
            self._reshape(step, reason, keep={c: w for c, w in self.workers.items() if c not in draining},
                          donors=dict(self.workers), exclude=set(nodes), forced=True, detected=time.time())
            return self.step
        self._maybe_scale_up(step, view)
        return self.step

    def _maybe_scale_up(self, step: int, view) -> None:
        e, res = self.spec.elastic, self.spec.resources
        if self._incoming is not None:
            inc = self._incoming
            ready, _ = ray.wait(inc["ready"], num_returns=len(inc["ready"]), timeout=0)
            if len(ready) == len(inc["ready"]):
                self._incoming = None
                extra = {("new", i): h for i, h in enumerate(inc["handles"])}
                try:
                    ray.get(inc["ready"])
                except Exception:
                    for h in inc["handles"]:
                        ray.kill(h)
                    self._scale_backoff = time.monotonic() + 30
                    return
                self._phases = {}
                self._reshape(step, f"{len(extra)} more worker slot{'s' if len(extra) > 1 else ''} joined",
                              keep={**self.workers, **extra}, donors=dict(self.workers), exclude=set(),
                              forced=False, detected=inc["detected"])
            elif time.monotonic() > inc["deadline"]:
                for h in inc["handles"]:
                    ray.kill(h)
                self._incoming = None
                self._scale_backoff = time.monotonic() + 30
            return
        if time.monotonic() < self._scale_backoff or len(self.workers) >= e.max_workers:
            return
        self._suspect &= view.alive  # a node that lost workers counts again once Ray marked it dead
        free = view.free_slots(res.cpus_per_worker, self.gpus, self._suspect)
        if free <= 0:
            return
        p, spec = self.spec.parallelism, self.spec
        mem = res.memory_per_worker_mb
        d = planner.plan(len(self.workers) + free, self.facts, spec.training.global_batch_size,
                         spec.training.microbatch_size, preferred=(p.dp, p.pp), min_workers=e.min_workers,
                         max_workers=e.max_workers, schedule=p.schedule, transport=p.transport,
                         optimizer=spec.optimizer.name, partition_rule=p.partition,
                         memory_bytes=mem * 2**20 if mem else None, current=(self.cur.dp, self.cur.pp),
                         min_gain=e.min_gain)
        if d.wait or (d.shape.dp, d.shape.pp) == (self.cur.dp, self.cur.pp):
            self._scale_backoff = time.monotonic() + 5  # re-plan when the cluster changes, not every step
            return
        k = d.shape.workers - len(self.workers)
        if k <= 0:
            return
        # start the new workers in the background; the reshape happens once they are up
        spawned = self._spawn([("new", i) for i in range(k)],
                              names=[f"relaytrain:{self.job_id}:joining-{self.gen}-{i}" for i in range(k)])
        self._incoming = {"handles": list(spawned.values()), "ready": [h.__ray_ready__.remote() for h in spawned.values()],
                          "deadline": time.monotonic() + self.start_timeout, "detected": time.time()}

    def _recover(self, step: int, refs: dict, lost: WorkerLost) -> int:
        """A step failed because workers died: discard it everywhere, re-plan over the slots
        left and continue from the last committed step (or the newest off-node copy)."""
        detected = lost.time
        self._set_state(JobState.RESHAPING)
        self._event("worker_lost", f"{lost.failure} during step {step + 1}; reshaping",
                    detail=lost.failure.detail, step=step + 1)
        self._phases = {"abort_s": time.time() - detected}
        # a live worker answers a ping in milliseconds, even mid-step (threaded actor), though a
        # loaded machine can take a second; a call to an actor on a crashed node fails after
        # ~1.5 s or hangs until Ray marks the node dead (~15 s): not waited for
        pings = {c: self.workers[c].ping.remote() for c in self.workers if c not in lost.lost}
        ray.wait(list(pings.values()), num_returns=len(pings), timeout=2.0)
        answered = {}
        for c, ref in pings.items():
            try:
                ray.get(ref, timeout=0)
                answered[c] = self.workers[c]
            except Exception:
                continue
        # the live workers were aborted: their step calls end within milliseconds, or within
        # seconds on a loaded machine; one that still runs after that is stuck and replaced
        ray.wait([refs[c] for c in answered], num_returns=len(answered), timeout=10.0)
        alive, stuck = {}, {}
        for c, h in answered.items():
            done, _ = ray.wait([refs[c]], timeout=0)
            (alive if done else stuck)[c] = h
        dead = set(self.workers) - set(alive) - set(stuck)
        suspect = {self._node_of(c) for c in dead}
        self._suspect |= suspect
        self._reshape(step, f"lost {', '.join(f'w{r}.{s}' for r, s in sorted(dead))} "
                            f"({lost.failure})" if dead else str(lost.failure),
                      keep=alive, donors={**alive, **stuck}, exclude=suspect, forced=True, detected=detected,
                      retire=set(stuck) | dead)
        return self.step

    def _reshape(self, step: int, reason: str, *, keep: dict, donors: dict, exclude: set, forced: bool,
                 detected: float, retire: set = frozenset()) -> None:
        """Re-plan and move state.  ``keep``: live workers that may take cells of the new shape;
        ``donors``: live workers whose committed layers may be copied; the current workers
        not kept are stopped afterwards.  A worker lost while state moves starts it over,
        from the off-node copy (a partial move leaves no reliable map of who holds what)."""
        for attempt in range(3):
            try:
                return self._reshape_once(reason, keep=keep, donors=donors, exclude=exclude, forced=forced,
                                          detected=detected)
            except JobFailure as e:
                dead = self._drop_dead(keep) | self._drop_dead(donors)
                if attempt == 2 or not dead:
                    raise
                self._event("worker_lost", f"{e} while reshaping; planning again", detail=e.detail)
                donors, forced = {}, True
                exclude = exclude | self._suspect

    def _drop_dead(self, handles: dict) -> set:
        """Remove the workers that do not answer (within 3 s) from ``handles``; their nodes
        become suspect."""
        pings = {c: h.ping.remote() for c, h in handles.items()}
        ray.wait(list(pings.values()), num_returns=len(pings), timeout=3.0)
        dead = set()
        for c, ref in pings.items():
            try:
                ray.get(ref, timeout=0)
            except Exception:
                dead.add(c)
                node = self._node_of(c)
                if node:
                    self._suspect.add(node)
                try:
                    ray.kill(handles.pop(c))
                except Exception:
                    pass
        return dead

    def _reshape_once(self, reason: str, *, keep: dict, donors: dict, exclude: set, forced: bool,
                      detected: float) -> None:
        old = (self.cur.dp, self.cur.pp) if self.cur else None
        committed = self.step
        self._set_state(JobState.RESHAPING)
        held = {layer for c in donors for layer in range(*self.where[c]["layers"]) if c in self.where}
        lost_layers = set(range(self.facts.layers)) - held - self.stateless  # a stateless layer is rebuilt
        copy, copy_layers, steps_lost, restored = None, None, 0, None
        if lost_layers:
            self._snapshot_settled()
            copy = self._newest_copy()
            if copy is None:
                raise JobFailure(f"every replica of layers {sorted(lost_layers)} was lost and there is no "
                                 "off-node copy (enable elastic.snapshot_every_steps or checkpoint.every_steps)")
            if copy["step"] == committed:
                copy_layers, restored = lost_layers, copy["source"]
            else:  # an older copy: every stage goes back to it so all layers agree
                steps_lost, restored = committed - copy["step"], copy["source"]
                committed = copy["step"]
        shape, why = self._decide(reusable=len(keep), exclude=exclude, current=None if forced else old,
                                  keep=keep if forced else None)
        if not forced and (shape.dp, shape.pp) == old:
            for c, h in keep.items():
                if c not in self.workers:
                    ray.kill(h)
            self._set_state(JobState.RUNNING)
            return
        assign = self._assign(shape, keep)
        previous = dict(self.workers)
        self._install(shape, why, assign, committed, copy=copy, donors=donors, copy_layers=copy_layers)
        self._snap_thread = None  # a copy still being fetched from the old shape is not waited for
        self._snap_wanted = None
        for c, h in list(previous.items()) + [(c, h) for c, h in keep.items() if c not in previous]:
            if h not in self.workers.values():
                try:
                    ray.kill(h)
                except Exception:
                    pass
        if steps_lost:  # the rows of the lost steps stay; their re-runs come again, marked rerun
            with self._lock:
                self.step = committed
        self.reshapes += 1
        self._phases["installed_at"] = time.time()
        self._reshaping = {"reason": reason, "old": list(old) if old else None, "new": [shape.dp, shape.pp], "detected": detected,
                           "steps_lost": steps_lost, "restored_from": restored, "why": why,
                           "committed": committed}

    def _reshaped(self, committed: int) -> None:
        """The first step of a new shape committed: record the reshape with its cost."""
        r, self._reshaping = self._reshaping, None
        seconds = time.time() - r["detected"]
        phases = {k: round(v, 3) for k, v in self._phases.items() if k.endswith("_s")}
        phases["first_step_s"] = round(time.time() - self._phases.get("installed_at", time.time()), 3)
        old = f"{r['old'][0]}x{r['old'][1]}" if r["old"] else "none"
        new = f"{r['new'][0]}x{r['new'][1]}"
        lost = (f"{r['steps_lost']} steps lost, restored from the {r['restored_from']}" if r["steps_lost"]
                else f"no step lost{', lost layers restored from the ' + r['restored_from'] if r['restored_from'] else ''}")
        self._event("reshape", f"reshaped {old} -> {new} after {r['reason']}: step {committed} committed "
                    f"{seconds:.2f} s after detection; {lost} ({r['why']})",
                    reason=r["reason"], old_shape=r["old"], new_shape=r["new"], recovery_s=seconds,
                    steps_lost=r["steps_lost"], restored_from=r["restored_from"], step=committed, phases_s=phases)
        with self._lock:
            if self.metrics:
                self.metrics[-1]["recovery_s"] = seconds
        self.job_metrics.reshaped(seconds)
        self._set_state(JobState.RUNNING)

    def _newest_copy(self) -> Optional[dict]:
        """The newest complete off-node copy: the scheduler's snapshot or a checkpoint."""
        best = None
        if self.snap is not None:
            best = {**self.snap, "source": f"snapshot of step {self.snap['step']} in the scheduler's memory"}
        if self.checkpoint_root:
            try:
                state = checkpoint.load(self.checkpoint_root)
                if best is None or int(state["step"]) > best["step"]:
                    best = {"step": int(state["step"]), "model": state["model"], "optim": state["optim"],
                            "source": f"checkpoint {state['path']}"}
            except FileNotFoundError:
                pass
        return best

    def _assign(self, shape: planner.Shape, keep: dict) -> dict:
        """Give kept workers the cells whose layers they already hold (most overlap first)."""
        bounds = shape.bounds
        cells = [(r, s) for r in range(shape.dp) for s in range(shape.pp)]
        pairs = []
        for i, (c, h) in enumerate(keep.items()):
            held = set(range(*self.where[c]["layers"])) if c in self.where else set()
            for (r, s) in cells:
                overlap = len(held & set(range(*bounds[s])))
                pairs.append((-overlap, (r, s) != c, (r, s), i, c))
        pairs.sort(key=lambda x: x[:4])
        assign, used = {}, set()
        for _, _, cell, _, c in pairs:
            if cell in assign or c in used:
                continue
            assign[cell] = keep[c]
            used.add(c)
        return assign
