"""Keep torch from importing torch._dynamo where nothing compiles.

torch wraps some of its functions in ``torch._disable_dynamo`` (an optimizer's
``add_param_group``, ``zero_grad``, ``state_dict``; the functional Adam; DTensor's dispatch; ...).
The wrapper imports ``torch._dynamo`` on its first call, and so does every optimizer's ``step``
(``_use_grad_for_differentiable``, for two ``graph_break()`` calls): 1.3-2.3 s of CPU here, in
every process that builds and steps an optimizer, so in the scheduler's pre-flight and in each
worker of every job.

Until something imports ``torch._dynamo``, nothing in the process can be compiling: such a
function behaves as the plain function, and ``graph_break()`` does nothing. :func:`defer`, for
the functions already loaded:
- gives each ``_disable_dynamo`` function a stand-in that calls the plain function while
  ``torch._dynamo`` is not imported and, from the first call after it is (a ``torch.compile`` in
  user code, activation checkpointing), puts torch's own disabled function in its place, what
  the wrapper would have built;
- has each optimizer's ``step`` wrapper call ``graph_break()`` only once ``torch._dynamo`` is
  imported, as before.
It is called where a process starts (StageWorker.__init__), before the pre-flight trace and
before each optimizer is built; each call walks only the torch modules imported since the last.
Functions of torch modules imported after the last call, and any torch whose wrappers are not
the ones this was written against (torch 2.13), keep torch's behaviour.
"""
from __future__ import annotations

import sys
import threading
from types import FunctionType

_lock = threading.Lock()
_scanned: set = set()  # the torch modules already walked
_seen: set = set()  # ids of the classes and functions already walked (they live as long as their modules)


def _until_dynamo(fn, recursive: bool):
    def call(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        import torch._dynamo

        real = torch._dynamo.disable(fn, recursive, wrapping=False)
        fn.__dynamo_disable = real  # what torch._compile's wrapper caches on its first call
        return real(*args, **kwargs)

    return call


def _use_grad_of(func):
    # torch/optim/optimizer.py's, its graph breaks only under dynamo; this code runs as torch's
    # function, with that module's globals, so it imports what it uses
    def _use_grad(*args, **kwargs):
        import sys

        import torch

        self = args[0]
        prev_grad = torch.is_grad_enabled()
        compiling = "torch._dynamo" in sys.modules
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            if compiling:
                torch._dynamo.graph_break()
            ret = func(*args, **kwargs)
        finally:
            if compiling:
                torch._dynamo.graph_break()
            torch.set_grad_enabled(prev_grad)
        return ret

    return _use_grad


def _torch_functions():
    """The functions of torch's loaded modules: module-level, of their classes (methods, static
    and class methods, properties), and the functions one or two closures deep (a decorator's
    wrapper holds the wrapped function).  Walked, not found with gc.get_objects(): Ray's
    workers gc.freeze() their imports, which hides them from it.  Modules walked before are
    skipped: a second call costs little, and covers the modules imported since."""

    def inside(v, depth):
        if id(v) in _seen:
            return
        if issubclass(type(v), type):  # (not isinstance: some objects warn when asked for __class__)
            _seen.add(id(v))
            if str(getattr(v, "__module__", "")).startswith("torch"):
                for a in list(vars(v).values()):
                    if isinstance(a, (staticmethod, classmethod)):
                        a = a.__func__
                    if isinstance(a, property):
                        yield from (g for x in (a.fget, a.fset, a.fdel) if x is not None for g in inside(x, depth))
                    else:
                        yield from inside(a, depth)
        elif type(v) is FunctionType:
            _seen.add(id(v))
            yield v
            for c in (v.__closure__ or ()) if depth < 2 else ():
                try:
                    x = c.cell_contents
                except ValueError:  # an empty cell
                    continue
                yield from inside(x, depth + 1)

    for name, mod in list(sys.modules.items()):
        if mod is not None and (name == "torch" or name.startswith("torch.")) and name not in _scanned:
            _scanned.add(name)
            for v in list(vars(mod).values()):
                yield from inside(v, 0)


def defer() -> int:
    """How many wrapped functions of the torch modules loaded since the last call got a stand-in
    (0 when torch._dynamo is already imported, or torch's wrappers are not the ones this was
    written against).  Call it again after importing more of torch (a few ms)."""
    with _lock:
        import torch

        if "torch._dynamo" in sys.modules:
            return 0
        from torch.optim import optimizer

        probe = torch._disable_dynamo(lambda: None)
        code = probe.__code__
        step = optimizer._use_grad_for_differentiable(lambda self: None)
        ours = _use_grad_of(None).__code__
        if code.co_freevars != ("fn", "recursive") or step.__code__.co_freevars != ours.co_freevars:
            return 0  # another torch: leave its wrappers alone
        n = 0
        for f in _torch_functions():
            if f.__code__ is code:
                fn, recursive = (c.cell_contents for c in f.__closure__)
                if getattr(fn, "__dynamo_disable", None) is None:
                    fn.__dynamo_disable = _until_dynamo(fn, recursive)
                    n += 1
            elif f.__code__ is step.__code__:
                f.__code__ = ours
                n += 1
        return n
