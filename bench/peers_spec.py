"""The one training problem every contestant of bench/peers.py runs, and how a step's
batch is cut, so relaytrain, torch.distributed.pipelining, Ray Train and the single
process see the same model, initial parameters, samples, microbatches and optimizer.

The model is relaytrain's built-in MLP 1024-1024x8-10 (nine ``nn.Sequential`` entries: eight
equal Linear(1024, 1024)+ReLU blocks and a Linear(1024, 10) head), the held-out comparison of
issue 19 (width 1024, 8 layers, microbatches of 32 rows at M = 8) among its sizes.  A pipeline
of p workers with v model chunks each cuts it into p x v chunks (virtual stages) with
:func:`chunk_sizes`, the same for every contestant: the eight blocks as evenly as they go, the
head (1/100 of a block's cost) with the last chunk -- what relaytrain's balanced partition makes
of these layers: for p = 2, v = 1 entries [0, 4) and [4, 9); for p x v = 4, [0, 2) [2, 4) [4, 6)
[6, 9).  Chunk k sits on worker k mod p ("loop" placement: 1F1B, interleaved 1F1B, ZB-H1), or,
for ZB-V, worker i holds chunks i and 2p-1-i ("v" placement).

A microbatch is ``mbs`` rows (16, 32 or 64; ``MBS`` = 64 is the default and what Ray Train's
replicas use): at 64 rows on one thread a 2-stage chunk's forward takes about 5-10 ms and its
backward twice that, and one activation is 256 KiB (a gloo hop is well under a millisecond, an
object-store hop a few ms): transport costs matter without dominating; at 16 rows they matter more.
"""
from __future__ import annotations

from service.spec import JobSpec, parse_spec

MBS = 64             # the default microbatch rows (Ray Train's replicas always use it)
MBS_ALL = (16, 32, 64)
WIDTH = 1024
LAYERS = 8           # hidden Linear+ReLU blocks; the head makes 9 entries
ENTRIES = LAYERS + 1
OUT = 10
SAMPLES = 4096       # B = 1024 at M = 16, mbs 64: four steps per epoch, reshuffled every epoch
CUT = 4              # p = 2, v = 1: stage 0 holds entries [0, CUT), stage 1 the rest
LR, MOMENTUM = 0.5, 0.9  # large enough that a wrong gradient shows in the loss within 3 steps
MODEL = {"kind": "mlp", "args": {"in_features": WIDTH, "hidden": WIDTH, "layers": LAYERS, "out_features": OUT}}
DATA = {"kind": "regression", "args": {"n": SAMPLES, "in_features": WIDTH, "out_features": OUT}}
DESCRIPTION = (f"MLP {WIDTH}-{WIDTH}x{LAYERS}-{OUT} (fp32), MSE on synthetic regression data, "
               f"SGD lr {LR} momentum {MOMENTUM}; pipelines cut into p x v chunks of equal blocks, "
               f"the head with the last")

# relaytrain's schedules: how many model chunks each worker holds, and where they sit
CHUNKS = {"gpipe": 1, "1f1b": 1, "zb_h1": 1, "interleaved_1f1b": 2, "zbv": 2}
PLACEMENT = {"zbv": "v"}  # the others: "loop"


def chunk_sizes(chunks: int) -> list[int]:
    """Entries per chunk (virtual stage), in model order: the LAYERS equal blocks as evenly as
    they go (the later chunks take the extra ones: with the head they are the cheapest) and the
    head with the last chunk."""
    if not 1 <= chunks <= LAYERS:
        raise ValueError(f"cannot cut {LAYERS} blocks into {chunks} chunks")
    base, extra = divmod(LAYERS, chunks)
    sizes = [base + (1 if i >= chunks - extra else 0) for i in range(chunks)]
    sizes[-1] += 1
    return sizes


def chunk_bounds(chunks: int) -> list[tuple[int, int]]:
    """[lo, hi) entries of each chunk."""
    out, lo = [], 0
    for n in chunk_sizes(chunks):
        out.append((lo, lo + n))
        lo += n
    return out


def owner(vs: int, workers: int, placement: str = "loop") -> int:
    """The worker (pipeline rank) that holds chunk ``vs``: loop, chunk k on k mod p; "v",
    worker i holds i and 2p-1-i (and 2p+i, 4p-1-i, ... past two chunks)."""
    k, i = divmod(vs, workers)
    return workers - 1 - i if placement == "v" and k % 2 else i


def chunks_of(rank: int, workers: int, per_worker: int, placement: str = "loop") -> list[int]:
    """The chunks of pipeline rank ``rank``, in model order."""
    return [vs for vs in range(workers * per_worker) if owner(vs, workers, placement) == rank]


def describe(pp: int, v: int) -> str:
    return " ".join(f"[{lo}, {hi})" for lo, hi in chunk_bounds(pp * v))


def spec(m: int, *, mbs: int = MBS, dp: int = 1, pp: int = 1, schedule: str = "1f1b",
         transport: str = "collective", steps: int = 1, name: str = "peers",
         partition: str | None = None, weight_group: int = 1) -> JobSpec:
    """The job for M microbatches of ``mbs`` samples per step (global batch M x mbs); with
    pp > 1 the chunks of :func:`chunk_sizes` (one list entry per virtual stage), or
    ``partition`` ("balanced", "uniform") when given; ``weight_group`` > 1: the split
    schedules' W's in groups of that many microbatches (parallelism.weight_group)."""
    v = CHUNKS.get(schedule, 1)
    par = {"dp": dp, "pp": pp, "schedule": schedule, "transport": transport,
           "partition": (partition or chunk_sizes(pp * v)) if pp > 1 else "uniform"}
    if v != 1:  # (left out otherwise: an engine without parallelism.stages_per_worker still reads the spec)
        par["stages_per_worker"] = v
    if weight_group != 1:  # (likewise)
        par["weight_group"] = weight_group
    return parse_spec({
        "name": name,
        "model": MODEL,
        "data": DATA,
        "loss": "mse",
        "optimizer": {"name": "sgd", "lr": LR, "momentum": MOMENTUM},
        "training": {"global_batch_size": mbs * m, "microbatch_size": mbs, "steps": steps, "seed": 0,
                     "shuffle": True},
        "parallelism": par,
        "resources": {"cpus_per_worker": 1},
        "checkpoint": {"every_steps": 0},
    })
