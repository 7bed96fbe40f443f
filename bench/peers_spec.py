"""The one training problem every contestant of bench/peers.py runs, and how a step's
batch is cut, so relaytrain, torch.distributed.pipelining, Ray Train and the single
process see the same model, initial parameters, samples, microbatches and optimizer.

The model is relaytrain's built-in MLP 1024-1024x8-10 (nine ``nn.Sequential`` entries);
the two pipeline stages are entries [0, 4) and [4, 9) for every contestant.  A
microbatch is 64 samples: on one thread a stage's forward takes about 5-10 ms and its
backward twice that, and one activation is 256 KiB (a gloo hop is well under a
millisecond, an object-store hop a few ms): transport costs matter without dominating.
"""
from __future__ import annotations

from service.spec import JobSpec, parse_spec

MBS = 64
WIDTH = 1024
LAYERS = 8           # hidden Linear+ReLU blocks; the head makes 9 entries
OUT = 10
SAMPLES = 4096       # B = 1024 at M = 16: four steps per epoch, reshuffled every epoch
CUT = 4              # stage 0 holds entries [0, CUT), stage 1 the rest
LR, MOMENTUM = 0.5, 0.9  # large enough that a wrong gradient shows in the loss within 3 steps
MODEL = {"kind": "mlp", "args": {"in_features": WIDTH, "hidden": WIDTH, "layers": LAYERS, "out_features": OUT}}
DATA = {"kind": "regression", "args": {"n": SAMPLES, "in_features": WIDTH, "out_features": OUT}}
DESCRIPTION = (f"MLP {WIDTH}-{WIDTH}x{LAYERS}-{OUT} (fp32), MSE on synthetic regression data, "
               f"SGD lr {LR} momentum {MOMENTUM}, microbatch {MBS}, "
               f"stages = entries [0, {CUT}) and [{CUT}, {LAYERS + 1})")


def spec(m: int, *, dp: int = 1, pp: int = 1, schedule: str = "1f1b", transport: str = "collective",
         steps: int = 1, name: str = "peers") -> JobSpec:
    """The job for M microbatches of MBS samples per step (global batch M x MBS)."""
    return parse_spec({
        "name": name,
        "model": MODEL,
        "data": DATA,
        "loss": "mse",
        "optimizer": {"name": "sgd", "lr": LR, "momentum": MOMENTUM},
        "training": {"global_batch_size": MBS * m, "microbatch_size": MBS, "steps": steps, "seed": 0,
                     "shuffle": True},
        "parallelism": {"dp": dp, "pp": pp, "schedule": schedule, "transport": transport,
                        "partition": [CUT, LAYERS + 1 - CUT] if pp == 2 else "uniform"},
        "resources": {"cpus_per_worker": 1},
        "checkpoint": {"every_steps": 0},
    })
