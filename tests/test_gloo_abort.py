"""A step parked in a gloo wait that the abort cannot end is given up on (actors/failures.py,
actors/heap.py ``StepThread.give_up_if_parked``, actors/worker.py ``abort``).

The abort shuts the group's sockets, and gloo then fails every pending operation but one: a send
that had begun to write to a receiver that stopped reading (a stalled or loaded process) sits in
its pair's transmit queue, which gloo's ``Pair::signalException`` passes by.  Its wait ends only at
the group's timeout.  Seen in the suite as an elastic job's survivor still "in the aborted step"
10 s after a peer was lost (tests/test_elastic.py, the stalled workers and [k] in the README)."""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from actors import failures
from actors.failures import StageAborted, StepAbandoned, waiting_on_peers
from actors.heap import StepThread

N = 16 << 20  # floats: 64 MiB, far more than the sockets' buffers hold


# ---------------------------------------------------------------- the step thread, without gloo

def test_a_task_parked_in_a_wait_on_peers_is_given_up_on_and_leaves_quietly():
    """The caller hears ``why`` once the task has been parked ``parked_s``; the tasks queued
    behind it and later ones run on a new thread, in order; when the old wait ends, the old
    thread raises out of it and touches nothing (its caller's future keeps ``why``)."""
    release, parked_in = threading.Event(), []
    ran_after: list = []

    def parked():
        parked_in.append(threading.get_ident())
        with waiting_on_peers():
            release.wait(30)
        ran_after.append("the old task went on")  # never: its wait's end raises StepAbandoned
        return "old"

    steps = StepThread(1)
    first = steps.submit(parked)
    queued = steps.submit(lambda: threading.current_thread().ident)
    while steps.parked_since() is None:  # the thread's first task imports torch first
        time.sleep(0.01)
    [old] = parked_in
    aborted = time.monotonic()
    assert not steps.give_up_if_parked(aborted, parked_s=0.3, watch_s=0.1, why=StageAborted("x"))  # watched too short
    given_up = steps.give_up_if_parked(aborted, parked_s=0.3, watch_s=5.0, why=StageAborted("given up"))
    assert given_up and 0.3 <= time.monotonic() - aborted < 1.5
    with pytest.raises(StageAborted, match="given up"):
        first.result(timeout=1)
    assert queued.result(timeout=5) != old  # ran on the new thread
    assert steps.run(lambda: 7) == 7
    release.set()  # the old wait ends: the old thread leaves without touching the future
    time.sleep(0.3)
    assert ran_after == [] and str(first.exception()) == "given up"
    assert old not in {t.ident for t in threading.enumerate()}
    assert not failures.abandoned(old)  # forgotten as it ended: a later thread may get its id


def test_a_task_that_computes_or_ends_is_not_given_up_on():
    """Only a task parked in a wait on its peers is given up on: one computing is left to reach
    its next wait (the abort fails it there), and one that ends is answered as it ended."""
    steps = StepThread(1)
    steps.run(lambda: None)  # started (its first task imports torch)
    busy = steps.submit(lambda: (time.sleep(1.0), "computed")[1])  # not in a wait on peers
    time.sleep(0.1)
    assert not steps.give_up_if_parked(time.monotonic(), parked_s=0.2, watch_s=3.0, why=StageAborted("x"))
    assert busy.result() == "computed"

    def short():
        with waiting_on_peers():
            time.sleep(0.2)
        return "done"

    quick = steps.submit(short)
    time.sleep(0.05)
    assert not steps.give_up_if_parked(time.monotonic(), parked_s=1.0, watch_s=3.0, why=StageAborted("x"))
    assert quick.result() == "done"


def test_waits_nest_and_an_abandoned_thread_raises_when_the_outer_one_ends():
    got = []

    def nested():
        try:
            with waiting_on_peers():
                with waiting_on_peers():
                    time.sleep(0.05)
                got.append(failures.waiting_since(threading.get_ident()) is not None)  # still in the outer
                failures.abandon(threading.get_ident())
        except StepAbandoned:
            got.append("abandoned")
        got.append(failures.waiting_since(threading.get_ident()))
        failures.forget(threading.get_ident())

    t = threading.Thread(target=nested)
    t.start()
    t.join()
    assert got == [True, "abandoned", None]


# ---------------------------------------------------------------- with gloo: the wait the abort cannot end

def _receiver(port: int, ready) -> None:
    import torch

    from actors.collectives import Group
    from actors.transport import CollectiveTransport

    g = Group()
    g.init("gloo", "127.0.0.1", port, 1, 2, 60)
    tr = CollectiveTransport([0, 1], 1, torch.device("cpu"))
    tr.begin_step(0, [("act", 0, ((N,), torch.float32), 0)])  # posted: the sender begins to write
    ready.set()
    time.sleep(120)  # stopped by the test (SIGSTOP), then killed


def _sender(port: int, go, out) -> None:
    import torch

    from actors.collectives import Group
    from actors.transport import CollectiveTransport

    g = Group()
    g.init("gloo", "127.0.0.1", port, 0, 2, 8)  # the group's timeout: what ends the wait otherwise
    go.wait(60)
    steps = StepThread(1)
    tr = CollectiveTransport([0, 1], 0, torch.device("cpu"))

    def step():
        tr.send_to(1, 0, "act", 0, torch.ones(N))
        tr.finish_step()  # the send's wait: the receiver stopped reading mid-write
        return "sent"

    fut = steps.submit(step)
    time.sleep(0.5)
    aborted = time.monotonic()
    g.abort()  # what a worker's abort does first: the group's sockets shut
    time.sleep(1.0)
    res = {"ended_by_the_abort": fut.done()}
    res["given_up"] = steps.give_up_if_parked(aborted, parked_s=1.5, watch_s=20.0,
                                              why=StageAborted("given up"), first=g.strand)
    try:
        fut.result(timeout=10)
        res["error"] = None
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
    res["answered_s"] = time.monotonic() - aborted
    res["step_threads"] = sum(t.name == "relaytrain-step" for t in threading.enumerate())
    res["next"] = steps.run(lambda: 42)
    t = time.monotonic()
    g.leave()
    res["leave_s"] = time.monotonic() - t
    time.sleep(max(0.0, aborted + 9.0 - time.monotonic()))  # past the group's timeout: the old wait ended
    res["step_threads_later"] = sum(t.name == "relaytrain-step" for t in threading.enumerate())
    out.put(res)


def test_a_send_to_a_receiver_that_stopped_reading_outlives_the_abort_and_is_given_up_on():
    """Two processes on gloo: the receiver posts its receive of 64 MiB and stops (SIGSTOP); the
    sender's step sends and waits.  The abort (sockets shut) does not end that wait; 1.5 s later
    the step is given up on: its caller hears so at once, the next task runs on a new thread,
    and leaving the group does not hang.  At the group's timeout the old thread leaves."""
    from tests.s3server import free_port

    ctx = multiprocessing.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    port = free_port()
    recv = ctx.Process(target=_receiver, args=(port, ready), daemon=True)
    send = ctx.Process(target=_sender, args=(port, go, out), daemon=True)
    recv.start()
    send.start()
    try:
        assert ready.wait(90), "the receiver did not start"
        os.kill(recv.pid, signal.SIGSTOP)
        go.set()
        res = out.get(timeout=90)
    finally:
        for p in (recv, send):
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
    assert res["ended_by_the_abort"] is False, res  # gloo's behaviour this guards against (torch 2.13)
    assert res["given_up"] and res["error"] == "StageAborted: given up", res
    assert 1.5 <= res["answered_s"] < 4.0, res
    assert res["step_threads"] == 2 and res["next"] == 42, res  # the old one still parked beside the new
    assert res["leave_s"] < 5.0, res
    assert res["step_threads_later"] == 1, res
