"""How activations and their gradients move between neighbouring stages.

``ObjectStoreTransport``: the sender calls the receiver's ``deliver`` method with the
tensor (Ray moves it) and the receiver's step thread waits on an inbox.  A tensor of up to
``INLINE_MAX`` bytes goes as a few arguments below Ray's inline limit, so Ray sends it
inside the call instead of through the object store's shared memory, and the call has no
return object to track: both cost less CPU and latency per hop (measured on this machine:
256 KiB, 3.7 ms of CPU and 4.0 ms of latency per hop before, 2.9 ms and 2.4 ms after).
``CollectiveTransport``: torch.distributed send/recv (gloo on CPU, NCCL on GPU), with
buffers shaped from the stage boundary's known activation shape.  It knows the step's
receives in advance (``begin_step``) and keeps the next ``RECV_AHEAD`` of them posted: gloo
moves a message only once its receive is posted, and the sending process, by then busy
computing, would otherwise have to be scheduled again to push it (measured: 1-5 ms gaps
before a stage's forwards).
Both never wait forever: a receive that times out raises with what it waited for.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from actors.failures import waiting_on_peers

KINDS = {"act": 0, "grad": 1, "tie": 2, "eval": 3, "skip": 4, "skipgrad": 5, "evalskip": 6}
# "tie": a tied parameter's gradient, between any two stages; "eval": an evaluation's activation
# (forward only); "skip", "skipgrad", "evalskip": a skip tensor between the chunks that stash and
# pop it, its gradient, an evaluation's (actors/portals.py)
RECV_AHEAD = 2  # receives kept posted ahead of the one being waited for
INLINE_PART = 96 * 1024    # Ray inlines call arguments up to 100 KiB serialized (max_direct_call_object_size)
INLINE_MAX = 384 * 1024    # above this, one object-store object costs less than many inline parts (measured)


class Inbox:
    """Tensors delivered by other actors, keyed by (step, kind, microbatch), for one
    configuration generation (late deliveries from an older shape are dropped)."""

    def __init__(self):
        self._items: dict[tuple, Any] = {}
        self._cond = threading.Condition()
        self.closed: Optional[str] = None
        self.gen = 0

    def reset(self, gen: int) -> None:
        with self._cond:
            self._items.clear()
            self.closed = None
            self.gen = gen

    def put(self, gen: int, key: tuple, value: Any) -> None:
        with self._cond:
            if gen != self.gen:
                return
            self._items[key] = value
            self._cond.notify_all()

    def take(self, key: tuple, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._items:
                if self.closed:
                    raise RuntimeError(self.closed)
                left = deadline - time.monotonic()
                if left <= 0:
                    what = (f"the gradient of tied parameter group {key[2] >> 16}" if key[1] == "tie"
                            else f"{key[1]} of microbatch {key[2]}")
                    raise TimeoutError(f"waited {timeout:.0f} s for {what} at step {key[0] + 1}; "
                                       "the other stage did not send it")
                self._cond.wait(left)
            return self._items.pop(key)

    def drop_before(self, step: int) -> None:
        with self._cond:
            for k in [k for k in self._items if k[0] < step]:
                del self._items[k]

    def close(self, reason: str) -> None:
        with self._cond:
            self.closed = reason
            self._cond.notify_all()


def to_wire(t: torch.Tensor) -> tuple:
    """(shape, parts): the tensor's bytes as one array, or as slices Ray sends inline."""
    a = t.detach().cpu().numpy()
    if a.nbytes <= INLINE_PART or a.nbytes > INLINE_MAX:
        return a.shape, (a,)
    flat, n = a.reshape(-1), INLINE_PART // a.itemsize
    return a.shape, tuple(flat[i:i + n] for i in range(0, flat.size, n))


def from_wire(wire: tuple, device: torch.device) -> torch.Tensor:
    shape, parts = wire
    # Ray hands out read-only memory: copy (or join), so in-place layers cannot touch it
    a = np.array(parts[0], copy=True) if len(parts) == 1 else np.concatenate(parts)
    return torch.from_numpy(a.reshape(shape)).to(device)


class ObjectStoreTransport:
    name = "object_store"
    fixed_shapes = False  # each tensor travels with its shape

    def __init__(self, inbox: Inbox, row: tuple, stage: int, device: torch.device, timeout: float, gen: int = 0):
        """``row``: the actors of every stage of this worker's replica; ``stage``: its own."""
        self.inbox, self.row, self.stage = inbox, row, stage
        self.device, self.timeout, self.gen = device, timeout, gen

    def send_to(self, stage: int, step: int, kind: str, key: int, tensor: torch.Tensor) -> None:
        shape, parts = to_wire(tensor)
        self.row[stage].deliver.options(num_returns=0).remote(self.gen, step, kind, key, shape, *parts)

    def recv_from(self, stage: int, step: int, kind: str, key: int, like: tuple) -> torch.Tensor:
        return from_wire(self.inbox.take((step, kind, key), self.timeout), self.device)

    def begin_step(self, step: int, expected: list) -> None:
        pass

    def drop(self) -> None:
        pass

    def finish_step(self) -> None:
        pass


class CollectiveTransport:
    name = "collective"
    fixed_shapes = True   # receive buffers are shaped from the stage boundary's activation

    def __init__(self, row_ranks: list[int], stage: int, device: torch.device):
        """``row_ranks``: the process-group rank of every stage of this worker's replica."""
        self.ranks, self.device = row_ranks, device
        self._pending: list = []
        self._expected: collections.deque = collections.deque()  # (kind, key, (shape, dtype), stage) not posted
        self._posted: collections.deque = collections.deque()    # (kind, key, work, buffer), in order

    @staticmethod
    def _tag(kind: str, key: int) -> int:
        return len(KINDS) * key + KINDS[kind]

    def send_to(self, stage: int, step: int, kind: str, key: int, tensor: torch.Tensor) -> None:
        t = tensor.detach().contiguous()
        self._pending.append((dist.isend(t, dst=self.ranks[stage], tag=self._tag(kind, key)), t))

    def begin_step(self, step: int, expected: list) -> None:
        """The step's receives, in the order ``recv_from`` will ask for them:
        (kind, key, (shape, dtype), from stage)."""
        self._expected = collections.deque(expected)
        self._posted.clear()
        self._post()

    def _post(self) -> None:
        while self._expected and len(self._posted) < RECV_AHEAD:
            kind, key, (shape, dtype), stage = self._expected.popleft()
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            self._posted.append((kind, key, dist.irecv(buf, src=self.ranks[stage], tag=self._tag(kind, key)), buf))

    def recv_from(self, stage: int, step: int, kind: str, key: int, like: tuple) -> torch.Tensor:
        if self._posted and self._posted[0][:2] == (kind, key):
            _, _, work, buf = self._posted.popleft()
            self._post()  # the next one flows in while this stage computes
            with waiting_on_peers():
                work.wait()
            return buf
        shape, dtype = like  # a receive nobody announced (a tied parameter's gradient)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        with waiting_on_peers():
            dist.recv(buf, src=self.ranks[stage], tag=self._tag(kind, key))
        return buf

    def finish_step(self) -> None:
        with waiting_on_peers():
            for work, _ in self._pending:
                work.wait()
        self._pending.clear()

    def drop(self) -> None:
        """Forget pending sends and posted receives (they hold a group being left)."""
        self._pending.clear()
        self._posted.clear()
        self._expected.clear()
