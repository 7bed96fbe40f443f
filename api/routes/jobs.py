"""/v1/jobs: submit, list, inspect, cancel, finish early, follow, download and delete jobs."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from fastapi import APIRouter, Header, Query, Response
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from api.deps import ManagerDep, TenantDep
from api.schemas import ErrorOut, EventOut, JobOut, JobPage, OutputLineOut
from service.spec import INT64_MAX, JobSpec
from service.states import JobState

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
ERRORS = {401: {"model": ErrorOut}, 404: {"model": ErrorOut}}


@router.post("", status_code=201, response_model=JobOut,
             responses={200: {"model": JobOut, "description": "an earlier job with the same Idempotency-Key"},
                        401: {"model": ErrorOut}, 409: {"model": ErrorOut}, 422: {"model": ErrorOut},
                        429: {"model": ErrorOut}})
def submit_job(spec: JobSpec, manager: ManagerDep, tenant: TenantDep, response: Response,
               idempotency_key: Annotated[Optional[str], Header(min_length=1, max_length=255)] = None,
               resume_from: Annotated[Optional[str], Query(
                   min_length=1, max_length=255, description="an ended job of yours: this job starts from its "
                   "newest checkpoint, in this spec's shape")] = None) -> JobOut:
    """Submit a job spec; it starts at once when the cluster scheduler admits it, else it is
    QUEUED with its place and reason (GET /v1/cluster shows the queue). A retried POST with the same
    Idempotency-Key returns the first job (200) instead of starting a second. With
    ``?resume_from=JOB`` it starts from that ended job's newest checkpoint (422 when it has none,
    409 while it still runs)."""
    job, created = manager.submit(tenant, spec, idempotency_key, resume_from)
    if not created:
        response.status_code = 200
    return JobOut.from_row(job)


@router.get("", response_model=JobPage, responses={401: {"model": ErrorOut}})
def list_jobs(manager: ManagerDep, tenant: TenantDep,
              state: Annotated[Optional[list[JobState]], Query(description="keep jobs in these states")] = None,
              limit: Annotated[int, Query(ge=1, le=500)] = 50,
              offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0) -> JobPage:
    """The tenant's jobs, newest first."""
    rows, total = manager.store.list_jobs(tenant, [s.value for s in state or []], limit, offset)
    return JobPage(items=[JobOut.from_row(r) for r in manager.with_durability(rows)], total=total, limit=limit,
                   offset=offset)


@router.get("/{job_id}", response_model=JobOut, responses=ERRORS)
def get_job(job_id: str, manager: ManagerDep, tenant: TenantDep) -> JobOut:
    return JobOut.from_row(manager.get(tenant, job_id))


class JobDeleted(BaseModel):
    id: str
    deleted: bool = True
    checkpoints: Optional[str] = Field(None, description="'deleted <where>' or 'kept at <where>'; null when the "
                                                         "job wrote none")


@router.delete("/{job_id}", response_model=JobDeleted,
               responses={**ERRORS, 409: {"model": ErrorOut}, 503: {"model": ErrorOut}})
def delete_job(job_id: str, manager: ManagerDep, tenant: TenantDep,
               checkpoints: Annotated[bool, Query(description="also delete the job's checkpoint folder "
                                                              "(<checkpoint.path>/<tenant>/<job id>)")] = False
               ) -> JobDeleted:
    """Delete an ended job and what the server keeps of it: its record, events, metrics, logs,
    timelines and model files; with ``?checkpoints=true`` its checkpoints too (a job that resumes
    from them, ``resume_from``, can no longer).  409 while it is active (cancel it first); 503,
    keeping the job, when its checkpoints' storage fails."""
    return JobDeleted(**manager.delete(tenant, job_id, checkpoints))


@router.post("/{job_id}/cancel", response_model=JobOut, responses={**ERRORS, 409: {"model": ErrorOut}})
def cancel_job(job_id: str, manager: ManagerDep, tenant: TenantDep) -> JobOut:
    """Stop a job at its next step boundary; 409 if it already ended."""
    return JobOut.from_row(manager.cancel(tenant, job_id))


@router.post("/{job_id}/finish", response_model=JobOut, responses={**ERRORS, 409: {"model": ErrorOut}})
def finish_job(job_id: str, manager: ManagerDep, tenant: TenantDep) -> JobOut:
    """End a training job early, keeping its model: after the step under way the model is
    written out (GET .../model), evaluated when the spec has `eval`, and the job SUCCEEDS;
    409 if it is not training (QUEUED, PENDING, ended, or being cancelled)."""
    return JobOut.from_row(manager.finish(tenant, job_id))


@router.get("/{job_id}/events", response_model=list[EventOut], responses=ERRORS)
def job_events(job_id: str, manager: ManagerDep, tenant: TenantDep,
               after: Annotated[int, Query(ge=0, le=INT64_MAX, description="only events with a larger id")] = 0,
               limit: Annotated[int, Query(ge=1, le=10000)] = 1000) -> list[dict]:
    manager.get(tenant, job_id)
    return manager.store.get_events(job_id, after, limit)


@router.get("/{job_id}/output", response_model=list[OutputLineOut], responses=ERRORS)
def job_output(job_id: str, manager: ManagerDep, tenant: TenantDep,
               after: Annotated[int, Query(ge=0, le=INT64_MAX, description="only lines with a larger id")] = 0,
               limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
               tail: Annotated[bool, Query(description="the last `limit` lines instead of the first")] = False
               ) -> list[dict]:
    """What the job's workers and scheduler printed, a line each, oldest first (the store keeps
    a job's newest 20,000 lines)."""
    manager.get(tenant, job_id)
    return manager.store.get_logs(job_id, after, limit, tail=tail)


@router.get("/{job_id}/metrics", response_model=list[dict], responses=ERRORS)
def job_metrics(job_id: str, manager: ManagerDep, tenant: TenantDep,
                after_step: Annotated[int, Query(ge=0, le=INT64_MAX, description="only steps after this one")] = 0,
                limit: Annotated[int, Query(ge=1, le=100000)] = 10000) -> list[dict]:
    """One row per committed step (step, loss, time, samples_per_s, dp, pp, bubble, ...)."""
    manager.get(tenant, job_id)
    return manager.store.get_metrics(job_id, after_step, limit)


class ModelFileOut(BaseModel):
    name: str = Field(description="a shard file: GET /v1/jobs/{job_id}/model/files/{name}")
    bytes: int = Field(description="its size")


class ModelFilesOut(BaseModel):
    """The model's index, as in its model.safetensors.index.json, and its shard files."""
    model_config = {"extra": "allow"}
    metadata: dict[str, Any] = Field(description="total_size (bytes of tensor data), step, format, and order: "
                                                 "every tensor name in the model's state_dict order")
    weight_map: dict[str, str] = Field(description="tensor name -> the shard file that holds it")
    files: list[ModelFileOut] = Field(description="the shard files, one per pipeline stage, in order")


MODEL_ERRORS = {**ERRORS, 409: {"model": ErrorOut, "description": "the job has not SUCCEEDED"}}


@router.get("/{job_id}/model", response_class=Response,
            responses={**ERRORS, 409: {"model": ErrorOut, "description": "the job has not SUCCEEDED, or the model "
                                       "is larger than RELAYTRAIN_MODEL_PT_MAX_MB: download its shards"},
                       200: {"content": {"application/octet-stream": {}}, "description": "torch.save'd state_dict"}})
def job_model(job_id: str, manager: ManagerDep, tenant: TenantDep):
    """The trained model's state_dict (torch.load it), once the job SUCCEEDED, assembled from its
    shards in the model's order. Only a model of at most RELAYTRAIN_MODEL_PT_MAX_MB (default
    1024 MiB) comes as one file: a larger one is a 409, and its shards are at
    /v1/jobs/{job_id}/model/files."""
    return Response(manager.models.whole(tenant, job_id), media_type="application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="{job_id}.pt"'})


@router.get("/{job_id}/model/files", response_model=ModelFilesOut, responses=MODEL_ERRORS)
def job_model_files(job_id: str, manager: ManagerDep, tenant: TenantDep) -> dict:
    """The trained model as Hugging Face publishes large ones, once the job SUCCEEDED: its index
    (model.safetensors.index.json: `metadata`, `weight_map`) and `files`, a safetensors shard per
    pipeline stage with its size. Download each file, and the index, from
    /v1/jobs/{job_id}/model/files/{name}."""
    return manager.models.files(tenant, job_id)


@router.get("/{job_id}/model/files/{name:path}", response_class=Response,
            responses={**MODEL_ERRORS, 200: {"content": {"application/octet-stream": {}},
                                             "description": "the file's bytes"}})
def job_model_file(job_id: str, name: str, manager: ManagerDep, tenant: TenantDep):
    """One file of the trained model: a shard /v1/jobs/{job_id}/model/files lists (a safetensors
    file) or the index, model.safetensors.index.json. Any other name is a 404 that lists the files."""
    data = manager.models.file(tenant, job_id, name)
    return Response(data, media_type="application/octet-stream",
                    headers={"Content-Disposition": f'attachment; filename="{name}"'})


@router.get("/{job_id}/logs", response_class=PlainTextResponse, responses=ERRORS)
def job_logs(job_id: str, manager: ManagerDep, tenant: TenantDep,
             source: Annotated[Literal["all", "events", "output"], Query(
                 description="'events' (the job's events, failures with tracebacks), 'output' (what the "
                             "workers and the scheduler printed) or 'all', merged by time")] = "all",
             tail: Annotated[Optional[int], Query(ge=1, le=100000, description="only the last N lines")] = None) -> str:
    """The job's log as text: its events, and what its actors printed (`[w0.1 stdout] ...`)."""
    return manager.log_text(tenant, job_id, source, tail)
