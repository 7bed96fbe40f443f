"""How a job changes shape while it runs: the mechanics behind the elastic policy's
``Reshape``.  A ``Move`` says why and with which workers; ``Reshaper.carry_out`` chooses where
the committed state comes from (live donors, or the newest off-node copy when every holder
of some layers is gone), installs the new shape on kept and new workers, and stops the
workers left over.  ``Reshaper.after_loss`` turns a failed step into a ``Move``."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import ray

from actors.failures import JobFailure, WorkerLost, cell_name
from actors.statekeeper import StateKeeper
from actors.workergroup import WorkerGroup, kill
from service import planner

# a worker silent to the abort's ping (sent at the first error) counts as lost when it is still
# silent this long after the error: a live one answers in milliseconds, a loaded machine's in
# under a second; an actor on a crashed node fails only after ~1.5 s
SILENT_GRACE_S = 0.8
# a node whose workers were taken for lost is not placed on until Ray marks it dead (~15 s); if
# it is still alive after this long, its workers were only slow, and it counts again
SUSPECT_S = 30.0
# when every worker holding some of the state is silent, they get this much longer before the job
# rolls back to an off-node copy (or fails without one): a live process on a loaded machine can go
# unscheduled for seconds, while a worker on a crashed node stays silent however long it is asked
LOADED_GRACE_S = 5.0


@dataclass
class Move:
    """A reshape to carry out.  ``keep``: live workers that may take cells of the new shape;
    ``donors``: live workers whose committed layers may be copied (the current workers not
    kept are stopped afterwards); ``exclude``: nodes not to place on."""

    reason: str
    keep: dict
    donors: dict
    exclude: set
    forced: bool
    detected: float = field(default_factory=time.time)
    copy: Optional[dict] = None            # the off-node copy chosen for lost layers
    copy_layers: Optional[set] = None      # the (layer, TP rank) pieces taken from it (None: all, with copy)
    steps_lost: int = 0
    restored_from: Optional[str] = None
    restored_step: Optional[int] = None    # the step of that copy
    lost: tuple = ()                       # the cells found dead after a failed step (after_loss)
    after_loss: bool = False               # made by after_loss: its held workers may be stopped for their slots
    release_tried: bool = False            # release_held tried (and found stopping them would lose state)
    committed: Optional[int] = None        # the step the new shape starts from
    draining: tuple = ()                   # the draining nodes it moves off (off_draining)
    phases: dict = field(default_factory=dict)  # where the reshape's seconds went


@dataclass
class Reshaped:
    """A reshape installed; recorded once the first step of its shape commits."""

    reason: str
    old: Optional[list]
    new: list
    detected: float
    steps_lost: int
    restored_from: Optional[str]
    restored_step: Optional[int]
    why: str
    phases: dict
    moved: int = 0        # layers with state that workers of the new shape did not hold (copied in)
    tp: int = 1           # both shapes' tensor-parallel groups (a reshape keeps tp)
    paused_since: Optional[float] = None  # training stopped then: at a loss, its detection; a growth or a
    # drain trains on until the reshape begins (its new workers started in the background)


class Reshaper:
    def __init__(self, group: WorkerGroup, keeper: StateKeeper, layers: int, stateless: set):
        self.group, self.keeper = group, keeper
        self.layers, self.stateless = layers, stateless
        self._suspect: dict[str, float] = {}    # nodes that lost workers -> since when

    def suspect(self, alive: set) -> set:
        """The nodes not to place on: those that lost workers while none of their other workers
        answered, until Ray marks them dead or they stay alive for SUSPECT_S."""
        now = time.monotonic()
        self._suspect = {n: t for n, t in self._suspect.items() if n in alive and now - t < SUSPECT_S}
        return set(self._suspect)

    # ---------------------------------------------------------------- turning events into moves

    def stateful(self) -> set:
        """The job's state as (layer, TP rank) pieces: a tensor-parallel job's rank j holds rank
        j's slices; a stateless layer has none (it is rebuilt)."""
        tp = self.group.shape.tp if self.group.shape else 1
        return {(i, j) for i in set(range(self.layers)) - self.stateless for j in range(tp)}

    def unheld(self, holders) -> set:
        """The pieces of state none of the workers ``holders`` (cells) holds."""
        return self.stateful() - {piece for c in holders for piece in self.group.pieces_of(c)}

    def after_loss(self, refs: dict, lost: WorkerLost) -> Move:
        """A step failed because workers died: which are alive (answer a ping and finished
        their aborted step), which are stuck (answer but still run: replaced), which are dead."""
        g = self.group
        # a live worker answers a ping in milliseconds, even mid-step (threaded actor), though a
        # loaded machine can take a second; a call to an actor on a crashed node fails after
        # ~1.5 s or hangs until Ray marks the node dead (~15 s): not waited for.  The workers
        # that stayed silent to the abort's ping get until 1.2 s after the first error
        answered, _ = g.answering({c: h for c, h in g.workers.items() if c not in lost.lost}, timeout=2.0,
                                  silent=lost.silent, silent_until=lost.time + SILENT_GRACE_S)
        quiet = {c: h for c, h in g.workers.items() if c not in answered and c not in lost.lost}
        if quiet and self.unheld(answered):
            late, _ = g.answering(quiet, timeout=LOADED_GRACE_S)
            answered = {**answered, **late}
        # the live workers were aborted: their step calls end within milliseconds, or within
        # seconds on a loaded machine; one that still runs after that is stuck and replaced
        ray.wait([refs[c] for c in answered], num_returns=len(answered), timeout=10.0)
        alive, stuck = {}, {}
        for c, h in answered.items():
            done, _ = ray.wait([refs[c]], timeout=0)
            (alive if done else stuck)[c] = h
        dead = set(g.workers) - set(alive) - set(stuck)
        nodes = {g.node_of(c) for c in dead}
        # a node where another worker answered is up: its lost worker was a process (killed, out
        # of memory, crashed), and its slots count again as soon as they are free
        up = {g.node_of(c) for c in answered}
        self._suspect.update({n: time.monotonic() for n in nodes - up if n})
        reason = (f"lost {', '.join(cell_name(c) for c in sorted(dead))} ({lost.failure})" if dead
                  else str(lost.failure))
        return Move(reason, keep=alive, donors={**alive, **stuck}, exclude=nodes, forced=True, detected=lost.time,
                    lost=tuple(sorted(dead)), after_loss=True)

    def off_draining(self, view) -> Optional[Move]:
        """The move off nodes that announced they are going (``view``: actors.cluster.NodeView)."""
        g = self.group
        draining = {c for c in g.workers if g.node_of(c) in view.draining}
        if not draining:
            return None
        nodes = sorted({g.node_of(c) for c in draining})
        deadlines = [view.draining[n] for n in nodes if view.draining[n]]
        left = f", deadline in {min(deadlines) - time.time():.0f} s" if deadlines else ""
        reason = f"node{'s' if len(nodes) > 1 else ''} {', '.join(n[:12] for n in nodes)} draining{left}"
        return Move(reason, keep={c: w for c, w in g.workers.items() if c not in draining}, donors=dict(g.workers),
                    exclude=set(nodes), forced=True, draining=tuple(nodes))

    def held(self, move: Move) -> dict:
        """The job's live workers that ``move`` cannot keep (cell -> worker): stuck in their step,
        or in a tensor-parallel group that lost a member.  They hold their slots until stopped."""
        whole = self.group.whole_groups(move.keep)
        return {c: h for c, h in {**move.donors, **move.keep}.items() if c not in whole}

    def taken_in(self, move: Move) -> list:
        """The workers ``move`` keeps from outside the current shape (a growth's, up and taken in):
        their TP groups stay placed when others are stopped."""
        return [h for c, h in self.group.whole_groups(move.keep).items() if c not in self.group.workers]

    def dead(self, move: Move) -> dict:
        """The current shape's workers that ``move`` neither keeps nor takes state from (lost)."""
        return {c: h for c, h in self.group.workers.items() if c not in move.donors and c not in move.keep}

    def release_held(self, move: Move, committed: int, timeout: float = 30.0) -> Optional[dict]:
        """Stop the workers ``held`` names, so that their slots count.  First the state only they
        hold comes to the scheduler, as its copy of the step the move starts from (``choose_copy``
        chooses it again; ``committed``: the job's newest step): their own layers when that is the
        newest step (exported), and the copies of that step that no other live worker keeps.  They
        are stopped only if the move then still starts from that step (else their state would be
        lost: an export failed), and the lost workers' placement is dropped with them.  Returns
        what was done ({"held", "step", "pieces", "failed"}), or None when nothing was stopped."""
        g = self.group
        held = self.held(move)
        if not held:
            return None
        move.release_tried = True
        self.keeper.settle()
        _forget_copy(move)
        self.choose_copy(move, committed)
        step = move.committed
        whole = g.whole_groups(move.keep)
        alive = {h._actor_id.hex() for h in whole.values()}
        lost_after = self.unheld(whole)
        need = (lost_after if step == committed else self.stateful()) - self.keeper.covered(step, alive)
        asked: dict = {}   # (layer, TP rank) pieces -> (the worker asked, the call that brings them)
        if step == committed:
            for c, h in sorted(held.items()):
                mine = sorted((g.pieces_of(c) & need) - set(asked))
                if mine:
                    ref = h.export.remote(sorted({i for i, _ in mine}), step)
                    asked.update({piece: (c, ref) for piece in mine})
        by_id = {h._actor_id.hex(): c for c, h in held.items()}
        for (lo, hi, plane), keeper in self.keeper.only_kept_by(step, set(by_id), alive).items():
            pieces = ({(i, plane) for i in range(lo, hi)} & need) - set(asked)
            if pieces:
                c = by_id[keeper]
                ref = held[c].export_copy.remote(list(range(lo, hi)), step, plane)
                asked.update({piece: (c, ref) for piece in pieces})
        deadline = time.monotonic() + timeout
        refs = {id(ref): ref for _, ref in asked.values()}
        got = {k: _state_or_none(ref, deadline) for k, ref in refs.items()}
        taken = {piece: got[id(ref)] for piece, (_, ref) in asked.items() if got[id(ref)] is not None}
        self.keeper.keep_here(step, {(i, i + 1, j): state for (i, j), state in taken.items()})
        failed = sorted({c for piece, (c, ref) in asked.items() if got[id(ref)] is None})
        if lost_after:  # without them, would the move still start from that step?
            copy = self.keeper.newest_copy(lost_after, alive, committed, self.stateful())
            if copy is None or copy["step"] < step:
                return None
        dead = self.dead(move)
        g.stop_now({**held, **dead}, stay=self.taken_in(move))
        move.keep = {c: h for c, h in move.keep.items() if c in whole}
        move.donors = {c: h for c, h in move.donors.items() if c not in held}
        _forget_copy(move)
        return {"held": held, "step": step, "pieces": len(taken), "failed": failed}

    def drop_dead(self, handles: dict) -> set:
        """Remove the workers that do not answer (within 3 s) from ``handles``; their nodes
        become suspect."""
        _, dead = self.group.answering(handles, timeout=3.0)
        for c in dead:
            node = self.group.node_of(c)
            if node:
                self._suspect[node] = time.monotonic()
            kill(handles.pop(c))
        return dead

    # ---------------------------------------------------------------- carrying a move out

    def choose_copy(self, move: Move, committed: int) -> None:
        """Where the layers no donor holds come from: the newest off-node copy.  An older copy
        takes every stage back with it, so all layers agree (the steps since then re-run)."""
        move.committed = committed
        lost = self.unheld(move.donors)
        if not lost:
            return
        lost_layers = {i for i, _ in lost}
        self.keeper.settle()
        # the copies kept by any live worker count (kept workers too: a reshape tried again after a worker
        # was lost while state moved has no donors, but its kept workers still keep their copies)
        alive = {h._actor_id.hex() for h in [*move.donors.values(), *move.keep.values()]}
        copy = self.keeper.newest_copy(lost, alive, committed, self.stateful())
        if copy is None:
            raise JobFailure(f"every replica of layers {sorted(lost_layers)} was lost and there is no "
                             "off-node copy of them (enable elastic.snapshot_every_steps or checkpoint.every_steps; "
                             "the copy of a stage is kept on another node, so it survives one node at a time)")
        move.copy, move.restored_from, move.restored_step = copy, copy["source"], copy["step"]
        if copy["step"] == committed:
            move.copy_layers = lost
        else:
            move.steps_lost, move.committed = committed - copy["step"], copy["step"]

    def carry_out(self, move: Move, shape: planner.Shape, why: str, boundary: list) -> Reshaped:
        """Install ``shape`` with ``move``'s workers and state; stop the workers left over."""
        g = self.group
        old = _named(g.shape) if g.shape else None
        previous = dict(g.workers)
        phases = dict(move.phases)
        assign = self.assign(shape, move.keep)
        was = {id(h): c for c, h in move.keep.items()}  # a kept worker's cell before the move
        held = lambda cell: g.layers_of(was[id(assign[cell])]) if cell in assign else set()  # noqa: E731
        moved = sum(len(shape.layers_of(s) - held((r, s)) - self.stateless) for r, s in shape.cells)
        phases.update(self.install(shape, why, assign, move.committed, boundary,
                                   copy=move.copy, copy_layers=move.copy_layers, donors=move.donors))
        self.keeper.forget_pending()
        self.keeper.drop_taken()  # (what held workers gave for this reshape: its workers hold it now)
        g.stop_others(list(previous.values()) + [h for c, h in move.keep.items() if c not in previous])
        phases["installed_at"] = time.time()
        paused = phases.pop("began_at", move.detected)
        return Reshaped(move.reason, old, _named(shape), move.detected, move.steps_lost, move.restored_from,
                        move.restored_step, why, phases, moved, shape.tp, paused)

    def install(self, shape: planner.Shape, why: str, assign: dict, committed: int, boundary: list, *,
                copy: Optional[dict], donors: dict, copy_layers: Optional[set] = None) -> dict:
        """Configure workers into ``shape`` at ``committed`` steps and connect them; the cells
        not in ``assign`` get new workers.  Layers a worker lacks come from ``donors`` or, for
        ``copy_layers`` (every layer when None and ``copy`` is given), from ``copy``."""
        g = self.group
        cells = shape.cells
        spawned = g.spawn([c for c in cells if c not in assign])
        t = time.time()
        try:
            if spawned:  # (a growth's new workers start in the background: here only after a loss or a drain)
                g.wait_ready(spawned)
            started = {"start_s": time.time() - t} if spawned else {}
            if copy is not None and copy_layers is None:
                copy_layers = {(i, j) for i in range(self.layers) for j in range(shape.tp)}
            everyone = {**assign, **spawned}
            old_layers = {h._actor_id.hex(): g.pieces_of(c) for c, h in donors.items()}
            sources = self.keeper.sources(shape, everyone, committed, copy=copy, copy_layers=copy_layers or set(),
                                          donors=donors, old_layers=old_layers, stateless=self.stateless)
            return {**started, **g.configure(shape, why, everyone, committed, sources, boundary)}
        except BaseException:
            for h in spawned.values():
                kill(h)
            raise

    def assign(self, shape: planner.Shape, keep: dict) -> dict:
        """Give kept workers the cells whose layers they already hold (most overlap first).  With
        tensor parallelism only whole TP groups are kept (a group sits on one node), each taking
        a stage replica's group, its workers keeping their TP ranks."""
        if shape.tp > 1:
            return self._assign_groups(shape, keep)
        cells = shape.cells
        mine = {s: shape.layers_of(s) for s in range(shape.width)}
        pairs = []
        for i, (c, h) in enumerate(keep.items()):
            held = self.group.layers_of(c)
            for (r, s) in cells:
                overlap = len(held & mine[s])
                pairs.append((-overlap, (r, s) != c, (r, s), i, c))
        pairs.sort(key=lambda x: x[:4])
        assign, used = {}, set()
        for _, _, cell, _, c in pairs:
            if cell in assign or c in used:
                continue
            assign[cell] = keep[c]
            used.add(c)
        return assign

    def _assign_groups(self, shape: planner.Shape, keep: dict) -> dict:
        groups = []  # each kept whole group: the layers its rank 0 holds, its workers in TP rank order
        whole = list(self.group.whole_groups(keep).items())
        for k in range(0, len(whole), shape.tp):
            members = whole[k:k + shape.tp]
            groups.append((self.group.layers_of(members[0][0]), [h for _, h in members]))
        pairs = sorted((-len(held & shape.layers_of(shape.slot(st))), (r, st), gi)
                       for gi, (held, _) in enumerate(groups) for r in range(shape.dp) for st in range(shape.pp))
        assign, used, taken = {}, set(), set()
        for _, (r, st), gi in pairs:
            if (r, st) in taken or gi in used:
                continue
            taken.add((r, st))
            used.add(gi)
            for j, h in enumerate(groups[gi][1]):
                assign[(r, shape.slot(st, j))] = h
        return assign


def _named(shape: planner.Shape) -> list:
    """[dp, pp], with the workers per stage when a stage is replicated: [dp, pp, replicas]."""
    return [shape.dp, shape.pp] + ([list(shape.replicas)] if shape.replicas else [])


def _forget_copy(move: Move) -> None:
    """The move chooses where its lost state comes from again (``choose_copy``)."""
    move.committed = move.copy = move.copy_layers = move.restored_from = move.restored_step = None
    move.steps_lost = 0


def _state_or_none(ref, deadline: float) -> Optional[dict]:
    try:
        return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
    except Exception:  # lost meanwhile, or not at that step: its layers come from another copy
        return None
