"""Checkpoints written off the step's path (``checkpoint.every_steps``).

At a step boundary each stage's worker of replica 0 starts its part (``StageWorker.save_part``:
the only call the step waits for, a few ms); in a thread of its own it copies its committed state
to memory while the next step computes (that step's optimizer update waits for the copy), then
writes the part straight to the storage while training goes on.  The scheduler writes the
manifest once every part is written (service/checkpoint.py: a checkpoint without its manifest
is not one), then deletes the checkpoints beyond ``checkpoint.keep``.

One checkpoint is written at a time, so a worker holds at most one extra copy of its state: a
checkpoint due while the previous one is still being written is taken at the first step
boundary after that one ends (the event says which step asked for it).  A checkpoint that
could not be written is a ``checkpoint_failed`` event and training goes on; after
``checkpoint.max_failures`` failures in a row, failing for ``checkpoint.fail_after_s`` since the
first of them, the job fails, saying why (a job writing a checkpoint every few seconds failed
after 37 s of storage outage, its restarts unused: a user trial).  A checkpoint still being
written after ``checkpoint.slow_after_s`` says so once (``checkpoint_slow``): a storage that hangs
rather than refuses said nothing for minutes.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import ray

from actors.failures import JobFailure, lost_actor
from service import checkpoint, logtext


def _reason(e: BaseException) -> str:
    """The first line that says something, of a worker's (or Ray's) error."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException) and not isinstance(e, JobFailure):
        e = cause
    text = logtext.first_line(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class CheckpointWriter:
    def __init__(self, group, root: Optional[str], spec, record, meta: dict, timeout: float):
        self.group, self.root, self.record, self.meta, self.timeout = group, root, record, meta, timeout
        c = spec.checkpoint
        self.every, self.keep, self.max_failures, self.last = c.every_steps, c.keep, c.max_failures, spec.training.steps
        self.fail_after_s, self.slow_after_s = c.fail_after_s, c.slow_after_s
        self.failures = 0                   # in a row
        self.failing_since: Optional[float] = None  # the first failure in a row (``clock``)
        self.clock = time.monotonic
        self.owed: Optional[int] = None     # the step that asked for a checkpoint while one was being written
        self.flight: Optional[dict] = None  # the checkpoint being written: step, folder, refs, times
        self.known: Optional[set[int]] = None  # steps with a folder on the storage (read once)
        self.written: Optional[tuple[int, str]] = None  # the newest complete checkpoint: step, path
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="relaytrain-checkpoint")  # manifests
        if self.root and self.every:  # read while the first steps run (and the connection is made)
            self._scan = self._finisher.submit(checkpoint.step_folders, self.root)

    def due(self, committed: int) -> bool:
        return checkpoint_due(self.root, self.every, self.last, committed)

    def after_commit(self, committed: int) -> None:
        """Finish the checkpoint being written if it is; start step ``committed``'s if one is due
        (or owed) and none is being written."""
        self.poll(block=committed == self.last)
        asked = committed if self.due(committed) else self.owed
        if asked is None:
            return
        if self.flight is not None:
            self.owed = asked
            return
        self.owed = None
        self._start(committed, asked)
        if committed == self.last:
            self.poll(block=True)

    def now(self, committed: int) -> str:
        """Write the checkpoint of ``committed`` steps (unless it is written already) and wait
        for it; its path.  A failure raises ``JobFailure``."""
        if not self.root:
            raise JobFailure("a checkpoint was asked for but the job writes none (set checkpoint.every_steps)")
        self.poll(block=True)
        if self.written is None or self.written[0] != committed:
            self._start(committed, committed)
            self.poll(block=True)
        if self.written is None or self.written[0] != committed:
            raise JobFailure(f"the checkpoint of step {committed} could not be written to {self.root}")
        return self.written[1]

    def _start(self, step: int, asked: int) -> None:
        g = self.group
        t0 = self.clock()
        try:
            if self.known is None:  # step folders already there (a restart's): cleaned before reuse
                self.known = self._scan.result(timeout=self.timeout)
            folder = checkpoint.begin(self.root, step, clean=step in self.known)
            self.known.add(step)
            # replica 0 of each stage (every rank of its TP group: they gather, rank 0 writes)
            first = [g.workers[(0, g.shape.slot(s, j))] for s in range(g.shape.pp) for j in range(g.shape.tp)]
            started = [w.save_part.remote(str(folder), step) for w in first]
            ray.get(started, timeout=self.timeout)
            refs = [w.part_written.remote(step) for w in first]
        except Exception as e:
            self._failed(step, e)
            return
        self.flight = {"step": step, "asked": asked, "folder": folder, "refs": refs, "t0": t0,
                       "pause_s": self.clock() - t0}

    def poll(self, block: bool = False, lost: Optional[str] = None) -> None:
        """Once every part of the checkpoint being written is, write its manifest (and delete
        the checkpoints beyond ``keep``) in a thread of this scheduler; with ``block``, wait
        for all of it.  ``lost``: why the job stops or restarts meanwhile (a failure then is
        said as such, not counted against checkpoint.max_failures)."""
        f = self.flight
        if f is None:
            return
        if "done" not in f:
            ready, _ = ray.wait(f["refs"], num_returns=len(f["refs"]), timeout=self.timeout if block else 0)
            if len(ready) < len(f["refs"]) and not block:
                self._say_if_slow(f)
                return
            f["done"] = self._finisher.submit(self._complete, f, len(ready) == len(f["refs"]))
        if not (block or f["done"].done()):
            self._say_if_slow(f)  # the manifest's write may hang too
            return
        self.flight = None
        error = f["done"].exception()
        if error is not None and lost:
            self.record.event("checkpoint_failed", f"checkpoint of step {f['step']} not completed: {lost}",
                              step=f["step"], reason=_reason(error))
        elif error is not None:
            self._failed(f["step"], error)
        else:
            self.failures, self.failing_since = 0, None

    def _say_if_slow(self, f: dict) -> None:
        took = self.clock() - f["t0"]
        if took < self.slow_after_s or f.get("slow_said"):
            return
        f["slow_said"] = True
        newest = f"step {self.written[0]}" if self.written else "none yet"
        self.record.event("checkpoint_slow", f"checkpoint of step {f['step']} is still being written after {took:.0f} s "
                                             f"(checkpoint.slow_after_s is {self.slow_after_s:g}): the storage at "
                                             f"{self.root} is slow or does not answer; training goes on, and the "
                                             f"newest complete checkpoint is {newest}",
                          step=f["step"], seconds=round(took, 1))

    def _complete(self, f: dict, written: bool) -> None:
        """Check the parts, write the manifest last, and say so (a ``checkpoint`` event)."""
        if not written:
            raise JobFailure(f"its parts were not written within {self.timeout:.0f} s")
        parts = [p for p in ray.get(f["refs"]) if p is not None]
        path = checkpoint.finish(self.root, f["folder"], f["step"], parts, dict(self.meta), keep=self.keep)
        step, upload_s = f["step"], time.monotonic() - f["t0"]
        self.written = (step, str(path))
        size = sum(p.get("bytes", 0) for p in parts)
        copy_s = max(p.get("copy_s", 0.0) for p in parts)
        late = f" (due at step {f['asked']}; the previous one was still being written)" if f["asked"] != step else ""
        self.record.event("checkpoint", f"checkpoint of step {step} at {path}: {size / 2**20:.1f} MiB, copied in "
                                        f"{copy_s:.2f} s and written in {upload_s:.2f} s beside training; the step "
                                        f"paused {f['pause_s'] * 1e3:.0f} ms to start it{late}",
                          step=step, path=str(path), bytes=size, write_s=round(upload_s, 3),
                          pause_s=round(f["pause_s"], 4), copy_s=round(copy_s, 4), asked_at=f["asked"])

    def _failed(self, step: int, e: BaseException) -> None:
        if lost_actor(e):  # not the storage: the step's own failure follows and says so (a restart or reshape)
            self.record.event("checkpoint_failed", f"checkpoint of step {step} not completed: a worker was lost "
                              f"while it was written ({_reason(e)})", step=step, reason=_reason(e))
            return
        now = self.clock()
        self.failures += 1
        self.failing_since = self.failing_since if self.failing_since is not None else now
        failing_s = now - self.failing_since
        reason = _reason(e)
        stops = self.failures >= self.max_failures and failing_s >= self.fail_after_s
        goes_on = "the job stops: checkpoint.max_failures is reached" if stops else "training goes on"
        over = f" over {failing_s:.0f} s" if self.failures > 1 else ""
        limit = f" and {self.fail_after_s:g} s" if self.fail_after_s else ""
        self.record.event("checkpoint_failed", f"checkpoint of step {step} failed ({self.failures} in a row{over}, "
                                               f"the job fails at {self.max_failures}{limit}): {reason}; {goes_on}",
                          step=step, failures=self.failures, failing_s=round(failing_s, 1), reason=reason)
        if stops:
            raise JobFailure(f"{self.failures} checkpoints in a row could not be written to {self.root} over "
                             f"{failing_s:.0f} s (checkpoint.max_failures is {self.max_failures}, "
                             f"checkpoint.fail_after_s {self.fail_after_s:g}); the last: {reason}")


def checkpoint_due(root, every: int, last: int, committed: int) -> bool:
    """Is a checkpoint due after ``committed`` steps (every ``every`` steps and after the last)?"""
    return bool(root and every and (committed % every == 0 or committed == last))
