"""The FastAPI application: routes, auth, limits, telemetry."""
from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from api.errors import JobError
from api.jobs import JobManager
from api.routes import health, jobs, packages, timeline, ui
from service.auth import Authenticator, load_tokens, load_weights
from service.settings import Settings
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


def create_app(settings: Optional[Settings] = None, connect_ray: bool = True) -> FastAPI:
    settings = settings or Settings()
    settings.home.mkdir(parents=True, exist_ok=True)
    store = Store(settings.db_url)
    manager = JobManager(settings, store, load_weights(settings.api_tokens, settings.tokens_file,
                                                       settings.tenant_weights, settings.weights_file))
    auth = Authenticator(load_tokens(settings.api_tokens, settings.tokens_file))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if connect_ray:
            manager.connect()
            manager.start_background()
        yield
        manager.stop_background()

    app = FastAPI(title="relaytrain", version="0.1.0", lifespan=lifespan,
                  description="Elastic data x pipeline parallel training on Ray. Send "
                              "'Authorization: Bearer <token>' on every /v1 call.")
    app.state.manager, app.state.auth, app.state.settings = manager, auth, settings
    app.state.telemetry = Telemetry()

    def body_limit(path: str) -> int:
        return settings.max_package_bytes if path.startswith("/v1/packages") else settings.max_body_bytes

    app.add_middleware(BodyLimit, limit_for=body_limit)

    @app.middleware("http")
    async def limits_and_telemetry(request: Request, call_next):
        t0 = time.perf_counter()
        length = request.headers.get("content-length")
        limit = body_limit(request.url.path)
        if length is not None and (not length.isdigit() or int(length) > limit):
            response = JSONResponse({"detail": f"request body over the limit of {limit} bytes"}, status_code=413)
        else:
            response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        tel = request.app.state.telemetry
        tel.requests.labels(request.method, path, str(response.status_code)).inc()
        tel.latency.labels(request.method, path).observe(time.perf_counter() - t0)
        return response

    @app.exception_handler(JobError)
    async def job_error(_request: Request, exc: JobError):
        return JSONResponse({"detail": exc.message}, status_code=exc.status)

    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(packages.router)
    app.include_router(timeline.router)
    ui.mount(app)
    return app
