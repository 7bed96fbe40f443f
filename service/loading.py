"""Turning a job spec into live objects: model, data, loss, optimizer.

Used by the CLI's pre-flight check (before any actor starts) and by every worker.
Every failure raises :class:`SpecError` with a message that says what to change.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from service import builtins
from service.spec import JobSpec, LossSpec, SpecError


@contextlib.contextmanager
def _on_path(dirs: Sequence[str]):
    added = [d for d in dirs if d and d not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for d in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(d)


def import_object(path: str, field: str, search: Sequence[str] = ()) -> Any:
    """Import ``'package.module:name'``, looking first in ``search`` folders."""
    module_name, _, attr = path.partition(":")
    with _on_path(list(search)):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            where = f" (looked in {', '.join(search)} and the installed packages)" if search else ""
            raise SpecError(f"{field}: cannot import module {module_name!r}: {e}{where}; "
                            "check the import path, or ship the code with runtime_env.working_dir") from None
        except Exception as e:  # the user's module raised while importing
            raise SpecError(f"{field}: importing {module_name!r} raised {type(e).__name__}: {e}\n"
                            f"{traceback.format_exc()}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SpecError(f"{field}: module {module_name!r} has no attribute {attr!r}; "
                        "check the name after the ':'") from None


def _call_builder(fn: Callable, kwargs: dict, field: str) -> Any:
    try:
        return fn(**kwargs)
    except TypeError as e:
        if "argument" in str(e):
            raise SpecError(f"{field}: the builder does not accept these args {sorted(kwargs)}: {e}") from None
        raise SpecError(f"{field}: the builder raised TypeError: {e}\n{traceback.format_exc()}") from None
    except SpecError:
        raise
    except Exception as e:
        raise SpecError(f"{field}: the builder raised {type(e).__name__}: {e}\n{traceback.format_exc()}") from None


def build_model(spec: JobSpec, search: Sequence[str] = ()) -> nn.Sequential:
    """``torch.manual_seed(seed); builder()``: the initial parameters, whatever the shape."""
    m = spec.model
    fn = builtins.MODELS[m.kind] if m.kind else import_object(m.builder, "model.builder", search)
    torch.manual_seed(spec.training.seed)
    model = _call_builder(fn, m.args, "model.builder" if m.builder else f"model.kind={m.kind}")
    if not isinstance(model, nn.Sequential):
        raise SpecError(f"model.builder must return torch.nn.Sequential, got {type(model).__name__}; "
                        "wrap the layers in nn.Sequential so they can be cut into pipeline stages")
    if len(model) == 0:
        raise SpecError("model.builder returned an empty nn.Sequential; it needs at least one layer")
    return model


class Samples:
    """Random access to the data by sample index, as (x, y) batches."""

    def __init__(self, data: Any, field: str = "data.builder"):
        if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
            x, y = data
            if len(x) != len(y):
                raise SpecError(f"{field}: X has {len(x)} samples but Y has {len(y)}; they must match")
            self.x, self.y, self.dataset = x, y, None
        elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
            self.x = self.y = None
            self.dataset = data
        else:
            raise SpecError(f"{field} must return (X, Y) tensors or a map-style Dataset of (x, y) pairs, "
                            f"got {type(data).__name__}")

    def __len__(self) -> int:
        return len(self.x) if self.dataset is None else len(self.dataset)

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.dataset is None:
            return self.x[idx], self.y[idx]
        from torch.utils.data import default_collate

        x, y = default_collate([self.dataset[int(i)] for i in idx])
        return x, y


def build_data(spec: JobSpec, search: Sequence[str] = ()) -> Samples:
    d = spec.data
    fn = builtins.DATA[d.kind] if d.kind else import_object(d.builder, "data.builder", search)
    field = "data.builder" if d.builder else f"data.kind={d.kind}"
    samples = Samples(_call_builder(fn, d.args, field), field)
    n, b = len(samples), spec.training.global_batch_size
    if n < b:
        raise SpecError(f"{field} gave {n} samples, fewer than training.global_batch_size ({b}); "
                        "lower the batch size or give more data")
    return samples


def cross_entropy(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy; sequence outputs (N, T, C) are flattened over N and T."""
    if pred.dim() > 2:
        return F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1))
    return F.cross_entropy(pred, target)


def mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(pred, target.reshape(pred.shape).to(pred.dtype))


LOSSES = {"cross_entropy": cross_entropy, "mse": mse}


def build_loss(spec: JobSpec, search: Sequence[str] = ()) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A loss returning the mean over its microbatch (the engine scales it by mbs / B)."""
    if isinstance(spec.loss, LossSpec):
        fn = import_object(spec.loss.builder, "loss.builder", search)
        return _call_builder(fn, {}, "loss.builder")
    return LOSSES[spec.loss]


OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def build_optimizer(spec: JobSpec, params) -> torch.optim.Optimizer:
    cls = OPTIMIZERS[spec.optimizer.name]
    params = list(params)
    if not params:  # a stage of parameter-free layers still gets an optimizer object
        params = [nn.Parameter(torch.zeros(0))]
    try:
        return cls(params, **spec.optimizer.kwargs())
    except (TypeError, ValueError) as e:
        raise SpecError(f"optimizer: {spec.optimizer.name} rejects its arguments "
                        f"{spec.optimizer.kwargs()}: {e}") from None


@dataclass
class Loaded:
    """Everything a process needs to train the spec's model."""

    spec: JobSpec
    model: nn.Sequential
    samples: Samples
    loss: Callable


def load_job(spec: JobSpec, search: Sequence[str] = ()) -> Loaded:
    return Loaded(spec, build_model(spec, search), build_data(spec, search), build_loss(spec, search))


def check_structure(spec: JobSpec, search: Sequence[str] = ()) -> nn.Sequential:
    """The checks that need no data and no memory: the model is built on the meta device
    (no parameter storage), its layer count checked against pp and the partition, and the
    optimizer's arguments tried on a stand-in parameter."""
    with torch.device("meta"):
        model = build_model(spec, search)
    _check_model(spec, model)
    return model


def _check_model(spec: JobSpec, model: nn.Sequential) -> None:
    layers, pp = len(model), spec.parallelism.pp
    if pp > layers:
        raise SpecError(f"parallelism.pp is {pp} but the model has only {layers} layers (entries of its "
                        f"nn.Sequential); use pp <= {layers} or split the model into more layers")
    part = spec.parallelism.partition
    if isinstance(part, list) and sum(part) != layers:
        raise SpecError(f"parallelism.partition {part} covers {sum(part)} layers but the model has {layers}; "
                        "the counts must add up to the number of layers")
    costs = spec.parallelism.layer_costs_ms
    if costs is not None and len(costs) != layers:
        raise SpecError(f"parallelism.layer_costs_ms lists {len(costs)} costs but the model has {layers} layers; "
                        "give one cost per entry of its nn.Sequential")
    build_optimizer(spec, [nn.Parameter(torch.zeros(1))])


def preflight(spec: JobSpec, search: Sequence[str] = ()) -> Loaded:
    """Check that the spec can work before any actor starts: imports, builder return
    types, layer count against pp, optimizer arguments, and one microbatch through the
    model and the loss."""
    job = load_job(spec, search)
    _check_model(spec, job.model)
    from service.sampling import step_indices

    idx = step_indices(0, len(job.samples), spec.training.global_batch_size, spec.training.seed,
                       spec.training.shuffle)[: spec.training.microbatch_size]
    try:
        x, y = job.samples.batch(idx)
    except Exception as e:
        raise SpecError(f"data: reading a microbatch failed with {type(e).__name__}: {e}") from None
    try:
        out = job.model(x)
    except Exception as e:
        raise SpecError(f"the model fails on a microbatch of the data (x of shape {tuple(x.shape)}, "
                        f"dtype {x.dtype}): {type(e).__name__}: {e}") from None
    try:
        loss = job.loss(out, y)
    except Exception as e:
        raise SpecError(f"the loss fails on the model's output (shape {tuple(out.shape)}) and the targets "
                        f"(shape {tuple(y.shape)}): {type(e).__name__}: {e}") from None
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise SpecError("the loss must return a scalar tensor (the mean over the microbatch)")
    return job


def search_dirs(spec_dir: Optional[str]) -> list[str]:
    return [str(Path(spec_dir).resolve())] if spec_dir else []
