"""Tensor parallelism inside a stage (``parallelism.tp``): what a layer's ``tp_plan`` says.

A layer (an entry of the model's layer list) says how it splits over the t workers of its
stage's tensor-parallel group with a ``tp_plan`` attribute: a dict from a submodule name to a
style, the strings Hugging Face transformers uses in its models' plans:

- ``"colwise"``: an ``nn.Linear`` whose output features are split (its weight's rows and its
  bias); its output is each rank's slice (Megatron-LM's column-parallel linear).
- ``"rowwise"``: an ``nn.Linear`` whose input features are split (its weight's columns); its
  outputs are summed over the group (one all-reduce), the bias added once.
- ``"packed_colwise"``: a column-wise ``nn.Linear`` whose output is several projections side by
  side (a fused ``qkv`` is 3, a fused gate|up is 2): each part is split on its own, so rank j
  holds the j-th slice of every part and the layer's ``.chunk(parts, -1)`` still cuts it into
  its parts.  The number of parts is ``tp_packed[name]`` (default 2, as transformers').
- ``"replicated_with_grad_allreduce"``: any submodule kept whole on every rank whose gradient
  is summed over the group, for a parameter that acts on split activations (a per-head norm
  after a column-wise layer sees only its rank's heads, so each rank gets part of its gradient).

Everything else is replicated on every rank of the group; its gradients must agree on every
rank (its inputs are the same), which the first step checks (actors/tensorpar.py).  Checked
here on the meta device, before any actor starts: the names, the styles, the packed parts,
and that t divides each split width and its heads.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

STYLES = ("colwise", "rowwise", "packed_colwise", "replicated_with_grad_allreduce")
SUMMED = "replicated_with_grad_allreduce"
HEAD_ATTRS = ("head_dim", "head_size", "attention_head_size")


@dataclass(frozen=True)
class Split:
    """One split submodule: its style, the weight dimension it splits, its packed parts."""

    style: str
    dim: int            # the weight's split dimension (0: output features, 1: input features; -1: not split)
    parts: int = 1      # projections side by side (packed_colwise)


def plan_of(layer: nn.Module) -> dict[str, Split]:
    """The layer's ``tp_plan`` as splits by submodule name (empty: replicated)."""
    plan = getattr(layer, "tp_plan", None) or {}
    packed = getattr(layer, "tp_packed", None) or {}
    out = {}
    for name, style in plan.items():
        parts = int(packed.get(name, 2)) if style == "packed_colwise" else 1
        out[name] = Split(style, -1 if style == SUMMED else 1 if style == "rowwise" else 0, parts)
    return out


def check_layer(index: int, layer: nn.Module, tp: int) -> None:
    """Raise ValueError saying what to change unless ``layer``'s plan splits over ``tp`` ranks."""
    plan = getattr(layer, "tp_plan", None)
    if plan is None:
        return
    where = f"layer {index} ({type(layer).__name__})"
    if not isinstance(plan, dict):
        raise ValueError(f"{where}: tp_plan must be a dict from submodule name to a style ({', '.join(STYLES)}), "
                         f"got {type(plan).__name__}")
    packed = getattr(layer, "tp_packed", None) or {}
    if not isinstance(packed, dict) or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                           for v in packed.values()):
        raise ValueError(f"{where}: tp_packed must be a dict from submodule name to its number of packed parts "
                         f"(an integer >= 1, e.g. {{'attn.qkv': 3}}), got {packed!r}")
    names = dict(layer.named_modules())
    for name, style in plan.items():
        if not isinstance(style, str) or style not in STYLES:
            raise ValueError(f"{where}: tp_plan[{name!r}] is {style!r}; the styles are {', '.join(STYLES)}")
        if name not in names or not name:
            linears = [n for n, m in layer.named_modules() if isinstance(m, nn.Linear)]
            raise ValueError(f"{where}: tp_plan names {name!r}, which is not a submodule of the layer; its Linear "
                             f"submodules are {linears}")
        mod = names[name]
        if style == SUMMED:
            continue
        if not isinstance(mod, nn.Linear):
            raise ValueError(f"{where}: tp_plan[{name!r}] is {style!r} but {name} is a {type(mod).__name__}; "
                             "relaytrain splits nn.Linear layers only: leave it out of the plan (it is then "
                             "replicated)")
        split = plan_of(layer)[name]
        width = mod.in_features if split.dim == 1 else mod.out_features
        what = "input features" if split.dim == 1 else "output features"
        if width % (tp * split.parts):
            per = f" in each of its {split.parts} packed parts" if split.parts > 1 else ""
            raise ValueError(f"{where}: {name} has {width} {what}{per}, which parallelism.tp={tp} does not divide"
                             f"{' evenly per part' if split.parts > 1 else ''}; choose a tp that divides "
                             f"{width // split.parts}, or leave {name} out of tp_plan")
        if split.dim == 0:  # a column split slices heads: each rank needs whole heads
            head = _head_size(layer, name)
            local = width // split.parts // tp
            if head and local % head:
                heads = width // split.parts // head
                raise ValueError(f"{where}: {name} holds {heads} attention heads of {head} features, which "
                                 f"parallelism.tp={tp} does not divide; choose a tp that divides {heads}")


def _head_size(layer: nn.Module, name: str) -> int:
    """The head size declared on ``name``'s parent module (``head_dim`` and the like), else 0."""
    parent = layer.get_submodule(name.rpartition(".")[0]) if "." in name else layer
    for attr in HEAD_ATTRS:
        v = getattr(parent, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return 0
