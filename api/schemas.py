"""Request and response schemas of the REST API (separate from the store's rows)."""
from __future__ import annotations

import re
from typing import Any, Optional

from pydantic import BaseModel, Field

from service.states import JobState


class QueuePlace(BaseModel):
    position: int = Field(description="1-based: the job the cluster scheduler admits next is 1")
    reason: str = Field(description="what it waits for, e.g. 'waiting for 2 CPU slots (2 workers); 1 job ahead'")


class TenantUse(BaseModel):
    tenant: str
    weight: float = Field(description="its weight in the fair shares (RELAYTRAIN_TENANT_WEIGHTS, tokens, file)")
    share: float = Field(description="CPU slots its weight entitles it to among the tenants with work now")
    using: float = Field(description="CPU slots of its jobs' placed shapes")
    starting: float = Field(0.0, description="CPU slots allotted to its admitted jobs that have no workers placed yet "
                                             "(waiting for slots, or starting them); the fair shares count them as held")
    running: int = Field(description="its jobs admitted (PENDING, RUNNING, RESHAPING)")
    queued: int = Field(description="its jobs QUEUED")


class QueuedJob(BaseModel):
    position: int
    tenant: str
    job: Optional[str] = Field(None, description="the job id; only for your own jobs")
    reason: str


class ClusterOut(BaseModel):
    policy: str = Field(description="elastic, fair or fifo (RELAYTRAIN_QUEUE_POLICY)")
    capacity: float = Field(description="CPU slots of the cluster (or its autoscaling ceiling) for jobs")
    tenants: list[TenantUse]
    queue: list[QueuedJob]


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
    restarts: int = Field(0, description="times the job was restarted from a checkpoint after its scheduler was lost")
    checkpoint: Optional[dict[str, Any]] = Field(
        None, description="the newest complete checkpoint: step, path (a folder or URL) and time; the one a "
                          "restart resumes from")
    queue: Optional[QueuePlace] = Field(None, description="a QUEUED job's place in the queue and why it waits")
    waiting: Optional[str] = Field(
        None, description="what an admitted job (PENDING or RESHAPING) waits for when too few worker slots are "
                          "alive, e.g. 'waiting for workers: 1 slot alive, the job needs at least "
                          "elastic.min_workers=2' (its newest waiting event)")
    allotted_workers: Optional[int] = Field(
        None, description="workers the cluster scheduler allots the job (an elastic job shrinks or grows to fit)")
    spec: dict[str, Any]

    @classmethod
    def from_row(cls, row: dict) -> "JobOut":
        out = {k: row[k] for k in cls.model_fields if k in row}
        if isinstance(out.get("spec"), dict):
            out["spec"] = redacted(out["spec"])
        return cls(**out)


SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSW|CREDENTIAL|PRIVATE|(^|_)(API_?)?KEY$|AUTH", re.I)


def redacted(spec: dict) -> dict:
    """A spec as answers show it: the values of ``runtime_env.env_vars`` whose names look like
    secrets (``AWS_SECRET_ACCESS_KEY``, ``HF_TOKEN``, ``..._PASSWORD``, ``..._API_KEY``) as
    ``***``. They are stored as given (the job needs them), but every answer echoed them back,
    on the page and in ``relaytrain status --json`` too (a user trial)."""
    env = (spec.get("runtime_env") or {}).get("env_vars")
    if not isinstance(env, dict) or not any(SECRET_NAME.search(str(k)) for k in env):
        return spec
    hidden = {k: "***" if SECRET_NAME.search(str(k)) else v for k, v in env.items()}
    return {**spec, "runtime_env": {**spec["runtime_env"], "env_vars": hidden}}


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


class OutputLineOut(BaseModel):
    id: int
    time: float
    source: str = Field(description="the actor that printed it: 'w<dp>.<pp>' or 'scheduler'")
    stream: str = Field(description="'stdout' or 'stderr'")
    line: str


class PackageOut(BaseModel):
    sha256: str
    uri: str = Field(description="name this in a spec's runtime_env.working_dir")
    size: int


class ErrorOut(BaseModel):
    detail: Any


class TimelineBox(BaseModel):
    action: str = Field(description="like 1F3: stage 1, forward, microbatch 3 (global id)")
    kind: str = Field(description="F or B")
    mb: int = Field(description="global microbatch id")
    start: float = Field(description="seconds from the step's first action")
    end: float


class TimelineLane(BaseModel):
    worker: str = Field(description="w<dp_rank>.<pp_rank>")
    dp_rank: int
    pp_rank: int
    node: Optional[str] = Field(None, description="Ray node id the worker ran on")
    busy_s: float = Field(description="seconds inside actions")
    actions: list[TimelineBox] = Field(description="in the order the worker ran them")


class TimelineOut(BaseModel):
    job: str
    step: int = Field(description="the step (1-based) these times were measured in")
    available: list[int] = Field(description="steps whose timelines the store keeps (a ring of the newest)")
    dp: int
    pp: int
    schedule: str
    microbatches_per_replica: int
    start: Optional[float] = Field(None, description="unix time of the step's first action")
    span_s: float = Field(description="seconds from the first action's start to the last one's end")
    utilization: Optional[float] = Field(None, description="measured: busy / (stages x span), averaged over replicas")
    utilization_plan: Optional[float] = Field(None, description="the schedule's ideal, backward = 2 x forward; "
                                              "with sends_early or last_sent_early, as the workers ran it")
    sends_early: bool = Field(False, description="every backward sent its input gradient before computing its "
                                                 "weight gradients (chunks of plain Linear layers): the plan is the "
                                                 "schedule with each B followed by its W")
    last_sent_early: bool = Field(False, description="each worker's last backward of the step sent its input gradient "
                                                     "before its weight gradients (torch's split of that backward, "
                                                     "chunks whose weights are not in plain Linears); the plan lets "
                                                     "the stage before start its last backward at that send")
    weight_group: int = Field(1, description="parallelism.weight_group: the W's of that many microbatches ran as one "
                                             "product per Linear, at the group's last W (each W box: an equal "
                                             "share of the group's time); the plan is the grouped one")
    lanes: list[TimelineLane]
