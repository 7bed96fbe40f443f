"""/v1/packages: upload a zip of user code that a spec's runtime_env.working_dir names."""
from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request

from api.deps import ManagerDep, TenantDep
from api.schemas import ErrorOut, PackageOut
from service import packages

router = APIRouter(prefix="/v1/packages", tags=["packages"])


@router.post("", status_code=201, response_model=PackageOut,
             responses={401: {"model": ErrorOut}, 413: {"model": ErrorOut}, 422: {"model": ErrorOut}},
             openapi_extra={"requestBody": {"required": True, "content": {"application/zip": {
                 "schema": {"type": "string", "format": "binary"}}}}})
async def upload_package(request: Request, manager: ManagerDep, tenant: TenantDep) -> PackageOut:
    """Send the zip as the request body (Content-Type: application/zip). Content-addressed:
    the same zip gives the same uri."""
    limit = manager.settings.max_package_bytes
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise HTTPException(413, f"the package is over the limit of {limit} bytes")
    try:
        sha, uri = packages.save(bytes(body), manager.settings.packages_dir, limit)
    except packages.PackageError as e:
        raise HTTPException(422, str(e)) from None
    manager.store.add_package(sha, tenant, len(body))
    return PackageOut(sha256=sha, uri=uri, size=len(body))
