"""Dependencies as typed aliases."""
from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request

from api.jobs import JobManager


def get_manager(request: Request) -> JobManager:
    return request.app.state.manager


def get_tenant(request: Request) -> str:
    tenant = request.app.state.auth.tenant_for(request.headers.get("authorization"))
    if tenant is None:
        raise HTTPException(401, "missing or unknown API token: send 'Authorization: Bearer <token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    return tenant


ManagerDep = Annotated[JobManager, Depends(get_manager)]
TenantDep = Annotated[str, Depends(get_tenant)]
