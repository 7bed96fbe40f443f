"""/v1/jobs/{id}/timeline: the measured swimlane of a recent step, as JSON or SVG."""
from __future__ import annotations

from typing import Annotated, Optional

from fastapi import APIRouter, Query, Response

from api.deps import ManagerDep, TenantDep
from api.errors import NotFound
from api.jobs import JobManager
from api.schemas import ErrorOut, TimelineOut
from service import timeline
from service.states import JobState

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
ERRORS = {401: {"model": ErrorOut}, 404: {"model": ErrorOut}, 422: {"model": ErrorOut}}
StepQuery = Annotated[Optional[int], Query(ge=1, le=2**31 - 1,
                                           description="a step (1-based) the store keeps; unset: the newest kept")]


def _view(manager: JobManager, tenant: str, job_id: str, step: Optional[int]) -> dict:
    job = manager.get(tenant, job_id)
    kept = manager.store.timeline_steps(job_id)
    if not kept:
        ended = JobState(job["state"]).is_terminal
        raise NotFound(f"job {job_id} has no measured timeline: it ended ({job['state']}) before any step committed"
                       if job["step"] == 0 and ended else
                       f"job {job_id} has no measured timeline yet: none of its steps has committed"
                       if job["step"] == 0 else f"job {job_id} kept no timeline of its steps")
    if step is not None and step not in kept:
        beyond = f"job {job_id} has {job['steps']} steps" if step > job["steps"] else f"step {step} of job {job_id} is not kept"
        raise NotFound(f"{beyond}; timelines kept: steps {timeline.steps_text(kept)}")
    entry = manager.store.get_timeline(job_id, step)
    if entry is None:  # dropped from the ring between the two reads
        raise NotFound(f"step {step} of job {job_id} is no longer kept; try again")
    return timeline.view(entry, kept, job=job_id)


@router.get("/{job_id}/timeline", response_model=TimelineOut, responses=ERRORS)
def job_timeline(job_id: str, manager: ManagerDep, tenant: TenantDep, step: StepQuery = None) -> dict:
    """What each worker did in a recent step, as measured on the workers: a lane per worker
    (dp, pp), each action's start and end.  The store keeps a ring of the newest timelines
    (at most one a second while the job runs, and its last step)."""
    return _view(manager, tenant, job_id, step)


@router.get("/{job_id}/timeline.svg", response_class=Response, responses={
    **ERRORS, 200: {"content": {"image/svg+xml": {}}, "description": "the swimlane picture"}})
def job_timeline_svg(job_id: str, manager: ManagerDep, tenant: TenantDep, step: StepQuery = None) -> Response:
    """The same timeline as an SVG swimlane (what `relaytrain timeline --out` writes)."""
    return Response(timeline.render_svg(_view(manager, tenant, job_id, step)), media_type="image/svg+xml")
