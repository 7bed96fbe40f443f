"""Where a stage worker's step memory comes from: memory the step before freed, kept in the
process, instead of memory handed back to the kernel and faulted in again.

PyTorch's CPU allocator is plain ``malloc``.  A training step frees its weight gradients
(``zero_grad(set_to_none=True)``, as a hand-written loop does) and its activations, and the
next step asks for the same sizes again.  Where glibc has given those blocks back to the
kernel, each 4 KiB page is zero-filled on its first touch: a page fault, 1.5-2 us on this
machine, and 7-15 us while the host is reclaiming the guest's freed memory (this machine's
virtio free page reporting).  Measured in the peer bench's job (bench/peers.py, MLP
1024-1024x8-10, 64-row microbatches, two workers on two cores): the first weight-gradient
product of a step into a fresh 4 MiB ``.grad`` took 7-16 ms with 1,024 page faults, against
1.5-3 ms into memory already mapped; some steps took 290 ms where the others took 210.

Three things gave the memory back:

- Ray runs an actor's calls on a pool of threads (a worker has ``max_concurrency`` 8), and glibc
  gives each thread its own heap (arena): a step ran on another thread than the step before,
  found none of the memory that step freed, and faulted its own in anew.  ``StepThread`` runs
  every step and evaluation of a worker on one thread of its own.
- A thread's arena grows in heaps of at most 64 MiB, and a heap that empties is unmapped.
  ``runtime_env`` starts the workers with ``MALLOC_ARENA_MAX=1``: every thread allocates from
  the main heap, which has no such limit.
- glibc serves blocks from 128 KiB up (its threshold moves up to 32 MiB as such blocks are
  freed) with a fresh ``mmap``, returns them with ``munmap``, and gives the free top of its heap
  back (``M_TRIM_THRESHOLD``).  ``keep_freed`` fixes the first at 32 MiB and turns the second
  off (``mallopt``): blocks below 32 MiB come from the heap and stay mapped once freed.  Larger
  blocks (a GPT head's 206 MB gradient) are still mapped and unmapped every step: kept on the
  heap, they fragmented it, and the head stage's peak grew from 1.68 to 2.17 GiB
  (bench/memory.py --quick).

Kept, the freed memory still fragmented: in a stage of 2 x 4 MiB weight gradients the heap
grew by 1-4 MiB in 2-4 of steps 5-14, and by 32 MiB between steps 1 and 51 (then no more); each
growth was faulted in fresh (256-1,024 faults in that step) though 10-20 MiB lay free
in 500-1,100 pieces.  A shim around malloc (LD_PRELOAD, run 2026-11-26) showed what asked for
the memory when the heap grew: the first product of each weight gradient (4 MiB, the step
thread), and 1 MiB blocks of Ray's task execution (its call threads).  Two things keep the
pieces whole:

- A weight's gradient is written into the memory of its gradient of the step before
  (actors/deferred.py, the Linear layers whose weight gradients the engine computes itself),
  where nothing holds that any more: no 4 MiB block is freed and asked for again each step.
- ``runtime_env`` turns off glibc's per-thread caches of small blocks (``NO_TCACHE``): each of
  a worker's dozens of threads kept up to 7 freed blocks of each size up to 1 KiB, scattered
  over the heap and counted as in use, so the free space around them never merged (with the
  caches off alone, the 1 MiB growths stopped in 3 runs and the 4 MiB ones went on).

With both, the first stage's heap grew 2.3 MiB between steps 11 and 150 (10 MiB before), and
in 14 runs of both cases of tests/test_memory.py no worker's step 5-14 took more than 194 faults
(before: 4 of 10 steps of 256-1,027 in some runs).  Turning the caches off cost no measurable
time: a one-process MLP step (1024 x 8, 8 microbatches of 64) took 390-403 ms with them off,
393-413 ms with them on; the same model in two stages, 60 steps run 4 times each way in turn,
242-287 ms off and 239-271 ms on (medians of each run).

The process's peak (VmHWM) over its share is as before (bench/memory.py --quick: 1.06-1.26x);
its resident size no longer falls between steps.  Set ``RELAYTRAIN_KEEP_FREED=0`` to leave
glibc's thresholds and caches as they are (a worker whose environment sets
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or a threshold tunable keeps those:
bench/memory.py's tuned runs set a 1 MiB threshold; a job that sets ``GLIBC_TUNABLES`` keeps its
own); elsewhere than glibc (musl, macOS) none of this does anything.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional, TypeVar

from actors import failures, nodeenv

T = TypeVar("T")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
KEEP_UP_TO = 32 << 20      # blocks below 32 MiB come from the heap (above: mapped and unmapped, as glibc does)
NEVER_TRIM = 2**31 - 1     # mallopt takes an int


def runtime_env(job_env: dict, nice: int = 0, parent: Optional[dict] = None) -> dict:
    """The worker actors' own ``runtime_env`` option (Ray merges it into ``parent``, the
    scheduler's, which they inherit): none where every node gives the settings
    (actors/nodeenv.py); else one malloc arena, unless the job's runtime_env sets its own
    ``MALLOC_ARENA_MAX``; no per-thread caches of small blocks (``NO_TCACHE``), unless it sets
    ``GLIBC_TUNABLES`` or turns all of this off (``RELAYTRAIN_KEEP_FREED=0``); and the niceness
    and get re-check the scheduler's runtime_env does not carry (it started where the nodes
    gave them, and this worker may start on a node that does not)."""
    if nodeenv.given_by_nodes(job_env, nice):
        return {}
    env = job_env.get("env_vars") or {}
    inherited = (parent or {}).get("env_vars") or {}
    # what the job's processes see: this process's environment (which they share) under the job's own
    wanted = nodeenv.settings(nice, {**os.environ, **env})
    ours = {k: v for k, v in wanted.items() if k not in env and k not in inherited}
    return {"runtime_env": {"env_vars": ours}} if ours else {}


def keep_freed() -> str:
    """Tune this process's malloc as above; returns what was done (a worker keeps it as ``heap``)."""
    if not nodeenv.keep_freed_on():
        return "off (RELAYTRAIN_KEEP_FREED=0)"
    chosen = [k for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_") if k in os.environ]
    if chosen or "_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return f"left as the environment sets it ({', '.join(chosen) or 'GLIBC_TUNABLES'})"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "not glibc: malloc left as it is"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not mallopt(M_MMAP_THRESHOLD, KEEP_UP_TO):
        return f"glibc {version} refused the thresholds: malloc left as it is"
    mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)
    return f"glibc {version}: blocks below {KEEP_UP_TO >> 20} MiB from the heap, freed memory kept"


class StepThread:
    """One daemon thread that runs what :meth:`run` is given, in order; the caller waits for the
    result or the exception (re-raised as it was).  ``threads``: the OpenMP team size it uses
    (torch's thread count is per thread: a new thread would otherwise take the default).

    A task parked in a wait on its peers that cannot end (actors/failures.py ``waiting_on_peers``)
    can be given up on (:meth:`abandon`): its caller is answered at once, a new thread runs the
    tasks queued behind it and every later one, and the old thread, once its wait ends, leaves
    without touching anything (its wait raises ``StepAbandoned``)."""

    def __init__(self, threads: int, name: str = "relaytrain-step"):
        self._threads, self._name = threads, name
        self._lock = threading.Lock()
        self._running: Optional[tuple] = None  # (thread id, future) of the task running
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._start()

    def _start(self) -> None:
        threading.Thread(target=self._loop, args=(self._work,), name=self._name, daemon=True).start()

    def _loop(self, work: queue.SimpleQueue) -> None:
        import torch  # here: the scheduler names the worker's runtime_env without torch

        torch.set_num_threads(self._threads)
        me = threading.get_ident()
        while True:
            fn, args, done = work.get()
            if not done.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running = (me, done)
            out = err = None
            try:
                out = fn(*args)
            except BaseException as e:  # the caller's thread raises it
                err = e
            with self._lock:
                if failures.abandoned(me):  # its caller was answered; another thread runs the next tasks
                    failures.forget(me)  # thread ids are reused
                    return
                self._running = None
            if err is None:
                done.set_result(out)
            else:
                done.set_exception(err)
            del fn, args, done, out, err  # nothing of a step (its tensors, a failure's frames) waits here for the next

    def submit(self, fn: Callable[..., T], *args) -> "Future[T]":
        """Queue ``fn(*args)`` behind what was queued before; its future."""
        done: Future = Future()
        with self._lock:
            self._work.put((fn, args, done))
        return done

    def run(self, fn: Callable[..., T], *args) -> T:
        return self.submit(fn, *args).result()

    def busy(self) -> bool:
        return self._running is not None

    def parked_since(self) -> Optional[float]:
        """When the task running began the wait on peers it is parked in (``time.monotonic``), or None."""
        running = self._running
        return failures.waiting_since(running[0]) if running else None

    def abandon(self, why: BaseException) -> bool:
        """Give up on the task running, parked in a wait on peers: its caller gets ``why``, and a
        new thread takes the queue.  False when no task runs (it ended meanwhile)."""
        with self._lock:
            if self._running is None:
                return False
            thread, done = self._running
            self._running = None
            failures.abandon(thread)
            old, self._work = self._work, queue.SimpleQueue()
            while True:
                try:
                    self._work.put(old.get_nowait())
                except queue.Empty:
                    break
            self._start()
        done.set_exception(why)
        return True

    def give_up_if_parked(self, aborted: float, parked_s: float, watch_s: float, why: BaseException,
                          still: Callable[[], bool] = lambda: True, first: Callable[[], None] = lambda: None) -> bool:
        """After an abort at ``aborted`` (``time.monotonic``): abandon the task running once it
        has been parked in a wait on peers for ``parked_s`` since the abort (or since its wait
        began, if later), calling ``first()`` just before.  Watches until the task ends,
        ``still()`` turns false (the worker moved on) or ``watch_s`` have passed; True if it gave
        up on the task."""
        while still() and self.busy() and time.monotonic() < aborted + watch_s:
            since = self.parked_since()
            if since is not None and time.monotonic() - max(since, aborted) > parked_s:
                first()
                return self.abandon(why)
            time.sleep(0.05)
        return False
