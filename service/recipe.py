"""The training recipe's arithmetic, shared by the engine and the one-process reference
(tests/reference.py): the learning rate of a step and the clipping of a gradient norm; and
the check that the hardware can run ``training.precision: bf16``."""
from __future__ import annotations

import math

from service.spec import JobSpec, SpecError

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


def needs_global_norm(spec: JobSpec) -> bool:
    """Do the workers need the whole model's gradient norm before their update (to clip it,
    or to skip a non-finite step everywhere)?  Then they sum it among themselves each step."""
    t = spec.training
    return t.grad_clip_norm is not None or t.skip_nonfinite


def step_update(spec: JobSpec, total_norm) -> tuple[float, bool]:
    """(the factor every gradient is scaled by, whether the step is skipped) for a step whose
    whole-model gradient norm is ``total_norm`` (None: not summed, nothing to decide)."""
    t = spec.training
    if total_norm is None:
        return 1.0, False
    if not math.isfinite(total_norm):
        return 1.0, t.skip_nonfinite  # without skip_nonfinite the scheduler fails the job
    return (clip_coef(total_norm, t.grad_clip_norm) if t.grad_clip_norm is not None else 1.0), False


def check_precision(spec: JobSpec, gpus: bool) -> None:
    """Raise :class:`SpecError` when ``training.precision`` is bf16 and this process's hardware
    cannot run it: on GPUs (``gpus``) a device without native bf16
    (``torch.cuda.is_bf16_supported``: compute capability 8.0 on, or ROCm), on CPUs a bf16
    autocast matmul that raises.  Call it where the workers run (their kind of node)."""
    if spec.training.precision != "bf16":
        return
    import torch  # here: lr_at and clip_coef stay importable without torch

    fix = "set training.precision: fp32"
    if gpus:
        if not torch.cuda.is_available():
            raise SpecError("training.precision is bf16 on GPUs, but this process sees no CUDA device; "
                            f"{fix}, or check that the workers get a GPU (resources.gpus_per_worker)")
        try:
            ok = torch.cuda.is_bf16_supported(including_emulation=False)
        except TypeError:  # a torch before the argument
            ok = torch.cuda.is_bf16_supported()
        if not ok:
            name = torch.cuda.get_device_name()
            raise SpecError(f"training.precision is bf16 but the GPU ({name}) has no native bf16 (it needs compute "
                            f"capability 8.0 or newer, such as A100, L4, H100); {fix}, or run on such GPUs")
        return
    try:
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            out = torch.ones(4, 4) @ torch.ones(4, 4)
        if out.dtype != torch.bfloat16 or not bool((out.float() == 4).all()):
            raise RuntimeError(f"a 4x4 matmul gave {out.dtype} {out.flatten()[:4].tolist()}, not bf16 4.0")
    except Exception as e:
        raise SpecError(f"training.precision is bf16 but this CPU cannot run bf16 autocast "
                        f"({type(e).__name__}: {e}); {fix}") from None
