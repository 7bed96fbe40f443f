"""The web page: plain HTML, CSS and JavaScript from api/static (no build step, nothing
from another host).  The page asks for an API token once (kept in the browser tab's
sessionStorage) and reads the same /v1 endpoints as the CLI.

The API's own pages, ``/docs`` (Swagger UI) and ``/redoc``, are served from this server too:
FastAPI's defaults load their script and style from cdn.jsdelivr.net, so on a cluster without
internet they were blank.  The files are fastapi-offline's copies (Swagger UI 5, which renders
FastAPI's OpenAPI 3.1; the swagger-ui-bundle package's 4.15 does not)."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
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


API_PAGES = Path(str(resources.files("fastapi_offline") / "static"))


@router.get("/docs")
def swagger(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_swagger_ui_html(openapi_url=f"{root}{request.app.openapi_url}", title="relaytrain API",
                               swagger_js_url=f"{root}/api-pages/swagger-ui-bundle.js",
                               swagger_css_url=f"{root}/api-pages/swagger-ui.css",
                               swagger_favicon_url=f"{root}/api-pages/favicon.png")


@router.get("/redoc")
def redoc(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    return get_redoc_html(openapi_url=f"{root}{request.app.openapi_url}", title="relaytrain API",
                          redoc_js_url=f"{root}/api-pages/redoc.standalone.js",
                          redoc_favicon_url=f"{root}/api-pages/favicon.png", with_google_fonts=False)


def mount(app: FastAPI) -> None:
    """The page, its files, and the API's pages (create the app with docs_url=None, redoc_url=None)."""
    app.include_router(router)
    app.mount("/static", _Static(directory=STATIC), name="static")
    app.mount("/api-pages", StaticFiles(directory=API_PAGES), name="api-pages")
