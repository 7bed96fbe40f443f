"""What user code prints in an actor, kept for the job's log.

``OutputTap.install()`` wraps the process's ``sys.stdout`` and ``sys.stderr``: every write
still goes to the original stream (Ray's log files and the driver's console see it as
before), and complete lines are also kept, with their time and stream, until the scheduler
takes them with a step's result (Ray's own marker lines excepted).  What Python writes is
caught (print, warnings, logging to a stream handler); what C++ writes straight to the file
descriptor is not.

Bounded: a line is cut at ``MAX_LINE`` characters, and at most ``MAX_KEPT`` lines wait; a
process that prints faster than it is read loses the oldest, and the next ``take`` says how
many.
"""
from __future__ import annotations

import collections
import sys
import threading
import time
from typing import Optional

MAX_LINE = 2000
MAX_KEPT = 2000
# lines Ray itself prints for its log monitor (ray._private.ray_constants.LOG_PREFIX_*): not the user's
RAY_MARKERS = (":actor_name:", ":task_name:", ":job_id:", ":event_summary:", ":info_message:")


class _Tee:
    """A text stream that writes through to ``inner`` and hands complete lines to ``tap``."""

    def __init__(self, inner, tap: "OutputTap", name: str):
        self._inner, self._tap, self._name = inner, tap, name
        self._partial = ""
        self._cut = False  # the line being written is longer than MAX_LINE and its head was kept

    def write(self, s: str) -> int:
        n = self._inner.write(s)
        if s:
            self._tap._feed(self, s)
        return len(s) if n is None else n

    def flush(self) -> None:
        self._inner.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding, ...: the original stream's
        return getattr(self._inner, name)


class OutputTap:
    _installed: Optional["OutputTap"] = None

    def __init__(self, max_kept: int = MAX_KEPT, max_line: int = MAX_LINE):
        self.max_line = max_line
        self._lines: collections.deque = collections.deque(maxlen=max_kept)
        self._dropped = 0
        self._lock = threading.Lock()

    @classmethod
    def install(cls) -> "OutputTap":
        """Tap this process's stdout and stderr (once: later calls return the same tap)."""
        if cls._installed is None:
            tap = cls()
            sys.stdout = _Tee(sys.stdout, tap, "stdout")
            sys.stderr = _Tee(sys.stderr, tap, "stderr")
            cls._installed = tap
        return cls._installed

    def _feed(self, tee: _Tee, s: str) -> None:
        with self._lock:
            *lines, rest = (tee._partial + s).split("\n")
            if tee._cut:  # the current line's head was kept already: drop the rest of it
                if lines:
                    lines.pop(0)
                    tee._cut = False
                else:
                    rest = ""
            if len(rest) > self.max_line:  # a very long line without a newline yet: keep its head now
                lines.append(rest)
                rest, tee._cut = "", True
            tee._partial = rest
            now = time.time()
            for line in lines:
                if not line.startswith(RAY_MARKERS):
                    self._keep((now, tee._name, line[: self.max_line]))

    def _keep(self, entry: tuple) -> None:
        """Keep one (time, stream, text) line, counting the oldest one it pushes out (lock held)."""
        if len(self._lines) == self._lines.maxlen:
            self._dropped += 1
        self._lines.append(entry)

    def put(self, lines: list) -> None:
        """Keep lines another process printed on this one's behalf ((time, stream, text) each, as
        :meth:`take` gives them): the model's trace, run in a task (actors/layerfacts.py)."""
        with self._lock:
            for line in lines:
                self._keep(tuple(line))

    def take(self) -> list[tuple[float, str, str]]:
        """The lines kept since the last call: (unix time, "stdout" | "stderr", text)."""
        with self._lock:
            out = list(self._lines)
            self._lines.clear()
            if self._dropped:
                t = out[0][0] if out else time.time()
                out.insert(0, (t, "stderr", f"[relaytrain: {self._dropped} earlier lines were dropped: "
                                            f"more than {self._lines.maxlen} waited to be read]"))
                self._dropped = 0
            return out
