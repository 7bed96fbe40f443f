"""What the scheduler sees of the cluster: alive nodes, which are draining, free worker slots.

``NodeWatch`` polls once a second in a thread of the scheduler, so the training loop only
reads its last answer at step boundaries (no GCS call on the step's critical path).
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class NodeView:
    alive: set[str] = field(default_factory=set)
    draining: dict[str, Optional[float]] = field(default_factory=dict)  # node id -> deadline (unix s) or None
    free: dict[str, dict[str, float]] = field(default_factory=dict)     # node id -> available resources
    time: float = 0.0

    def free_slots(self, cpus: float, gpus: float, exclude: set[str] = frozenset(), group: int = 1) -> int:
        """Worker slots free on alive, non-draining nodes outside ``exclude``; with ``group`` > 1
        (a tensor-parallel group, placed on one node) only whole groups of slots count."""
        n = 0
        for node in self.alive - set(self.draining) - set(exclude):
            res = self.free.get(node, {})
            k = math.floor(res.get("CPU", 0.0) / cpus + 1e-9) if cpus else 1 << 30
            if gpus:
                k = min(k, math.floor(res.get("GPU", 0.0) / gpus + 1e-9))
            n += max(0, k) // group * group
        return n


def _draining_nodes() -> dict[str, Optional[float]]:
    """Draining nodes and their deadlines (unix s, None without one), from the GCS.
    (``ray.nodes()`` has no draining field; the node snapshot's DRAINING state lags.)"""
    from ray._private.state import state

    return {node: (ms / 1000.0 if ms else None) for node, ms in state.get_draining_nodes().items()}


def observe() -> NodeView:
    import ray
    from ray._private.state import available_resources_per_node

    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    return NodeView(alive=alive, draining=_draining_nodes(), free=dict(available_resources_per_node()),
                    time=time.time())


def largest_node_memory() -> float:
    """The most memory (bytes, Ray's ``memory`` resource) an alive node with CPUs offers."""
    import ray

    return max((n["Resources"].get("memory", 0.0) for n in ray.nodes()
                if n.get("Alive") and n["Resources"].get("CPU", 0.0) > 0), default=0.0)


class NodeWatch:
    def __init__(self, period: float = 1.0):
        self.period = period
        self.view = NodeView()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "NodeWatch":
        if self._thread is not None:  # already watching
            return self
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="relaytrain-nodewatch", daemon=True)
        self._thread.start()
        return self

    def refresh(self) -> NodeView:
        try:
            self.view = observe()
        except Exception:
            pass
        return self.view

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            self.refresh()

    def stop(self) -> None:
        self._stop.set()
