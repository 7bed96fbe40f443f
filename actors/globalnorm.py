"""``training.batch_norm: global``: every sample normalised with the whole global batch's
statistics, forward and backward, as one process's BatchNorm on the whole batch.

A BatchNorm's output for one microbatch depends on every microbatch of the step, so a stage
whose layers hold a BatchNorm cannot finish any microbatch's forward before all of them have
reached that BatchNorm.  ``Lockstep`` runs a chunk's microbatch forwards as threads, strictly one
at a time: each runs its layers as it would alone (its own dropout seeds, its own skip tracker,
autocast) until it calls a BatchNorm, where it hands the turn back; when every microbatch waits
at the same BatchNorm, ``GlobalNorm`` normalises them all at once (with the stage's other
replicas' sums when dp > 1), and each goes on.  One autograd node per BatchNorm call holds every
microbatch, so the step's backward of the chunk, run once for all its microbatches, computes
the exact whole-batch gradient (the sums of the output gradient and of its product with the
normalised input, summed over replicas the same way).

The random generator's state is kept per thread across a wait, so a dropout after a BatchNorm
in the same layer draws what it would draw with the microbatch run alone.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from actors.failures import talking_to_peers, waiting_on_peers


# The threads microbatches run on, kept between steps: a thread's first torch work costs about
# 2 ms (its OpenMP team and thread-local state), which a new thread per microbatch and step paid.
_idle: list = []          # the idle threads' task queues
_pool_lock = threading.Lock()
_pool_size = 0


def _submit(task: Callable[[], None]) -> None:
    global _pool_size
    with _pool_lock:
        q = _idle.pop() if _idle else None
        if q is None:
            _pool_size += 1
    if q is None:
        q = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(q,), name=f"relaytrain-microbatch-{_pool_size}", daemon=True).start()
    q.put(task)


def _serve(q: "queue.SimpleQueue") -> None:
    while True:
        q.get()()
        with _pool_lock:
            _idle.append(q)


def pool() -> tuple[int, int]:
    """(threads kept, of which idle)."""
    with _pool_lock:
        return _pool_size, len(_idle)


class _Abort(BaseException):
    """Ends a waiting microbatch thread when the step is given up."""


def _work(x: torch.Tensor) -> torch.dtype:
    """The dtype the elementwise work runs in: float32 for bf16 / fp16 inputs (as PyTorch's
    BatchNorm computes them), else the input's."""
    return torch.promote_types(x.dtype, torch.float32)


def sums(xs: list) -> torch.Tensor:
    """Per channel, the sum and the sum of squares of every microbatch's input, then the count
    of values per channel (float64, 2C + 1)."""
    dims = [0, *range(2, xs[0].dim())]
    c = xs[0].shape[1]
    out = torch.zeros(2 * c + 1, dtype=torch.float64, device=xs[0].device)
    with torch.no_grad():
        for x in xs:
            x = x.to(_work(x))  # bf16 under autocast: squared in float32
            out[:c] += x.sum(dims, dtype=torch.float64)
            out[c:2 * c] += (x * x).sum(dims, dtype=torch.float64)
            out[2 * c] += x.numel() // c
    return out


class GlobalNorm(torch.autograd.Function):
    """y_j = (x_j - mean) / sqrt(var + eps) * weight + bias for every microbatch j, with the mean
    and biased variance over all of them (and over ``group``'s ranks).  The per-channel sums
    are float64; the elementwise work is one multiply-add per element in the input's dtype."""

    @staticmethod
    def forward(ctx, weight, bias, eps, group, sums, *xs):
        """``sums``: :func:`sums` of ``xs`` (this replica's)."""
        dims = [0, *range(2, xs[0].dim())]
        shape = [1, -1] + [1] * (xs[0].dim() - 2)
        c = xs[0].shape[1]
        sums = sums.clone()
        if group is not None:
            with talking_to_peers("summing the BatchNorm statistics with the stage's replicas"):
                with waiting_on_peers():
                    dist.all_reduce(sums, group=group)
        n = sums[2 * c]
        mean = sums[:c] / n
        invstd = (sums[c:2 * c] / n - mean * mean).clamp_min(0).add(eps).rsqrt()
        scale = invstd if weight is None else invstd * weight.double()
        shift = -mean * scale if bias is None else bias.double() - mean * scale
        ys = [torch.addcmul(shift.to(_work(x)).view(shape), x.to(_work(x)), scale.to(_work(x)).view(shape)).to(x.dtype)
              for x in xs]
        ctx.save_for_backward(weight, mean, invstd, *xs)
        ctx.meta = (dims, shape, c, n, group, bias is not None)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        weight, mean, invstd, *xs = ctx.saved_tensors
        dims, shape, c, n, group, has_bias = ctx.meta
        sums = torch.zeros(2 * c, dtype=torch.float64, device=xs[0].device)
        for x, dy in zip(xs, dys):
            if dy is not None:
                sums[:c] += dy.sum(dims, dtype=torch.float64)
                sums[c:] += (dy.to(_work(x)) * x.to(_work(x))).sum(dims, dtype=torch.float64)
        # sum of dy * xhat = (sum of dy * x - mean * sum of dy) * invstd
        local = torch.cat([sums[:c], (sums[c:] - mean * sums[:c]) * invstd])
        if group is not None:  # the weight's and bias' gradients stay this replica's share (summed after)
            local_share = local.clone()
            with talking_to_peers("summing the BatchNorm gradients with the stage's replicas"):
                with waiting_on_peers():
                    dist.all_reduce(local, group=group)
        else:
            local_share = local
        mean_dy, mean_dy_xhat = local[:c] / n, local[c:] / n
        k1 = invstd if weight is None else invstd * weight.double()   # dx = dy k1 + x k2 + k3
        k2 = -k1 * invstd * mean_dy_xhat
        k3 = -k1 * mean_dy - k2 * mean
        dxs = []
        for x, dy in zip(xs, dys):
            w = _work(x)
            dx = torch.addcmul(k3.to(w).view(shape), x.to(w), k2.to(w).view(shape))
            if dy is not None:
                dx.addcmul_(dy.to(w), k1.to(w).view(shape))
            dxs.append(dx.to(x.dtype))
        dw = local_share[c:].to(weight.dtype) if weight is not None else None
        db = local_share[:c].to(weight.dtype) if has_bias else None
        return (dw, db, None, None, None, *dxs)


class Lockstep:
    """Runs ``m`` microbatch forwards as threads, one at a time, meeting at each BatchNorm.

    The hub (the worker's step thread) starts each microbatch with :meth:`start` when its input
    is there; a microbatch runs until it calls :meth:`meet` (a BatchNorm) or ends, and hands the
    turn back.  When every started microbatch waits at the same BatchNorm, :meth:`go_on`
    computes them together and lets each go on in turn.  ``finished(j, output)`` is called on
    the hub as microbatch j ends.  Each hand-over wakes exactly one thread (a semaphore each)."""

    def __init__(self, joint: Callable[[object, list], list], finished: Callable[[int, object], None]):
        self.joint, self.finished = joint, finished
        self.go: dict = {}                  # j -> its semaphore: released when it may run
        self.back = threading.Semaphore(0)  # released when the running microbatch hands the turn back
        self.mine = threading.local()       # in a microbatch's thread: its j
        self.waiting: dict = {}             # j -> (what it meets, its input)
        self.results: dict = {}             # j -> what it gets back
        self.done: dict = {}                # j -> ("ok", output) | ("error", exception) | ("aborted", None)
        self.order: list = []
        self.busy: dict = {}                # j -> seconds it ran
        self.aborting = False

    def start(self, j: int, fn: Callable[[], object]) -> None:
        threads = torch.get_num_threads()
        go = self.go[j] = threading.Semaphore(0)

        def body():
            if torch.get_num_threads() != threads:  # a thread's own OpenMP team: the worker's size, not all cores
                torch.set_num_threads(threads)
            self.mine.j = j
            go.acquire()
            try:
                out = ("ok", fn())
            except _Abort:
                out = ("aborted", None)
            except BaseException as e:  # the user's model (or a lost peer): raised on the hub
                out = ("error", e)
            self.done[j] = out
            self.back.release()

        self.order.append(j)
        _submit(body)
        self._let_run(j)

    def meet(self, what, x):
        """In a microbatch's thread: wait until every microbatch meets ``what``; its output."""
        j = self.mine.j
        rng = torch.random.get_rng_state()
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.waiting[j] = (what, x)
        self.back.release()
        self.go[j].acquire()
        if self.aborting:
            raise _Abort()
        y = self.results.pop(j)
        torch.random.set_rng_state(rng)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        return y

    def _let_run(self, j: int) -> None:
        t0 = time.time()
        self.go[j].release()
        self.back.acquire()
        self.busy[j] = self.busy.get(j, 0.0) + time.time() - t0
        bad = next((out for out in self.done.values() if out[0] == "error"), None)
        if bad is not None:
            self.abort()
            raise bad[1]
        if j in self.done:
            self.finished(j, self.done[j][1])

    def go_on(self) -> None:
        """On the hub, once every microbatch is started: meet and go on until all have ended."""
        while len(self.done) < len(self.order):
            live = [j for j in self.order if j not in self.done]
            met = {self.waiting[j][0] for j in live if j in self.waiting}
            if len(live) < len(self.order) or len(met) != 1:
                ended = [j for j in self.order if j in self.done]
                self.abort()
                raise RuntimeError(
                    "training.batch_norm: global needs every microbatch to reach every BatchNorm, in the same "
                    f"order; here microbatches {ended} ended while others wait at {sorted(map(str, met))}"
                    if ended else
                    f"training.batch_norm: global needs the microbatches to reach the same BatchNorm in turn, but "
                    f"they wait at {sorted(map(str, met))} (the layers take different paths for different "
                    "microbatches): use batch_norm: deferred for such a model")
            what = met.pop()
            t0 = time.time()
            ys = self.joint(what, [self.waiting[j][1] for j in live])
            share = (time.time() - t0) / len(live)
            for j, y in zip(live, ys):
                del self.waiting[j]
                self.results[j] = y
                self.busy[j] = self.busy.get(j, 0.0) + share
                self._let_run(j)

    def abort(self) -> None:
        """Ends every waiting thread (the step is given up)."""
        self.aborting = True
        for j in list(self.waiting):
            del self.waiting[j]
            self.go[j].release()
            self.back.acquire()
