"""A worker's process group, and how to break it fast when a peer is lost.

gloo has no working abort: ``destroy_process_group()``, ``ProcessGroup.abort()`` and
``shutdown()`` leave its TCP connections open, so a peer blocked in recv or all_reduce on
this process stays blocked until the group's timeout.  Measured with torch 2.13: a peer is
released only when the sockets close.  So this module records the TCP sockets gloo opens
(in ``init_process_group`` and ``new_group``) and, on abort, shuts them down: every pending
gloo op here and on every peer connected to us raises "Connection closed by peer" within
about 10 ms, and the failure spreads through the group.  Safe from any thread.  NCCL has a
real abort, used when the backend is NCCL.

It also holds the two ways a stage's replicas sum their gradients: ``SharedMemorySum`` when
they all live on one node (CPU), ``GradBuckets`` (gloo or NCCL, in buckets) otherwise.
"""
from __future__ import annotations

import contextlib
import gc
import os
import re
import socket
import sys
import threading
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from actors.failures import talking_to_peers, waiting_on_peers


def _sockets() -> dict[int, str]:
    out = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:  # not Linux: abort falls back to the group's timeout
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out[int(fd)] = target
    return out


def _ray_ports() -> set[int]:
    """Ports of this node's Ray services, never to be touched."""
    try:
        import ray

        node = ray._private.worker.global_worker.node
        ports = {node.node_manager_port, node.metrics_export_port, int(node.gcs_address.rsplit(":", 1)[1])}
        return {p for p in ports if p}
    except Exception:
        return set()


# process groups left while a step thread given up on still waited in them (Group.strand): kept
# for the process's life, a few sockets and threads each, never destroyed under that wait
_KEPT: list = []
# how long leaving such a group may take before the worker goes on without it
LEAVE_S = 10.0


def _bounded(fn, seconds: float) -> None:
    """``fn()`` on a helper thread, waited for at most ``seconds`` (it may block in gloo)."""
    t = threading.Thread(target=fn, daemon=True, name="relaytrain-leave")
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise RuntimeError(f"leaving the process group took over {seconds:.0f} s")


class Group:
    """The default process group of one shape, plus its stage subgroups."""

    def __init__(self):
        self.backend: Optional[str] = None
        self._fds: dict[int, str] = {}
        self._exclude: set[int] = set()
        self._stranded = False

    def _track(self, before: dict[int, str]) -> None:
        for fd, ino in _sockets().items():
            if before.get(fd) == ino:
                continue
            try:
                s = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                    peer, local = s.getpeername(), s.getsockname()  # a listener raises here
                    if peer[1] not in self._exclude and local[1] not in self._exclude:
                        self._fds[fd] = ino
            except OSError:
                pass
            finally:
                s.close()

    def init(self, backend: str, host: str, port: int, rank: int, world: int, timeout_s: float) -> None:
        self.backend = backend
        self._exclude = {port} | _ray_ports()  # the rendezvous store and Ray's own connections
        before = _sockets()
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", world_size=world, rank=rank,
                                timeout=timedelta(seconds=timeout_s))
        if backend == "gloo":
            self._track(before)

    def new_group(self, ranks: list[int]):
        before = _sockets()
        g = dist.new_group(ranks)  # collective: every rank calls it, in the same order
        if self.backend == "gloo":
            self._track(before)
        return g

    def abort(self) -> None:
        """Make every pending and later op of this group, here and on its peers, fail now."""
        if self.backend == "nccl":
            try:
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group()
            except Exception:
                pass
        for fd, ino in list(self._fds.items()):
            try:
                if os.readlink(f"/proc/self/fd/{fd}") == ino:  # the fd was not reused meanwhile
                    s = socket.socket(fileno=os.dup(fd))
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    finally:
                        s.close()
            except OSError:
                pass
        self._fds.clear()

    def strand(self) -> None:
        """A step thread was given up on while it waited in this group (actors/heap.py
        ``StepThread.abandon``): when the group is left, its process groups are kept, not
        destroyed, since destroying a gloo group joins its threads, and one of them may be in the
        wait that gloo ends only at the group's timeout."""
        self._stranded = True

    def leave(self) -> None:
        """Abort and destroy the group; never hangs."""
        self.abort()
        if dist.is_initialized():
            if self._stranded:
                try:
                    _KEPT.extend(dist.distributed_c10d._world.pg_map)
                except Exception:
                    pass
            try:
                _bounded(dist.destroy_process_group, LEAVE_S) if self._stranded else dist.destroy_process_group()
            except Exception as e:
                if self._stranded:
                    print(f"relaytrain: {e}", file=sys.stderr, flush=True)
        self.backend = None
        self._stranded = False
        # frees the ProcessGroupGloo objects nobody references any more (their sockets and
        # threads); what survives is frozen, so the next collection skips it: a full one over
        # torch's and the model's objects takes 0.2-0.5 s, on every reshape's critical path
        gc.collect()
        gc.freeze()


def grad_view(flat, p):
    """``p``'s gradient inside ``flat`` (a slice of ``p.numel()`` elements), laid out as ``p``
    is: a ``channels_last`` weight gets a ``channels_last`` gradient.  torch's fused optimizers
    (relaytrain's default) step a weight and its gradient element by element in memory order,
    so a gradient in another layout than its weight's updated the wrong elements (measured:
    fused SGD 0.35 off a step)."""
    if p.is_contiguous():
        return flat.view_as(p)
    need = 1
    for d in sorted(range(p.dim()), key=p.stride):
        if p.size(d) != 1 and p.stride(d) != need:  # not dense (overlapping or with gaps): keep torch's order
            return flat.view_as(p)
        need *= p.size(d)
    return flat.as_strided(p.size(), p.stride())


def got_gradient(p) -> None:
    """Note that ``p`` got a gradient this step (from autograd, through the hooks the sums
    below put on every parameter, or from a weight-gradient product: actors/deferred.py)."""
    p.relaytrain_got_grad = True


class UsedOnly:
    """What the gradient sums share: a parameter that no replica used this step ends it with no
    ``.grad``, as in one process (its optimizer then skips it: no weight decay, no moments).
    The buckets give every parameter a ``.grad`` view from the step's start, so use is noted
    apart (``got_gradient``) and summed over the replicas with the gradients."""

    def _note_uses(self) -> list:
        return [p.register_post_accumulate_grad_hook(got_gradient) for p in self.params]

    def _forget_uses(self) -> None:
        for p in self.params:
            p.relaytrain_got_grad = False

    def _drop_unused(self) -> None:
        """Collective: the parameters that no replica used lose their ``.grad`` on every replica
        (one all-reduce of a flag per parameter, a few hundred bytes)."""
        import torch

        unused = torch.tensor([float(not p.relaytrain_got_grad) for p in self.params], device=self.params[0].device)
        with waiting_on_peers():
            dist.all_reduce(unused, op=dist.ReduceOp.SUM, group=self.group)
        everywhere = float(dist.get_world_size(self.group))
        for p, n in zip(self.params, unused.tolist()):
            if n == everywhere:
                p.grad = None


class GradBuckets(UsedOnly):
    """The data-parallel gradient all-reduce (SUM) of one stage, in buckets whose flat
    buffers the gradients accumulate into directly (DDP's ``gradient_as_bucket_view``): no
    copy into or out of the all-reduce.

    The stage's parameters are cut into buckets of at most ``bucket_bytes``, last layer
    first (the order in which backward finishes their gradients).  ``attach`` (at the start
    of a step) zeroes the buffers and points each ``.grad`` into its bucket, so every
    backward of the step accumulates there.  With ``overlap``, while the step's last
    backward runs (``arm``), a hook on each parameter counts its gradient in, and a bucket
    whose gradients are all final is all-reduced asynchronously while backward goes on, as
    DDP does; buckets are launched in index order, so every replica issues the same
    collectives in the same order.  ``finish`` launches what is left and waits.  The sum of
    two replicas is the same in any bucketing; with more, the reduction order may differ
    from one flat all-reduce by float rounding.
    """

    def __init__(self, params: list, group, bucket_bytes: int, overlap: bool):
        import torch

        self.params, self.group, self.overlap = [p for p in params if p.requires_grad], group, overlap
        self.buckets: list[list] = []
        size = 0
        for p in reversed(self.params):  # backward produces the last layer's gradients first
            nbytes = p.numel() * p.element_size()
            if not self.buckets or (size + nbytes > bucket_bytes and self.buckets[-1]):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self.flats = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
                      for b in self.buckets]
        self.views = []
        for flat, b in zip(self.flats, self.buckets):
            off, views = 0, []
            for p in b:
                views.append(grad_view(flat[off:off + p.numel()], p))
                off += p.numel()
            self.views.append(views)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]
        self._armed = False
        self._reset()

    def _reset(self) -> None:
        self._missing = [len(b) for b in self.buckets]
        self._next = 0                      # the next bucket to launch
        self._works: list = []

    def attach(self) -> None:
        """Zero the buckets and make every ``.grad`` a view into its bucket."""
        self._reset()
        self._forget_uses()
        for flat, b, views in zip(self.flats, self.buckets, self.views):
            flat.zero_()
            for p, v in zip(b, views):
                p.grad = v

    def arm(self) -> None:
        """The next backward is the step's last: reduce buckets as they become final."""
        self._armed = self.overlap

    def _ready(self, p) -> None:
        got_gradient(p)
        if not self._armed:
            return
        i = self._bucket_of[id(p)]
        self._missing[i] -= 1
        with talking_to_peers("an all-reduce launched during backward"):  # inside autograd: the user's backward
            while self._next < len(self.buckets) and self._missing[self._next] == 0:
                self._launch(self._next)

    def _launch(self, i: int) -> None:
        for p, v in zip(self.buckets[i], self.views[i]):
            if p.grad is not None and p.grad.data_ptr() != v.data_ptr():  # replaced, not accumulated into
                v.copy_(p.grad)
            p.grad = v
        self._works.append(dist.all_reduce(self.flats[i], op=dist.ReduceOp.SUM, group=self.group, async_op=True))
        self._next = i + 1

    def finish(self) -> None:
        """Launch the buckets not launched yet and wait for all: every ``.grad`` holds the sum."""
        self._armed = False
        while self._next < len(self.buckets):
            self._launch(self._next)
        works, self._works = self._works, []
        with waiting_on_peers():
            for work in works:
                work.wait()
        self._drop_unused()

    def close(self) -> None:
        self._armed = False
        self._works = []
        for h in self._handles:
            h.remove()
        self._handles = []


class SharedMemorySum(UsedOnly):
    """The data-parallel gradient SUM of one stage whose replicas all live on this node,
    through shared memory instead of gloo's TCP loopback.

    A file in /dev/shm holds one slot per replica of the stage's flattened gradient.  Each
    replica maps the file and its ``.grad`` tensors are views into its own slot (``attach``
    zeroes it at the start of a step), so backward accumulates straight into shared memory:
    no copy in, no separate result.  ``finish`` waits at a barrier of the stage group (a gloo
    barrier, so an abort still wakes it); then replica r adds up chunk r of every slot, in
    replica order, and writes that sum into chunk r of every slot; a second barrier, and
    every slot holds the whole sum.  Each element is summed once, by one replica, in one
    order, so the replicas stay bit-identical, and with 2 replicas the sum equals gloo's
    exactly.  The other replicas' slots are read and written with pread/pwrite in 4 MiB
    pieces, never through the mapping, so a replica's resident memory holds its own
    gradients once and no more (before: the slots were double-buffered, every one mapped,
    and the sum went to a private buffer: 2 x dp + 1 copies).  The file is unlinked as soon
    as every replica has opened it: nothing is left behind by a crash.  ``create`` returns
    None (gloo is used) when the replicas are on different nodes, the parameters are not all
    CPU tensors of one dtype, or /dev/shm has no room.
    """

    overlap = False  # summed after the backward, through the file

    PIECE_BYTES = 4 << 20

    def __init__(self, params: list, group, rank: int, world: int, path: str):
        import torch

        self.params, self.group, self.rank, self.world = params, group, rank, world
        self._handles = self._note_uses()
        self.n = n = sum(p.numel() for p in params)
        dtype = params[0].dtype
        self.fd = os.open(path, os.O_RDWR)
        self.own = torch.from_file(path, shared=True, size=world * n, dtype=dtype)[rank * n:(rank + 1) * n]
        self.views, off = [], 0
        for p in params:
            self.views.append(grad_view(self.own[off:off + p.numel()], p))
            off += p.numel()
        self.esize = params[0].element_size()
        per = -(-n // world)
        self.chunk = (min(n, rank * per), min(n, (rank + 1) * per))  # the elements this replica sums
        piece = max(1, min(self.chunk[1] - self.chunk[0], self.PIECE_BYTES // self.esize))
        self.acc, self.buf = torch.empty(piece, dtype=dtype), torch.empty(piece, dtype=dtype)

    @classmethod
    def create(cls, params: list, group, rank: int, world: int, node: str, tag: str) -> Optional["SharedMemorySum"]:
        """Collective over the stage group (every replica calls it): the shared-memory sum,
        or None when it cannot be used."""
        import uuid

        params = [p for p in params if p.requires_grad]
        local = (bool(params) and all(p.device.type == "cpu" for p in params)
                 and len({p.dtype for p in params}) == 1)
        path = f"/dev/shm/relaytrain-{re.sub(r'[^A-Za-z0-9_.-]', '_', tag)}-{uuid.uuid4().hex[:8]}"
        seen: list = [None] * world
        dist.all_gather_object(seen, (node, local, path), group=group)
        if len({s[0] for s in seen}) != 1 or not all(s[1] for s in seen):
            return None
        path = seen[0][2]
        ok = True
        if rank == 0:
            nbytes = world * sum(p.numel() for p in params) * params[0].element_size()
            try:  # reserve the pages now: a full /dev/shm is an error here, not a SIGBUS later
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                finally:
                    os.close(fd)
            except OSError:
                ok = False
        agreed: list = [None] * world
        dist.all_gather_object(agreed, ok, group=group)
        try:
            return cls(params, group, rank, world, path) if agreed[0] else None
        finally:
            dist.barrier(group=group)  # everyone has mapped it (or given up): the name can go
            if rank == 0 and agreed[0]:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def attach(self) -> None:
        """This step's gradients accumulate in this replica's slot."""
        self._forget_uses()
        self.own.zero_()
        for p, v in zip(self.params, self.views):
            p.grad = v

    def arm(self) -> None:
        pass

    def finish(self) -> None:
        for p, v in zip(self.params, self.views):
            if p.grad is None:  # a parameter this step did not use: its zeros are in the slot
                p.grad = v
            elif p.grad.data_ptr() != v.data_ptr():  # replaced, not accumulated into
                v.copy_(p.grad)
                p.grad = v
        dist.barrier(group=self.group)  # every slot is complete
        lo, hi = self.chunk
        for start in range(lo, hi, self.acc.numel()):
            k = min(hi, start + self.acc.numel()) - start
            acc, buf = self.acc[:k], self.buf[:k]
            for r in range(self.world):  # in replica order
                part = self.own[start:start + k] if r == self.rank else self._read(r, start, buf)
                if r == 0:
                    acc.copy_(part)
                else:
                    acc.add_(part)
            for r in range(self.world):
                if r == self.rank:
                    self.own[start:start + k].copy_(acc)
                else:
                    self._write(r, start, acc)
        dist.barrier(group=self.group)  # every chunk is summed: each slot holds the whole sum
        self._drop_unused()

    def _offset(self, r: int, start: int) -> int:
        return (r * self.n + start) * self.esize

    def _read(self, r: int, start: int, buf):
        import torch

        got = os.preadv(self.fd, [buf.view(torch.uint8).numpy()], self._offset(r, start))
        if got != buf.numel() * self.esize:
            raise RuntimeError(f"shared-memory gradient sum: read {got} of {buf.numel() * self.esize} bytes")
        return buf

    def _write(self, r: int, start: int, acc) -> None:
        import torch

        data = acc.view(torch.uint8).numpy()
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], self._offset(r, start) + done)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.own = None  # the mapping goes with the last reference
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
