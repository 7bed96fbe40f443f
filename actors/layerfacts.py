"""What the scheduler learns about a job's layers before placing it, without building them:
each layer's cost (declared in the spec, or estimated from its FLOPs and bytes), parameter
bytes, output shape and bytes, and which layers carry no state (service/tracing.py).

A job's scheduler does not import torch (it would cost each job about 2.4 s of CPU and 300 MB
on the head node, before its workers could start): ``learn_for_job`` has the model traced in
the job's first worker when it has one already (a fixed shape's workers start before the
trace, and import torch and the job's code for their stages anyway: ``StageWorker.trace``),
else in a Ray task on the head node, in the job's runtime_env, whose process Ray may keep and
reuse for the next job with the same runtime_env.  What comes back is plain data: dtypes travel by name
(``service/tracing.py``: ``dtype_name``), and the workers turn them back into torch's."""
from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass
from typing import Callable, Optional

from actors.output import OutputTap
from service import planner
from service.spec import JobSpec, SpecError


@dataclass(frozen=True)
class Layers:
    facts: planner.LayerFacts
    metas: list            # (shape, dtype name) of each layer's output for one microbatch
    stateless: frozenset   # layers with no parameters and no persistent buffers: built whole at any step
    profiled: bool         # the costs were declared or estimated (else all zero)
    on_meta: bool          # traced on the meta device (else run once for real: a small model)
    skips: list = ()       # the model's skips: (stasher, popper, name, at, (shape, dtype name)) (actors/portals.py)
    state: Optional[dict] = None  # the whole model's state: {name: shape} (what its checkpoints hold)

    def boundary(self, shape: planner.Shape) -> list:
        """(shape, dtype) of what each stage of ``shape`` sends on."""
        return [self.metas[hi - 1] for _, hi in shape.bounds]


def learn_for_job(spec: JobSpec, search: list[str], gpu: Optional[bool] = None,
                  cancelled: Callable[[], bool] = lambda: False, cwd: Optional[str] = None,
                  worker=None) -> Layers:
    """:func:`learn` as a job's scheduler runs it, in the job's own folder (its working_dir
    comes first in ``search``; ``cwd``: the folder of the code package relaytrain ships, which
    the trace runs in, actors/codepkg.py): in ``worker``, one of the job's own workers already
    starting (a fixed shape's, which has or will have torch and the job's code imported anyway),
    else in a Ray task on the head node when called in an actor (the scheduler), else here.
    Raises :class:`SpecError` for a spec the trace refuses, ``JobFailure`` for an unexpected
    error in it, ``JobCancelled`` once ``cancelled()``."""
    import ray

    if not (ray.is_initialized() and ray.get_runtime_context().get_actor_id()):
        return learn(spec, [os.getcwd(), *search], gpu)
    from actors.failures import JobCancelled, JobFailure
    from service.names import on_the_head

    def wait(ref, stop):
        while not ray.wait([ref], timeout=0.5)[0]:
            if cancelled():
                stop(ref)
                raise JobCancelled("job cancelled while its model was traced")
        return ray.get(ref)

    got = None
    if worker is not None:  # no process of its own: the worker's torch and imports serve its stage next
        try:
            got = wait(worker.trace.remote(gpu), lambda ref: None)
        except ray.exceptions.RayActorError:
            got = None  # that worker was lost before it answered (its node went): a task of its own, below
    if got is None:
        ref = ray.remote(_learn_task).options(
            num_cpus=0, max_retries=0, name="relaytrain-preflight", runtime_env=ray.get_runtime_context().runtime_env,
            **on_the_head()).remote(spec.model_dump(mode="json"), search, gpu, cwd)
        try:
            got = wait(ref, lambda r: ray.cancel(r, force=True))
        except ray.exceptions.RayError as e:  # its process died (out of memory, killed)
            raise JobFailure(f"the pre-flight check of the model was lost: {type(e).__name__}: "
                             f"{str(e).strip().splitlines()[-1] if str(e).strip() else ''}", detail=str(e)) from None
    kind, out, detail, printed = got
    OutputTap.install().put(printed)  # what the user's code printed: the job's log, as the scheduler's
    if kind == "spec":
        raise SpecError(out)
    if kind == "error":
        raise JobFailure(f"the pre-flight check of the model raised {out}", detail=detail)
    return out


def _learn_task(spec: dict, search: list[str], gpu: Optional[bool], cwd: Optional[str] = None) -> tuple:
    """The Ray task of :func:`learn_for_job`: (kind, what, detail, printed): ("ok", Layers, ""),
    ("spec", message, "") or ("error", "Type: message", traceback), and the lines the user's code
    printed meanwhile.  Its process serves later jobs too, so the user's modules it imported
    (from the job's folder or ``search``) are forgotten after the trace: the next job imports its
    own code afresh, as its workers do."""
    tap = OutputTap.install()
    tap.take()  # nothing of an earlier job's
    back = os.getcwd()
    if cwd:  # the job's code package: its folder is the working directory, as in its workers
        os.chdir(cwd)
    try:
        kind, out, detail = _traced(spec, search, gpu)
    finally:
        os.chdir(back)
    return kind, out, detail, tap.take()


def _traced(spec: dict, search: list[str], gpu: Optional[bool]) -> tuple:
    import ray

    from service import loading  # noqa: F401  (the engine's modules stay imported)

    own = [os.path.realpath(d) for d in search]
    if ray.get_runtime_context().runtime_env.get("working_dir") or os.path.realpath(os.getcwd()) in own:
        own.append(os.path.realpath(os.getcwd()))
    before = set(sys.modules)
    try:
        return outcome(JobSpec.model_validate(spec), [os.getcwd(), *search], gpu)
    finally:
        for name in set(sys.modules) - before:
            where = os.path.realpath(getattr(sys.modules[name], "__file__", None) or "/")
            if name.split(".")[0] not in ENGINE and any(where.startswith(d + os.sep) for d in own):
                del sys.modules[name]


ENGINE = ("actors", "service", "api", "relaytrain")  # never forgotten, wherever they lie


def outcome(spec: JobSpec, search: list[str], gpu: Optional[bool]) -> tuple:
    """:func:`learn` here, as (kind, what, detail): ("ok", Layers, ""), ("spec", message, "")
    or ("error", "Type: message", traceback)."""
    try:
        return "ok", learn(spec, search, gpu), ""
    except SpecError as e:
        return "spec", str(e), ""
    except Exception as e:
        return "error", f"{type(e).__name__}: {e}", traceback.format_exc()


def learn(spec: JobSpec, search: list[str], gpu: Optional[bool] = None) -> Layers:
    """The pre-flight check (service/loading.py) and what it traced, in this process.  ``gpu``:
    whether the workers get GPUs, as the scheduler decided it (``resources.gpus_per_worker`` unset
    takes one when the cluster has a GPU per worker); without it, what the spec says."""
    from service import tracing
    from service.loading import preflight

    p = spec.parallelism
    t = preflight(spec, search)
    profiled = (spec.elastic.enabled or (p.partition == "balanced" and p.pp > 1) or bool(p.layer_costs_ms)
                or p.replicas == "auto")
    if p.layer_costs_ms:
        seconds = [c / 1000.0 for c in p.layer_costs_ms]
    elif profiled:
        seconds = tracing.estimate_seconds(t, threads=max(1, int(spec.resources.cpus_per_worker)))
    else:
        seconds = [0.0] * len(t.metas)
    act_bytes = [tracing.nbytes(shape, dtype) for shape, dtype in t.metas]
    facts = planner.LayerFacts(seconds, t.param_bytes, act_bytes, saved_bytes=t.saved_bytes or None,
                               checkpointing=spec.training.activation_checkpointing,
                               skips=[(s.stasher, s.popper, tracing.nbytes(*s.meta)) for s in t.skips],
                               gathers=t.norms if spec.training.batch_norm == "global" else frozenset(),
                               # under bf16 autocast autograd computes every gradient (actors/stage.py)
                               linear_work=None if spec.training.precision == "bf16" else t.grad_work,
                               gpu=bool(spec.resources.gpus_per_worker) if gpu is None else gpu)
    metas = [(tuple(shape), tracing.dtype_name(dtype)) for shape, dtype in t.metas]
    skips = [(s.stasher, s.popper, s.name, s.at, (tuple(s.meta[0]), tracing.dtype_name(s.meta[1]))) for s in t.skips]
    return Layers(facts, metas, t.stateless, profiled, t.on_meta, skips, t.model_state)
