"""Step by step, what a worker's heap does: page faults, the heap's size, its free pieces.

    .venv/bin/python bench/heap_growth.py [--case 4MiB|25MiB] [--steps 30] [--runs 2]
                                          [--tunables glibc.malloc.tcache_count=3] [--every 1]

Runs tests/test_memory.py's job (bench/memory.py's ``reuse_spec``: a 1x2 MLP, 1F1B over gloo, SGD with momentum; ``4MiB``: width
1024, 4 layers, 4 microbatches of 64 rows, so 2 x 4 MiB of weight gradients a stage and 1 MiB of
inputs a step; ``25MiB``: width 2560, a 10 MiB and a 25 MiB gradient) and samples each worker
every 20 ms from outside and inside:

  * /proc/<pid>/task/*/stat: the minor page faults of each thread (which thread faulted);
  * /proc/<pid>/maps: the size of the ``[heap]`` mapping (where glibc's main heap grew);
  * glibc's ``mallinfo2`` (an actor call): bytes in use, bytes free, the free top, and the
    number of free pieces.

Per worker and step it prints the step's faults (and the threads that took 64 or more), the heap
before and after, and mallinfo2 at the step's end.  A heap that grows in a step faults the new
pages in that step: that is what actors/heap.py keeps from happening.  ``--tunables`` replaces
the workers' ``GLIBC_TUNABLES`` (the default is actors/heap.py's ``NO_TCACHE``; ``""`` gives
glibc's own).  ``--every N`` prints every N-th step only (long runs: where the heap stops
growing).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = ROOT  # run as a script: the repository, not bench/, first (bench/ names shadow others)
else:
    sys.path.insert(0, ROOT)

import ray  # noqa: E402

from bench import memory  # noqa: E402

FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


def mallinfo(_actor=None) -> dict:
    """glibc's mallinfo2 of the calling process (run in a worker through ``__ray_call__``; the
    structure is made here: a ctypes class does not travel to the worker by value)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in FIELDS]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    m = libc.mallinfo2()
    return {k: getattr(m, k) for k in FIELDS}


def threads(pid: int) -> dict:
    """tid -> (name, minor faults so far)."""
    out = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                s = open(f"/proc/{pid}/task/{tid}/stat").read()
            except OSError:
                continue
            comm = s[s.index("(") + 1:s.rindex(")")]
            out[int(tid)] = (comm, int(s[s.rindex(")") + 2:].split()[7]))
    except OSError:
        pass
    return out


def heap_size(pid: int) -> int:
    total = 0
    try:
        for line in open(f"/proc/{pid}/maps"):
            if "[heap]" in line:
                lo, hi = line.split()[0].split("-")
                total += int(hi, 16) - int(lo, 16)
    except OSError:
        pass
    return total


class Sampler(memory.Sampler):
    """bench/memory.py's sampler (it finds the job's actors), sampling the figures above."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.samples: dict = {}   # pid -> [(t, threads, heap bytes, mallinfo2 or None)]
        self.handles: dict = {}

    def run(self) -> None:
        k = 0
        while not self._halt.is_set():
            if k % 5 == 0:
                self._discover()
            now = time.time()
            for name, info in list(self.actors.items()):
                if info["kind"] != "worker":
                    continue
                pid = info["pid"]
                if pid not in self.handles:
                    self.handles[pid] = ray.get_actor(name, namespace=memory.NAMESPACE)
                try:
                    mi = ray.get(self.handles[pid].__ray_call__.remote(mallinfo), timeout=5)
                except Exception:
                    mi = None
                self.samples.setdefault(pid, []).append((now, threads(pid), heap_size(pid), mi))
            k += 1
            self._halt.wait(self.interval)


def run(case: str, steps: int, every: int, tunables: str | None) -> None:
    from actors.runner import run_job

    name = f"heap-{uuid.uuid4().hex[:6]}"
    # a job's own GLIBC_TUNABLES replaces actors/heap.py's (runtime_env)
    spec = memory.reuse_spec(case, name, steps, {"env_vars": {"GLIBC_TUNABLES": tunables}} if tunables is not None else None)
    sampler = Sampler(name, interval=0.02, pss_every=0)
    sampler.start()
    try:
        final = run_job(spec=spec, out=f"/tmp/{name}", progress=False, record=False)
    finally:
        sampler.stop()
    ends = [row["time"] for row in final["metrics"]]
    for w in sampler.workers():
        series = sampler.samples.get(w["pid"], [])
        if not series:
            continue

        def at(t):
            before = [x for x in series if x[0] <= t]
            return before[-1] if before else series[0]

        print(f"{w['name']} (pid {w['pid']}), {case}:")
        for i in range(1, len(ends) - 1):
            if (i + 2) % every:
                continue
            a, b = at(ends[i]), at(ends[i + 1])
            took = {f"{comm}:{tid}": n - a[1].get(tid, (comm, 0))[1] for tid, (comm, n) in b[1].items()}
            faults = sum(took.values())
            big = {k: v for k, v in took.items() if v >= 64}
            mi = b[3] or {}
            print(f"  step {i + 2:4d}: {faults:5d} faults, heap {a[2] >> 10} -> {b[2] >> 10} KiB, "
                  f"in use {mi.get('uordblks', 0) >> 10} KiB, free {mi.get('fordblks', 0) >> 10} KiB "
                  f"in {mi.get('ordblks', '?')} pieces, top {mi.get('keepcost', 0) >> 10} KiB"
                  + (f"  {big}" if big else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", choices=sorted(memory.REUSE_CASES), default="4MiB")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--tunables", default=None, help="the workers' GLIBC_TUNABLES (default: actors/heap.py's)")
    args = ap.parse_args()
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    for _ in range(args.runs):
        run(args.case, args.steps, args.every, args.tunables)


if __name__ == "__main__":
    main()
