"""The console's FastAPI app (wiring only): :func:`create_app`.

- ``/api/v1/...``: the REST API (:mod:`apogee_console.api`), OpenAPI at ``/docs`` and
  ``/openapi.json``; every error ``application/problem+json`` (:mod:`apogee_console.problems`);
- ``/healthz`` (the process serves), ``/readyz`` (a nameserver answers), unauthenticated;
- before any of them, :class:`~apogee_console.gate.Gate`: the Host (and an action's Origin)
  must be one of ``allowed_hosts``, ``/api/v1`` needs a login before its body is read (when
  login is required), and bodies have a size cap;
- ``/`` and ``/ui/{page}``: the single-page app's ``static/index.html``; ``/static/...``: its
  files (package data of ``apogee_console``).

The app's lifespan starts the sampler (when charts are not read from Prometheus) and closes the
cluster's connections on shutdown. Every answer counts in the console's metrics by route
template and status, and carries headers that keep it out of other sites' frames.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Final

from fastapi import FastAPI
from fastapi.responses import FileResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from apogee.rpc.security import ClientSecurity
from apogee_console import problems
from apogee_console.api import act, read, session
from apogee_console.api.state import Console
from apogee_console.gate import Gate
from apogee_console.metrics import ConsoleMetrics
from apogee_console.settings import ConsoleSettings

API_PREFIX: Final = "/api/v1"
SECURITY_HEADERS: Final[tuple[tuple[bytes, bytes], ...]] = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
)
#: Not on /docs, whose page loads Swagger UI from a CDN.
CSP: Final = (
    b"content-security-policy",
    b"default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
    b"frame-ancestors 'none'",
)


def static_dir() -> Path:
    return Path(str(resources.files("apogee_console") / "static"))


class _Observe:
    """Counts each HTTP answer by route template and status, times it, and adds
    :data:`SECURITY_HEADERS` (pure ASGI: no per-request task)."""

    def __init__(self, app: ASGIApp, metrics: ConsoleMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def wrapped(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.extend(SECURITY_HEADERS)
                if not scope["path"].startswith("/docs"):
                    headers.append(CSP)
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, wrapped)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None)
            if path and scope["path"].startswith(API_PREFIX + "/"):
                path = API_PREFIX + path  # routes of included routers know only their own part
            template = path or (
                "/static/*" if scope["path"].startswith("/static/") else "unmatched"
            )
            self.metrics.requests.labels(template, scope["method"], str(status)).inc()
            self.metrics.latency.labels(template).observe(time.perf_counter() - start)


def create_app(
    settings: ConsoleSettings,
    *,
    clock: Callable[[], float] = time.time,
    security: ClientSecurity | None = None,
    metrics: ConsoleMetrics | None = None,
) -> FastAPI:
    """The app of ``settings``; ``clock`` (epoch seconds) drives sessions and sampling;
    ``security`` overrides how the cluster is called (default: the settings' TLS and
    ``auth_credentials_file``)."""
    console = Console(settings, clock=clock, security=security, metrics=metrics)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await console.start()
        try:
            yield
        finally:
            await console.stop()

    app = FastAPI(
        title="Apogee console",
        version="1",
        lifespan=lifespan,
        openapi_url="/openapi.json",
        docs_url="/docs",
        redoc_url=None,
    )
    app.state.console = console
    problems.install(app)
    app.include_router(session.router, prefix=API_PREFIX)
    app.include_router(read.router, prefix=API_PREFIX)
    app.include_router(act.router, prefix=API_PREFIX)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> PlainTextResponse:
        if await console.cluster.ready():
            return PlainTextResponse("ready")
        return PlainTextResponse("not ready: no nameserver answers", status_code=503)

    static = static_dir()
    index = static / "index.html"

    def index_page() -> FileResponse:
        return FileResponse(index, media_type="text/html", headers={"Cache-Control": "no-cache"})

    @app.get("/", include_in_schema=False)
    async def root() -> FileResponse:
        return index_page()

    @app.get("/ui/{page:path}", include_in_schema=False)
    async def ui(page: str) -> FileResponse:
        return index_page()

    app.mount("/static", StaticFiles(directory=static), name="static")
    app.add_middleware(Gate, console=console)  # inside _Observe: its refusals are counted too
    app.add_middleware(_Observe, metrics=console.metrics)
    return app
