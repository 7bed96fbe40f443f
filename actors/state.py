"""A stage's state as it moves between workers: parameters and persistent buffers
(``state_dict``) and optimizer state keyed by parameter name, so any partition can load it.

A state key of the whole model starts with its layer index ('3.0.weight' is layer 3), so
parts of several stages merge into one dict and a subset of layers is a filter."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:  # the scheduler moves states by name (layer_of, subset_state) without torch
    import torch
    from torch import nn


def layer_of(name: str) -> int:
    """The layer index of a state key of the whole model ('3.0.weight' -> 3)."""
    return int(name.split(".", 1)[0])


def has_state(layer: nn.Module) -> bool:
    """Does ``layer`` carry state that must move with it (parameters or persistent buffers)?
    A layer without any (an activation, a reshape, a dropout) is complete once it is built,
    at any step; non-persistent buffers are made again by its constructor."""
    return bool(layer.state_dict())


def clone(v: Any) -> Any:
    import torch

    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu", copy=True)
    if isinstance(v, dict):
        return {k: clone(x) for k, x in v.items()}
    return v


def optimizer_state_by_name(opt: torch.optim.Optimizer, names: list[str]) -> dict:
    """The optimizer's state keyed by parameter name, so any partition can load it."""
    sd = opt.state_dict()
    return {"state": {names[i]: v for i, v in sd["state"].items() if i < len(names)},
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]}


def load_optimizer_state(opt: torch.optim.Optimizer, names: list[str], saved: dict) -> None:
    state = {i: saved["state"][n] for i, n in enumerate(names) if n in saved["state"]}
    group = dict(saved["groups"][0], params=list(range(len(opt.param_groups[0]["params"]))))
    opt.load_state_dict({"state": state, "param_groups": [group]})


def empty() -> dict:
    return {"model": {}, "optim": {"state": {}, "groups": None}}


def merge_states(parts: Iterable[dict]) -> dict:
    """One {model, optim} state from the parts of several stages (or sources)."""
    out = empty()
    for part in parts:
        out["model"].update(part["model"])
        out["optim"]["state"].update(part["optim"]["state"])
        out["optim"]["groups"] = out["optim"]["groups"] or part["optim"]["groups"]
    return out


def subset_state(state: dict, layers: set[int]) -> dict:
    keep = lambda k: layer_of(k) in layers  # noqa: E731
    return {"model": {k: v for k, v in state["model"].items() if keep(k)},
            "optim": {"state": {k: v for k, v in state["optim"]["state"].items() if keep(k)},
                      "groups": state["optim"]["groups"]}}
