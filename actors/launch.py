"""Starting, finding and stopping a job's scheduler actor: what ``relaytrain run``
(actors/runner.py) and the control plane (api/jobs.py) share."""
from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import ray

from actors import codepkg, nodeenv
from service import logtext, packages, rayconnect
from service.names import NAMESPACE, is_scheduler, job_of_placement_group, on_the_head, placement_group_name, scheduler_name
from service.spec import JobSpec, SpecError

RUNTIME_ENV_EXCLUDES = [*packages.EXCLUDED_DIRS, *(f"*{s}" for s in packages.EXCLUDED_SUFFIXES)]
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


def connect(ray_address: Optional[str], local_cpus: Optional[int] = None) -> bool:
    """Connect to Ray; returns True when this call started (and so must stop) it."""
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"logging_level": "WARNING", "log_to_driver": True}
    if ray_address:
        rayconnect.init(ray_address, **kwargs)  # a ray:// address: Ray's token, and a refusal explained
        return True
    # never a cluster of `ray start`; local_cpus may exceed the cores (slots are logical); its
    # processes inherit what a job's need (actors/nodeenv.py), so they start without a runtime_env
    try:
        rayconnect.init("local", include_dashboard=False, num_cpus=local_cpus, labels=nodeenv.prepare(), **kwargs)
    except Exception as e:  # Ray's traceback alone ("The current node timed out during startup": a user trial)
        ray.shutdown()
        first = logtext.first_line(e, type(e).__name__)
        raise rayconnect.RayConnectError(
            f"the local Ray did not start ({first}); on a busy machine its daemons can miss Ray's start-up "
            "deadline: try again, or start one with `ray start --head` and pass its address as --ray-address") from None
    return True


def job_runtime_env(spec: JobSpec, spec_dir: Optional[str]) -> dict:
    """The spec's runtime_env; when the spec imports user code and names no working_dir,
    its folder is shipped as the working_dir."""
    env = dict(spec.runtime_env)
    if spec.uses_imports and spec_dir and "working_dir" not in env:
        env["working_dir"] = str(Path(spec_dir).resolve())
        env["excludes"] = (list(env.get("excludes", [])) + RUNTIME_ENV_EXCLUDES
                           + [f"/{packages.gitignore_escaped(p)}" for p in packages.run_outputs(Path(env["working_dir"]))])
    return env


def upload_runtime_env(env: dict) -> dict:
    """Upload local ``working_dir``/``py_modules`` folders to the cluster and name them by
    URI: Ray accepts local folders only in ``ray.init``, not on a single actor."""
    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

    env = dict(env)
    scratch = tempfile.mkdtemp(prefix="relaytrain-pkg-")
    try:
        env = upload_py_modules_if_needed(env, include_gitignore=True, scratch_dir=scratch)
        env = upload_working_dir_if_needed(env, include_gitignore=True, scratch_dir=scratch)
    except Exception as e:  # over Ray's limit: a sentence, not Ray's traceback (a user trial)
        big = re.search(r"Package size \(([^)]+)\) exceeds the maximum size of (\S+?)\.?(\s|$)", str(e))
        if not big:
            raise
        what = env.get("working_dir") or ", ".join(map(str, env.get("py_modules") or [])) or "folder"
        raise SpecError(f"the job's code ({what}) is {big[1]} once packed, over the {big[2]} Ray ships: move data "
                        f"and other files that are not code out of it, or list them in runtime_env.excludes "
                        f"(gitignore patterns) or a .gitignore there (a spec's own folder, shipped by relaytrain, "
                        f"leaves out {', '.join(RUNTIME_ENV_EXCLUDES)} and the folders of earlier runs' --out)") from None
    finally:  # the packages are in Ray's store now
        shutil.rmtree(scratch, ignore_errors=True)
    env.pop("excludes", None)
    return env


def scheduler_placement() -> dict:
    """Actor options that keep a job's scheduler on the head node: it holds the off-node
    copy of the workers' state, so it must not share a worker node's fate."""
    return on_the_head()


def check_fits(spec: JobSpec, max_cpus: Optional[float] = None, max_gpus: Optional[float] = None) -> None:
    """Refuse a job that this cluster can never hold: against its resources now, or against
    the ceiling an autoscaler can grow it to (``max_cpus``/``max_gpus``) when given."""
    res = dict(ray.cluster_resources())
    if max_cpus is not None:
        res["CPU"] = max(res.get("CPU", 0), max_cpus)
    if max_gpus is not None:
        res["GPU"] = max(res.get("GPU", 0), max_gpus)
    # an elastic job starts as soon as its smallest shape fits
    workers = spec.elastic.min_workers if spec.elastic.enabled else spec.parallelism.dp * spec.parallelism.pipeline_workers
    need_cpu = workers * spec.resources.cpus_per_worker
    if need_cpu > res.get("CPU", 0):
        what = "elastic.min_workers (its smallest shape)" if spec.elastic.enabled else "parallelism.dp x parallelism.pp"
        raise SpecError(f"the job needs {need_cpu:g} CPU slots ({workers} workers x "
                        f"{spec.resources.cpus_per_worker:g}) but the cluster has {res.get('CPU', 0):g}; "
                        f"lower {what} or resources.cpus_per_worker, or add nodes")
    gpus = spec.resources.gpus_per_worker or 0
    if gpus and workers * gpus > res.get("GPU", 0):
        raise SpecError(f"the job needs {workers * gpus:g} GPUs but the cluster has {res.get('GPU', 0):g}; "
                        "lower resources.gpus_per_worker or dp x pp")
    tp = spec.parallelism.tp
    if tp > 1 and max_cpus is None:  # a TP group is placed on one node (an autoscaler may add bigger ones)
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        per = {"CPU": tp * spec.resources.cpus_per_worker, **({"GPU": tp * gpus} if gpus else {})}
        if not any(all(n.get(k, 0) >= v for k, v in per.items()) for n in nodes):
            most = max((n.get("CPU", 0) for n in nodes), default=0)
            raise SpecError(f"parallelism.tp {tp} places each stage's {tp} workers on one node ({per}), but the "
                            f"largest node has {most:g} CPUs{' and ' + str(max(n.get('GPU', 0) for n in nodes)) + ' GPUs' if gpus else ''}: "
                            "lower parallelism.tp or resources.cpus_per_worker, or add a larger node")


def job_process_env(runtime_env: dict, nice: int) -> Optional[dict]:
    """``runtime_env`` for the job's processes (its scheduler's, and its workers', which inherit
    it): None where every node gives them what they need (actors/nodeenv.py); else the job's
    niceness (``resources.nice``), and Ray's re-check of a blocked get at
    ``nodeenv.GET_RECHECK_MS`` unless the job sets ``RAY_get_check_signal_interval_milliseconds``.
    Ray renices every worker process it starts to 15 unless ``RAY_worker_niceness`` says
    otherwise; at 15 any other busy process on the node takes nearly all of a core from a job's
    workers (README: "The job's processes")."""
    if nodeenv.given_by_nodes(runtime_env, nice):
        return None
    wanted = nodeenv.settings(nice)
    env_vars = {"RAY_get_check_signal_interval_milliseconds": wanted["RAY_get_check_signal_interval_milliseconds"],
                **(runtime_env.get("env_vars") or {}), "RAY_worker_niceness": wanted["RAY_worker_niceness"]}
    return {**runtime_env, "env_vars": env_vars}


def start_scheduler(job_id: str, spec: dict, search: list[str], *, runtime_env: Optional[dict] = None,
                    detached: bool = False, **kwargs):
    """Create the job's named scheduler actor on the head node; ``kwargs`` go to
    ``JobScheduler`` (checkpoint_root, resume, timeout, start_timeout, store_url, model_dir,
    rerun_through, allocation, traced: the model's trace when the caller made it, finish_asked:
    who asked the job to finish early, before a restart)."""
    from actors.scheduler import JobScheduler

    options: dict[str, Any] = {"lifetime": "detached"} if detached else {}
    rest, code = codepkg.split(runtime_env or {})  # a working_dir package alone: shipped by relaytrain
    env = job_process_env(rest, (spec.get("resources") or {}).get("nice", 0))
    if env is not None:
        options["runtime_env"] = env
    return ray.remote(JobScheduler).options(
        name=scheduler_name(job_id), namespace=NAMESPACE, num_cpus=0, max_concurrency=4,
        **scheduler_placement(), **options,
    ).remote(job_id, spec, search, detached=detached, code=code, **kwargs)


def find_scheduler(job_id: str):
    """The job's scheduler actor, or None when there is none."""
    try:
        return ray.get_actor(scheduler_name(job_id), namespace=NAMESPACE)
    except ValueError:
        return None


def wait_for_job(job_name: str, timeout: float) -> Optional[str]:
    """The id of the job named ``job_name`` (the name and a suffix ``run_job`` makes up) once
    its scheduler actor is registered (``find_scheduler`` gives it), or None after ``timeout``
    seconds."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["namespace"] == NAMESPACE and is_scheduler(a["name"], job_prefix=f"{job_name.lower()}-"):
                return a["name"].split(":")[1]
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def wait_actors_gone(job_id: str, timeout: float) -> bool:
    """Wait until no named actor of the job lives (a lost scheduler's workers die with it, a
    moment later); True if none is left."""
    import time

    prefix = f"relaytrain:{job_id}:"
    deadline = time.monotonic() + timeout
    while True:
        try:
            left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["namespace"] == NAMESPACE and a["name"].startswith(prefix)]
        except Exception:
            left = []
        if not left or time.monotonic() > deadline:
            return not left
        time.sleep(0.2)


def release_placement_group(job_id: str) -> None:
    """Free the worker slots of a job whose scheduler died without cleaning up (its placement
    groups are detached, so nothing else would): the job's, and an elastic tensor-parallel
    job's one per TP group."""
    try:
        ray.util.remove_placement_group(ray.util.get_placement_group(placement_group_name(job_id)))
    except Exception:
        pass  # none was made, or it is gone already
    remove_placement_groups(placement_groups_by_job().get(job_id, []))


def placement_groups_by_job() -> dict[str, list[str]]:
    """The placement groups of relaytrain's jobs that Ray has not removed (hex ids), by job id;
    empty when Ray's table cannot be read."""
    try:
        table = ray.util.placement_group_table()
    except Exception:
        return {}
    out: dict[str, list[str]] = {}
    for pg_id, info in table.items():
        job_id = job_of_placement_group(info.get("name") or "")
        if job_id and info.get("state") != "REMOVED":
            out.setdefault(job_id, []).append(pg_id)
    return out


def remove_placement_groups(pg_ids) -> None:
    from ray.util.placement_group import PlacementGroup

    for pg_id in pg_ids:
        try:
            ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
        except Exception:
            pass  # gone meanwhile


def stop_at_boundary(sched, grace: float = 10.0) -> None:
    """Ask the scheduler to stop at the next step boundary (it then releases its workers and
    their placement group) and wait up to ``grace`` s for it to end; raises when it does not
    answer."""
    import time

    if ray.get(sched.poll.remote(), timeout=5)["state"] not in TERMINAL:
        ray.get(sched.cancel.remote(), timeout=5)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if ray.get(sched.poll.remote(), timeout=5)["state"] in TERMINAL:
                break
            time.sleep(0.2)


def stop(sched, job_id: str, grace: float = 10.0) -> None:
    """Stop the job's actors: :func:`stop_at_boundary`, then kill whatever is left."""
    try:
        stop_at_boundary(sched, grace)
    except Exception:
        pass
    try:
        ray.kill(sched)  # its workers are owned by it and die with it
    except Exception:
        pass
    release_placement_group(job_id)
