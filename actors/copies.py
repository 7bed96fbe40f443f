"""The copies of stages' committed state a worker keeps: for another stage (it is that stage's
off-node *peer*, actors/statekeeper.py) and of its own stage until a newer copy is complete."""
from __future__ import annotations

import os
import threading
import time

import torch

from actors.state import merge_states, subset_state


class KeptCopies:
    def __init__(self):
        # (lo, hi, plane, step) -> {step, model, optim}; the plane is the TP rank whose slices these are
        self._copies: dict[tuple[int, int, int, int], dict] = {}
        self._lock = threading.Lock()

    def keep(self, layers: tuple, step: int, state: dict, plane: int = 0) -> None:
        """Keep ``state`` of layers [lo, hi) (TP rank ``plane``'s slices) at ``step``: a range's
        two newest steps stay until ``drop``, so every stage can go back one step together."""
        lo, hi = layers
        with self._lock:
            self._copies[(lo, hi, plane, step)] = state
            for old in sorted(k[3] for k in self._copies if k[:3] == (lo, hi, plane))[:-2]:
                del self._copies[(lo, hi, plane, old)]

    def export(self, layers: list[int], step: int, who: str, plane: int = 0) -> dict:
        """The kept state of ``layers`` (TP rank ``plane``'s slices) at ``step``."""
        with self._lock:
            held = {k: v for k, v in self._copies.items() if k[3] == step and k[2] == plane}
        missing = set(layers) - {i for lo, hi, _, _ in held for i in range(lo, hi)}
        if missing:
            raise RuntimeError(f"{who} keeps no copy of layers {sorted(missing)}"
                               f"{f' (TP rank {plane})' if plane else ''} at step {step}")
        return subset_state(merge_states(held.values()), set(layers))

    def drop(self, before: int) -> int:
        """Forget copies older than step ``before``; returns how many stay."""
        with self._lock:
            self._copies = {k: v for k, v in self._copies.items() if k[3] >= before}
            return len(self._copies)


class Uploads:
    """Checkpoint parts being written in the background.  A part's state is copied in the
    upload's own thread while the next step computes (the parameters and the optimizer state do
    not change until the next optimizer step, which waits for the copy: ``wait_copied``), then
    written out while the worker trains on."""

    def __init__(self):
        self._running: dict[int, tuple[threading.Thread, dict, threading.Event]] = {}  # step -> ...
        self._lock = threading.Lock()
        self._staging: dict[str, torch.Tensor] = {}  # the copy's memory, reused by the next checkpoint

    def busy(self) -> bool:
        with self._lock:
            return any(t.is_alive() for t, _, _ in self._running.values())

    def copy(self, tree):
        """A copy of ``tree`` (dicts of tensors) in the staging buffers kept from the last
        checkpoint: memory already touched, so the copy costs a quarter of a fresh clone (no
        page faults; measured 20 against 90 ms for 128 MiB here).  Only while no other upload
        runs (the scheduler writes one checkpoint at a time)."""
        used: set[str] = set()

        def walk(v, key: str):
            if isinstance(v, torch.Tensor):
                b = self._staging.get(key)
                if b is None or b.shape != v.shape or b.dtype != v.dtype:
                    b = self._staging[key] = torch.empty(v.shape, dtype=v.dtype)
                used.add(key)
                return b.copy_(v.detach())
            if isinstance(v, dict):
                return {k: walk(x, f"{key}\0{k}") for k, x in v.items()}
            return v

        out = walk(tree, "")
        for key in set(self._staging) - used:  # layers this worker no longer holds
            del self._staging[key]
        return out

    def start(self, step: int, copy, write) -> None:
        """In a thread: ``state = copy()``, then ``write(state)`` (returns the part's entry);
        ``wait(step)`` gives the entry, with ``copy_s`` and ``write_s``."""
        outcome: dict = {}
        copied = threading.Event()

        def run():
            _lowest_priority()
            try:
                t0 = time.perf_counter()
                try:
                    state = copy()
                finally:
                    copied.set()
                t1 = time.perf_counter()
                outcome["entry"] = dict(write(state), copy_s=round(t1 - t0, 4),
                                        write_s=round(time.perf_counter() - t1, 4))
            except BaseException as e:  # handed to whoever waits
                outcome["error"] = e

        t = threading.Thread(target=run, name=f"relaytrain-upload-{step}", daemon=True)
        with self._lock:
            self._running[step] = (t, outcome, copied)
        t.start()

    def wait_copied(self) -> None:
        """Until every upload has its copy of the state (before the state changes)."""
        with self._lock:
            events = [c for _, _, c in self._running.values()]
        for c in events:
            c.wait()

    def wait(self, step: int) -> dict:
        """The entry of step ``step``'s part once it is written; its error if it failed."""
        with self._lock:
            got = self._running.get(step)
        if got is None:
            raise RuntimeError(f"no checkpoint part of step {step} was started here")
        t, outcome, _ = got
        t.join()
        with self._lock:
            self._running.pop(step, None)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["entry"]


def _lowest_priority() -> None:
    """Run this thread (and the threads it starts: fsspec's I/O loop) at the lowest CPU priority:
    where the training thread and the upload share cores, the step gets them first and the
    upload takes what the step leaves (waits on peers, bubbles).  Linux schedules threads on
    their own, so this leaves the worker's other threads as they are."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: the upload runs as it is
        pass
