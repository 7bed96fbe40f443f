"""The FastAPI application: routes, auth, limits, telemetry."""
from __future__ import annotations

import json
import logging
import math
import time
from contextlib import asynccontextmanager
from typing import Optional

import yaml
from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from api.errors import JobError
from api.jobs import JobManager
from api.routes import health, jobs, packages, timeline, ui
from service import logtext
from service.auth import Authenticator, Weights, load_tokens
from service.settings import Settings
from service.spec import error_message, read_yaml

_log = logging.getLogger("uvicorn.error")  # the server's own log
from service.states import JobState
from service.store import Store


class _StoreCounters:
    """Counters read from the job store at scrape time (every API replica reports the same)."""

    def __init__(self):
        self.store: Optional[Store] = None

    def collect(self):
        if self.store is None:
            return
        c = CounterMetricFamily("relaytrain_reshapes", "reshapes of jobs in the store (all tenants)")
        c.add_metric([], self.store.count_events("reshape"))
        yield c
        r = CounterMetricFamily("relaytrain_restarts", "restarts of jobs in the store (a lost scheduler, or a fixed-shape "
                                "job's lost worker; all tenants)")
        r.add_metric([], self.store.count_events("restarted"))
        yield r


class Telemetry:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.store_counters = _StoreCounters()
        self.registry.register(self.store_counters)
        self.jobs = Gauge("relaytrain_jobs", "jobs in the store by state", ["state"], registry=self.registry)
        self.requests = Counter("relaytrain_http_requests_total", "HTTP requests", ["method", "route", "status"],
                                registry=self.registry)
        self.latency = Histogram("relaytrain_http_request_seconds", "HTTP request latency", ["method", "route"],
                                 registry=self.registry)

    def refresh(self, store: Store) -> None:
        self.store_counters.store = store
        counts = store.count_by_state()
        for s in JobState:
            self.jobs.labels(state=s.value).set(counts.get(s.value, 0))


class BodyLimit:
    """ASGI middleware: a request body larger than its route's limit is a 413, whether the
    client sent Content-Length or streamed it in chunks."""

    def __init__(self, app, limit_for):
        self.app, self.limit_for = app, limit_for

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_for(scope["path"])
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise HTTPException(413, f"request body over the limit of {limit} bytes")
            return message

        await self.app(scope, limited_receive, send)


def json_safe(value):
    """``value`` with every non-finite float written as its text ("nan", "inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class SpecBody:
    """ASGI middleware for POST /v1/jobs: the spec comes as JSON (also with no Content-Type), or
    as YAML (what a spec file holds; Content-Type application/yaml), passed on as JSON; any other
    body is a 415 saying how to send it (``curl -d`` sends form data unless told otherwise)."""

    YAML = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml")

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].rstrip("/") != "/v1/jobs":
            return await self.app(scope, receive, send)
        # the metrics' route label: the router writes its match into the copies below, or this
        # answers before it (400, 415), so the metrics middleware outside reads it from here
        scope["relaytrain.route"] = "/v1/jobs"
        headers = dict(scope["headers"])
        ctype = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        if not ctype:  # no Content-Type (python requests' data=, some scripts): read as JSON, which it is
            scope = dict(scope, headers=[*scope["headers"], (b"content-type", b"application/json")])
            return await self.app(scope, receive, send)
        if ctype == "application/json" or ctype.endswith("+json"):
            return await self.app(scope, receive, send)
        if ctype not in self.YAML:
            return await JSONResponse(
                {"detail": f"POST /v1/jobs takes the job spec as JSON (Content-Type: application/json) or YAML "
                           f"(Content-Type: application/yaml), not {ctype}; e.g. curl -H 'Content-Type: "
                           "application/yaml' --data-binary @spec.yaml"}, status_code=415)(scope, receive, send)
        body, more = b"", True
        try:
            while more:
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
        except HTTPException as e:  # BodyLimit's 413, raised here outside the routes' handlers
            return await JSONResponse({"detail": e.detail}, status_code=e.status_code)(scope, receive, send)
        try:
            # bounded (a few hundred aliased bytes can stand for billions), and off the event loop
            data = await run_in_threadpool(read_yaml, body.decode("utf-8"))
            text = json.dumps(data).encode()
        except (yaml.YAMLError, UnicodeDecodeError, TypeError, ValueError) as e:
            return await JSONResponse({"detail": f"the body is not a YAML job spec: {e}"},
                                      status_code=400)(scope, receive, send)
        scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k not in (b"content-type", b"content-length")]
                     + [(b"content-type", b"application/json"), (b"content-length", str(len(text)).encode())])
        sent = False

        async def as_json():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": text, "more_body": False}

        await self.app(scope, as_json, send)


def _plain(e: dict) -> dict:
    """One of pydantic's errors as the CLI says it (service/spec.py ``format_validation_error``):
    an unknown field is "unknown field (check its spelling)", not "Extra inputs are not
    permitted"; and an error about the whole body does not echo the whole spec back."""
    e = {**e, "msg": error_message(e)}
    if isinstance(e.get("input"), dict) and (tuple(e.get("loc") or ()) == ("body",) or e.get("type") == "missing"):
        e.pop("input")  # the whole body, or the object a missing field belongs in: nothing the user needs back
    return e


def create_app(settings: Optional[Settings] = None, connect_ray: bool = True) -> FastAPI:
    settings = settings or Settings()
    settings.home.mkdir(parents=True, exist_ok=True)
    store = Store(settings.db_url)
    weights = Weights(settings.api_tokens, settings.tokens_file, settings.tenant_weights, settings.weights_file)
    manager = JobManager(settings, store, weights.current)
    auth = Authenticator(load_tokens(settings.api_tokens, settings.tokens_file), settings.api_tokens,
                         settings.tokens_file)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if connect_ray:
            manager.connect()
            manager.start_background()
        yield
        manager.stop_background()

    app = FastAPI(title="relaytrain", version="0.1.0", lifespan=lifespan,
                  docs_url=None, redoc_url=None,  # served by ui.mount from this server, not a CDN
                  description="Elastic data x pipeline parallel training on Ray. Send "
                              "'Authorization: Bearer <token>' on every /v1 call.")
    app.state.manager, app.state.auth, app.state.settings, app.state.weights = manager, auth, settings, weights
    app.state.telemetry = Telemetry()

    def body_limit(path: str) -> int:
        return settings.max_package_bytes if path.startswith("/v1/packages") else settings.max_body_bytes

    app.add_middleware(SpecBody)  # inside BodyLimit: a YAML body is read only within the limit
    app.add_middleware(BodyLimit, limit_for=body_limit)

    @app.middleware("http")
    async def limits_and_telemetry(request: Request, call_next):
        t0 = time.perf_counter()
        length = request.headers.get("content-length")
        limit = body_limit(request.url.path)
        status = 500  # what the client gets when the route raises (counted too, then raised on)
        try:
            if length is not None and (not length.isdigit() or int(length) > limit):
                response = JSONResponse({"detail": f"request body over the limit of {limit} bytes"}, status_code=413)
            else:
                response = await call_next(request)
            status = response.status_code
            return response
        finally:
            path = getattr(request.scope.get("route"), "path", None) or request.scope.get("relaytrain.route", "unmatched")
            tel = request.app.state.telemetry
            tel.requests.labels(request.method, path, str(status)).inc()
            tel.latency.labels(request.method, path).observe(time.perf_counter() - t0)

    @app.exception_handler(JobError)
    async def job_error(_request: Request, exc: JobError):
        return JSONResponse({"detail": exc.message}, status_code=exc.status)

    from sqlalchemy.exc import InterfaceError, OperationalError, TimeoutError as PoolTimeout

    @app.exception_handler(OperationalError)
    @app.exception_handler(InterfaceError)
    @app.exception_handler(PoolTimeout)
    async def store_down(_request: Request, exc: Exception):
        """The job store does not answer (PostgreSQL stopped, its network gone, SQLite's disk
        gone): a 503 a client retries, saying so, not a bare 500 "Internal Server Error" (a user
        trial); the jobs train on meanwhile.  The client gets the error's kind; its text (hosts,
        users) goes to the server's log.  Other database errors (a constraint, a bug) stay 500s."""
        orig = getattr(exc, "orig", None) or exc
        first = logtext.first_line(orig)
        _log.warning("the job store does not answer: %s: %s", type(orig).__name__, first[:300])
        return JSONResponse({"detail": f"the job store does not answer ({type(orig).__name__}); the jobs train on, "
                                       "try again shortly (GET /readyz says when it is back)"},
                            status_code=503, headers={"Retry-After": "5"})

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError):
        """FastAPI's 422, whatever the body held: a NaN or an infinity it echoes is written as
        text (JSON has no such numbers, and writing one would turn the 422 into a 500).  A body
        that is not JSON at all is a 400, as YAML that does not parse is (it was a 422 whose
        detail said only "JSON decode error")."""
        errors = exc.errors()
        bad = next((e for e in errors if e.get("type") == "json_invalid"), None)
        if bad is not None:
            loc = bad.get("loc") or ()
            at = f" at character {loc[1]}" if len(loc) > 1 and isinstance(loc[1], int) else ""
            why = (bad.get("ctx") or {}).get("error") or bad.get("msg")
            return JSONResponse({"detail": f"the body is not JSON: {why}{at}; send the job spec as JSON "
                                           "(Content-Type: application/json) or as YAML (Content-Type: "
                                           "application/yaml)"}, status_code=400)
        return JSONResponse({"detail": json_safe(jsonable_encoder([_plain(e) for e in errors]))}, status_code=422)

    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(packages.router)
    app.include_router(timeline.router)
    ui.mount(app)
    return app
