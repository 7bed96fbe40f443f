"""The environment a job's processes start with, given by the node instead of a ``runtime_env``.

A job's scheduler and workers need four settings from their first instruction on, which only
the process environment can give: Ray's niceness for the processes it starts
(``RAY_worker_niceness``, 15 by default, at which any busy process takes a core from a job),
its re-check of a blocked get (``RAY_get_check_signal_interval_milliseconds``), and glibc's
malloc settings (``MALLOC_ARENA_MAX``, ``GLIBC_TUNABLES``: actors/heap.py).  Given as a
``runtime_env``, they cost each process a second start: Ray starts a process whose runtime_env
is not empty through ``setup_worker.py``, a Python that imports part of Ray (0.4-0.5 s of CPU
here) and then execs the worker, and asks its runtime-env agent for the environment first.
Measured on this machine, four actors that import torch, three rounds each way: 8.1-10.1 s of
CPU and 4.6-5.7 s to be ready with the settings in a runtime_env, 6.4-7.4 s and 3.4-4.2 s with
the same settings inherited from the node.

So where relaytrain starts Ray itself (``relaytrain run``'s local Ray, ``relaytrain serve``'s
embedded one, the tests' clusters) or its manifests start it (k8s/), the node starts with these
settings in its environment, which every process Ray starts there inherits, and with the label
``LABEL``.  A job whose processes need nothing else (``resources.nice`` 0, no runtime_env of its
own) then starts them with no runtime_env, when every live node carries the label; on any other
cluster, or a node without the label, it passes them in a runtime_env as before.
"""
from __future__ import annotations

import os
from typing import Iterable, Optional

LABEL = "relaytrain/process-env"  # a node label: this node's processes start with ``settings()``
VERSION = "1"                     # bumped when settings() changes: a node with another value is not relied on

# Ray re-checks a blocked ``ray.get`` of an object on another node every this many ms (its
# default: 1000). About one fetch in three inside a job on a simulated 3-node cluster sat out
# that whole second (README, "Elasticity"); at 100 ms such a fetch waits 100 ms at most.
GET_RECHECK_MS = 100
NO_TCACHE = "glibc.malloc.tcache_count=0"


def keep_freed_on(env: Optional[dict] = None) -> bool:
    """Whether actors/heap.py keeps freed memory: glibc's thresholds and its per-thread caches
    (``RELAYTRAIN_KEEP_FREED=0`` leaves both as glibc has them; the one arena stays)."""
    env = os.environ if env is None else env
    return env.get("RELAYTRAIN_KEEP_FREED") != "0"


def tunables(inherited: Optional[str]) -> str:
    """``GLIBC_TUNABLES`` with glibc's per-thread caches of small blocks off, keeping what the
    environment already sets (its own ``tcache_count`` wins)."""
    if not inherited:
        return NO_TCACHE
    return inherited if "tcache_count" in inherited else f"{inherited}:{NO_TCACHE}"


def settings(nice: int = 0, env: Optional[dict] = None) -> dict:
    """The environment variables a job's processes need at niceness ``nice``, over ``env`` (by
    default this process's environment, whose ``GLIBC_TUNABLES`` is kept)."""
    env = os.environ if env is None else env
    out = {"RAY_worker_niceness": str(int(nice)), "RAY_get_check_signal_interval_milliseconds": str(GET_RECHECK_MS),
           "MALLOC_ARENA_MAX": "1"}
    if keep_freed_on(env):
        out["GLIBC_TUNABLES"] = tunables(env.get("GLIBC_TUNABLES"))
    return out


def prepare() -> dict:
    """Put ``settings()`` into this process's environment, for a Ray node it is about to start
    (its processes inherit them), and return the labels to start that node with."""
    os.environ.update(settings())
    return {LABEL: VERSION}


def labelled(nodes: Iterable[dict]) -> bool:
    """Whether every live node of ``nodes`` (as ``ray.nodes()`` lists them) was started with
    ``settings()``."""
    alive = [n for n in nodes if n.get("Alive")]
    return bool(alive) and all((n.get("Labels") or {}).get(LABEL) == VERSION for n in alive)


def given_by_nodes(job_env: dict, nice: int = 0) -> bool:
    """Whether a job's processes can start with no runtime_env: it has none of its own, runs at
    niceness 0, and every live node of the cluster gives the settings."""
    if job_env or nice:
        return False
    import ray

    try:
        return labelled(ray.nodes())
    except Exception:  # no answer from the GCS: pass the settings, as on any cluster
        return False


def priority_note(nice: int, now: Optional[int] = None) -> str:
    """A warning for the job's log when this process does not run at the job's niceness (''
    when it does): the node it runs on did not give it the settings, e.g. a node labelled but
    started without them, or one without the label that joined between the job's look at the
    nodes and this worker's placement."""
    now = os.nice(0) if now is None else now
    if now == nice:
        return ""
    return (f"relaytrain: warning: this process runs at niceness {now}, not the job's resources.nice {nice} "
            f"(Ray starts its processes at 15 unless told otherwise): its node's Ray was started without the "
            f"environment relaytrain's processes need, or with the label {LABEL}={VERSION} but not that "
            "environment; start every node's Ray as actors/nodeenv.py says (README, \"The job's processes\")")
