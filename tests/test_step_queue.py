"""How a worker takes its steps' calls (actors/worker.py ``StageWorker.run_step``), without Ray:
each call queues its step on the worker's one step thread right behind the step before,
whatever order the calls' threads get there in, and builds the step's microbatches on its
own thread while the step before runs, so the step thread goes from one step to the next
without waiting for a call's thread.  A failure to build a step's batch is that step's error."""
from __future__ import annotations

import random
import threading
import time

import pytest

from actors.heap import StepThread
from actors.worker import StageWorker


class Cell:
    first, last = True, False
    dp_rank, index, replicas = 0, 0, ()


def bare_worker(build_ms: float, step_ms: float, fail_at: int = -1):
    """A StageWorker with only what run_step uses: its step thread, the order marks, a batch
    builder that takes ``build_ms`` and a step that takes ``step_ms`` and records what ran."""
    w = object.__new__(StageWorker)
    w._turn, w._started, w.timeout = threading.Condition(), -1, 30.0
    w._compute, w.cell, w.job_id = StepThread(1), Cell(), "queue-test"
    w.ran, w.built_on = [], {}
    step_thread = {}

    def my_batch(step):
        w.built_on[step] = threading.get_ident()
        time.sleep(random.uniform(0, build_ms) / 1000)
        if step == fail_at:
            raise ValueError(f"no such sample in the batch of step {step + 1}")
        return [f"x{step}"], None

    def run_step(step, called, batch, split=None):
        step_thread.setdefault("id", threading.get_ident())
        xs, _ = batch.result()
        w.ran.append((step, xs[0], time.time()))
        time.sleep(step_ms / 1000)
        return {"step": step}

    w._my_batch, w._run_step, w.step_thread = my_batch, run_step, step_thread
    return w


def call_all(w, steps, jitter_ms: float) -> dict:
    """Every step's call, each from its own thread, started in a shuffled order."""
    got, errors = {}, {}

    def call(step):
        time.sleep(random.uniform(0, jitter_ms) / 1000)
        try:
            got[step] = w.run_step(step)
        except Exception as e:
            errors[step] = e

    order = list(steps)
    random.Random(7).shuffle(order)
    threads = [threading.Thread(target=call, args=(s,)) for s in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return {"got": got, "errors": errors}


def test_steps_run_in_order_whatever_order_their_calls_come_in():
    random.seed(3)
    w = bare_worker(build_ms=5, step_ms=2)
    out = call_all(w, range(12), jitter_ms=20)
    assert out["errors"] == {}
    assert [s for s, _, _ in w.ran] == list(range(12))
    assert [x for _, x, _ in w.ran] == [f"x{s}" for s in range(12)]  # each step got its own batch
    assert out["got"] == {s: {"step": s} for s in range(12)}
    # the batches were built on the calls' threads, none on the step thread
    assert w.step_thread["id"] not in set(w.built_on.values())


def test_a_step_called_early_starts_the_moment_the_step_before_ends():
    w = bare_worker(build_ms=0, step_ms=80)
    t = threading.Thread(target=w.run_step, args=(0,))
    t.start()
    time.sleep(0.02)
    w.run_step(1)  # came while step 0 ran: queued behind it
    t.join()
    (_, _, t0), (_, _, t1) = w.ran
    assert 0.08 <= t1 - t0 < 0.13  # step 1 began as step 0's 80 ms ended (a loaded machine may add a few ms)


def test_a_batch_that_cannot_be_built_fails_its_own_step_only():
    w = bare_worker(build_ms=1, step_ms=1, fail_at=2)
    out = call_all(w, range(4), jitter_ms=5)
    assert set(out["errors"]) == {2}
    assert "no such sample in the batch of step 3" in str(out["errors"][2])
    assert [s for s, _, _ in w.ran] == [0, 1, 3]


def test_a_call_whose_step_before_never_comes_says_so():
    w = bare_worker(build_ms=0, step_ms=0)
    w.timeout = 0.6
    with pytest.raises(RuntimeError, match="queue-test:w0.0 waited 1 s to run step 3: step 2 did not begin here"):
        w.run_step(2)
