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

The process's peak (VmHWM) over its share is as before (bench/memory.py --quick: 1.06-1.26x);
its resident size no longer falls between steps.  tests/test_memory.py reads the workers' faults
from /proc: 0-8 in most steps after the fourth, against about 2,000 every step before, for
2 x 4 MiB of gradients a stage.  Not every step: the heap fragments (likely because Ray's own
threads allocate from it too; not traced), and now and then a freed block no longer fits the
next step's request, which then comes from fresh memory (2026-11-26: a 10 MiB block, 2,560
faults, in one or two of ten steps in half the runs of the 25 MiB case).  Set
``RELAYTRAIN_KEEP_FREED=0`` to leave glibc's thresholds as they are (a worker whose environment
sets ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_`` or glibc's malloc tunables keeps
those: bench/memory.py's tuned runs set a 1 MiB threshold); elsewhere than glibc (musl,
macOS) none of this does anything.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import queue
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
KEEP_UP_TO = 32 << 20      # blocks below 32 MiB come from the heap (above: mapped and unmapped, as glibc does)
NEVER_TRIM = 2**31 - 1     # mallopt takes an int


def runtime_env(job_env: dict) -> dict:
    """The worker actors' own ``runtime_env`` option (Ray merges it into the job's): one malloc
    arena, unless the job's runtime_env sets its own ``MALLOC_ARENA_MAX``."""
    if "MALLOC_ARENA_MAX" in (job_env.get("env_vars") or {}):
        return {}
    return {"runtime_env": {"env_vars": {"MALLOC_ARENA_MAX": "1"}}}


def keep_freed() -> str:
    """Tune this process's malloc as above; returns what was done (a worker keeps it as ``heap``)."""
    if os.environ.get("RELAYTRAIN_KEEP_FREED", "1") == "0":
        return "off (RELAYTRAIN_KEEP_FREED=0)"
    chosen = [k for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_") if k in os.environ]
    if chosen or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
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
    (torch's thread count is per thread: a new thread would otherwise take the default)."""

    def __init__(self, threads: int, name: str = "relaytrain-step"):
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, args=(threads,), name=name, daemon=True).start()

    def _loop(self, threads: int) -> None:
        torch.set_num_threads(threads)
        while True:
            fn, args, done = self._work.get()
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # the caller's thread raises it
                done.set_exception(e)
            del fn, args, done  # nothing of a step (its tensors, a failure's frames) waits here for the next

    def submit(self, fn: Callable[..., T], *args) -> "Future[T]":
        """Queue ``fn(*args)`` behind what was queued before; its future."""
        done: Future = Future()
        self._work.put((fn, args, done))
        return done

    def run(self, fn: Callable[..., T], *args) -> T:
        return self.submit(fn, *args).result()
