"""What the scheduler and the pre-flight check learn about a model without holding it.

The model runs one microbatch on PyTorch's ``meta`` device: tensors with shapes and dtypes
but no storage, so a model of any size costs no memory.  That gives each layer's output
shape and dtype (the stage boundaries' activations), its parameter bytes, its forward FLOPs
(``torch.utils.flop_counter``) and whether it has state, and checks that the model and the
loss accept the data.  A model that cannot run on ``meta`` (an operator without a meta
kernel, ``.item()``, data-dependent shapes) is run for real instead when its parameters are
small (``REAL_RUN_MAX_BYTES``); a larger one is refused with the reason.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from service import builtins, lazydynamo
from service.spec import SpecError

REAL_RUN_MAX_BYTES = 64 * 2**20  # parameters a process may build for a moment to trace a model for real
LAYER_OVERHEAD_S = 20e-6         # a layer's fixed cost per pass (Python and operator dispatch)


# the forwards known to be nn.Linear's, and whether they first cast the input to the weight's
# dtype (the built-in models' Linear: float32 data into a float64 model)
LINEAR_FORWARDS = {nn.Linear.forward: False, builtins.Linear.forward: True}


def conv1d_class():
    """transformers' ``Conv1D`` (GPT-2's, GPT's projections: ``x @ W + b``, a Linear whose weight is
    stored transposed), where the process has imported transformers (a model built of it has);
    None otherwise.  Never imports transformers."""
    utils = sys.modules.get("transformers.pytorch_utils")
    return getattr(utils, "Conv1D", None)


def plain_conv1d(m: nn.Module) -> bool:
    """transformers' ``Conv1D`` with its own forward (one ``torch.addmm``)."""
    cls = conv1d_class()
    return cls is not None and isinstance(m, cls) and type(m).forward is cls.forward


def plain_linear(m: nn.Module) -> bool:
    """A Linear whose forward is nn.Linear's own, or the built-in models' (which only casts its
    input), or transformers' ``Conv1D`` with its own (the same product, the weight transposed);
    a subclass that overrides it otherwise is left alone.  The workers compute such a layer's
    weight gradient themselves, after the input gradient (actors/deferred.py)."""
    if isinstance(m, nn.Linear):
        return type(m).forward in LINEAR_FORWARDS
    return plain_conv1d(m)


def rows_hook(rows: dict):
    """A forward hook recording in ``rows`` (module id -> rows) the rows of the module's first
    output, the first time it runs: the rows a weight is applied to, a conv's output positions,
    otherwise every entry but the last dimension's (tokens, batch rows)."""
    def hook(m: nn.Module, args, out) -> None:
        if id(m) not in rows:
            t = _first_tensor(out)
            if t is not None:
                ch = 1 if isinstance(m, nn.modules.conv._ConvNd) and t.dim() > 2 else -1
                rows[id(m)] = t.numel() // max(t.shape[ch], 1) if t.dim() else 1
    hook.relaytrain_rows = True
    return hook


def count_rows(part: nn.Module, rows: dict) -> None:
    """A ``rows_hook`` on every module of ``part``, recording into ``rows`` what ``weighed``
    weighs each weight by.  Hooks of an earlier call are dropped first; ``forget_rows`` drops them."""
    forget_rows(part)
    for m in part.modules():
        m.register_forward_hook(rows_hook(rows))


def forget_rows(part: nn.Module) -> None:
    for m in part.modules():
        for k in [k for k, h in m._forward_hooks.items() if getattr(h, "relaytrain_rows", False)]:
            del m._forward_hooks[k]


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    for v in (out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()):
        if isinstance(v, torch.Tensor):
            return v
    return None


def _grad_work(m: nn.Module, q: torch.Tensor, rows) -> float:
    """A weight's gradient's multiply-adds for ``rows`` rows: a matrix's (a Linear's, a conv's
    kernel, an attention's projections) 2 x rows x its elements; a vector's (a bias, a norm's
    scale) or an embedding table's (a scatter into the rows looked up) rows x its last dimension."""
    if rows is None:
        return 0.0
    if q.dim() >= 2 and not isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
        return 2.0 * rows * q.numel()
    return float(rows * (q.shape[-1] if q.dim() else 1))


def weighed(part: nn.Module, rows: dict, own: Callable[[nn.Module], bool]) -> tuple[float, float]:
    """(the weight-gradient work of ``part``'s modules that ran (``rows`` holds them) and pass
    ``own``, all its weight-gradient work), by the rows ``rows_hook`` saw.  Weighed by work, not
    by elements: a Conv2d's small kernel, applied at every position of its image, can cost more
    than a Linear head ten times its size.  A module that never ran itself (a Linear whose weight
    its parent passes to ``F.linear``) is weighed by its parent's rows; a weight no running module
    holds counts nothing."""
    seen: set = set()
    mine = total = 0.0

    def walk(m: nn.Module, inherited) -> None:
        nonlocal mine, total
        r = rows.get(id(m), inherited)
        counts = id(m) in rows and own(m)
        for q in m.parameters(recurse=False):
            if q.requires_grad and id(q) not in seen:
                seen.add(id(q))
                work = _grad_work(m, q, r)
                total += work
                mine += work if counts else 0.0
        for c in m.children():
            walk(c, r)
    walk(part, None)
    return mine, total


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as plain data ('float32'): what a job's scheduler holds and passes on, without torch."""
    return str(dtype).removeprefix("torch.")


def dtype_named(name) -> torch.dtype:
    """The dtype :func:`dtype_name` named (a torch.dtype is returned as it is)."""
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not the name of a torch dtype")
    return dtype


def nbytes(shape: tuple, dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def norms_of(part: nn.Module) -> list:
    """The BatchNorm layers of ``part`` that keep running statistics (a subclass with a forward
    of its own, such as SyncBatchNorm, is left alone): the ones ``training.batch_norm`` governs."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return [m for m in part.modules()
            if isinstance(m, _BatchNorm) and type(m).forward is _BatchNorm.forward and m.track_running_stats]


def changes_input_in_place(layer: nn.Module) -> bool:
    """Does ``layer`` write into its input (``nn.ReLU(inplace=True)`` and torch's other
    ``inplace`` activations, or an ``nn.Sequential`` that starts with one)?  A stage's input
    is a leaf that needs its gradient, which autograd refuses to change in place: such a first
    layer gets a copy of it."""
    while isinstance(layer, nn.Sequential) and len(layer):
        layer = layer[0]
    return getattr(layer, "inplace", False) is True


@dataclass(frozen=True)
class Trace:
    metas: list            # (shape, dtype) of each layer's output for one microbatch
    flops: list[int]       # each layer's forward FLOPs for one microbatch
    param_bytes: list[int]
    io_bytes: list[int]    # bytes each layer reads and writes: input, output, parameters
    stateless: frozenset   # layers with no parameters and no persistent buffers
    on_meta: bool          # False: the model was run for real (it has no meta kernels)
    saved_bytes: list = dataclasses.field(default_factory=list)  # what autograd keeps per layer for backward
    skips: list = dataclasses.field(default_factory=list)  # SkipFacts of the model's skips (relaytrain.skip)
    norms: frozenset = frozenset()  # layers holding a BatchNorm with running statistics (training.batch_norm)
    # each layer's weight-gradient work: (its plain Linears' that ran, all of it) (``weighed``): the
    # share whose products the workers compute after sending the input gradient
    grad_work: list = dataclasses.field(default_factory=list)
    state: list = dataclasses.field(default_factory=list)  # each layer's state_dict: {key in the layer: shape}
    # the whole model's state_dict (what its checkpoints hold): {name: shape}; service/loading.py preflight
    model_state: dict = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class SkipFacts:
    """A skip connection (relaytrain.skip): the layers that stash and pop it, its name, where it
    sits among each layer's declarations, and the (shape, dtype) of its tensor for one microbatch."""

    stasher: int
    popper: int
    name: str
    at: tuple
    meta: tuple


def trace(layers_on: Callable[[str], dict[int, nn.Module]], count: int, x: torch.Tensor, y: torch.Tensor,
          loss: Callable, bf16: bool = False) -> Trace:
    """Run one microbatch (``x``, ``y``) through the layers ``layers_on(device)`` builds, then
    the loss; raises :class:`SpecError` saying what failed.  With ``bf16`` the output dtypes
    are those under bf16 autocast (what crosses a stage boundary)."""
    t = _trace(layers_on, count, x, y, loss, bf16)
    if bf16:
        dtypes, skip_dtypes = _autocast_dtypes(layers_on, count, x, t.on_meta)
        t = dataclasses.replace(
            t, metas=[(shape, dtype) for (shape, _), dtype in zip(t.metas, dtypes)],
            skips=[dataclasses.replace(s, meta=(s.meta[0], skip_dtypes.get((s.stasher, s.name), s.meta[1])))
                   for s in t.skips])
    return t


def _autocast_dtypes(layers_on: Callable[[str], dict[int, nn.Module]], count: int, x: torch.Tensor,
                     on_meta: bool) -> list:
    """Each layer's output dtype under bf16 autocast.  The meta device ignores autocast, so the
    layers run on fake CPU tensors (shapes and dtypes, no storage; torch's FakeTensorMode), or
    for real when the model was run for real."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from relaytrain import skip

    mode = FakeTensorMode(allow_non_fake_inputs=True) if on_meta else contextlib.nullcontext()
    dtypes, recorder, stashers = [], _Recorder(skip.Tracker()), {}
    # built on the meta device, then given fake CPU tensors: a builder that calls .to(dtype),
    # .double() or .float() fails when it builds inside FakeTensorMode ("Couldn't swap")
    layers = _on_fake_cpu(layers_on("meta"), mode) if on_meta else layers_on("cpu")
    with mode, skip.use_tracker(recorder):
        h = mode.from_tensor(x) if on_meta else x
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            for i in range(count):
                try:
                    h = layers[i](h)
                except Exception as e:
                    raise SpecError(f"layer {i} ({type(layers[i]).__name__}) fails under bf16 autocast "
                                    f"(training.precision: bf16): {type(e).__name__}: {e}") from None
                dtypes.append(h.dtype)
                for key in recorder.metas:
                    stashers.setdefault(key, i)
    # (stasher layer, name) -> the skip tensor's dtype under autocast
    return dtypes, {(stashers[key], key[1]): meta[1] for key, meta in recorder.metas.items()}


def _on_fake_cpu(layers: dict[int, nn.Module], mode) -> dict[int, nn.Module]:
    """``layers`` (on the meta device) with every parameter and buffer a fake CPU tensor of the
    same shape and dtype (no storage); a tensor shared by several modules (a tied weight) stays
    one tensor."""
    cpu, made = torch.device("cpu"), {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            f = mode.fake_tensor_converter.from_meta_and_device(mode, t.detach(), cpu)
            made[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else f
        return made[id(t)]

    with mode:
        for layer in layers.values():
            for mod in layer.modules():
                for table in (mod._parameters, mod._buffers):
                    for name, t in list(table.items()):
                        if t is not None and t.device.type == "meta":
                            table[name] = fake(t)
    return layers


def _trace(layers_on: Callable[[str], dict[int, nn.Module]], count: int, x: torch.Tensor, y: torch.Tensor,
           loss: Callable, bf16: bool = False) -> Trace:
    metas = layers_on("meta")
    size = sum(_param_bytes(metas[i]) for i in range(count))
    try:
        with torch.device("meta"):  # tensors a layer makes itself (torch.arange(T)) are meta too
            return _run(metas, count, x.to("meta"), y.to("meta"), loss, on_meta=True, bf16=bf16)
    except _Certain as e:
        raise SpecError(str(e)) from None
    except _UserError as e:
        meta_error = e
    except Exception as e:  # a failure of the meta device itself, not of the user's code
        meta_error = _UserError(f"{type(e).__name__}: {e}")
    if size > REAL_RUN_MAX_BYTES:
        raise SpecError(f"{meta_error} (traced on PyTorch's meta device: the model's {size / 2**20:.0f} MiB of "
                        "parameters are too many to run it once for real here; if the model works, an operator "
                        "of it has no meta kernel or its shapes depend on the data)")
    try:
        return _run(layers_on("cpu"), count, x, y, loss, on_meta=False, bf16=bf16)
    except _UserError as e:
        raise SpecError(str(e)) from None


class _UserError(Exception):
    pass


class _Certain(_UserError):
    """A failure on meta the real kernels would have too: no run for real to try."""


class _MixedDtypes(RuntimeError):
    """Named RuntimeError in messages, as the real kernels' errors are."""


_MixedDtypes.__name__ = "RuntimeError"


def _param_bytes(layer: nn.Module) -> int:
    return sum(q.numel() * q.element_size() for q in layer.parameters())


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class _Saved:
    """Bytes of activations autograd saves for backward while ``layer`` runs: each tensor once,
    its parameters (and views of them) not counted."""

    def __init__(self, layer: nn.Module):
        self.bytes, self._seen = 0, set()
        self._params = {id(q) for q in layer.parameters()} | {id(b) for b in layer.buffers()}

    def pack(self, t):
        base = t._base if t._base is not None else t
        if id(base) not in self._params and id(base) not in self._seen:
            self._seen.add(id(base))
            self.bytes += _nbytes(base)
        return t


class _Recorder:
    """A skip tracker that notes the shape and dtype of what is stashed."""

    def __init__(self, inner):
        self.inner, self.metas = inner, {}

    def save(self, key, tensor):
        self.metas[key] = (tuple(tensor.shape), tensor.dtype)
        self.inner.save(key, tensor)

    def load(self, key):
        return self.inner.load(key)


def _same_dtypes(autocast: bool = False):
    """A dispatch mode for the meta trace.  On the meta device, the products and norms run
    whatever their operands' dtypes: a float64 microbatch (numpy's default) into a float32
    ``nn.Linear`` passed the trace and failed on every worker at step 1 (a user trial).  The mode
    makes them refuse, as their CPU and CUDA kernels do; a norm may take a bf16 or fp16 input
    with float32 parameters, as those kernels allow.  ``autocast``: the workers run under bf16
    autocast, which casts float32, bfloat16 and float16 operands of these products to one dtype:
    only float64 beside them is refused.  (Convolutions, RNNs and PReLU check on meta already.)"""
    mode = _same_dtypes_mode()()
    mode.autocast = autocast
    return mode


@functools.cache
def _same_dtypes_mode():
    """The mode's class, made once (torch's dispatch modules are imported only for a trace)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    aten = torch.ops.aten
    products = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.addbmm, aten.mv, aten.addmv, aten.dot}
    norms = {aten.native_layer_norm, aten.native_group_norm, aten.native_batch_norm,
             aten._native_batch_norm_legit, aten._native_batch_norm_legit_no_training}
    low = {torch.bfloat16, torch.float16}

    class SameDtypes(TorchDispatchMode):
        autocast = False

        @classmethod
        def _should_skip_dynamo(cls) -> bool:  # else its dispatch is wrapped in torch._disable_dynamo,
            return False  # whose first call imports torch._dynamo (32-88 MiB, seconds of CPU; service/lazydynamo.py)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            packet = func.overloadpacket
            if packet in products or packet in norms:
                dtypes = [a.dtype for a in tree_leaves((args, kwargs or {}))
                          if isinstance(a, torch.Tensor) and a.is_floating_point()]
                if self.autocast:  # autocast casts these to one: only float64 stays apart
                    dtypes = [d if d == torch.float64 else torch.float32 for d in dtypes]
                if len(set(dtypes)) > 1 and not (packet in norms and dtypes[0] in low
                                                 and set(dtypes[1:]) <= {torch.float32, dtypes[0]}):
                    names = ", ".join(dtype_name(d) for d in dict.fromkeys(dtypes))
                    raise _MixedDtypes(f"{packet.__name__} of tensors of different dtypes ({names}): PyTorch's "
                                       "kernels need them to be the same")
            return func(*args, **(kwargs or {}))

    return SameDtypes


def _run(layers: dict[int, nn.Module], count: int, x, y, loss, on_meta: bool, bf16: bool = False) -> Trace:
    from relaytrain import skip

    try:
        found = skip.layout([layers[i] for i in range(count)])
    except skip.SkipError as e:
        raise _UserError(f"the model's skip connections: {e}") from None
    recorder = _Recorder(skip.Tracker())
    with skip.use_tracker(recorder):
        t = _run_layers(layers, count, x, y, loss, on_meta, bf16)
    facts = [SkipFacts(s.stasher, s.popper, s.name, s.at, recorder.metas[s.key]) for s in found]
    return dataclasses.replace(t, skips=facts)


def _other_arguments(layer: nn.Module) -> list:
    """The parameters of ``layer.forward`` after its first (those a pipeline leaves unset)."""
    import inspect

    try:
        params = list(inspect.signature(layer.forward).parameters.values())
    except (TypeError, ValueError):
        return []
    return [p.name for p in params[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _run_layers(layers: dict[int, nn.Module], count: int, x, y, loss, on_meta: bool, bf16: bool = False) -> Trace:
    metas, flops, io, saved = [], [], [], []
    work = []  # each layer's weight-gradient work (plain Linears that ran, all): not a Linear whose weight F.linear takes
    from torch.utils.flop_counter import FlopCounterMode  # 0.2 s of imports (triton): only where a model is traced

    lazydynamo.defer()  # its dispatch would import torch._dynamo (service/lazydynamo.py)

    h = x
    with torch.enable_grad(), (_same_dtypes(bf16) if on_meta else contextlib.nullcontext()):  # what autograd saves is what a microbatch in flight holds
        for i in range(count):
            inp = h = h.detach().requires_grad_(h.is_floating_point())
            keep = _Saved(layers[i])
            rows: dict = {}
            count_rows(layers[i], rows)
            try:
                with FlopCounterMode(display=False) as fc, torch.autograd.graph.saved_tensors_hooks(keep.pack, _same):
                    h = layers[i](h.clone() if h.requires_grad and changes_input_in_place(layers[i]) else h)
            except Exception as e:
                hint = ""
                if "leaf Variable that requires grad is being used in an in-place operation" in str(e):
                    hint = ("; the layer writes into its input in place, which a pipeline stage's input (a tensor "
                            "that needs its gradient) does not allow: compute it out of place (x = x + y, not "
                            "x += y; F.relu(x), not F.relu(x, inplace=True)); torch's own inplace=True modules are "
                            "handled")
                elif isinstance(e, TypeError) and "required positional argument" in str(e):
                    hint = ("; a pipeline calls each layer with one tensor, the output of the layer before: wrap a "
                            "layer that takes more (nn.MultiheadAttention takes query, key and value) in a module "
                            "whose forward(x) calls it and returns one tensor")
                elif (wanted := _float_dtypes(layers[i])) and inp.is_floating_point() and inp.dtype not in wanted:
                    want = next(iter(wanted))
                    cast = ("X.float(), or torch.as_tensor(a, dtype=torch.float32) of a numpy array, float64 by "
                            "default" if want == torch.float32 else f"X.to(torch.{dtype_name(want)})")
                    hint = (f"; the layer's parameters are {'/'.join(dtype_name(d) for d in wanted)} and its input "
                            f"{dtype_name(inp.dtype)}: " + (
                                f"have the data builder return {dtype_name(want)} inputs ({cast}), or build the "
                                "model in the data's dtype" if i == 0 else
                                "cast the input in this layer's forward or the output of the layer before"))
                elif more := _other_arguments(layers[i]):
                    hint = (f"; a pipeline calls each layer with one tensor (the output of the layer before) and "
                            f"nothing for its other arguments ({', '.join(more)}): if it needs them (a transformers "
                            "block needs position_embeddings or an attention mask), wrap it in a module whose "
                            "forward(x) makes them and calls it")
                given = "" if i == 0 else f", given an input of shape {tuple(inp.shape)} {inp.dtype},"
                raise (_Certain if isinstance(e, _MixedDtypes) else _UserError)(
                                 f"the model fails on a microbatch of the data (x of shape {tuple(x.shape)}, dtype "
                                 f"{x.dtype}): layer {i} ({type(layers[i]).__name__}){given} raised "
                                 f"{type(e).__name__}: {e}{hint}") from None
            finally:
                forget_rows(layers[i])
            if not isinstance(h, torch.Tensor):
                raise _UserError(f"layer {i} ({type(layers[i]).__name__}) returned {type(h).__name__}, not a tensor; "
                                 "a pipeline passes one tensor from layer to layer (return only the hidden states)")
            metas.append((tuple(h.shape), h.dtype))
            work.append(weighed(layers[i], rows, plain_linear))
            flops.append(int(fc.get_total_flops()))
            io.append(_nbytes(inp) + _nbytes(h) + _param_bytes(layers[i]))
            saved.append(keep.bytes)
        try:
            value = loss(h.detach(), y)
        except Exception as e:
            raise _UserError(f"the loss fails on the model's output (shape {tuple(h.shape)}) and the targets "
                             f"(shape {tuple(y.shape)}): {type(e).__name__}: {e}") from None
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        raise _UserError("the loss must return a scalar tensor (the mean over the microbatch)")
    stateless = frozenset(i for i in range(count) if not layers[i].state_dict())
    norms = frozenset(i for i in range(count) if norms_of(layers[i]))
    state = [{k: tuple(v.shape) if isinstance(v, torch.Tensor) else None  # get_extra_state: any object
              for k, v in layers[i].state_dict().items()} for i in range(count)]
    return Trace(metas, flops, [_param_bytes(layers[i]) for i in range(count)], io, stateless, on_meta, saved,
                 norms=norms, grad_work=work, state=state)


def _same(t):
    return t


def _float_dtypes(layer: nn.Module) -> dict:
    """The dtypes of ``layer``'s floating parameters, in order (a dict used as an ordered set)."""
    return dict.fromkeys(q.dtype for q in layer.parameters() if q.is_floating_point())


_SPEED: dict[int, tuple[float, float]] = {}


def machine_speed(threads: int) -> tuple[float, float]:
    """(FLOP/s of a float32 matmul, bytes/s of a copy) with ``threads`` torch threads,
    measured once per process (a few milliseconds): the fastest of 8 tries, which other work on
    the machine slows least (the median made a balanced cut differ between two runs of one spec
    on a loaded machine: a user trial)."""
    if threads not in _SPEED:
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            a, src = torch.randn(384, 384), torch.randn(2**21)
            dst = torch.empty_like(src)
            mm, cp = [], []
            for _ in range(9):
                t0 = time.perf_counter()
                a @ a
                t1 = time.perf_counter()
                dst.copy_(src)
                mm.append(t1 - t0)
                cp.append(time.perf_counter() - t1)
            _SPEED[threads] = (2 * 384**3 / min(mm[1:]), 2 * src.numel() * 4 / min(cp[1:]))
        finally:
            torch.set_num_threads(old)
    return _SPEED[threads]


def backward_passes(param_bytes: list[int]) -> list[int]:
    """Forward-sized passes each layer's step makes, forward included: 3 (the forward, its input
    gradient, its weight gradient) where some earlier layer has parameters; the model's input
    needs no gradient, so the first layer with parameters computes only its weight gradient (2),
    and the layers before it have no backward at all (1).  Measured here on the peer bench's MLP
    (2026-12-04): the first of two stages spent 5.5 ms a microbatch in its backward of 4 blocks,
    the second 6.8 in its 4."""
    out, seen = [], False
    for b in param_bytes:
        out.append(3 if seen else 2 if b else 1)
        seen = seen or bool(b)
    return out


def estimate_seconds(t: Trace, threads: int) -> list[float]:
    """Each layer's forward + backward seconds for one microbatch, from its FLOPs and bytes at
    this machine's measured speed: each backward pass (input gradient, weight gradient) as
    long as the forward, where the layer makes it (``backward_passes``)."""
    flop_s, byte_s = machine_speed(threads)
    return [n * (f / flop_s + b / byte_s + LAYER_OVERHEAD_S)
            for n, f, b in zip(backward_passes(t.param_bytes), t.flops, t.io_bytes)]
