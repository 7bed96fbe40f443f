"""Request and response schemas of the REST API (separate from the store's rows)."""
from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, Field

from service.states import JobState


class JobOut(BaseModel):
    id: str
    name: str
    tenant: str
    state: JobState
    step: int = Field(description="committed steps")
    steps: int = Field(description="steps the job will train")
    loss: Optional[float] = Field(None, description="loss of the last committed step")
    samples_per_s: Optional[float] = None
    shape: Optional[dict[str, Any]] = Field(None, description="dp, pp, layers per stage, schedule, transport")
    created_at: float
    started_at: Optional[float] = None
    ended_at: Optional[float] = None
    error: Optional[str] = Field(None, description="why the job failed")
    spec: dict[str, Any]

    @classmethod
    def from_row(cls, row: dict) -> "JobOut":
        return cls(**{k: row.get(k) for k in cls.model_fields})


class JobPage(BaseModel):
    items: list[JobOut]
    total: int
    limit: int
    offset: int


class EventOut(BaseModel):
    model_config = {"extra": "allow"}
    id: int
    time: float
    type: str
    message: str


class PackageOut(BaseModel):
    sha256: str
    uri: str = Field(description="name this in a spec's runtime_env.working_dir")
    size: int


class ErrorOut(BaseModel):
    detail: Any
