"""Why a job or a step stopped: the sentence a person reads first, and whether the cause
was user code, a broken connection to a peer, or a worker that is gone."""
from __future__ import annotations

import re
from typing import Optional

import ray


class JobFailure(RuntimeError):
    """A job stopped; ``str()`` is the one sentence a person reads first."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


def worker_failure(name: str, step: Optional[int], err: Exception, phase: str = "while starting") -> JobFailure:
    cause = getattr(err, "cause", None) or err
    where = f" at step {step + 1}" if step is not None else f" {phase}"
    if isinstance(err, ray.exceptions.RayTaskError):
        what = f"raised {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        if isinstance(cause, ray.exceptions.RayTaskError) or type(cause).__name__.startswith("RayTaskError"):
            what = str(err).strip().splitlines()[-1]
    elif isinstance(err, ray.exceptions.ActorDiedError) and "__init__" in str(err):
        lines = [ln for ln in str(err).splitlines() if ln.strip()]
        what = "failed to start: " + (lines[-1].strip() if lines else "its constructor raised")
    elif isinstance(err, ray.exceptions.RayActorError):
        what = "died (its process or node was lost)"
    else:
        what = f"raised {type(err).__name__}: {err}"
    return JobFailure(f"worker {name}{where} {what}", detail=traceback_text(name, err))


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def traceback_text(name: str, err: Exception) -> str:
    """The remote traceback as a person reads it, without terminal colours."""
    lines = _ANSI.sub("", str(err)).strip().splitlines()
    if lines and lines[0].startswith("ray::"):
        return f"Traceback from worker {name} ({lines[0]}), most recent call last:\n" + "\n".join(lines[1:])
    return f"Traceback from worker {name}:\n" + "\n".join(lines)


class WorkerLost(Exception):
    """Workers of a step were lost (their actor or node died); the job can reshape.
    ``lost``: workers whose calls failed with a Ray actor error (surely gone); ``silent``:
    workers that had not answered a ping yet (maybe gone, maybe slow: checked again)."""

    def __init__(self, failure: "JobFailure", lost: set, first_error_time: float, silent: set = frozenset()):
        super().__init__(str(failure))
        self.failure, self.lost, self.time, self.silent = failure, lost, first_error_time, set(silent)


_COMM_ERRORS = ("DistBackendError", "StageAborted", "TimeoutError")
_COMM_WORDS = ("Connection closed", "Connection reset", "peer", "Gloo", "gloo", "was discarded", "Broken pipe")


def is_comm_error(err: Exception) -> bool:
    """A step that failed because a peer went away (not because user code raised)."""
    cause = getattr(err, "cause", None) or err
    text = str(err)
    return type(cause).__name__ in _COMM_ERRORS or any(w in text for w in _COMM_WORDS)


def lost_actor(err: Exception) -> bool:
    return isinstance(err, ray.exceptions.RayActorError) and not isinstance(err, ray.exceptions.RayTaskError)
