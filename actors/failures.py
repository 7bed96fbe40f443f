"""Why a job or a step stopped: the sentence a person reads first, and what kind of cause
it was.  Causes are told apart by exception type and by which actor died, never by the
words of a message (a user's exception says whatever the user wrote):

- ``lost``: a worker's actor or node is gone (a Ray actor error that is not a task error);
- ``peer``: a worker's step failed while it talked to its peers (``PeerLost``, raised by the
  worker around every transport and collective call) or was discarded (``StageAborted``);
- ``user``: anything else a worker raised: the user's code (model, data, loss) or a bug.
"""
from __future__ import annotations

import contextlib
import re
import threading
import time
from typing import Iterator, Optional

import ray


class JobFailure(RuntimeError):
    """A job stopped; ``str()`` is the one sentence a person reads first."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail
        self.lost: frozenset = frozenset()  # the workers (cells) found lost, when that was the cause


class LostWorkerFailure(JobFailure):
    """A fixed-shape job's worker was lost during a step: the job restarts from its newest
    checkpoint when restarts.max allows (actors/controller.py), else fails with this message.
    ``bare``: the failure without the advice."""

    def __init__(self, message: str, detail: str, bare: JobFailure, t_error: float):
        super().__init__(message, detail)
        self.bare, self.time = bare, t_error


class JobCancelled(RuntimeError):
    """The job was cancelled while the scheduler waited on something other than a step."""


class PeerLost(RuntimeError):
    """A worker's call to the transport or a collective failed: a peer went away (or the
    step was aborted under it).  Raised only by the engine, around its communication."""


class StageAborted(PeerLost):
    """The scheduler discarded the step this worker was running (a peer was lost)."""


@contextlib.contextmanager
def talking_to_peers(what: str) -> Iterator[None]:
    """Whatever fails inside is a lost peer (``PeerLost``), whatever its type or text."""
    try:
        yield
    except PeerLost:
        raise
    except Exception as e:
        raise PeerLost(f"{what} failed: {type(e).__name__}: {e}") from e


class StepAbandoned(StageAborted):
    """Raised in a step thread that was given up on (``abandon``) when its wait on peers ends:
    another thread runs the worker's steps by then, so it must touch nothing on its way out."""


# Waits on peers that the abort cannot end.  The abort shuts the group's sockets
# (actors/collectives.py), and gloo then fails every pending operation, except one: a send of an
# unbound buffer that had begun to write and was queued in its pair's transmit queue (the receiver
# stopped reading for a moment: a loaded machine, a stalled process).  gloo's tcp
# ``Pair::signalException`` signals the queued operations that carry a bound buffer only, so that
# send's ``waitSend`` waits until the group's timeout (300 s), and so does whatever waits for it: a
# ``finish_step``, or a tensor-parallel all-reduce in the step (tests/test_gloo_abort.py makes one).
_waiting: dict[int, list] = {}   # thread id -> [depth, when its outermost wait began]
_abandoned: set[int] = set()     # threads given up on


@contextlib.contextmanager
def waiting_on_peers() -> Iterator[None]:
    """Around a blocking wait on peers (a receive, a send's completion, a collective): marks the
    thread as parked in it, so that a step the abort could not wake can be told from one still
    computing; in a thread given up on meanwhile, the wait's end raises ``StepAbandoned``."""
    me = threading.get_ident()
    mark = _waiting.setdefault(me, [0, time.monotonic()])
    mark[0] += 1
    try:
        yield
    finally:
        mark[0] -= 1
        if mark[0] == 0:
            _waiting.pop(me, None)
        if me in _abandoned:
            raise StepAbandoned("this step was given up on while it waited on its peers")


def waiting_since(thread: int) -> Optional[float]:
    """When ``thread`` began the wait on peers it is parked in (``time.monotonic``), or None."""
    mark = _waiting.get(thread)
    return mark[1] if mark else None


def abandon(thread: int) -> None:
    _abandoned.add(thread)


def forget(thread: int) -> None:
    """``thread``, given up on, ends (its id may be another thread's next)."""
    _abandoned.discard(thread)


def abandoned(thread: Optional[int] = None) -> bool:
    """Was ``thread`` (this one by default) given up on?"""
    return (threading.get_ident() if thread is None else thread) in _abandoned


class WorkerLost(Exception):
    """Workers of a step were lost (their actor or node died); the job can reshape.
    ``lost``: workers whose calls failed with a Ray actor error (surely gone); ``silent``:
    workers that had not answered a ping yet (maybe gone, maybe slow: checked again)."""

    def __init__(self, failure: JobFailure, lost: set, first_error_time: float, silent: set = frozenset()):
        super().__init__(str(failure))
        self.failure, self.lost, self.time, self.silent = failure, lost, first_error_time, set(silent)
        self.refs: dict = {}  # the calls that were running (their workers are surveyed)


def _cause(err: BaseException) -> BaseException:
    return getattr(err, "cause", None) or err


def lost_actor(err: BaseException) -> bool:
    return isinstance(err, ray.exceptions.RayActorError) and not isinstance(err, ray.exceptions.RayTaskError)


def is_comm_error(err: BaseException) -> bool:
    """A step that failed because a peer went away (not because user code raised)."""
    return isinstance(_cause(err), PeerLost)


def kind_of(err: BaseException) -> str:
    """'lost', 'peer' or 'user' (see the module's docstring)."""
    if lost_actor(err):
        return "lost"
    return "peer" if is_comm_error(err) else "user"


def step_failure(errors: dict, step: Optional[int], phase: str, *, elastic: bool, t_error: float,
                 silent: set = frozenset()) -> Exception:
    """What a call to every worker raises when ``errors`` (cell -> exception) came back: the
    first user error as the job's failure; else, in an elastic job's step, ``WorkerLost``
    (the job reshapes); else the first lost worker's failure."""
    kinds = {c: kind_of(e) for c, e in errors.items()}
    user = sorted(c for c, kind in kinds.items() if kind == "user")
    if user:
        return worker_failure(cell_name(user[0]), step, errors[user[0]], phase)
    lost = {c for c, kind in kinds.items() if kind == "lost"}
    c = min(lost) if lost else min(errors)
    failure = worker_failure(cell_name(c), step, errors[c], phase)
    if elastic and step is not None:
        return WorkerLost(failure, lost, t_error, set(silent) - lost)
    if lost and step is not None:
        return LostWorkerFailure(f"{failure}; a fixed-shape job stops when a worker is lost: set elastic.enabled: "
                                 "true to go on with the workers left, or restarts.max (with checkpoint.every_steps) "
                                 "to restart it from its newest checkpoint", failure.detail, failure, t_error)
    failure.lost = frozenset(c for c in lost if not _constructor_raised(errors[c]))
    return failure


def cell_name(c: tuple) -> str:
    """A worker's name in messages: cell (1, 0) is 'w1.0'."""
    return f"w{c[0]}.{c[1]}"


def _constructor_raised(err: BaseException) -> bool:
    """A worker actor that died because its constructor raised (as worker_failure tells it)."""
    return isinstance(err, ray.exceptions.ActorDiedError) and "__init__" in str(err)


def worker_failure(name: str, step: Optional[int], err: BaseException, phase: str = "while starting") -> JobFailure:
    cause = _cause(err)
    where = f" at step {step + 1}" if step is not None else f" {phase}"
    if isinstance(err, ray.exceptions.RayTaskError):
        what = f"raised {type(cause).__name__}: {_message(cause)}"
        inner = cause.__cause__
        if inner is not None and _message(inner):  # a wrapper's words say little (torch's stage backward)
            what += f" (from {type(inner).__name__}: {_message(inner)})"
        if isinstance(cause, ray.exceptions.RayTaskError) or type(cause).__name__.startswith("RayTaskError"):
            what = str(err).strip().splitlines()[-1]
    elif _constructor_raised(err):
        lines = [ln for ln in str(err).splitlines() if ln.strip()]
        what = "failed to start: " + (lines[-1].strip() if lines else "its constructor raised")
    elif isinstance(err, ray.exceptions.RayActorError):
        what = "died (its process or node was lost)"
    else:
        what = f"raised {type(err).__name__}: {err}"
    return JobFailure(f"worker {name}{where} {what}", detail=traceback_text(name, err))


def _message(e: BaseException, limit: int = 2000) -> str:
    """The exception's whole message, as its author wrote it (a second line often says what to
    do), without trailing spaces or blank lines; cut at ``limit`` characters."""
    said = str(e)
    if isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], str) and "\n" in e.args[0]:
        said = e.args[0]  # str(KeyError) is the repr of its key: a message's lines came out as one "\n" line
    text = "\n".join(ln.rstrip() for ln in said.strip().splitlines() if ln.strip())
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more characters in the detail)"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def traceback_text(name: str, err: BaseException) -> str:
    """The remote traceback as a person reads it, without terminal colours."""
    lines = _ANSI.sub("", str(err)).strip().splitlines()
    if lines and lines[0].startswith("ray::"):
        return f"Traceback from worker {name} ({lines[0]}), most recent call last:\n" + "\n".join(lines[1:])
    return f"Traceback from worker {name}:\n" + "\n".join(lines)
