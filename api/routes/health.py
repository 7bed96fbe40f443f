"""Health, readiness and Prometheus metrics."""
from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from api.deps import ManagerDep, TenantDep
from api.schemas import ClusterOut, ErrorOut

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict:
    """The process is up (no auth)."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "the store or Ray is not reachable"}})
def readyz(request: Request):
    """The job store and the Ray cluster are reachable."""
    manager = request.app.state.manager
    checks = {}
    try:
        checks["store"] = manager.store.ping()
    except Exception:
        checks["store"] = False
    checks["ray"] = manager.ray_ok()
    return JSONResponse({"ready": all(checks.values()), **checks}, status_code=200 if all(checks.values()) else 503)


@router.get("/metrics", response_class=Response)
def metrics(request: Request) -> Response:
    """Prometheus text: jobs by state, requests and their latencies, reshapes."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    request.app.state.telemetry.refresh(request.app.state.manager.store)
    return Response(generate_latest(request.app.state.telemetry.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/cluster", response_model=ClusterOut, tags=["cluster"], responses={401: {"model": ErrorOut}})
def cluster(manager: ManagerDep, tenant: TenantDep) -> ClusterOut:
    """The shared cluster as its scheduler sees it: capacity, each tenant's weight, share and
    use, and the queue in order (other tenants' job ids left out)."""
    return ClusterOut(**manager.cluster.view(tenant))
