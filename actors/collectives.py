"""A worker's process group, and how to break it fast when a peer is lost.

gloo has no working abort: ``destroy_process_group()``, ``ProcessGroup.abort()`` and
``shutdown()`` leave its TCP connections open, so a peer blocked in recv or all_reduce on
this process stays blocked until the group's timeout.  Measured with torch 2.13: a peer is
released only when the sockets close.  So this module records the TCP sockets gloo opens
(in ``init_process_group`` and ``new_group``) and, on abort, shuts them down: every pending
gloo op here and on every peer connected to us raises "Connection closed by peer" within
about 10 ms, and the failure spreads through the group.  Safe from any thread.  NCCL has a
real abort, used when the backend is NCCL.
"""
from __future__ import annotations

import gc
import os
import socket
from datetime import timedelta
from typing import Optional

import torch.distributed as dist


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


class Group:
    """The default process group of one shape, plus its stage subgroups."""

    def __init__(self):
        self.backend: Optional[str] = None
        self._fds: dict[int, str] = {}
        self._exclude: set[int] = set()

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

    def leave(self) -> None:
        """Abort and destroy the group; never hangs."""
        self.abort()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        self.backend = None
        gc.collect()  # frees ProcessGroupGloo objects nobody references any more
