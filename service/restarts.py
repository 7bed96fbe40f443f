"""Where a job's checkpoints go, and whether a job whose scheduler was lost restarts.

Pure: the control plane (api/jobs.py, for submitted jobs) and ``relaytrain run``
(actors/runner.py, for a job in the foreground) ask ``decide`` when a job's scheduler actor is
gone, and start a new scheduler that resumes from the newest complete checkpoint when it says so.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from service.spec import JobSpec, SpecError

URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: str) -> bool:
    return bool(URL_RE.match(path))


def checkpoint_root(spec: JobSpec, *, home: Optional[Path] = None, tenant: str = "", job_id: str = "") -> Optional[str]:
    """The folder (or URL) of a job's checkpoints; None when the spec writes none.

    A job in the foreground (``relaytrain run``: no ``home``) writes into ``checkpoint.path``
    itself (a local path is made absolute).  A submitted job writes into its own folder under
    it, ``<path>/<tenant>/<job id>``, so jobs never share one; a relative path is taken under
    the server's data folder (``<home>/checkpoints/<tenant>/<job id>``)."""
    if not spec.checkpoint.every_steps:
        return None
    path = spec.checkpoint.path
    if home is None:
        return path.rstrip("/") if is_url(path) else str(Path(path).resolve())
    if is_url(path):
        return f"{path.rstrip('/')}/{tenant}/{job_id}"
    base = Path(path) if Path(path).is_absolute() else Path(home) / "checkpoints"
    return str(base / tenant / job_id)


def check_local_root(spec: JobSpec, home: Path, allowed: Sequence[str] = ()) -> None:
    """A submitted job's local ``checkpoint.path`` lies under the server's data folder (a
    relative path always does) or one of the folders ``allowed`` (the operator's
    ``RELAYTRAIN_CHECKPOINT_ROOTS``): a tenant must not have the service write wherever its user
    may (``/etc``, another tenant's folders). Raises ``SpecError`` saying what to use."""
    path = spec.checkpoint.path
    if not spec.checkpoint.every_steps or is_url(path) and not path.lower().startswith("file://"):
        return
    local = Path(path[len("file://"):] if path.lower().startswith("file://") else path)
    if not local.is_absolute():
        return
    target = Path(os.path.normpath(local))
    roots = [Path(os.path.normpath(Path(home).resolve())), *(Path(os.path.normpath(r)) for r in allowed if r)]
    if any(target == r or r in target.parents for r in roots):
        return
    raise SpecError(f"checkpoint.path {path!r} is outside the folders this server lets jobs write to "
                    f"({', '.join(str(r) for r in roots)}); use a relative path (it lands under the server's data "
                    "folder), s3://bucket/prefix, or ask the operator to add the folder to "
                    "RELAYTRAIN_CHECKPOINT_ROOTS")


@dataclass(frozen=True)
class Decision:
    restart: bool
    message: str     # the sentence for the job's event (restarted) or its error (failed)
    fields: Optional[dict] = None  # a restart's ``restarted`` event fields (with the checkpoint's path added)


def decide(spec: JobSpec, *, used: int, committed: int, newest_step: Optional[int], reason: str,
           cancelling: bool = False) -> Decision:
    """Whether a job whose scheduler was lost (``reason``) restarts: ``used`` restarts so far,
    ``committed`` steps recorded, ``newest_step`` that of its newest complete checkpoint (None:
    there is none).  A job its user was cancelling never restarts."""
    most = spec.restarts.max
    if cancelling:
        return Decision(False, f"{reason} while the job was being cancelled; it is not restarted")
    if most == 0:
        return Decision(False, f"{reason}; the job can not go on (set restarts.max to restart it from its newest "
                               "checkpoint)")
    if used >= most:
        return Decision(False, f"{reason}, and its restarts are used up ({used} of restarts.max {most})")
    if newest_step is None:
        why = ("checkpoint.every_steps is 0" if not spec.checkpoint.every_steps
               else "none had been written yet")
        return Decision(False, f"{reason}, and there is no complete checkpoint to restart it from ({why})")
    rerun = max(0, committed - newest_step)
    runs = "1 committed step runs" if rerun == 1 else f"{rerun} committed steps run"
    return Decision(True, f"{reason}; restart {used + 1} of {most} from the checkpoint of step {newest_step} "
                          f"({runs} again)",
                    {"reason": reason, "restart": used + 1, "restarts_max": most, "from_step": newest_step,
                     "rerun_steps": rerun})


class StorageUnreadable(Exception):
    """A job's checkpoint storage did not answer for the whole wait; ``str()`` says so."""


def read_waiting(read: Callable[[], Any], *, why: str, wait_s: float, said: Callable[[str], None],
                 pause: Callable[[], bool]) -> tuple[bool, Any]:
    """``read()`` of a job's checkpoint storage, tried again while it raises, for ``wait_s``
    seconds from its first failure (an S3 endpoint down for a minute failed a job at once that
    had restarts left: a user trial): ``said(message)`` once at the first failure (a ``waiting``
    event), ``pause()`` between tries (False: stop trying).  Returns ``(True, what read
    returned)``, or ``(False, None)`` when ``pause`` stopped it; raises
    :class:`StorageUnreadable`, saying how long it waited, past the wait.  The control plane's
    restarts and resumes and ``relaytrain run``'s restart share it."""
    since = None
    while True:
        try:
            return True, read()
        except Exception as e:
            now = time.monotonic()
            first = since is None
            since = now if first else since
            waited = now - since
            if waited >= wait_s:
                raise StorageUnreadable(f"{why}{f' for {waited:.0f} s' if waited >= 1 else ''}: "
                                        f"{type(e).__name__}: {e}") from None
            if first:
                said(f"{why} ({type(e).__name__}: {e}); trying again for up to {wait_s:g} s")
            if not pause():
                return False, None


def check_storage(root: Optional[str]) -> None:
    """Reach the checkpoints' storage once, before any actor starts: an unknown scheme, a
    bucket that does not exist or credentials it refuses are a SpecError saying what to change."""
    if root is None:
        return
    from service import storage
    from service.spec import SpecError

    try:
        storage.check_url(root)
    except ValueError as e:
        raise SpecError(str(e)) from None
