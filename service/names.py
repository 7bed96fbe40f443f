"""The names Ray knows a job's actors by, and the namespace they live in: one module, low
enough for every layer (the control plane, the actors and the tests) to use."""
from __future__ import annotations

NAMESPACE = "relaytrain"


def on_the_head() -> dict:
    """Ray options that keep a process on the head node (a job's scheduler, its pre-flight
    task): a 0-CPU head is not reached by soft node affinity, hence the head's own resource."""
    return {"resources": {"node:__internal_head__": 0.001}}


def scheduler_name(job_id: str) -> str:
    return f"relaytrain:{job_id}:scheduler"


def placement_group_name(job_id: str) -> str:
    return f"relaytrain:{job_id}:workers"


def tp_group_prefix(job_id: str) -> str:
    """What the names of an elastic job's tensor-parallel groups' placement groups begin with."""
    return f"{placement_group_name(job_id)}-tp"


def job_of_placement_group(name: str) -> str | None:
    """The job whose placement group (:func:`placement_group_name`, :func:`tp_group_name`) is
    named ``name``; None for any other name."""
    if not name.startswith("relaytrain:"):
        return None
    job_id, _, kind = name[len("relaytrain:"):].rpartition(":")
    if job_id and (kind == "workers" or kind.startswith("workers-tp")):
        return job_id
    return None


def tp_group_name(job_id: str, n: int) -> str:
    """The placement group of an elastic job's n-th tensor-parallel group (one node each)."""
    return f"{tp_group_prefix(job_id)}{n}"


def worker_name(job_id: str, dp_rank: int, pp_rank: int, gen: int = 0) -> str:
    """A worker started for cell (dp_rank, pp_rank) of configuration ``gen`` (0: the first)."""
    return f"relaytrain:{job_id}:w{dp_rank}.{pp_rank}" + (f"-{gen}" if gen else "")


def joining_name(job_id: str, gen: int, i: int) -> str:
    """The i-th worker started for a scale-up while configuration ``gen`` runs."""
    return f"relaytrain:{job_id}:joining-{gen}-{i}"


def is_scheduler(name: str, job_prefix: str = "") -> bool:
    return name.startswith(f"relaytrain:{job_prefix}") and name.endswith(":scheduler")
