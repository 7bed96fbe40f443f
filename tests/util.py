"""Scripted test doubles for the job controller (as Ray Train v2's tests/util.py): a cluster of
named nodes, a worker group whose steps succeed or fail as the test queues them, a reshaper
that places cells on nodes without moving state, and a state keeper that holds nothing.
The controller and the elastic policy under test are the real ones; no Ray runs."""
from __future__ import annotations

import collections
import time
from typing import Callable, Optional

import ray

from actors.cluster import NodeView
from actors.failures import PeerLost, step_failure
from actors.reshape import Move, Reshaped, Reshaper
from actors.workergroup import Joining


class FakeCluster:
    """Nodes with one worker slot each; a node can be removed (dead) or set draining."""

    def __init__(self, nodes: int):
        self.nodes = {f"node{i}": 1.0 for i in range(nodes)}
        self.draining: dict[str, Optional[float]] = {}
        self.group: Optional["FakeGroup"] = None
        self.seen_at: Optional[float] = None  # set: the view is as of then, before any worker for a growth started

    def remove(self, node: str) -> None:
        self.nodes.pop(node)

    def add(self, node: str) -> None:
        self.nodes[node] = 1.0

    @property
    def view(self) -> NodeView:
        """The watch's view of the last second (``seen_at``: while a growth's workers start, one
        as of then, from before they took their slots)."""
        return self._view(stale=self.seen_at is not None and self.group is not None and self.group.joining is not None)

    def _view(self, stale: bool = False) -> NodeView:
        used = collections.Counter(w["node"] for w in self.group.where.values()) if self.group else {}
        joining = len(self.group.joining.handles) if self.group and self.group.joining and not stale else 0
        joining += self.group.joined_unplaced if self.group else 0  # up, holding their slots
        free = {n: {"CPU": cpus - used.get(n, 0)} for n, cpus in self.nodes.items()}
        for n in free:  # workers being started take free slots first
            take = min(joining, max(0, int(free[n]["CPU"])))
            free[n]["CPU"] -= take
            joining -= take
        return NodeView(alive=set(self.nodes), draining=dict(self.draining), free=free,
                        time=self.seen_at if stale else time.time())

    def refresh(self) -> NodeView:
        return self._view()

    def start(self) -> "FakeCluster":
        return self

    def stop(self) -> None:
        pass


def user_error(exc: BaseException) -> ray.exceptions.RayTaskError:
    """What ray.get raises when a worker's step raised ``exc`` in user code."""
    return ray.exceptions.RayTaskError("run_step", f"Traceback (most recent call last):\n{type(exc).__name__}: {exc}",
                                       exc)


def peer_error() -> ray.exceptions.RayTaskError:
    return user_error(PeerLost("receiving the activation of microbatch 3 failed: RuntimeError: Connection closed"))


def died() -> ray.exceptions.ActorDiedError:
    return ray.exceptions.ActorDiedError()


class FakeGroup:
    """The worker group's interface, with steps scripted by ``queue_step``."""

    def said(self, cell: tuple) -> str:
        return f"w{cell[0]}.{cell[1]}"  # its actors are named after their cells

    def __init__(self, spec, cluster: FakeCluster):
        self.spec, self.cluster = spec, cluster
        self.elastic = spec.elastic.enabled
        self.timeout = self.start_timeout = 5.0
        self.workers: dict = {}
        self.where: dict = {}
        self.shape = None
        self.gpus = 0.0
        self.joining: Optional[Joining] = None
        self.steps_run: list[int] = []
        self.lost: set = set()                  # the cells of the last failed step's errors
        self.killed: set = set()                # cells whose process died on a node that stays up
        self.stuck: set = set()                 # cells that answer but whose aborted step never ends
        self.started_joining: list[tuple] = []  # (workers started, workers already up) per background start
        self.added_joining: list[int] = []      # workers added to a growth whose workers were starting
        self.start_boundaries = 1               # a growth's workers are up at the k-th boundary after their start
        self._starting = 0
        self.joined_unplaced = 0                # workers of a growth that are up, holding slots, not yet placed
        self._outcomes: collections.deque = collections.deque()
        cluster.group = self

    def queue_step(self, errors: Optional[dict] = None, before: Optional[Callable[[], None]] = None) -> None:
        """The next step: every worker succeeds (``errors`` None) or these cells raise; ``before``
        runs first (e.g. the test removes a node)."""
        self._outcomes.append((errors, before))

    @staticmethod
    def whole_groups(handles: dict) -> dict:
        return dict(handles)  # no tensor parallelism in these jobs

    def slots_freed(self, held: dict, dead: dict, stay=()) -> dict:
        return {self.node_of(c): 1.0 for c in held if self.node_of(c)}  # a slot each (one per node)

    # --- what the reshaper does to it
    def place(self, shape) -> None:
        kept = {c: w["node"] for c, w in self.where.items()}
        free = [n for n in self.cluster.nodes if n not in self.cluster.draining and n not in kept.values()]
        cells = [(r, s) for r in range(shape.dp) for s in range(shape.pp)]
        nodes = [n for n in kept.values() if n in self.cluster.nodes and n not in self.cluster.draining] + free
        self.where = {c: {"node": nodes[i], "layers": shape.bounds[c[1]], "name": ""} for i, c in enumerate(cells)}
        self.workers = {c: f"worker-{c}" for c in cells}
        self.shape = shape
        self.joined_unplaced = 0

    # --- the WorkerGroup interface the controller uses
    def gpus_per_worker(self) -> float:
        return 0.0

    def call_all(self, method: str, *args) -> dict:
        return {c: (method, args) for c in self.workers}

    def gather(self, refs: dict, step, timeout: float, phase: str = "while starting") -> dict:
        errors, before = self._outcomes.popleft() if self._outcomes else (None, None)
        if before:
            before()
        if errors:
            self.lost = set(errors)
            raise step_failure(errors, step, phase, elastic=self.elastic, t_error=time.time())
        self.steps_run.append(step + 1)
        now = time.time()
        return {c: {"loss": 0.5 if c[1] == self.shape.pp - 1 else None, "busy": 0.01, "start": now, "pipe_end": now,
                    "end": now, "peak_live": 1, "allreduce_s": 0.0, "output": [], "timeline": []} for c in refs}

    def node_of(self, c) -> Optional[str]:
        return self.where.get(c, {}).get("node")

    def describe(self) -> dict:
        return {f"w{r}.{s}": self.where[(r, s)]["node"] for r, s in sorted(self.workers)}

    def drain_output(self) -> dict:
        return {}

    def stop_others(self, handles) -> None:
        pass

    def take_joined(self, keep: dict) -> None:
        pass

    def spawn(self, cells: list) -> dict:
        return {}  # a fixed-shape job's workers, started early: here placed by the reshaper's install

    def start_joining(self, k: int, up: tuple = (), detected: Optional[float] = None) -> None:
        self.started_joining.append((k, len(up)))
        self.joining = Joining([*up, *(f"joining-{len(self.started_joining)}-{i}" for i in range(k))], [],
                               time.monotonic() + 5, detected or time.time())
        self._starting = 0

    def add_joining(self, k: int) -> None:
        self.added_joining.append(k)
        self.joining.handles += [f"added-{len(self.added_joining)}-{i}" for i in range(k)]

    def joined(self) -> Optional[dict]:
        """Workers started for a growth are up at the ``start_boundaries``-th boundary after it."""
        self._starting += 1
        if self.joining is not None and self._starting < self.start_boundaries:
            return None
        got, self.joining = self.joining, None
        self.joined_unplaced = len(got.handles) if got else 0
        return {("new", i): h for i, h in enumerate(got.handles)} if got else None

    def keep_survivors(self, calls: list, wait_s: float = 10.0) -> dict:
        """The workers whose cells the last failed step did not lose (a fixed-shape restart)."""
        self.workers = {c: w for c, w in self.workers.items() if c not in self.lost}
        self.where = {c: w for c, w in self.where.items() if c in self.workers}
        return dict(self.workers)

    def teardown(self) -> None:
        self.workers = {}


class FakeReshaper(Reshaper):
    """Places cells on the fake cluster's nodes; every state source is taken as given."""

    def __init__(self, *args):
        super().__init__(*args)
        self.started_in_foreground: list[int] = []  # per reshape: workers it had to start while training paused

    def install(self, shape, why, assign, committed, boundary, *, copy, donors, copy_layers=None) -> dict:
        self.group.place(shape)
        return {}

    def after_loss(self, refs: dict, lost) -> Move:
        g = self.group
        dead = {c for c in g.workers if g.node_of(c) not in g.cluster.nodes or c in g.killed}
        alive = {c: h for c, h in g.workers.items() if c not in dead}
        nodes = {g.node_of(c) for c in dead}
        up = {g.node_of(c) for c in alive}  # as the real one: a node where a worker answered is up
        self._suspect.update({n: time.monotonic() for n in nodes - up if n})
        g.where = {c: w for c, w in g.where.items() if c not in g.killed}  # a dead process's slot is free
        g.killed = set()
        keep = {c: h for c, h in alive.items() if c not in g.stuck}  # a stuck one is a donor, not kept
        return Move(f"lost {sorted(dead)} ({lost.failure})", keep=keep, donors=alive, exclude=nodes, forced=True,
                    detected=lost.time, lost=tuple(sorted(dead)), after_loss=True)

    def release_held(self, move: Move, committed: int, timeout: float = 30.0) -> dict:
        """As the real one, without state: the held workers stop and their slots come free."""
        g = self.group
        held = self.held(move)
        move.release_tried = True
        for c in held:
            g.workers.pop(c, None)
            g.where.pop(c, None)
        g.stuck -= set(held)
        move.keep = {c: h for c, h in move.keep.items() if c not in held}
        move.donors = {c: h for c, h in move.donors.items() if c not in held}
        move.committed = None
        return {"held": held, "step": committed, "pieces": 0, "failed": []}

    def choose_copy(self, move: Move, committed: int) -> None:
        move.committed = committed

    def carry_out(self, move: Move, shape, why: str, boundary: list) -> Reshaped:
        g = self.group
        old = [g.shape.dp, g.shape.pp] if g.shape else None
        self.started_in_foreground.append(max(0, shape.workers - len(move.keep)))  # the real install starts them
        g.where = {c: w for c, w in g.where.items() if c in move.keep}
        g.place(shape)
        return Reshaped(move.reason, old, [shape.dp, shape.pp], move.detected, 0, None, None, why,
                        {"installed_at": time.time()}, paused_since=move.phases.get("began_at"))

    def drop_dead(self, handles: dict) -> set:
        return set()


class FakeKeeper:
    checkpoint_root = None
    origin = None  # the checkpoint the job started from (StateKeeper.origin)
    snapshot_s = None
    wanted = None

    def snapshot_landed(self) -> bool:
        return True

    def take_snapshot(self, committed: int) -> None:
        pass

    def after_commit(self, committed: int, spec, record, job_id: str) -> None:
        pass

    def resume_copy(self):
        return None

    def settle(self) -> None:
        pass

    def newest_copy(self, lost, alive, committed, stateful):
        return None

    def forget_pending(self) -> None:
        pass

    def due(self, committed: int, spec) -> bool:
        return False

    def finish_writing(self, lost=None) -> None:
        pass

    def write_final(self, committed: int, out: dict) -> dict:
        return {"metadata": {"total_size": 0, "step": committed}, "weight_map": {}}
