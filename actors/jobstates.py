"""The controller's states: one class each, with the job state (the enum the store, the API
and the UI share) it shows as.  Only ``JobController._step`` makes one from another."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from actors.reshape import Move
from service.states import JobState


@dataclass(frozen=True)
class State:
    job_state: ClassVar[JobState]

    @property
    def is_terminal(self) -> bool:
        return self.job_state.is_terminal


@dataclass(frozen=True)
class Starting(State):
    """Learning the layers, then placing the first shape (an elastic job may wait for slots)."""

    job_state = JobState.PENDING
    waited_since: Optional[float] = None


@dataclass(frozen=True)
class Restarting(Starting):
    """A fixed-shape job that lost a worker places its shape afresh and resumes from its newest
    checkpoint: RUNNING still, as after a restart of its scheduler."""

    job_state = JobState.RUNNING


@dataclass(frozen=True)
class Running(State):
    """Between steps: ``step`` committed steps so far."""

    job_state = JobState.RUNNING
    step: int = 0


@dataclass(frozen=True, eq=False)
class Reshaping(State):
    """Carrying out ``move`` (it may wait for slots; ``attempt`` counts workers lost meanwhile)."""

    job_state = JobState.RESHAPING
    move: Move = None
    attempt: int = 0
    waited_since: Optional[float] = None


@dataclass(frozen=True)
class Finishing(State):
    """Every step committed: copying the final model out."""

    job_state = JobState.RUNNING


@dataclass(frozen=True)
class Ended(State):
    kind: ClassVar[str]
    message: str = ""
    fields: dict = field(default_factory=dict)

    @property
    def is_terminal(self) -> bool:  # the controller's loop ends (a preempted job's queue wait is not its)
        return True


@dataclass(frozen=True)
class Succeeded(Ended):
    job_state = JobState.SUCCEEDED
    kind = "finished"


@dataclass(frozen=True)
class Failed(Ended):
    job_state = JobState.FAILED
    kind = "failed"


@dataclass(frozen=True)
class Cancelled(Ended):
    job_state = JobState.CANCELLED
    kind = "cancelled"


@dataclass(frozen=True)
class Preempted(Ended):
    """Gave its slots back to the cluster scheduler after a checkpoint: queued again, to resume."""

    job_state = JobState.QUEUED
    kind = "preempted"
