"""What the scheduler learns about a job's layers before placing it: each layer's cost (from
the spec, a CPU profile or nothing), parameter bytes, output shape and bytes, and which
layers carry no state."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.state import has_state
from service import partition, planner
from service.loading import build_data, build_model
from service.sampling import step_indices
from service.spec import JobSpec, SpecError


@dataclass(frozen=True)
class Layers:
    facts: planner.LayerFacts
    metas: list            # (shape, dtype) of each layer's output for one microbatch
    stateless: frozenset   # layers with no parameters and no persistent buffers: built whole at any step
    profiled: bool         # the costs were measured or declared (else all zero)


def learn(spec: JobSpec, search: list[str]) -> Layers:
    p = spec.parallelism
    model = build_model(spec, search)
    samples = build_data(spec, search)
    t = spec.training
    idx = step_indices(0, len(samples), t.global_batch_size, t.seed, t.shuffle)[: t.microbatch_size]
    x, _ = samples.batch(idx)
    profiled = spec.elastic.enabled or (p.partition == "balanced" and p.pp > 1) or bool(p.layer_costs_ms)
    seconds = _costs(spec, model, x, profiled)
    metas, act_bytes = [], []
    with torch.no_grad():
        h = x
        for layer in model:
            h = layer(h)
            metas.append((tuple(h.shape), h.dtype))
            act_bytes.append(h.numel() * h.element_size())
    params = [sum(q.numel() * q.element_size() for q in layer.parameters()) for layer in model]
    stateless = frozenset(i for i, layer in enumerate(model) if not has_state(layer))
    return Layers(planner.LayerFacts(seconds, params, act_bytes), metas, stateless, profiled)


def _costs(spec: JobSpec, model, x, profiled: bool) -> list[float]:
    costs = spec.parallelism.layer_costs_ms
    if costs:
        if len(costs) != len(model):
            raise SpecError(f"parallelism.layer_costs_ms lists {len(costs)} costs but the model has "
                            f"{len(model)} layers; give one cost per entry of its nn.Sequential")
        return [c / 1000.0 for c in costs]
    if profiled:
        return partition.profile_layers(model, x, threads=max(1, int(spec.resources.cpus_per_worker)))
    return [0.0] * len(model)
