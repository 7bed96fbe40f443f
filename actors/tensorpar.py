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
State leaves and enters a worker whole, keyed by name (``full`` / ``local``): checkpoints and
the final model do not depend on tp, so any (dp, pp, tp) resumes any.  The gathers (to TP rank
0, which writes) go through a second group of the same ranks, kept apart from the layers'
collectives.  Whole parameters inside a planned layer must get the same gradient on every rank
(checked on the first step) unless their plan says ``replicated_with_grad_allreduce``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from actors.failures import abandoned, waiting_on_peers
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
        self.summed: set[str] = set()        # whole parameters whose gradients are summed over the group
        self.checked = False                 # the replicated gradients were seen to agree on every rank

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
                if sp.style == tensorplan.SUMMED:
                    self.summed |= {f"{lname}.{name}.{pn}" for pn, _ in mod.named_parameters()}
                    continue
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
            if styles:
                parallelize_module(layer, self.mesh, styles)  # the parameters are placed already: only the hooks

    def _slice(self, full: torch.Tensor, sp: Split) -> torch.Tensor:
        """This rank's part of ``full``: its slice of each packed part, side by side."""
        if sp.parts == 1:
            return full.chunk(self.size, dim=sp.dim)[self.rank]
        return torch.cat([part.chunk(self.size, dim=sp.dim)[self.rank] for part in full.chunk(sp.parts, dim=sp.dim)],
                         dim=sp.dim)

    def replicated(self, name: str) -> bool:
        return name not in self.splits

    # ---------------------------------------------------------------- whole state out and in

    def after_backward(self, named: list) -> None:
        """After a step's backwards (before the data-parallel sum): sum the gradients of the
        parameters marked ``replicated_with_grad_allreduce`` over the group; and on the first
        step, check that every other whole parameter got the same gradient on every rank, else
        say which acts on split activations (each rank would update it with part of its
        gradient, and the copies would part)."""
        group = self.mesh.get_group()
        if self.summed:
            sum_grads([p for n, p in named if n in self.summed], group, 2**24)
        if self.checked:
            return
        self.checked = True
        whole = [(n, p.grad) for n, p in named if n not in self.splits and n not in self.summed and p.grad is not None]
        if not whole:
            return
        norms = torch.stack([(g.to_local() if hasattr(g, "to_local") else g).detach().double().norm() for _, g in whole])
        seen = [torch.empty_like(norms) for _ in range(self.size)]
        dist.all_gather(seen, norms, group=group)
        seen = torch.stack(seen)
        spread = (seen.amax(0) - seen.amin(0)) / seen.abs().amax(0).clamp_min(1e-30)
        bad = [whole[i][0] for i in torch.nonzero(spread > 1e-6).flatten().tolist()]
        if bad:
            raise ValueError(
                f"the tensor-parallel ranks of this stage got different gradients for {', '.join(bad[:4])}: "
                "these parameters act on split activations (as a per-head norm after a column-wise layer does), "
                "so each rank sees part of their gradient. Mark their submodule 'replicated_with_grad_allreduce' "
                "in the layer's tp_plan (their gradient is then summed over the group), or split them")

    def full(self, name: str, value: torch.Tensor, to_first: bool = False) -> Optional[torch.Tensor]:
        """The whole tensor of parameter ``name`` (or of its optimizer state ``value``, shaped as
        its local part): gathered over the group when split (every rank calls this, in the same
        order), else its local value.  ``to_first``: gathered on rank 0 only (the others get None)."""
        local = value.to_local() if hasattr(value, "to_local") else value
        sp = self.splits.get(name)
        if sp is None or local.dim() == 0:
            return local
        if to_first:
            parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
            dist.gather(local.contiguous(), parts, group=self.gather_group, group_dst=0)
            if parts is None:
                return None
        else:
            parts = [torch.empty_like(local) for _ in range(self.size)]
            dist.all_gather(parts, local.contiguous(), group=self.gather_group)
        if sp.parts == 1:
            return torch.cat(parts, dim=sp.dim)
        pieces = [p.chunk(sp.parts, dim=sp.dim) for p in parts]
        return torch.cat([pieces[j][k] for k in range(sp.parts) for j in range(self.size)], dim=sp.dim)

    def full_state(self, tensors: dict, to_first: bool = False) -> dict:
        """``{name: tensor}`` with every split entry whole (a collective: all ranks, same names)."""
        return {k: self.full(k, v, to_first) for k, v in tensors.items()}

    def full_optim(self, state: dict, to_first: bool = False) -> dict:
        """An optimizer state by name (actors/state.py) with every split entry whole."""
        return {"state": {n: {k: self.full(n, v, to_first) for k, v in s.items()} for n, s in state["state"].items()},
                "groups": state["groups"]}

    def local_optim(self, state: dict, params: dict) -> dict:
        """A whole optimizer state by name (or this rank's slices of it), as this rank's DTensors
        for ``params`` (name -> param)."""
        from torch.distributed.tensor import DTensor

        out = {}
        for n, s in state["state"].items():
            p = params.get(n)
            if not isinstance(p, DTensor):
                out[n] = s
                continue
            sp = self.splits.get(n)
            # a whole entry is sliced; one that is this rank's slice already (a copy of an earlier shape's
            # same rank) is taken as it is
            out[n] = {k: (DTensor.from_local((self._slice(v, sp) if sp and v.shape == p.shape else v).clone(),
                                             p.device_mesh, p.placements, run_check=False)
                          if torch.is_tensor(v) and v.dim() > 0 else v)
                      for k, v in s.items()}
        return {"state": out, "groups": state["groups"]}


def local(v):
    """``v`` with every DTensor in it (a tensor, or a dict of them) as this rank's local part."""
    if isinstance(v, dict):
        return {k: local(x) for k, x in v.items()}
    return v.to_local() if hasattr(v, "to_local") else v


class CollectiveBytes:
    """Payload bytes of the collectives DTensor runs inside the layers (the functional
    collectives its redistributions call), counted in this process: what TP moves a step.
    A failure of one of them (or of its wait) is noted too: it runs inside the user's layers,
    where an error would otherwise read as the user's, but it means a TP peer was lost."""

    NAMES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_tensor",
             "reduce_scatter_tensor", "all_to_all_single")
    bytes = 0
    calls = 0
    failed: Optional[BaseException] = None
    _installed = False

    @classmethod
    def install(cls) -> None:
        if cls._installed:
            return
        import torch.distributed._functional_collectives as funcol

        for name in cls.NAMES + ("wait_tensor",):
            orig = getattr(funcol, name, None)
            if orig is None:
                continue

            def counted(*a, _orig=orig, _count=name != "wait_tensor", **k):
                t = a[0] if a else None
                if _count and torch.is_tensor(t):
                    cls.bytes += t.numel() * t.element_size()
                    cls.calls += 1
                try:
                    if _count:
                        return _orig(*a, **k)
                    with waiting_on_peers():  # a wait the abort may not end (actors/failures.py)
                        return _orig(*a, **k)
                except Exception as e:
                    if not abandoned():  # a thread given up on reports nothing to the step after
                        cls.failed = e
                    raise

            setattr(funcol, name, counted)
        cls._installed = True

    @classmethod
    def take_failure(cls) -> Optional[BaseException]:
        """The failure of a collective since the last call, if any."""
        out, cls.failed = cls.failed, None
        return out

    @classmethod
    def take(cls) -> tuple[int, int]:
        """(bytes, calls) since the last take."""
        out = (cls.bytes, cls.calls)
        cls.bytes = cls.calls = 0
        return out


def sum_grads(params: list, group, bucket_bytes: int) -> None:
    """Sum the local gradients of ``params`` (a split parameter's slice) over ``group``, in
    flat buckets; a parameter with no gradient this step takes part with zeros, so every rank
    sums the same buckets."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list = []
    size = 0
    for g in [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params] + [None]:
        if g is not None and (not bucket or (size + g.numel() * g.element_size() <= bucket_bytes
                                             and g.dtype == bucket[0].dtype)):
            bucket.append(g)
            size += g.numel() * g.element_size()
            continue
        if bucket:
            flat = torch.cat([b.reshape(-1) for b in bucket])
            with waiting_on_peers():
                dist.all_reduce(flat, group=group)
            off = 0
            for b in bucket:
                b.copy_(flat[off:off + b.numel()].view_as(b))
                off += b.numel()
        bucket, size = ([g], g.numel() * g.element_size()) if g is not None else ([], 0)


class LocalGradSum:
    """The data-parallel gradient sum of a tensor-parallel stage: after the step's last
    backward, every parameter's local gradient (a split one's slice) summed over the stage's
    data-parallel group (``sum_grads``)."""

    overlap = False  # summed after the step's last backward, not during it

    def __init__(self, params: list, group, bucket_bytes: int):
        self.params, self.group, self.bucket_bytes = [p for p in params if p.requires_grad], group, bucket_bytes

    def attach(self) -> None:
        pass

    def arm(self) -> None:
        pass

    def finish(self) -> None:
        sum_grads(self.params, self.group, self.bucket_bytes)

    def close(self) -> None:
        pass
