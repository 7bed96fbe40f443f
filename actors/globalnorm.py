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

import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from actors.failures import talking_to_peers


class _Abort(BaseException):
    """Ends a waiting microbatch thread when the step is given up."""


class GlobalNorm(torch.autograd.Function):
    """y_j = (x_j - mean) / sqrt(var + eps) * weight + bias for every microbatch j, with the mean
    and biased variance over all of them (and over ``group``'s ranks); sums in float64."""

    @staticmethod
    def forward(ctx, weight, bias, eps, group, *xs):
        dims = [0, *range(2, xs[0].dim())]
        shape = [1, -1] + [1] * (xs[0].dim() - 2)
        c = xs[0].shape[1]
        sums = torch.zeros(2 * c + 1, dtype=torch.float64, device=xs[0].device)
        for x in xs:
            xd = x.double()
            sums[:c] += xd.sum(dims)
            sums[c:2 * c] += (xd * xd).sum(dims)
            sums[2 * c] += x.numel() // c
        if group is not None:
            with talking_to_peers("summing the BatchNorm statistics with the stage's replicas"):
                dist.all_reduce(sums, group=group)
        n = sums[2 * c]
        mean = sums[:c] / n
        var = (sums[c:2 * c] / n - mean * mean).clamp_min(0)
        invstd = (var + eps).rsqrt()
        ys = []
        for x in xs:
            xhat = ((x.double() - mean.view(shape)) * invstd.view(shape)).to(x.dtype)
            y = xhat
            if weight is not None:
                y = xhat * weight.view(shape).to(x.dtype) + bias.view(shape).to(x.dtype)
            ys.append(y)
        ctx.save_for_backward(weight, mean, invstd, *xs)
        ctx.meta = (dims, shape, c, n, group, bias is not None)
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys):
        weight, mean, invstd, *xs = ctx.saved_tensors
        dims, shape, c, n, group, has_bias = ctx.meta
        sums = torch.zeros(2 * c, dtype=torch.float64, device=xs[0].device)
        xhats = []
        for x, dy in zip(xs, dys):
            xhat = (x.double() - mean.view(shape)) * invstd.view(shape)
            xhats.append(xhat)
            if dy is not None:
                dd = dy.double()
                sums[:c] += dd.sum(dims)
                sums[c:] += (dd * xhat).sum(dims)
        local = sums.clone()  # the weight's and bias' gradients: this replica's share (the replicas' sum follows)
        if group is not None:
            with talking_to_peers("summing the BatchNorm gradients with the stage's replicas"):
                dist.all_reduce(sums, group=group)
        mean_dy, mean_dy_xhat = sums[:c] / n, sums[c:] / n
        scale = invstd if weight is None else invstd * weight.double()
        dxs = []
        for x, dy, xhat in zip(xs, dys, xhats):
            if dy is None:
                dy = torch.zeros_like(x)
            dx = (dy.double() - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
            dxs.append(dx.to(x.dtype))
        dw = local[c:].to(weight.dtype) if weight is not None else None
        db = local[:c].to(weight.dtype) if has_bias else None
        return (dw, db, None, None, *dxs)


class Lockstep:
    """Runs ``m`` microbatch forwards as threads, one at a time, meeting at each BatchNorm.

    The hub (the worker's step thread) starts each microbatch with :meth:`start` when its input
    is there; a microbatch runs until it calls :meth:`meet` (a BatchNorm) or ends.  When every
    started microbatch waits at the same BatchNorm, :meth:`go_on` computes them together and
    lets each go on in turn.  ``finished(j, output)`` is called on the hub as microbatch j ends."""

    def __init__(self, joint: Callable[[object, list], list], finished: Callable[[int, object], None]):
        self.joint, self.finished = joint, finished
        self.cv = threading.Condition()
        self.turn: Optional[int] = None     # the microbatch that runs (None: the hub)
        self.waiting: dict = {}             # j -> (what it meets, its input)
        self.results: dict = {}             # j -> what it gets back
        self.done: dict = {}                # j -> ("ok", output) | ("error", exception) | ("aborted", None)
        self.order: list = []
        self.threads: list = []
        self.busy: dict = {}                # j -> seconds it ran
        self.aborting = False

    def start(self, j: int, fn: Callable[[], object]) -> None:
        def body():
            with self.cv:
                while self.turn != j:
                    self.cv.wait()
            try:
                out = ("ok", fn())
            except _Abort:
                out = ("aborted", None)
            except BaseException as e:  # the user's model (or a lost peer): raised on the hub
                out = ("error", e)
            with self.cv:
                self.done[j] = out
                self.turn = None
                self.cv.notify_all()

        t = threading.Thread(target=body, name=f"relaytrain-microbatch-{j}", daemon=True)
        self.order.append(j)
        self.threads.append(t)
        t.start()
        self._let_run(j)

    def meet(self, what, x):
        """In a microbatch's thread: wait until every microbatch meets ``what``; its output."""
        rng = torch.random.get_rng_state()
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        with self.cv:
            j = self.turn
            self.waiting[j] = (what, x)
            self.turn = None
            self.cv.notify_all()
            while self.turn != j:
                self.cv.wait()
            if self.aborting:
                raise _Abort()
            y = self.results.pop(j)
        torch.random.set_rng_state(rng)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        return y

    def _let_run(self, j: int) -> None:
        t0 = time.time()
        with self.cv:
            self.turn = j
            self.cv.notify_all()
            while self.turn is not None:
                self.cv.wait()
        self.busy[j] = self.busy.get(j, 0.0) + time.time() - t0
        self._raise_errors()
        if j in self.done:
            self.finished(j, self.done[j][1])

    def _raise_errors(self) -> None:
        bad = next((out for out in self.done.values() if out[0] == "error"), None)
        if bad is not None:
            self.abort()
            raise bad[1]

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
        with self.cv:
            self.aborting = True
        for j in list(self.waiting):
            with self.cv:
                self.turn = j
                self.cv.notify_all()
                while self.turn is not None and j not in self.done:
                    self.cv.wait()
            self.waiting.pop(j, None)
