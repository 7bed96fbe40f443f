"""StoreSink: a job's progress written to the job store as it happens."""
from __future__ import annotations

import sys
import threading
import time
from typing import Any, Optional

from service import timeline
from service.store import LOG_KEEP, Store
from service.states import JobState


class StoreSink:
    """Writes a job's progress to the job store as it happens.  A store that is briefly
    unreachable does not stop training: rows wait and go with the next write.  Step
    timelines are written at most once per ``timeline.EVERY_S`` (the newest waits), and
    the one waiting goes with any state change, so an ended job shows its last step."""

    def __init__(self, url: str, job_id: str):
        self.store, self.job_id = Store(url), job_id
        self._events: list[dict] = []
        self._metrics: list[dict] = []
        self._logs: list[dict] = []
        self._fields: dict[str, Any] = {}
        self._state: Optional[tuple[JobState, Optional[str]]] = None
        self._timeline: Optional[dict] = None
        self._timeline_at = float("-inf")
        self._end_at: Optional[int] = None
        self._lock = threading.Lock()

    def write(self, events=(), metrics=(), state: Optional[JobState] = None, error: Optional[str] = None,
              timeline_entry: Optional[dict] = None, logs=(), end_at: Optional[int] = None, **fields) -> None:
        """Queue rows, job fields and a state change, then try to write everything queued;
        ``end_at``: the job's last step (it finished early: rows after it go)."""
        with self._lock:
            if end_at is not None:
                self._end_at = end_at
            self._events += list(events)
            self._metrics += list(metrics)
            self._logs = (self._logs + list(logs))[-LOG_KEEP:]
            self._fields.update(fields)
            if state is not None:
                self._state = (state, error)
            if timeline_entry is not None:
                self._timeline = timeline_entry
            try:
                if self._events:
                    self.store.add_events(self.job_id, [_jsonable(e) for e in self._events])
                    self._events = []
                if self._metrics:
                    self.store.add_metrics(self.job_id, self._metrics)
                    self._metrics = []
                if self._end_at is not None:
                    self.store.end_metrics_at(self.job_id, self._end_at)
                    self._end_at = None
                if self._logs:
                    self.store.add_logs(self.job_id, self._logs)
                    self._logs = []
                if self._fields:
                    self.store.update_job(self.job_id, **self._fields)
                    self._fields = {}
                if self._timeline is not None and (self._state is not None or
                                                   time.monotonic() - self._timeline_at >= timeline.EVERY_S):
                    self.store.put_timeline(self.job_id, self._timeline, keep=timeline.RING)
                    self._timeline, self._timeline_at = None, time.monotonic()
                if self._state is not None:
                    self.store.set_state(self.job_id, self._state[0], error=self._state[1])
                    self._state = None
            except Exception as e:  # keep training; what is queued goes with the next write
                print(f"relaytrain: job store write failed, will retry: {e}", file=sys.stderr)


def _jsonable(row: dict) -> dict:
    return {k: (v if isinstance(v, (str, int, float, bool, list, dict, type(None))) else str(v)) for k, v in row.items()}
