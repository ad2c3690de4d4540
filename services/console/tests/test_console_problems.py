"""What no handler expects (a bug, an error of a library) is still a problem+json answer: 500
``INTERNAL``, with its traceback in the console's log, never a plain-text "Internal Server
Error"; also when it is raised by a middleware outside the app's handlers."""

from __future__ import annotations

import logging

import httpx
import pytest
from console_support import assert_problem, console_app
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from apogee_console import problems

pytestmark = pytest.mark.unit


async def test_an_unexpected_error_is_a_500_problem_with_its_traceback_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def cluster() -> None:
        raise ValueError("Value out of range: 99999999999999999999999")

    async with console_app("127.0.0.1:1") as (app, client):
        monkeypatch.setattr(app.state.console.cluster, "cluster", cluster)
        with caplog.at_level(logging.ERROR, logger=problems.__name__):
            resp = await client.get("/api/v1/cluster")
    body = assert_problem(resp, 500, "INTERNAL")
    assert body["detail"] == (
        "the console failed to answer GET /api/v1/cluster: an unexpected error, logged with its "
        "traceback on the console; try again, and report it if it persists"
    )
    [record] = [r for r in caplog.records if r.name == problems.__name__]
    assert record.getMessage() == "GET /api/v1/cluster failed"
    assert record.exc_info is not None
    assert "ValueError: Value out of range" in caplog.text


class _Broken:
    """A middleware that fails on ``/broken``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/broken":
            raise RuntimeError("a middleware failed")
        await self.app(scope, receive, send)


async def test_an_error_outside_the_handlers_is_a_500_problem_too() -> None:
    app = FastAPI()
    problems.install(app)
    app.add_middleware(_Broken)  # outside problems.CatchAll
    # the server (uvicorn) gets the exception after the answer, and logs it
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://console") as client:
        resp = await client.get("/broken")
    assert assert_problem(resp, 500, "INTERNAL")["detail"].startswith(
        "the console failed to answer GET /broken: "
    )
