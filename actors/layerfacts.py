"""What the scheduler learns about a job's layers before placing it, without building them:
each layer's cost (declared in the spec, or estimated from its FLOPs and bytes), parameter
bytes, output shape and bytes, and which layers carry no state (service/tracing.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from service import planner, tracing
from service.loading import preflight
from service.spec import JobSpec


@dataclass(frozen=True)
class Layers:
    facts: planner.LayerFacts
    metas: list            # (shape, dtype) of each layer's output for one microbatch
    stateless: frozenset   # layers with no parameters and no persistent buffers: built whole at any step
    profiled: bool         # the costs were declared or estimated (else all zero)
    on_meta: bool          # traced on the meta device (else run once for real: a small model)
    skips: list = ()       # the model's skips: (stasher, popper, name, at, (shape, dtype)) (actors/portals.py)

    def boundary(self, shape: planner.Shape) -> list:
        """(shape, dtype) of what each stage of ``shape`` sends on."""
        return [self.metas[hi - 1] for _, hi in shape.bounds]


def learn(spec: JobSpec, search: list[str], gpu: Optional[bool] = None) -> Layers:
    """The pre-flight check (service/loading.py) and what it traced.  ``gpu``: whether the
    workers get GPUs, as the scheduler decided it (``resources.gpus_per_worker`` unset takes one
    when the cluster has a GPU per worker); without it, what the spec says."""
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
    act_bytes = [_bytes(shape, dtype) for shape, dtype in t.metas]
    facts = planner.LayerFacts(seconds, t.param_bytes, act_bytes, saved_bytes=t.saved_bytes or None,
                               checkpointing=spec.training.activation_checkpointing,
                               skips=[(s.stasher, s.popper, _bytes(*s.meta)) for s in t.skips],
                               gathers=t.norms if spec.training.batch_norm == "global" else frozenset(),
                               # under bf16 autocast autograd computes every gradient (actors/stage.py)
                               linears=None if spec.training.precision == "bf16" else t.linears,
                               gpu=bool(spec.resources.gpus_per_worker) if gpu is None else gpu)
    skips = [(s.stasher, s.popper, s.name, s.at, s.meta) for s in t.skips]
    return Layers(facts, t.metas, t.stateless, profiled, t.on_meta, skips)


def _bytes(shape: tuple, dtype) -> int:
    import torch

    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()
