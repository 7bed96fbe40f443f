"""The training recipe's arithmetic, shared by the engine and the one-process reference
(tests/reference.py): the learning rate of a step and the clipping of a gradient norm."""
from __future__ import annotations

import math

from service.spec import JobSpec

EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def lr_at(spec: JobSpec, s: int) -> float:
    """The learning rate of step ``s`` (1-based: the step being computed).  W = warmup_steps,
    S = training.steps: lr x s / W while s <= W; then 'constant' keeps lr, 'linear' goes from
    lr at s = W to min_lr at s = S, 'cosine' is min_lr + (lr - min_lr)(1 + cos(pi (s-W)/(S-W)))/2."""
    o, S = spec.optimizer, spec.training.steps
    sched, lr = o.schedule, o.lr
    W = sched.warmup_steps
    if W and s <= W:
        return lr * s / W
    if sched.name == "constant" or S <= W:
        return lr
    frac = min(1.0, max(0.0, (s - W) / (S - W)))
    if sched.name == "linear":
        return lr + (sched.min_lr - lr) * frac
    return sched.min_lr + (lr - sched.min_lr) * 0.5 * (1.0 + math.cos(math.pi * frac))


def clip_coef(total_norm: float, max_norm: float) -> float:
    """The factor every gradient is scaled by: min(1, max_norm / (norm + 1e-6))."""
    return min(1.0, max_norm / (total_norm + EPS))
