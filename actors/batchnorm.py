"""BatchNorm across microbatches and replicas (``training.batch_norm``).

A BatchNorm layer in training mode normalises each sample with its batch's statistics and
moves its running statistics toward them.  A pipeline runs it on microbatches, on several
replicas: each piece is normalised by its own statistics (as gradient accumulation in one
process is) and, left alone, each replica would move its own running statistics once per
microbatch it saw, so the replicas' buffers would part.  Here every ``nn.BatchNorm1d/2d/3d``
(found by type; the user's code is unchanged, only the worker's own copies get an instance
``forward``) normalises with its microbatch's statistics but does not touch its buffers; it
records, per microbatch, the per-channel sum and sum of squares of its input (float64).  At the
step's end the records are summed over the stage's replicas, and the update is applied at the
step's commit (a discarded step moves no buffer):

- ``microbatch``: one update per microbatch, in the step's global microbatch order, each with
  that microbatch's mean and unbiased variance: what one process accumulating over the same
  microbatches in order does;
- ``deferred``: one update per step, with the whole global batch's mean and unbiased variance:
  what one process's BatchNorm does after one forward of the whole batch;
- ``global``: normalised with the whole global batch's statistics too (actors/globalnorm.py:
  the worker's microbatches meet at each BatchNorm), updated as ``deferred``.

So every replica holds the same buffers after every step, whatever the shape.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from actors.failures import waiting_on_peers


class RunningStats:
    """The running statistics of a worker's BatchNorm layers over one step."""

    def __init__(self, modules: list, mode: str, microbatches: int, group=None):
        self.modules, self.mode, self.total = modules, mode, microbatches
        self.group = group               # the stage's replicas (dp > 1): where sums are summed
        self.g = 0                       # the global microbatch whose forward (or recompute) runs
        self.lockstep = None             # global mode: the step's forwards meeting at each BatchNorm
        self.seen: dict = {}             # (module index, microbatch) -> (sum, sum of squares, count)
        for i, m in enumerate(modules):
            m.forward = _bound(self, i, m)

    def uninstall(self) -> None:
        for m in self.modules:
            m.__dict__.pop("forward", None)

    def begin(self) -> None:
        self.seen = {}

    def record(self, i: int, x: torch.Tensor) -> None:
        with torch.no_grad():
            dims = [0, *range(2, x.dim())]
            xd = x.detach().double()
            n = x.numel() // x.shape[1]
            self.seen[(i, self.g)] = (xd.sum(dims), (xd * xd).sum(dims), n)  # a recompute writes the same

    def together(self, i: int, xs: list) -> tuple:
        """Global mode: BatchNorm ``i`` on every microbatch of the step at once (and, with the
        stage's replicas, on theirs): its outputs, one per microbatch."""
        from actors import globalnorm

        m, c = self.modules[i], self.modules[i].num_features
        mine = globalnorm.sums(xs)
        self.seen[(i, self.g)] = (mine[:c], mine[c:2 * c], int(mine[2 * c]))
        return globalnorm.GlobalNorm.apply(m.weight, m.bias, m.eps, self.group, mine, *xs)

    def reduce(self) -> Optional[list]:
        """The step's updates, summed over the stage's workers (its ``group``; None: one worker):
        per module, the (mean, unbiased variance) of each update in order."""
        if not self.modules:
            return None
        rows = self.total if self.mode == "microbatch" else 1
        sizes = [2 * m.num_features + 1 for m in self.modules]
        flat = torch.zeros(rows, sum(sizes), dtype=torch.float64)
        off = 0
        for i, size in enumerate(sizes):
            c = self.modules[i].num_features
            for (j, g), (s1, s2, n) in self.seen.items():
                if j != i:
                    continue
                r = g if rows > 1 else 0
                flat[r, off:off + c] += s1.cpu()
                flat[r, off + c:off + 2 * c] += s2.cpu()
                flat[r, off + 2 * c] += n
            off += size
        if self.group is not None:
            with waiting_on_peers():
                dist.all_reduce(flat, group=self.group)
        updates, off = [], 0
        for m, size in zip(self.modules, sizes):
            c = m.num_features
            mine = []
            for r in range(rows):
                s1, s2, n = flat[r, off:off + c], flat[r, off + c:off + 2 * c], flat[r, off + 2 * c]
                if n == 0:  # a microbatch this layer did not see (no step runs it partly)
                    continue
                mean = s1 / n
                var = (s2 - s1 * mean) / max(float(n) - 1, 1.0)
                mine.append((mean, var))
            updates.append(mine)
            off += size
        return updates

    def apply(self, updates: Optional[list]) -> None:
        """Move the buffers by the step's updates, as nn.BatchNorm's forward does."""
        if not updates:
            return
        with torch.no_grad():
            for m, mine in zip(self.modules, updates):
                for mean, var in mine:
                    m.num_batches_tracked.add_(1)
                    f = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
                    m.running_mean.mul_(1 - f).add_(mean.to(m.running_mean), alpha=f)
                    m.running_var.mul_(1 - f).add_(var.to(m.running_var), alpha=f)


def _bound(stats: RunningStats, i: int, m: _BatchNorm):
    own = type(m).forward

    def forward(x):
        if not m.training:
            return own(m, x)
        m._check_input_dim(x)
        if stats.mode == "global":
            if stats.lockstep is None:
                raise RuntimeError(f"BatchNorm {type(m).__name__}({m.num_features}) ran outside the step's forwards, "
                                   "where training.batch_norm: global cannot see the whole batch")
            return stats.lockstep.meet(i, x)
        stats.record(i, x)
        return F.batch_norm(x, None, None, m.weight, m.bias, True, 0.0, m.eps)
    return forward
