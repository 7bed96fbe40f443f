"""The job's processes run at the niceness its spec asks (resources.nice), read from the
processes while the job runs: Ray renices every worker process it starts to 15, where any
other busy process on the node would take nearly all of a core from the job (README: "The
job's processes"); tests/test_memory.py checks the default, 0, on a 1 x 4 job.  They also
re-check a blocked ``ray.get`` every 100 ms, not Ray's 1 s (actors/launch.py), and the workers
run with one malloc arena and no per-thread caches of small blocks (actors/heap.py)."""
from __future__ import annotations

import threading
import time
import uuid

import pytest

from bench import memory
from service.spec import parse_spec


@pytest.mark.parametrize("nice", [6, 0])
def test_the_scheduler_and_the_workers_run_at_resources_nice(ray_session, tmp_path, nice):
    """At 6 the job's processes get their settings in a runtime_env; at 0, on the tests' Ray
    (started as relaytrain starts its own: actors/nodeenv.py), from the node, with none."""
    from actors import heap, launch

    assert (launch.job_process_env({}, nice) is None) == (nice == 0)
    assert (heap.runtime_env({}, nice, {}) == {}) == (nice == 0)
    name = f"nice-{uuid.uuid4().hex[:6]}"
    spec = parse_spec({
        "name": name, "model": {"kind": "mlp", "args": {"hidden": 16, "layers": 2}}, "data": {"kind": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.05},
        "training": {"global_batch_size": 16, "microbatch_size": 8, "steps": 400, "seed": 1},
        "parallelism": {"dp": 1, "pp": 2}, "resources": {"nice": nice},
    })
    done, actors, envs = run_sampled(spec, tmp_path)
    seen = {n: (a["kind"], a["nice"]) for n, a in actors.items()}
    assert done.get("state") == "SUCCEEDED", done
    assert sorted(seen.values()) == [("scheduler", nice), ("worker", nice), ("worker", nice)], seen
    recheck = {n: e.get("RAY_get_check_signal_interval_milliseconds") for n, e in envs.items()}
    assert list(recheck.values()) == ["100"] * 3, recheck
    # and the workers' malloc: one arena, no per-thread caches of small blocks (actors/heap.py)
    heaps = {n: (e.get("MALLOC_ARENA_MAX"), e.get("GLIBC_TUNABLES")) for n, e in envs.items()
             if seen[n][0] == "worker"}
    assert list(heaps.values()) == [("1", "glibc.malloc.tcache_count=0")] * 2, heaps


def run_sampled(spec, tmp_path, workers: int = 2) -> tuple[dict, dict, dict]:
    """``run_job`` of ``spec`` in a thread while bench/memory.py's Sampler finds its processes:
    (the job's result, {actor name: its pid, kind, nice}, {actor name: the environment it started
    with}), read once its scheduler and ``workers`` workers are up."""
    from actors.runner import run_job

    sampler = memory.Sampler(spec.name, interval=0.05, pss_every=0)
    sampler.start()
    done: dict = {}
    job = threading.Thread(target=lambda: done.update(
        run_job(spec=spec, out=str(tmp_path), progress=False, record=False)), daemon=True)
    job.start()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and job.is_alive():
            if sampler.scheduler() and len(sampler.workers()) == workers:
                break
            time.sleep(0.1)
        actors = dict(sampler.actors)
        envs = {n: environ(a["pid"]) for n, a in actors.items()}
    finally:
        job.join(120)
        sampler.stop()
    return done, actors, envs


def environ(pid: int) -> dict:
    """The environment process ``pid`` started with, from /proc."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}
