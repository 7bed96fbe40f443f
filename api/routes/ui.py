"""The web page: plain HTML, CSS and JavaScript from api/static (no build step, nothing
from another host).  The page asks for an API token once (kept in the browser tab's
sessionStorage) and reads the same /v1 endpoints as the CLI."""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent.parent / "static"
HEADERS = {
    # everything from this server; the swimlane SVG is inserted as markup, never scripts
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)


@router.get("/")
def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=HEADERS)


class _Static(StaticFiles):
    async def get_response(self, path, scope):
        response = await super().get_response(path, scope)
        for k, v in HEADERS.items():
            response.headers.setdefault(k, v)
        return response


def mount(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/static", _Static(directory=STATIC), name="static")
