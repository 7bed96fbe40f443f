"""Copies of a job's committed state, away from the workers that train it: the snapshot in
the scheduler's memory (elastic jobs, every ``elastic.snapshot_every_steps``), checkpoints on
storage, the checkpoint a run resumes from, and the final model.  It also says where each
worker of a new shape gets the layers it lacks: a live donor, or the newest copy.

The interface the controller uses: ``take_snapshot`` after a commit, ``snapshot_landed``
before the next commit, ``newest_copy`` when layers were lost, ``sources`` when installing
a shape, ``save_checkpoint`` and ``collect`` (the whole state, for the final model)."""
from __future__ import annotations

import shutil
import threading
import time
from typing import Optional

import ray

from actors.failures import JobFailure
from actors.state import merge_states, subset_state
from actors.workergroup import WorkerGroup
from service import checkpoint, shards


class StateKeeper:
    def __init__(self, group: WorkerGroup, checkpoint_root: Optional[str], resume: Optional[str], timeout: float):
        self.group = group
        self.checkpoint_root, self.resume, self.timeout = checkpoint_root, resume, timeout
        self.snap: Optional[dict] = None                 # off-node copy of every stage: {step, model, optim}
        self.snapshot_s: Optional[float] = None          # seconds from a commit to its copy landing here
        self._wanted: Optional[int] = None               # the step of the newest copy asked for
        self._busy = 0                                   # snapshot fetches in flight
        self._thread: Optional[threading.Thread] = None
        self._cond = threading.Condition()

    # ---------------------------------------------------------------- the snapshot

    def take_snapshot(self, committed: int) -> None:
        """Ask every stage for a copy of its committed state (before the next step is sent, so
        it is served first) and keep it here, off the workers' nodes.  A thread fetches it
        while the next step runs, and that step commits only once it is here
        (``snapshot_landed``), so the copy is never more than one step behind."""
        if self._thread is not None:
            self._thread.join(30.0)
        with self._cond:
            self._busy += 1
            self._wanted = committed
        t0 = time.monotonic()
        g = self.group
        refs = [[g.workers[(0, s)].snapshot.remote(committed)] for s in range(g.shape.pp)]

        def fetch():
            try:
                self._fetch(committed, refs, t0, self.timeout)
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

        self._thread = threading.Thread(target=fetch, name="relaytrain-snapshot", daemon=True)
        self._thread.start()

    def _fetch(self, committed: int, refs: list, t0: float, timeout: float) -> bool:
        """Keep the copy of step ``committed`` from ``refs`` (per stage, the snapshot calls of
        one or more of its replicas: the first good answer counts).  False if a stage gave none."""
        deadline = time.monotonic() + timeout
        parts = []
        for stage_refs in refs:
            part = next((p for p in (_get(ref, deadline) for ref in stage_refs)
                         if p is not None and p["step"] == committed), None)
            if part is None:
                return False
            parts.append(part)
        with self._cond:
            self.snapshot_s = time.monotonic() - t0
            if self.snap is None or self.snap["step"] < committed:
                self.snap = {"step": committed, **merge_states(parts)}
        return True

    def snapshot_landed(self) -> bool:
        """Before a step commits: is the copy asked for after the previous commit here?  Waits
        for a fetch in flight and, if it failed, asks every replica of each stage once more.
        False means the workers cannot hand out their state (their node is going): the step
        must not commit, or a lost stage would go back more than one step."""
        wanted = self._wanted
        if wanted is None or (self.snap is not None and self.snap["step"] >= wanted):
            return True
        self.settle()
        if self.snap is not None and self.snap["step"] >= wanted:
            return True
        g = self.group
        refs = [[g.workers[(r, s)].snapshot.remote(wanted) for r in range(g.shape.dp)] for s in range(g.shape.pp)]
        return self._fetch(wanted, refs, time.monotonic(), timeout=3.0)

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

    def newest_copy(self) -> Optional[dict]:
        """The newest complete off-node copy: the scheduler's snapshot or a checkpoint."""
        best = None
        if self.snap is not None:
            best = {**self.snap, "source": f"snapshot of step {self.snap['step']} in the scheduler's memory"}
        newest = checkpoint.latest(self.checkpoint_root) if self.checkpoint_root else None
        if newest is not None:
            copy = _on_storage(newest)
            if best is None or copy["step"] > best["step"]:
                best = {**copy, "source": f"checkpoint {newest}"}
        return best

    def resume_copy(self) -> Optional[dict]:
        """The checkpoint a run resumes from: its step and path (each worker reads its own
        layers from it)."""
        return _on_storage(checkpoint.resolve(self.resume)) if self.resume else None

    def _from_stages(self, method: str, committed: int, *args) -> list:
        """``method`` of replica 0's worker of every stage, in stage order."""
        g = self.group
        out = g.gather({(0, s): getattr(g.workers[(0, s)], method).remote(*args) for s in range(g.shape.pp)},
                       None, self.timeout, phase=f"while writing its state at step {committed}")
        return [out[(0, s)] for s in range(g.shape.pp)]

    def write_final(self, committed: int, out: dict) -> dict:
        """Every stage writes its shard of the final model (service/shards.py) where ``out``
        says; returns the index (``metadata.order``: the model's names in state_dict order)."""
        entries = self._from_stages("write_final", committed, committed, out)
        order = [n for e in entries for n in e["names"]]
        return shards.index_of(entries, {"format": "pt", "step": committed, "order": order})

    def save_checkpoint(self, step: int, meta: dict, keep: int) -> str:
        """Every stage writes its own part, at once; the manifest goes last."""
        folder = checkpoint.begin(self.checkpoint_root, step)
        try:
            parts = self._from_stages("save_part", step, str(folder), step)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return str(checkpoint.finish(self.checkpoint_root, folder, step, parts, meta, keep=keep))

    # ---------------------------------------------------------------- where a new shape's layers come from

    def sources(self, bounds: list, assign: dict, committed: int, *, copy: Optional[dict], copy_layers: set,
                donors: dict, old_layers: dict, stateless: set) -> dict:
        """Per cell of ``assign``, the refs of the state of the layers its worker lacks: from
        ``copy`` for ``copy_layers``, else exported by a live donor (cell -> worker that held
        them, ``old_layers`` by actor id).  Layers with no state need nothing."""
        if committed == 0:
            return {}
        total = {i for lo, hi in bounds for i in range(lo, hi)}
        copy_refs: dict = {}
        out = {}
        for (r, s), h in assign.items():
            need = set(range(*bounds[s]))
            held = set() if copy_layers == total else old_layers.get(h._actor_id.hex(), set())
            refs = []
            from_copy = tuple(sorted(need & copy_layers))
            if from_copy and "model" not in copy:  # a checkpoint: the worker reads its layers itself
                refs.append({"checkpoint": copy["path"], "layers": list(from_copy)})
            elif from_copy:
                if from_copy not in copy_refs:
                    copy_refs[from_copy] = ray.put(subset_state(copy, set(from_copy)))
                refs.append(copy_refs[from_copy])
            missing = need - held - copy_layers - stateless
            refs += self._exports(sorted(missing), committed, donors, old_layers)
            out[(r, s)] = refs
        # every copy is taken before any donor reconfigures (and drops layers it no longer keeps)
        exports = [ref for refs in out.values() for ref in refs if isinstance(ref, ray.ObjectRef)]
        if exports:  # (a failed copy surfaces in the configure call that reads it)
            ray.wait(exports, num_returns=len(exports), timeout=self.group.start_timeout, fetch_local=False)
        return out

    @staticmethod
    def _exports(missing: list, committed: int, donors: dict, old_layers: dict) -> list:
        by_donor: dict = {}
        for layer in missing:
            donor = next((d for d in donors.values() if layer in old_layers[d._actor_id.hex()]), None)
            if donor is None:
                raise JobFailure(f"no live copy of layer {layer} at step {committed}")
            by_donor.setdefault(donor._actor_id.hex(), (donor, []))[1].append(layer)
        return [donor.export.remote(layers, committed) for donor, layers in by_donor.values()]


def _on_storage(path) -> dict:
    """A checkpoint as a copy: its step and path, no tensors (workers read their layers)."""
    return {"step": checkpoint.step_of(path), "path": str(path)}


def _get(ref, deadline: float) -> Optional[dict]:
    try:
        return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
    except Exception:
        return None  # that worker was lost (or its node's object store is gone)
