"""Tensor parallelism inside a stage (``parallelism.tp``): a stage's layers split over the t
workers of its TP group with PyTorch's DTensor (``parallelize_module``, ``ColwiseParallel`` /
``RowwiseParallel``, as torchtitan does), on a group of the job's gloo / NCCL world.

Each TP rank of a stage is a worker of its own *plane*: rank j of every stage and every
data-parallel replica form a whole dp x pp job, which sends activations and sums gradients
exactly as a job without TP does (the activations between stages are whole on every rank: a
row-wise layer's output is summed over the group).  The TP group adds the collectives inside
the layers (Megatron-LM's two all-reduces forward and two backward per transformer block).

A split parameter is a DTensor sharded over the group (``Shard(0)`` column-wise, ``Shard(1)``
row-wise); its gradient's local part is summed over the data-parallel group like any other.
State leaves and enters a worker whole, keyed by name (``full`` / ``local``): checkpoints,
peer copies and the final model do not depend on tp, so any (dp, pp, tp) resumes any.  The
gathers go through a second group of the same ranks, so a checkpoint taken while the next
step runs (its layers' collectives on the first group) never interleaves with it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from service import tensorplan
from service.tensorplan import Split


class TensorParallel:
    def __init__(self, group, gather_group, rank: int, size: int, device_type: str):
        from torch.distributed.device_mesh import DeviceMesh

        self.mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=("tp",))
        CollectiveBytes.install()
        self.gather_group = gather_group
        self.rank, self.size = rank, size
        self.splits: dict[str, Split] = {}   # stage parameter name -> how it is split

    # ---------------------------------------------------------------- splitting the layers

    def shard(self, stage: nn.Module) -> None:
        """Split every layer of ``stage`` (an nn.Sequential of whole layers) by its ``tp_plan``:
        each split parameter becomes this rank's slice (a copy: the whole tensor is freed)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        for lname, layer in stage.named_children():
            plan = tensorplan.plan_of(layer)
            if not plan:
                continue
            styles = {}
            for name, sp in plan.items():
                mod = layer.get_submodule(name)
                for pn, prm in list(mod.named_parameters(recurse=False)):
                    key = f"{lname}.{name}.{pn}"
                    if pn == "bias" and sp.dim == 1:  # a row-wise bias is added once, after the sum
                        local, place = prm.detach(), Replicate()
                    else:
                        bias_sp = Split(sp.style, 0, sp.parts) if pn == "bias" else sp
                        self.splits[key] = bias_sp
                        local, place = self._slice(prm.detach(), bias_sp).clone(), Shard(bias_sp.dim)
                    dt = DTensor.from_local(local, self.mesh, [place], run_check=False)
                    setattr(mod, pn, nn.Parameter(dt, requires_grad=prm.requires_grad))
                styles[name] = RowwiseParallel() if sp.dim == 1 else ColwiseParallel()
            parallelize_module(layer, self.mesh, styles)  # the parameters are placed already: only the hooks

    def _slice(self, full: torch.Tensor, sp: Split) -> torch.Tensor:
        """This rank's part of ``full``: its slice of each packed part, side by side."""
        if sp.parts == 1:
            return full.chunk(self.size, dim=sp.dim)[self.rank]
        return torch.cat([part.chunk(self.size, dim=sp.dim)[self.rank] for part in full.chunk(sp.parts, dim=sp.dim)],
                         dim=sp.dim)

    @property
    def active(self) -> bool:
        return bool(self.splits)

    def replicated(self, name: str) -> bool:
        return name not in self.splits

    # ---------------------------------------------------------------- whole state out and in

    def full(self, name: str, value: torch.Tensor, like_param: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The whole tensor of parameter ``name`` (or of its optimizer state ``value``, shaped as
        its local part): gathered over the group when split (every rank calls this, in the same
        order), else its local value."""
        local = value.to_local() if hasattr(value, "to_local") else value
        sp = self.splits.get(name)
        if sp is None or local.dim() == 0:
            return local
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.gather_group)
        if sp.parts == 1:
            return torch.cat(parts, dim=sp.dim)
        pieces = [p.chunk(sp.parts, dim=sp.dim) for p in parts]
        return torch.cat([pieces[j][k] for k in range(sp.parts) for j in range(self.size)], dim=sp.dim)

    def full_state(self, tensors: dict) -> dict:
        """``{name: tensor}`` with every split entry whole (a collective: all ranks, same names)."""
        return {k: self.full(k, v) for k, v in tensors.items()}

    def full_optim(self, state: dict) -> dict:
        """An optimizer state by name (actors/state.py) with every split entry whole."""
        return {"state": {n: {k: self.full(n, v) for k, v in s.items()} for n, s in state["state"].items()},
                "groups": state["groups"]}

    def local_optim(self, state: dict, params: dict) -> dict:
        """A whole optimizer state by name, as this rank's DTensors for ``params`` (name -> param)."""
        from torch.distributed.tensor import DTensor

        out = {}
        for n, s in state["state"].items():
            p = params.get(n)
            if not isinstance(p, DTensor):
                out[n] = s
                continue
            sp = self.splits.get(n)
            out[n] = {k: (DTensor.from_local((self._slice(v, sp) if sp else v).clone(), p.device_mesh, p.placements,
                                             run_check=False) if torch.is_tensor(v) and v.dim() > 0 else v)
                      for k, v in s.items()}
        return {"state": out, "groups": state["groups"]}


class CollectiveBytes:
    """Payload bytes of the collectives DTensor runs inside the layers (the functional
    collectives its redistributions call), counted in this process: what TP moves a step."""

    NAMES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_tensor",
             "reduce_scatter_tensor", "all_to_all_single")
    bytes = 0
    calls = 0
    _installed = False

    @classmethod
    def install(cls) -> None:
        if cls._installed:
            return
        import torch.distributed._functional_collectives as funcol

        for name in cls.NAMES:
            orig = getattr(funcol, name, None)
            if orig is None:
                continue

            def counted(*a, _orig=orig, **k):
                t = a[0] if a else None
                if torch.is_tensor(t):
                    cls.bytes += t.numel() * t.element_size()
                    cls.calls += 1
                return _orig(*a, **k)

            setattr(funcol, name, counted)
        cls._installed = True

    @classmethod
    def take(cls) -> tuple[int, int]:
        """(bytes, calls) since the last take."""
        out = (cls.bytes, cls.calls)
        cls.bytes = cls.calls = 0
        return out


class LocalGradSum:
    """The data-parallel gradient sum of a tensor-parallel stage: after the step's last
    backward, every parameter's local gradient (a split one's slice) summed over the stage's
    data-parallel group, flattened in buckets of ``bucket_bytes``."""

    overlap = False  # summed after the step's last backward, not during it

    def __init__(self, params: list, group, bucket_bytes: int):
        self.params, self.group, self.bucket_bytes = [p for p in params if p.requires_grad], group, bucket_bytes

    def attach(self) -> None:
        pass

    def arm(self) -> None:
        pass

    def finish(self) -> None:
        grads = [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in self.params) if g is not None]
        bucket: list = []
        size = 0
        for g in grads + [None]:
            if g is not None and (not bucket or size + g.numel() * g.element_size() <= self.bucket_bytes
                                  and g.dtype == bucket[0].dtype):
                bucket.append(g)
                size += g.numel() * g.element_size()
                continue
            if bucket:
                flat = torch.cat([b.reshape(-1) for b in bucket])
                dist.all_reduce(flat, group=self.group)
                off = 0
                for b in bucket:
                    b.copy_(flat[off:off + b.numel()].view_as(b))
                    off += b.numel()
            bucket, size = ([g], g.numel() * g.element_size()) if g is not None else ([], 0)

    def close(self) -> None:
        pass
