"""The copies of stages' committed state a worker keeps: for another stage (it is that stage's
off-node *peer*, actors/statekeeper.py) and of its own stage until a newer copy is complete."""
from __future__ import annotations

import threading

from actors.state import merge_states, subset_state


class KeptCopies:
    def __init__(self):
        self._copies: dict[tuple[int, int, int], dict] = {}  # (lo, hi, step) -> {step, model, optim}
        self._lock = threading.Lock()

    def keep(self, layers: tuple, step: int, state: dict) -> None:
        """Keep ``state`` of layers [lo, hi) at ``step``: a range's two newest steps stay until
        ``drop``, so every stage can go back one step together."""
        lo, hi = layers
        with self._lock:
            self._copies[(lo, hi, step)] = state
            for old in sorted(k[2] for k in self._copies if k[:2] == (lo, hi))[:-2]:
                del self._copies[(lo, hi, old)]

    def export(self, layers: list[int], step: int, who: str) -> dict:
        """The kept state of ``layers`` at ``step``."""
        with self._lock:
            held = {k: v for k, v in self._copies.items() if k[2] == step}
        missing = set(layers) - {i for lo, hi, _ in held for i in range(lo, hi)}
        if missing:
            raise RuntimeError(f"{who} keeps no copy of layers {sorted(missing)} at step {step}")
        return subset_state(merge_states(held.values()), set(layers))

    def drop(self, before: int) -> int:
        """Forget copies older than step ``before``; returns how many stay."""
        with self._lock:
            self._copies = {k: v for k, v in self._copies.items() if k[2] >= before}
            return len(self._copies)
