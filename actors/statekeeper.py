"""Copies of a job's committed state, away from the workers that train it: the off-node copy
of each stage (elastic jobs, every ``elastic.snapshot_every_steps``), checkpoints on storage,
the checkpoint a run resumes from, and the final model.  It also says where each worker of a
new shape gets the layers it lacks: a live donor, or the newest copy.

The off-node copy of a stage is kept by a worker on a node that runs no replica of that
stage (a *peer*, ``StageWorker.keep_copy``: the stage's committed state is that call's
argument, which Ray moves to the peer's node, and the peer keeps it in its own memory), so the copy's cost is spread over the workers and none of
it goes through the scheduler.  Only where every node runs a replica of the stage (one
node, or dp at least the nodes) does the scheduler keep that stage's copy itself.

With tensor parallelism (``parallelism.tp``) state is handled as (layer, TP rank) pieces: every
shape of an elastic job has the same tp and splits each layer alike, so TP rank j of any shape
holds the same slices.  The off-node copy is kept per (model chunk, TP rank), and a worker of
rank j takes rank j's slices, from a copy or a live worker of that rank, never gathered.

The interface the controller uses: ``take_snapshot`` after a commit, ``snapshot_landed``
before the next commit, ``newest_copy`` when layers were lost, ``sources`` when installing
a shape, checkpoints (actors/checkpoints.py) and ``write_final`` (each stage writes its own part)."""
from __future__ import annotations

import threading
import time
from typing import Optional

import ray

from actors.checkpoints import CheckpointWriter, checkpoint_due
from actors.failures import JobFailure
from actors.state import layer_of, subset_state
from actors.workergroup import WorkerGroup
from service import checkpoint, shards


class StateKeeper:
    def __init__(self, group: WorkerGroup, checkpoint_root: Optional[str], resume: Optional[str], timeout: float,
                 job_id: Optional[str] = None):
        self.group, self.job_id = group, job_id  # its own checkpoints only, where several jobs write
        self.checkpoint_root, self.resume, self.timeout = checkpoint_root, resume, timeout
        self.origin = resume  # the checkpoint the job started from: where it goes back to before it has one of its own
        # copies by step: {step: {(lo, hi, TP rank): [who keeps it: the peer worker, then the stage's own worker;
        # or the state, kept here]}}: the newest complete step and the ranges of a newer one landed so far
        self.kept: dict[int, dict] = {}
        self.complete: Optional[int] = None
        self.snapshot_s: Optional[float] = None          # seconds from a commit to its copy landing
        self._wanted: Optional[int] = None               # the step of the newest copy asked for
        self._busy = 0                                   # snapshot fetches in flight
        self._thread: Optional[threading.Thread] = None
        self._cond = threading.Condition()
        self.writer: Optional[CheckpointWriter] = None   # checkpoints on storage, written beside the steps
        self._taken: set = set()                         # (step, range, id) of the copies keep_here took

    # ---------------------------------------------------------------- the off-node copy

    def _holders(self) -> dict:
        """Per virtual stage (model chunk) and TP rank (its *plane*: 0 without tensor
        parallelism), who keeps its copy: a worker cell on a node that runs no replica of it
        (spread over the candidates), else None: the scheduler."""
        g = self.group
        load: dict = {c: 0 for c in g.workers}
        out = {}
        for vs, (lo, hi) in enumerate(g.shape.bounds):
            s = g.shape.owner(vs)
            nodes = {g.node_of((r, g.shape.slot(s, j))) for r in range(g.shape.dp) for j in range(g.shape.reps[s])}
            for plane in range(g.shape.tp):
                others = sorted((c for c in g.workers if g.node_of(c) not in nodes), key=lambda c: (load[c], c))
                out[(vs, plane)] = others[0] if others else None
                if others:
                    load[others[0]] += hi - lo
        return out

    def take_snapshot(self, committed: int) -> None:
        """Have every stage's committed state copied off its node, while the next step runs;
        that step commits only once the copy is complete (``snapshot_landed``), so the copy
        is never more than one step behind."""
        if self._thread is not None:
            self._thread.join(30.0)
        with self._cond:
            self._busy += 1
            self._wanted = committed
        t0 = time.monotonic()
        g = self.group
        calls = {}
        for (vs, plane), holder in self._holders().items():
            lo, hi = g.shape.bounds[vs]
            source = g.workers[(0, g.shape.slot(g.shape.owner(vs), plane))]
            if holder is None:
                calls[(lo, hi, plane)] = [(None, source.snapshot.remote(committed, False, (lo, hi)))]
            else:  # the peer keeps it, and so does the source until a newer copy is complete; the
                # state is the peer's argument (moved to its node before the call runs: StageWorker.keep_copy)
                h = g.workers[holder]
                state = source.snapshot.remote(committed, True, (lo, hi))
                calls[(lo, hi, plane)] = [([h, source], h.keep_copy.remote((lo, hi), state, committed, plane))]

        def fetch():
            try:
                self._fetch(committed, calls, t0, self.timeout)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

        self._thread = threading.Thread(target=fetch, name="relaytrain-snapshot", daemon=True)
        self._thread.start()

    def _fetch(self, committed: int, calls: dict, t0: float, timeout: float) -> bool:
        """Wait for the copy of step ``committed``: per stage range and plane, the first of its calls
        (a peer's ``keep_copy``, or a ``snapshot`` kept here) that succeeds, recorded as it
        lands.  False if a range got none."""
        deadline = time.monotonic() + timeout
        ok = True
        for key, tries in calls.items():
            for holder, ref in tries:
                got = _get(ref, deadline)
                if (got is not None and got["step"] == committed) if holder is None else got == committed:
                    with self._cond:
                        ranges = self.kept.setdefault(committed, {})
                        taken = [k for k in ranges.get(key, []) if isinstance(k, dict)]  # (kept here already: keep_here)
                        ranges[key] = taken + ([got] if holder is None else list(holder))
                    break
            else:
                ok = False
        if not ok:
            return False
        with self._cond:
            self.snapshot_s = time.monotonic() - t0
            if self.complete is None or self.complete < committed:
                self.complete = committed
                older = [h for step, ranges in self.kept.items() if step < committed for hs in ranges.values()
                         for h in hs]
                self.kept = {s: r for s, r in self.kept.items() if s >= committed}
                for h in {id(h): h for h in older if not isinstance(h, dict)}.values():
                    h.drop_copies.options(num_returns=0).remote(committed)
        return True

    def snapshot_landed(self) -> bool:
        """Before a step commits: is the copy asked for after the previous commit complete?
        Waits for a fetch in flight and, if it failed, asks every replica of each stage once
        more for a copy kept here.  False means the workers cannot hand out their state (their
        node is going): the step must not commit, or a lost stage would go back more than one
        step."""
        wanted = self._wanted
        if wanted is None or (self.complete is not None and self.complete >= wanted):
            return True
        self.settle()
        if self.complete is not None and self.complete >= wanted:
            return True
        g = self.group
        calls = {(lo, hi, j): [(None, g.workers[(r, g.shape.slot(g.shape.owner(vs), j))].snapshot.remote(
                                wanted, False, (lo, hi))) for r in range(g.shape.dp)]
                 for vs, (lo, hi) in enumerate(g.shape.bounds) for j in range(g.shape.tp)}
        return self._fetch(wanted, calls, time.monotonic(), timeout=3.0)

    @property
    def wanted(self) -> Optional[int]:
        return self._wanted

    def settle(self, timeout: float = 5.0) -> None:
        """Let a snapshot being fetched land (or fail) before choosing a copy."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._busy and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())

    def forget_pending(self) -> None:
        """A new shape: a copy still being fetched from the old one is not waited for."""
        self._thread = None
        self._wanted = None

    # ---------------------------------------------------------------- copies on storage

    def newest_copy(self, lost: set, alive: set, committed: int, stateful: set) -> Optional[dict]:
        """The newest copy to restore from: the off-node copy of step ``committed`` when it holds
        the ``lost`` pieces ((layer, TP rank): a TP rank's slices of a layer; rank 0 without TP)
        (kept by workers in ``alive``, actor ids, or here); else an older step's that holds every
        ``stateful`` piece (all go back to it); else the newest checkpoint (whole), if newer."""
        best = None
        with self._cond:
            kept = {step: dict(ranges) for step, ranges in self.kept.items()}
        for step in sorted(kept, reverse=True):
            ranges = {}  # each range's first keeper that is alive (or the state kept here)
            for r, keepers in kept[step].items():
                k = next((k for k in keepers if _at_hand(k, alive)), None)
                if k is not None:
                    ranges[r] = k
            covered = {(i, j) for lo, hi, j in ranges for i in range(lo, hi)}
            if (lost if step == committed else stateful) <= covered:
                where = "peer workers" if any(not isinstance(k, dict) for k in ranges.values()) else "the scheduler"
                best = {"step": step, "ranges": ranges, "source": f"copy of step {step} kept by {where}"}
                break
        # the checkpoint the job started from only when nothing newer is kept (its storage is not
        # read at every reshape of a job that writes no checkpoints)
        newest = checkpoint.newest_or_origin(self.checkpoint_root, self.job_id, None if best else self.origin)
        if newest is not None:
            copy = _on_storage(newest)
            if best is None or copy["step"] > best["step"]:
                best = {**copy, "source": f"checkpoint {newest}"}
        return best

    def only_kept_by(self, step: int, ids: set, alive: set) -> dict:
        """The ranges ((lo, hi, TP rank)) of step ``step``'s copy that only workers in ``ids``
        (actor ids) keep (none kept here, none by a worker in ``alive``): range -> one of them."""
        with self._cond:
            ranges = dict(self.kept.get(step, {}))
        out = {}
        for r, keepers in ranges.items():
            ours = [k._actor_id.hex() for k in keepers if not isinstance(k, dict) and k._actor_id.hex() in ids]
            if ours and not any(_at_hand(k, alive) for k in keepers):
                out[r] = ours[0]
        return out

    def covered(self, step: int, alive: set) -> set:
        """The (layer, TP rank) pieces of step ``step``'s copy kept here or by a worker in ``alive``."""
        with self._cond:
            ranges = dict(self.kept.get(step, {}))
        return {(i, j) for (lo, hi, j), keepers in ranges.items()
                if any(_at_hand(k, alive) for k in keepers) for i in range(lo, hi)}

    def keep_here(self, step: int, ranges: dict) -> None:
        """Keep these copies of step ``step`` here ((lo, hi, TP rank) -> state), ahead of any
        worker that keeps them too (workers about to be stopped gave them), until
        ``drop_taken`` (the reshape that needed them has installed its shape)."""
        with self._cond:
            kept = self.kept.setdefault(step, {})
            for r, state in ranges.items():
                kept[r] = [state, *kept.get(r, [])]
                self._taken.add((step, r, id(state)))

    def drop_taken(self) -> None:
        """Forget the copies ``keep_here`` took (the new shape's workers hold that state now)."""
        with self._cond:
            for step, r, ident in self._taken:
                keepers = [k for k in self.kept.get(step, {}).get(r, []) if id(k) != ident]
                if keepers:
                    self.kept[step][r] = keepers
                else:
                    self.kept.get(step, {}).pop(r, None)
            self.kept = {step: ranges for step, ranges in self.kept.items() if ranges}
            self._taken = set()

    def resume_copy(self) -> Optional[dict]:
        """The checkpoint a run resumes from: its step and path (each worker reads its own
        layers from it)."""
        return _on_storage(checkpoint.resolve(self.resume)) if self.resume else None

    def _from_stages(self, method: str, committed: int, *args) -> list:
        """``method`` of replica 0's worker of every stage, in stage order (with tensor-parallel
        stages every rank of replica 0's group takes part: rank 0 answers)."""
        g = self.group
        first = [(0, g.shape.slot(s, j)) for s in range(g.shape.pp) for j in range(g.shape.tp)]
        out = g.gather({c: getattr(g.workers[c], method).remote(*args) for c in first},
                       None, self.timeout, phase=f"while writing its state at step {committed}")
        return [out[c] for c in first if out[c] is not None]

    def write_final(self, committed: int, out: dict) -> dict:
        """Every stage writes its shard of the final model (service/shards.py) where ``out``
        says; returns the index (``metadata.order``: the model's names in state_dict order)."""
        entries = self._from_stages("write_final", committed, committed, out)
        order = sorted((n for e in entries for n in e["names"]), key=layer_of)  # stable: a layer's own order
        return shards.index_of(entries, {"format": "pt", "step": committed, "order": order})

    def checkpoint_now(self, committed: int, spec, record, job_id: str) -> str:
        """A checkpoint of ``committed`` steps, written before this returns (to preempt); its path."""
        self._writer(spec, record, job_id)
        return self.writer.now(committed)

    def due(self, committed: int, spec) -> bool:
        """Does anything ask the workers for their state after ``committed`` steps (a checkpoint
        due or owed, an off-node snapshot)?"""
        snap = spec.elastic.snapshot_every_steps if spec.elastic.enabled else 0
        if snap and committed % snap == 0:
            return True
        if self.writer is not None:
            return self.writer.due(committed) or self.writer.owed is not None
        return checkpoint_due(self.checkpoint_root, spec.checkpoint.every_steps, spec.training.steps, committed)

    def finish_writing(self, lost: Optional[str] = None) -> None:
        """Let the checkpoint being written beside training finish (its event before the job's
        end); a failure is its ``checkpoint_failed`` event, the job ends anyway.  ``lost``: why
        the job stops or restarts (said in that event)."""
        if self.writer is not None:
            try:
                self.writer.poll(block=True, lost=lost)
            except JobFailure:
                pass

    def _writer(self, spec, record, job_id: str) -> None:
        if self.writer is None:
            self.writer = CheckpointWriter(self.group, self.checkpoint_root, spec, record,
                                           {"job_id": job_id, "name": spec.name}, self.timeout)

    def after_commit(self, committed: int, spec, record, job_id: str) -> None:
        """The off-node snapshot and the checkpoint the spec asks for after ``committed`` steps
        (the checkpoint is written beside the next steps: actors/checkpoints.py)."""
        snap = spec.elastic.snapshot_every_steps if spec.elastic.enabled else 0
        if snap and committed % snap == 0:
            self.take_snapshot(committed)
        self._writer(spec, record, job_id)
        self.writer.after_commit(committed)

    # ---------------------------------------------------------------- where a new shape's layers come from

    def sources(self, shape, assign: dict, committed: int, *, copy: Optional[dict], copy_layers: set,
                donors: dict, old_layers: dict, stateless: set) -> dict:
        """Per cell of ``assign``, the refs of the state its worker lacks, as (layer, TP rank)
        pieces (a tensor-parallel worker of rank j needs rank j's slices of its layers; the
        whole layers from a checkpoint serve any rank): from ``copy`` for ``copy_layers``
        (pieces), else exported by a live donor of the same rank (cell -> worker that held
        them, ``old_layers``: pieces by actor id).  Layers with no state need nothing."""
        if committed == 0:
            return {}
        total = {(i, j) for i in range(shape.layers) for j in range(shape.tp)}
        copy_refs: dict = {}  # (layers, rank) -> one ref, shared by the cells that need them
        out = {}
        for (r, s), h in assign.items():
            j = s % shape.tp
            need = {(i, j) for i in shape.layers_of(s)}
            held = set() if copy_layers == total else old_layers.get(h._actor_id.hex(), set())
            refs = []
            from_copy = need & copy_layers
            if from_copy and "path" in copy:  # a checkpoint: the worker reads its layers itself
                refs.append({"checkpoint": copy["path"], "layers": sorted(i for i, _ in from_copy)})
            for (lo, hi, plane), keeper in (copy or {}).get("ranges", {}).items():
                part = tuple(sorted(i for i, k in from_copy if k == plane and lo <= i < hi))
                if not part:
                    continue
                if (part, plane) not in copy_refs:  # kept here (a state) or by a peer worker (its handle)
                    copy_refs[(part, plane)] = (ray.put(subset_state(keeper, set(part))) if isinstance(keeper, dict)
                                                else keeper.export_copy.remote(list(part), copy["step"], plane))
                refs.append(copy_refs[(part, plane)])
            missing = need - held - copy_layers - {(i, j) for i in stateless}
            refs += self._exports(sorted(missing), committed, donors, old_layers)
            out[(r, s)] = refs
        # every copy is taken before any donor reconfigures (and drops layers it no longer keeps)
        exports = list({ref: None for refs in out.values() for ref in refs if isinstance(ref, ray.ObjectRef)})  # (a
        # copy's ref serves every cell that needs those pieces: each replica of a stage)
        if exports:  # (a failed copy surfaces in the configure call that reads it)
            ray.wait(exports, num_returns=len(exports), timeout=self.group.start_timeout, fetch_local=False)
        return out

    @staticmethod
    def _exports(missing: list, committed: int, donors: dict, old_layers: dict) -> list:
        """Export calls for the ``missing`` pieces, each from a donor holding it."""
        by_donor: dict = {}
        for layer, rank in missing:
            donor = next((d for d in donors.values() if (layer, rank) in old_layers[d._actor_id.hex()]), None)
            if donor is None:
                raise JobFailure(f"no live copy of layer {layer}{f' (TP rank {rank})' if rank else ''} at step "
                                 f"{committed}")
            by_donor.setdefault(donor._actor_id.hex(), (donor, []))[1].append(layer)
        return [donor.export.remote(layers, committed) for donor, layers in by_donor.values()]


def _at_hand(keeper, alive: set) -> bool:
    """Can this keeper of a copy give it: the state kept here (a dict), or a worker in ``alive``
    (actor ids)?"""
    return isinstance(keeper, dict) or keeper._actor_id.hex() in alive


def _on_storage(path) -> dict:
    """A checkpoint as a copy: its step and path, no tensors (workers read their layers)."""
    return {"step": checkpoint.step_of(path), "path": str(path)}


def _get(ref, deadline: float) -> Optional[dict]:
    try:
        return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
    except Exception:
        return None  # that worker was lost (or its node's object store is gone)
