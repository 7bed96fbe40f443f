"""The paced MLP that bench/cluster.py and bench/checkpoint.py ship to their jobs.

``PACED`` is the source of a module ``paced`` (a bench writes it to a folder as ``paced.py``: the
jobs' package or ``spec_dir``; ``model.builder: "paced:build"``): the built-in MLP's layers (the
same names and state_dict as ``kind: mlp``), each block followed by a layer that sleeps like a
device computing, ``sleep_ms`` per sample in the forward and twice that in the backward, so that
a step's time falls with the replicas that share its batch on a machine where real compute would
not.  A Sleep layer has no state and returns its input: at ``sleep_ms=0`` the model is the plain
MLP (the one-process reference of bench/cluster.py).  This file is not named paced.py: the
scripts' folder bench/ is on the driver's and Ray workers' path, where it would shadow the jobs'
``paced``.
"""

PACED = '''"""relaytrain's benches' paced MLP: the built-in MLP with simulated device time (bench/paced_mlp.py)."""
import time

import torch
from torch import nn

from service.builtins import Linear


class _Pace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds * x.shape[0]
        if ctx.seconds:
            time.sleep(ctx.seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.seconds:
            time.sleep(2 * ctx.seconds)
        return grad, None


class Sleep(nn.Module):
    """Sleeps ``seconds_per_sample`` per sample in the forward, twice that in the backward."""

    def __init__(self, seconds_per_sample: float):
        super().__init__()
        self.seconds = float(seconds_per_sample)

    def forward(self, x):
        return _Pace.apply(x, self.seconds)


def build(in_features=64, hidden=128, layers=4, out_features=10, sleep_ms=1.0, dtype="float32"):
    dt = {"float32": torch.float32, "float64": torch.float64}[dtype]
    mods, width = [], in_features
    for _ in range(layers):
        mods.append(nn.Sequential(Linear(width, hidden, dtype=dt), nn.ReLU(), Sleep(sleep_ms / 1e3)))
        width = hidden
    mods.append(Linear(width, out_features, dtype=dt))
    return nn.Sequential(*mods)
'''
