"""Turning a job spec into live objects: model, data, loss, optimizer.

Used by the CLI's pre-flight check (before any actor starts) and by every worker.
Every failure raises :class:`SpecError` with a message that says what to change.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import inspect
import os
import sys
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from service import builtins, lazydynamo, tracing
from service.recipe import check_precision
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
            if e.name and not (module_name == e.name or module_name.startswith(e.name + ".")):
                # the module was found; something it imports is not installed
                raise SpecError(f"{field}: importing {module_name!r} failed: {e}; the package {e.name!r} it needs "
                                "is not installed where the job runs (add it to the image, or runtime_env.pip)") from None
            where = f" (looked in {', '.join(search)} and the installed packages)" if search else ""
            # with search folders the spec's folder is there (relaytrain ships it with the job):
            # the path is what is wrong, not how the code travels (a user trial was told to ship it)
            what = ("check the import path: it is a module in the spec's folder (shipped with the job) or an "
                    "installed package, written 'package.module:name'" if search else
                    "check the import path, or ship the code with runtime_env.working_dir")
            raise SpecError(f"{field}: cannot import module {module_name!r}: {e}{where}; {what}") from None
        except Exception as e:  # the user's module raised while importing
            raise SpecError(f"{field}: importing {module_name!r} raised {type(e).__name__}: {e}\n"
                            f"{traceback.format_exc()}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise SpecError(f"{field}: module {module_name!r} has no attribute {attr!r}; "
                        "check the name after the ':'") from None


def _call_builder(fn: Callable, kwargs: dict, field: str) -> Any:
    """``fn(**kwargs)``: args it does not take are named as such; anything it raises is "the
    builder raised", with the traceback for user code (a built-in's says nothing more)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or an extension type without a signature
        sig = None
    if sig is not None:
        try:
            sig.bind(**kwargs)
        except TypeError as e:
            named = [p.name for p in sig.parameters.values()
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "search"]
            raise SpecError(f"{field}: the builder does not accept these args {sorted(kwargs)}: {e} "
                            f"(it takes {', '.join(named) if named else 'no args'})") from None
    try:
        return fn(**kwargs)
    except SpecError:
        raise
    except Exception as e:
        if sig is None and isinstance(e, TypeError) and "argument" in str(e):
            raise SpecError(f"{field}: the builder does not accept these args {sorted(kwargs)}: {e}") from None
        where = "" if ".kind=" in field else f"\n{traceback.format_exc()}"  # a built-in's own frames help nobody
        raise SpecError(f"{field}: the builder raised {type(e).__name__}: {e}{where}") from None


def layer_seed(seed: int, i: int) -> int:
    """The seed layer ``i`` of a layer list is built under (``training.seed`` = ``seed``)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{i}".encode()).digest()[:8], "little") >> 1


def forward_seed(seed: int, step: int, microbatch: int, layer: int) -> int:
    """The seed torch's generator holds when layer ``layer`` of the model runs its training
    forward on microbatch ``microbatch`` (0-based, in the step's global order) of step ``step``
    (1-based): dropout masks and every other random draw inside a layer depend on these four
    numbers alone, not on the worker or the shape (README, "Semantics you can rely on")."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}:{microbatch}:{layer}".encode()).digest()[:8], "little") >> 1


@dataclass
class ModelRecipe:
    """How the spec's model is built, one layer at a time where the builder allows it.

    A *layer list* (the builder returns a list of zero-argument callables, or
    ``{"layers": [...], "tied": [[name, ...], ...]}``) builds layer i alone, right after
    ``torch.manual_seed(layer_seed(seed, i))``.  An ``nn.Sequential`` builder is built whole
    after ``torch.manual_seed(seed)``; its parameters shared between layers are its ties.
    ``tied`` groups names of the whole model (``"0.tok.weight"``) that are one parameter; the
    first name's initial value is the parameter's."""

    count: int
    names: list[str]                   # each layer's name in the whole model
    tied: list[tuple[str, ...]]
    seed: int
    makers: Optional[list[Callable[[], nn.Module]]] = None    # a layer list
    whole: Optional[Callable[[], nn.Sequential]] = None      # an nn.Sequential builder, unseeded

    @property
    def per_layer(self) -> bool:
        return self.makers is not None

    def build(self, wanted: Iterable[int], device: Optional[str | torch.device] = None) -> dict[int, nn.Module]:
        """Layers ``wanted`` at their initial values; copies of tied parameters are separate
        tensors (each holder keeps its own, kept equal by the engine)."""
        wanted = sorted(set(wanted))
        with torch.device(device) if device is not None else contextlib.nullcontext():
            if self.makers is None:
                torch.manual_seed(self.seed)
                full = self.whole()
                layers = {i: full[i] for i in wanted}
            else:
                layers = {i: self._make(i) for i in wanted}
        _untie(layers, self.names)
        return layers

    def _make(self, i: int) -> nn.Module:
        torch.manual_seed(layer_seed(self.seed, i))
        try:
            layer = self.makers[i]()
        except Exception as e:
            raise SpecError(f"model.builder: layer {i} ({_label(self.makers[i])}) raised {type(e).__name__}: {e}\n"
                            f"{traceback.format_exc()}") from None
        if not isinstance(layer, nn.Module):
            raise SpecError(f"model.builder: layer {i} ({_label(self.makers[i])}) returned {type(layer).__name__}, "
                            "not a torch.nn.Module; each entry of the layer list must build one layer")
        return layer

    def assemble(self, device: Optional[str | torch.device] = None) -> nn.Sequential:
        """The whole model in one process: ``nn.Sequential`` of every layer, each tie one
        shared parameter (the first name's)."""
        layers = self.build(range(self.count), device)
        model = nn.Sequential(OrderedDict((self.names[i], layers[i]) for i in range(self.count)))
        for group in self.tied:
            owner = model.get_parameter(group[0])
            for name in group[1:]:
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, owner)
        return model

    def copy_tied_init(self, layers: dict[int, nn.Module]) -> None:
        """Give the tied copies held in ``layers`` the first name's initial value: built here
        for a moment when its layer is elsewhere (the layers' seeds make it the same value)."""
        for group in self.tied:
            held = [n for n in group[1:] if _layer_of(n) in layers]
            if not held:
                continue
            i = _layer_of(group[0])
            source = layers[i] if i in layers else self.build([i])[i]
            value = source.get_parameter(group[0].split(".", 1)[1])
            with torch.no_grad():
                for n in held:
                    layers[_layer_of(n)].get_parameter(n.split(".", 1)[1]).copy_(value)


def _layer_of(name: str) -> int:
    return int(name.split(".", 1)[0])


def _label(fn: Callable) -> str:
    inner = getattr(fn, "func", fn)  # a functools.partial
    return getattr(inner, "__qualname__", None) or type(inner).__name__


def _untie(layers: dict[int, nn.Module], names: list[str]) -> None:
    """Give every layer its own copy of a parameter it shares with another layer (an
    nn.Sequential builder's tie): a layer's state must not depend on which layers are beside it."""
    seen: set[int] = set()
    for i in sorted(layers):
        for mod_name, mod in layers[i].named_modules():
            for attr, prm in list(mod.named_parameters(recurse=False)):
                if id(prm) in seen:
                    setattr(mod, attr, nn.Parameter(prm.detach().clone(), requires_grad=prm.requires_grad))
                else:
                    seen.add(id(prm))


def _sequential_ties(model: nn.Sequential) -> list[tuple[str, ...]]:
    groups: dict[int, list[str]] = {}
    for name, prm in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(prm), []).append(name)
    return [tuple(g) for g in groups.values() if len({_layer_of(n) for n in g}) > 1]


def model_recipe(spec: JobSpec, search: Sequence[str] = ()) -> ModelRecipe:
    """Call the builder (cheap for a layer list; on the meta device for an nn.Sequential,
    so no memory) and check what it returned."""
    m = spec.model
    field = "model.builder" if m.builder else f"model.kind={m.kind}"
    fn = builtins.MODELS[m.kind] if m.kind else import_object(m.builder, "model.builder", search)
    seed = spec.training.seed
    with torch.device("meta"):
        torch.manual_seed(seed)
        out = _call_builder(fn, m.args, field)
    if isinstance(out, nn.Sequential):
        if len(out) == 0:
            raise SpecError(f"{field} returned an empty nn.Sequential; it needs at least one layer")
        names = [n for n, _ in out.named_children()]
        if names != [str(i) for i in range(len(out))]:
            raise SpecError(f"{field} returned an nn.Sequential with named entries ({', '.join(names[:4])}, ...); "
                            "build it as nn.Sequential(*layers), whose entries are numbered: a layer's "
                            "number starts its parameters' names, which is how its state finds it")
        return ModelRecipe(len(out), names, _sequential_ties(out), seed, whole=lambda: _call_builder(fn, m.args, field))
    tied: list = []
    if isinstance(out, dict):
        extra = set(out) - {"layers", "tied"}
        if "layers" not in out or extra:
            raise SpecError(f"{field} returned a dict with keys {sorted(out)}; a layer list with ties is "
                            "{'layers': [callables...], 'tied': [['0.tok.weight', '5.weight'], ...]}")
        out, tied = out["layers"], out.get("tied") or []
    if not isinstance(out, (list, tuple)):
        raise SpecError(f"{field} must return torch.nn.Sequential or a layer list (a list of zero-argument "
                        f"callables, each building one layer), got {type(out).__name__}")
    if not out:
        raise SpecError(f"{field} returned an empty layer list; it needs at least one layer")
    for i, make in enumerate(out):
        if not callable(make) or isinstance(make, nn.Module):
            what = "a module instance" if isinstance(make, nn.Module) else type(make).__name__
            raise SpecError(f"{field}: entry {i} of the layer list is {what}, not a zero-argument callable "
                            "that builds the layer: write functools.partial(Block, ...) or lambda: Block(...) "
                            "so that each worker builds only its own layers")
    rec = ModelRecipe(len(out), [str(i) for i in range(len(out))], [], seed, makers=list(out))
    rec.tied = _check_ties(rec, tied, field)
    return rec


def _check_ties(rec: ModelRecipe, tied: Any, field: str) -> list[tuple[str, ...]]:
    if not isinstance(tied, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in tied):
        raise SpecError(f"{field}: 'tied' must be a list of groups of parameter names, such as "
                        "[['0.tok.weight', '5.weight']]")
    groups = [tuple(str(n) for n in g) for g in tied]
    if not groups:
        return []
    metas = rec.build({_layer_of(n) for g in groups for n in g if n.split(".", 1)[0].isdigit()
                       and _layer_of(n) < rec.count}, "meta")
    for g in groups:
        if len(g) < 2:
            raise SpecError(f"{field}: the tie {list(g)} names one parameter; a tie groups two or more")
        shapes = {}  # name -> shape, in the tie's order
        for n in g:
            head, _, rest = n.partition(".")
            if not head.isdigit() or int(head) >= rec.count or not rest:
                raise SpecError(f"{field}: the tie {list(g)} names {n!r}, which is not '<layer index>.<parameter>' "
                                f"of a layer 0-{rec.count - 1}")
            try:
                shapes[n] = tuple(metas[int(head)].get_parameter(rest).shape)
            except AttributeError:
                have = [k for k, _ in metas[int(head)].named_parameters()]
                raise SpecError(f"{field}: the tie {list(g)} names {n!r}, but layer {head} has no parameter "
                                f"{rest!r}; its parameters are {have}") from None
        if len(set(shapes.values())) > 1:
            said = ", ".join(f"{n} {list(shape)}" for n, shape in shapes.items())
            raise SpecError(f"{field}: the tie {list(g)} joins parameters of different shapes: {said}")
    return groups


def build_model(spec: JobSpec, search: Sequence[str] = ()) -> nn.Sequential:
    """The whole model in one process (the reference a job equals): see :class:`ModelRecipe`."""
    return model_recipe(spec, search).assemble()


class Samples:
    """Random access to the data by sample index, as (x, y) batches."""

    def __init__(self, data: Any, field: str = "data.builder"):
        self.field = field
        arrays = (torch.Tensor, np.ndarray)
        if isinstance(data, (tuple, list)) and len(data) == 2 and all(isinstance(t, arrays) for t in data):
            try:  # numpy's dtype kept (a reversed or strided view copied)
                x, y = (torch.as_tensor(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t for t in data)
            except (TypeError, ValueError) as e:
                raise SpecError(f"{field} returned numpy arrays torch cannot take ({e}): return arrays of numbers "
                                "(float32 features, int64 labels)") from None
            if len(x) != len(y):
                raise SpecError(f"{field}: X has {len(x)} samples but Y has {len(y)}; they must match")
            self.x, self.y, self.dataset = x, y, None
        elif isinstance(data, dict):  # a dict has __getitem__ and __len__: it was taken for a Dataset of 2
            raise SpecError(f"{field} returned a dict (keys {sorted(map(str, data))[:8]}), not (X, Y): return two "
                            "tensors of the same length, such as (d['x'], d['y']), or a map-style Dataset of (x, y) "
                            "pairs")
        elif isinstance(data, tuple) and data and all(isinstance(t, arrays) for t in data):
            raise SpecError(f"{field} returned a tuple of {len(data)} tensors, not (X, Y): return the inputs the "
                            "first layer takes and the loss's targets, two tensors of the same length (a pipeline "
                            "passes one tensor from layer to layer: stack further inputs into X)")
        elif isinstance(data, torch.utils.data.IterableDataset):
            raise SpecError(f"{field} returned an IterableDataset ({type(data).__name__}); relaytrain reads samples by "
                            "index, in the order its seed draws: return a map-style Dataset (__len__ and "
                            "__getitem__) or (X, Y) tensors")
        elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
            self.x = self.y = None
            self.dataset = data
        else:
            raise SpecError(f"{field} must return (X, Y) tensors or a map-style Dataset of (x, y) pairs, "
                            f"got {type(data).__name__}")

    def __len__(self) -> int:
        return len(self.x) if self.dataset is None else len(self.dataset)

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs(idx), self.targets(idx)

    def inputs(self, idx: torch.Tensor) -> torch.Tensor:
        """The inputs of samples ``idx`` (the first stage reads only these)."""
        if self.dataset is None:
            return self.x[idx]
        if callable(getattr(self.dataset, "inputs", None)):  # reads inputs alone (data.kind: tokens)
            return self.dataset.inputs(idx)
        return self._pairs(idx)[0]

    def targets(self, idx: torch.Tensor) -> torch.Tensor:
        """The targets of samples ``idx`` (the last stage reads only these)."""
        if self.dataset is None:
            return self.y[idx]
        if callable(getattr(self.dataset, "targets", None)):
            return self.dataset.targets(idx)
        return self._pairs(idx)[1]

    def _pairs(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.utils.data import default_collate

        items = [self.dataset[int(i)] for i in idx]
        first = items[0] if items else None
        if items and not (isinstance(first, (tuple, list)) and len(first) == 2):
            what = (f"a dict with keys {sorted(map(str, first))[:8]}" if isinstance(first, dict) else
                    f"a {type(first).__name__} of {len(first)}" if isinstance(first, (tuple, list)) else
                    ("an " if type(first).__name__[0] in "aeiou" else "a ") + type(first).__name__)
            raise SpecError(f"{self.field}: the Dataset's item {int(idx[0])} is {what}, not an (x, y) pair: return "
                            "(x, y) from __getitem__, x what the first layer takes and y the loss's target (for a "
                            "dict of input_ids and labels: (item['input_ids'], item['labels']))")
        try:
            x, y = default_collate(items)
        except RuntimeError as e:
            if "stack expects each tensor to be equal size" not in str(e):
                raise
            raise SpecError(f"{self.field}: the samples of one microbatch have different shapes ({e}): a microbatch "
                            "stacks its samples into one tensor, so give every x, and every y, one shape (pad "
                            "sequences to one length in __getitem__; under cross_entropy, targets of -100 are left "
                            "out of the loss)") from None
        for name, t in (("x", x), ("y", y)):
            if not isinstance(t, torch.Tensor):
                raise SpecError(f"{self.field}: the Dataset's {name} is a {type(first[0 if name == 'x' else 1]).__name__}, "
                                "not one tensor (or array, or number): a pipeline passes one tensor from layer to "
                                f"layer, so give one {name} per sample (an attention mask: build it inside the "
                                "model, or stack it with the ids into one tensor)")
        return x, y


def build_data(spec: JobSpec, search: Sequence[str] = ()) -> Samples:
    d = spec.data
    fn = builtins.DATA[d.kind] if d.kind else import_object(d.builder, "data.builder", search)
    field = "data.builder" if d.builder else f"data.kind={d.kind}"
    args = {**d.args, "search": list(search)} if d.kind == "tokens" else d.args  # a relative path: the spec's folder
    samples = Samples(_call_builder(fn, args, field), field)
    n, b = len(samples), spec.training.global_batch_size
    if n < b and n and samples.dataset is not None and not callable(getattr(samples.dataset, "inputs", None)):
        read_samples(samples, torch.tensor([0]), field)  # an item that is no (x, y) pair says that, not "too few"
    if n < b:
        raise SpecError(f"{field} gave {n} samples, fewer than training.global_batch_size ({b}); "
                        "lower the batch size or give more data")
    return samples


def cross_entropy(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy; sequence outputs (N, T, C) are flattened over N and T."""
    if pred.dim() > 2:
        return F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1))
    return F.cross_entropy(pred, target)


IGNORE_INDEX = -100  # F.cross_entropy's: a target equal to it (padding) is not counted


def cross_entropy_sum(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The sum of cross entropy over the counted targets (not ``IGNORE_INDEX``)."""
    if pred.dim() > 2:
        return F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1), reduction="sum")
    return F.cross_entropy(pred, target, reduction="sum")


def counted_targets(spec: JobSpec, targets: torch.Tensor) -> Optional[int]:
    """How many of a batch's ``targets`` count, when the built-in cross entropy leaves some out
    (``IGNORE_INDEX``, HF-style padding): its loss is then the mean over the batch's counted
    targets, each microbatch's sum divided by this count, whatever the microbatch size (a
    mean per microbatch scaled by mbs / B weighed a microbatch of 19 counted tokens as one of
    44). None when every target counts (or another loss): the mean per microbatch scaled by mbs / B."""
    if spec.loss != "cross_entropy" or targets.is_floating_point():
        return None
    n = int((targets != IGNORE_INDEX).sum())
    return None if n == targets.numel() else n


def check_labels(targets: torch.Tensor, output_shape: tuple, field: str) -> None:
    """The built-in cross entropy's class labels (all of an (X, Y) data's, else a microbatch's)
    lie in [0, classes) of the model's output: a model of 5 outputs for labels 0-9 failed at
    its first step, after the workers started, with torch's "Target 7 is out of bounds" (a
    user trial)."""
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() or not output_shape or \
            targets.numel() == 0:
        return  # probabilities as targets: F.cross_entropy checks their shape
    classes = output_shape[-1]
    counted = targets[targets != IGNORE_INDEX]
    if counted.numel() == 0:
        return
    low, high = int(counted.min()), int(counted.max())
    if low < 0 or high >= classes:
        raise SpecError(f"loss cross_entropy: the targets of {field} hold class labels from {low} to {high}, but the "
                        f"model's output has {classes} classes (its last dimension, of shape {list(output_shape)} for "
                        f"a microbatch), so labels must be in [0, {classes})" + (
                            f": make the model's last layer output {high + 1} classes or more" if low >= 0 else
                            f"; only {IGNORE_INDEX} may stand for a target left out"))


def mse(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if target.shape != pred.shape:
        if [d for d in target.shape if d != 1] != [d for d in pred.shape if d != 1]:
            raise ValueError(f"mse compares the model's output with targets of its shape, and the output has shape "
                             f"{list(pred.shape)} and the targets {list(target.shape)} (only dimensions of size 1 "
                             "may differ): make the model's output and the targets the same shape")
        target = target.reshape(pred.shape)  # (N,) targets for an (N, 1) output
    return F.mse_loss(pred, target.to(pred.dtype))


LOSSES = {"cross_entropy": cross_entropy, "mse": mse}


def build_loss(spec: JobSpec, search: Sequence[str] = ()) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """A loss returning the mean over its microbatch (the engine scales it by mbs / B)."""
    if isinstance(spec.loss, LossSpec):
        fn = import_object(spec.loss.builder, "loss.builder", search)
        return _call_builder(fn, {}, "loss.builder")
    return LOSSES[spec.loss]


OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def build_optimizer(spec: JobSpec, params) -> torch.optim.Optimizer:
    lazydynamo.defer()  # an optimizer would import torch._dynamo: 2 s of CPU per process (service/lazydynamo.py)
    cls = OPTIMIZERS[spec.optimizer.name]
    params = list(params)
    if not params:  # a stage of parameter-free layers still gets an optimizer object
        params = [nn.Parameter(torch.zeros(0))]
    kwargs = spec.optimizer.kwargs()
    if (cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW) and "fused" not in kwargs
            and "foreach" not in kwargs
            and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
            and len({p.device.type for p in params}) == 1
            and not any(hasattr(p, "device_mesh") for p in params)):  # DTensor (tensor-parallel) parameters
        # one kernel per tensor and no temporaries: the default single-tensor Adam allocates two
        # of each parameter's size (its sqrt and division), 2x the largest tensor at the peak;
        # SGD with momentum reads and writes each tensor once instead of three times (4 Linear
        # (1024, 1024): 2.1 ms a step against 3.7).  Same formulas, rounding may differ in the last bit
        try:
            return cls(params, **kwargs, fused=True)
        except (TypeError, ValueError, RuntimeError):
            pass  # an argument fused does not take: the user's arguments alone say what is wrong
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as e:
        raise SpecError(f"optimizer: {spec.optimizer.name} rejects its arguments "
                        f"{spec.optimizer.kwargs()}: {e}") from None


@dataclass
class Loaded:
    """Everything one process needs to train the spec's whole model (the reference loop)."""

    spec: JobSpec
    model: nn.Sequential
    samples: Samples
    loss: Callable


def load_job(spec: JobSpec, search: Sequence[str] = ()) -> Loaded:
    return Loaded(spec, build_model(spec, search), build_data(spec, search), build_loss(spec, search))


def check_structure(spec: JobSpec, search: Sequence[str] = ()) -> ModelRecipe:
    """The checks that need no data and no memory: what the builder returns (a layer list is
    not built; an nn.Sequential is built on the meta device), the layer count against pp and
    the partition, and the optimizer's arguments on a stand-in parameter."""
    rec = model_recipe(spec, search)
    _check_model(spec, rec.count)
    return rec


def _check_model(spec: JobSpec, layers: int) -> None:
    p = spec.parallelism
    pp, v = p.pp, p.chunks
    if pp > layers:
        raise SpecError(f"parallelism.pp is {pp} but the model has only {layers} layers (entries of its "
                        f"nn.Sequential or layer list); use pp <= {layers} or split the model into more layers")
    if pp * v > layers:
        raise SpecError(f"parallelism.schedule {p.schedule} with pp {pp} and stages_per_worker {v} cuts the model "
                        f"into {pp * v} chunks of at least one layer, but it has only {layers} layers (entries of its "
                        f"nn.Sequential or layer list); lower stages_per_worker or pp so that pp x stages_per_worker "
                        f"<= {layers}, or split the model into more layers")
    if p.schedule in ("zb_h1", "zbv") and spec.training.activation_checkpointing:
        raise SpecError(f"parallelism.schedule {p.schedule} splits each backward into its input gradient and its "
                        "weight gradient, which training.activation_checkpointing does not allow (the recomputed "
                        "forward is freed by the first half); use 1f1b or interleaved_1f1b with checkpointing, or "
                        "turn activation_checkpointing off")
    part = spec.parallelism.partition
    if isinstance(part, list) and sum(part) != layers:
        raise SpecError(f"parallelism.partition {part} covers {sum(part)} layers but the model has {layers}; "
                        "the counts must add up to the number of layers")
    costs = spec.parallelism.layer_costs_ms
    if costs is not None and len(costs) != layers:
        raise SpecError(f"parallelism.layer_costs_ms lists {len(costs)} costs but the model has {layers} layers; "
                        "give one cost per entry of its nn.Sequential or layer list")
    build_optimizer(spec, [nn.Parameter(torch.zeros(1))])


def first_microbatch(spec: JobSpec, samples: Samples) -> tuple[torch.Tensor, torch.Tensor]:
    from service.sampling import step_indices

    t = spec.training
    idx = step_indices(0, len(samples), t.global_batch_size, t.seed, t.shuffle)[: t.microbatch_size]
    return read_samples(samples, idx, "data")


def read_samples(samples: Samples, idx: torch.Tensor, field: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``samples.batch(idx)``; what the user's Dataset raises is one sentence naming where."""
    try:
        return samples.batch(idx)
    except SpecError:
        raise
    except Exception as e:
        raise SpecError(f"{field}: reading a microbatch failed with {type(e).__name__}: {e}{raised_at(e)}") from None


def _not_the_users() -> tuple:
    import sysconfig

    paths = {str(Path(__file__).resolve().parent.parent / "service"), str(Path(torch.__file__).resolve().parent)}
    paths |= {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(os.path.join(str(Path(p).resolve()), "") for p in paths)


_OURS = _not_the_users()  # frames in relaytrain's service, torch, the standard library and installed packages


def raised_at(e: BaseException) -> str:
    """`` (raised at FILE, line N, in FUNC)``: the innermost frame of the user's code in ``e``'s
    traceback (its Dataset's __getitem__ had only its message: a user trial); "" when none."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not os.path.realpath(f.filename).startswith(_OURS)]
    if not frames:
        return ""
    f = frames[-1]
    return f" (raised at {f.filename}, line {f.lineno}, in {f.name})"


def preflight(spec: JobSpec, search: Sequence[str] = ()) -> tracing.Trace:
    """Check that the spec can work before any actor starts: imports, what the builders
    return, layer count against pp, optimizer arguments, and one microbatch through the
    model and the loss, on the meta device (no memory; see service/tracing.py).  The trace's
    ``model_state`` names the whole model's state as its checkpoints hold it."""
    lazydynamo.defer()  # before the trace and the optimizer, which would import torch._dynamo
    rec = check_structure(spec, search)
    if spec.parallelism.tp > 1:
        check_tensor_plans(rec, spec.parallelism.tp)
    if not spec.resources.gpus_per_worker:  # GPU workers check their own device (actors/worker.py)
        check_precision(spec, gpus=False)
    samples = build_data(spec, search)
    ev = check_eval_data(spec, search, samples) if spec.eval is not None else None
    x, y = first_microbatch(spec, samples)
    t = tracing.trace(lambda device: rec.build(range(rec.count), device), rec.count, x, y,
                      build_loss(spec, search), bf16=spec.training.precision == "bf16")
    if spec.loss == "cross_entropy":
        check_labels(samples.y if samples.y is not None else y, t.metas[-1][0], samples.field)
        if ev is not None:  # its first microbatch, when it is a Dataset
            try:
                targets = ev.y if ev.y is not None else ev.targets(torch.arange(spec.training.microbatch_size))
            except Exception as e:
                raise SpecError(f"eval.data: reading a microbatch failed with {type(e).__name__}: {e}"
                                f"{raised_at(e)}") from None
            check_labels(targets, t.metas[-1][0], f"eval.{ev.field}")
    return dataclasses.replace(t, model_state={f"{rec.names[i]}.{k}": shape for i, layer in enumerate(t.state)
                                               for k, shape in layer.items()})


def check_builtin_spec(spec: JobSpec) -> Optional[dict]:
    """What the API server checks of a spec naming only built-ins (no user code runs there):
    everything ``preflight`` checks, the data too (a batch larger than the data, args a
    builder does not take), except data read from files (``tokens``), which are on the
    cluster's disks: for those the job's own pre-flight there reads them.  Returns the
    model's state names and shapes when it traced the model (``preflight``)."""
    kinds = {spec.data.kind, spec.eval.data.kind if spec.eval is not None else None}
    if "tokens" in kinds:
        check_structure(spec)
        return None
    return preflight(spec).model_state


def check_tensor_plans(rec: "ModelRecipe", tp: int) -> None:
    """Every layer's ``tp_plan`` names Linear submodules and splits them over ``tp`` ranks
    (service/tensorplan.py), checked on the meta device; a model with no plan at all gains
    nothing from tp and is refused."""
    from service import tensorplan

    layers = rec.build(range(rec.count), "meta")
    planned = 0
    for i in range(rec.count):
        try:
            tensorplan.check_layer(i, layers[i], tp)
        except ValueError as e:
            raise SpecError(f"parallelism.tp: {e}") from None
        planned += bool(tensorplan.plan_of(layers[i]))
    if not planned:
        raise SpecError(f"parallelism.tp {tp}: no layer of the model has a tp_plan, so every TP rank would compute "
                        "the whole model; give the layers to split a tp_plan (a dict like {'mlp.fc': 'colwise', "
                        "'mlp.proj': 'rowwise'}), or set tp 1")


def check_eval_data(spec: JobSpec, search: Sequence[str] = (), train: Optional[Samples] = None) -> "Samples":
    """The eval data builds, holds eval.batches x B samples, and gives samples shaped like the
    training data's (``train``, built again when not given: the pipeline's boundaries are traced
    from those); returns it."""
    try:
        ev = build_data(spec.model_copy(update={"data": spec.eval.data}), search)
    except SpecError as e:
        raise SpecError(f"eval.{e}") from None
    need = spec.eval.batches * spec.training.global_batch_size
    if len(ev) < need:
        raise SpecError(f"eval.data gives {len(ev)} samples, fewer than eval.batches x training.global_batch_size "
                        f"({spec.eval.batches} x {spec.training.global_batch_size} = {need}); lower eval.batches or "
                        "give more eval data")
    train = train if train is not None else build_data(spec, search)
    a, b = ev.inputs(torch.arange(1)), train.inputs(torch.arange(1))
    if (tuple(a.shape[1:]), a.dtype) != (tuple(b.shape[1:]), b.dtype):
        raise SpecError(f"eval.data's inputs are {tuple(a.shape[1:])} {a.dtype} per sample, the training data's "
                        f"{tuple(b.shape[1:])} {b.dtype}: the evaluation runs through the same pipeline, so give "
                        "eval data of the same shape")
    return ev


def search_dirs(spec_dir: Optional[str]) -> list[str]:
    return [str(Path(spec_dir).resolve())] if spec_dir else []
