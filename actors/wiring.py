"""A worker's connections in its current shape: the process group (gloo, NCCL on GPUs),
the transport of activations and their gradients, and the sum of the stage's gradients over
its replicas.  Rebuilt on every reshape (``connect``), torn down first (``leave``)."""
from __future__ import annotations

import os
import socket
from typing import Optional

from actors.collectives import GradBuckets, Group, SharedMemorySum
from actors.stage import Cell, GradientReducer, Transport
from actors.tensorpar import LocalGradSum, TensorParallel
from actors.transport import CollectiveTransport, Inbox, ObjectStoreTransport

# Gradient buckets of the data-parallel all-reduce (see actors/collectives.GradBuckets).
BUCKET_BYTES = int(float(os.environ.get("RELAYTRAIN_BUCKET_MB", "8")) * 2**20)
# Launch buckets during the last backward (as DDP) or after it.  Overlap pays where the
# all-reduce has its own engine (NCCL on a GPU); a CPU worker's compute threads already use
# its cores, and gloo's reduction then only competes with backward for them (measured on 2
# cores: slower, see README "Against the peers").  RELAYTRAIN_OVERLAP_ALLREDUCE=1/0 forces it.
_OVERLAP = os.environ.get("RELAYTRAIN_OVERLAP_ALLREDUCE")
# Replicas of a stage on one node sum through shared memory (actors/collectives.SharedMemorySum);
# RELAYTRAIN_SHM_ALLREDUCE=0 makes them use gloo like replicas on different nodes.
_SHM = os.environ.get("RELAYTRAIN_SHM_ALLREDUCE", "1") == "1"


def rendezvous_address() -> tuple[str, int]:
    """This node's address and a free port: where the shape's process group meets."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


class Wiring:
    def __init__(self):
        self.group = Group()
        self.transport: Optional[Transport] = None
        self.buckets: Optional[GradientReducer] = None  # the stage's gradient sum (dp > 1)
        self.stage_group = None
        self.tp: Optional[TensorParallel] = None  # the stage's tensor-parallel group (parallelism.tp > 1)

    def connect(self, c: Cell, stage, device, transport: str, row: tuple, rdzv: Optional[tuple], world: int, *,
                inbox: Inbox, timeout: float, node: str, tag: str, shard=None) -> None:
        """Join the shape's process group (when ``rdzv`` names one) and set up the transport;
        ``row``: the actors of every stage of this worker's replica.  With a tensor-parallel
        stage, ``shard(tp)`` builds the stage's layers split once the TP group exists (and
        returns the stage)."""
        self.leave()
        if rdzv is not None:
            backend = "nccl" if device.type == "cuda" else "gloo"
            self.group.init(backend, rdzv[0], rdzv[1], c.dp_rank * c.width + c.index, world, timeout)
            if c.tp > 1:  # every group first (they wait for every rank), then the layers are built split
                self.tp = self._tp_group(c, device)
                if c.dp > 1:
                    self._tp_stage_groups(c)
                stage = shard(self.tp)
                if c.dp > 1:
                    self.buckets = LocalGradSum(list(stage.parameters()), self.stage_group, BUCKET_BYTES)
            elif c.dp > 1 or c.replicas:
                self.buckets = self._stage_reducer(c, stage, device, node, tag)
        if transport == "collective":
            self.transport = CollectiveTransport([c.dp_rank * c.width + s for s in range(c.width)], c.index, device)
        else:
            self.transport = ObjectStoreTransport(inbox, row, c.index, device, timeout, c.gen)

    def _stage_reducer(self, c: Cell, stage, device, node: str, tag: str) -> Optional[GradientReducer]:
        """The sum of the stage's gradients over its workers (data-parallel replicas, and the
        replicas of a replicated stage): shared memory on one node, else gloo / NCCL buckets.
        Every rank creates every stage's group, in the same order."""
        reps = c.replicas or (1,) * c.pp
        for s in range(c.pp):
            first = sum(reps[:s])
            g = self.group.new_group([r * c.width + first + j for r in range(c.dp) for j in range(reps[s])])
            if s == c.pp_rank:
                self.stage_group = g
        n = c.dp * reps[c.pp_rank]
        if n == 1:
            return None
        params = list(stage.parameters())
        index = c.dp_rank * reps[c.pp_rank] + c.rep
        shm = SharedMemorySum.create(params, self.stage_group, index, n, node, tag) if _SHM else None
        if shm is not None:
            return shm
        overlap = device.type == "cuda" if _OVERLAP is None else _OVERLAP == "1"
        overlap = overlap and len(c.chunks) == 1 and not c.split  # several chunks or W actions: summed after the step
        return GradBuckets(params, self.stage_group, BUCKET_BYTES, overlap)

    def _tp_stage_groups(self, c: Cell) -> None:
        """A TP rank sums its gradients with the same rank of its stage's other data-parallel
        replicas: one group per (stage, TP rank)."""
        for s in range(c.pp):
            for j in range(c.tp):
                g = self.group.new_group([r * c.width + s * c.tp + j for r in range(c.dp)])
                if (s, j) == (c.pp_rank, c.tp_rank):
                    self.stage_group = g

    def _tp_group(self, c: Cell, device) -> TensorParallel:
        """The TP group of this worker's stage (and a second one of the same ranks for gathering
        whole state beside a running step).  Every rank creates every group, in the same order."""
        mine = gather = None
        for r in range(c.dp):
            for s in range(c.pp):
                ranks = [r * c.width + s * c.tp + j for j in range(c.tp)]
                g, g2 = self.group.new_group(ranks), self.group.new_group(ranks)
                if (r, s) == (c.dp_rank, c.pp_rank):
                    mine, gather = g, g2
        return TensorParallel(mine, gather, c.tp_rank, c.tp, device.type)

    def leave(self) -> None:
        self.stage_group = None
        self.tp = None
        if self.buckets is not None:
            self.buckets.close()
            self.buckets = None
        if self.transport is not None:
            self.transport.drop()  # pending sends and posted receives hold the old group
        self.group.leave()
