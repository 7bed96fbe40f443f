"""Job states: one enum shared by the store, the API, the CLI and the UI."""
from __future__ import annotations

import enum


class JobState(str, enum.Enum):
    QUEUED = "QUEUED"          # waiting for the cluster scheduler to admit it (api/cluster.py)
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    RESHAPING = "RESHAPING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)
