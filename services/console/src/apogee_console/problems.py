"""Every error the API answers is ``application/problem+json`` (RFC 9457)::

    {"type": "https://apogee.dev/problems/<kind-lowercase>", "title": "<KIND>",
     "status": <http>, "detail": "<the sentence the CLI prints>", "kind": "<KIND>"}

:func:`status_of` maps an :class:`~apogee.common.errors.ApogeeError`'s kind to its HTTP status
(by its gRPC code: INVALID_ARGUMENT 400, NOT_FOUND 404, PERMISSION_DENIED 403,
UNAUTHENTICATED 401, FAILED_PRECONDITION 409, UNAVAILABLE and DEADLINE_EXCEEDED 503, anything
else 500); the handlers installed by :func:`install` answer ApogeeErrors, :class:`Problem`
(the console's own refusals), FastAPI's validation errors (400, naming the field) and
Starlette's HTTP errors (404 for an unknown path, 405...).

Any other exception is a bug: :class:`CatchAll` (a middleware :func:`install` adds) logs its
traceback and answers 500 ``INTERNAL`` as problem+json, never Starlette's plain-text "Internal
Server Error". What is raised outside it (in a middleware added after :func:`install`) gets the
same answer from the app's outermost handler, and the server logs that traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any, Final

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from apogee.common.errors import ApogeeError

log = logging.getLogger(__name__)

MEDIA_TYPE: Final = "application/problem+json"
TYPE_BASE: Final = "https://apogee.dev/problems/"
#: The kind of a 500 for an unexpected exception.
INTERNAL: Final = "INTERNAL"

_BY_CODE: Final = {
    "INVALID_ARGUMENT": 400,
    "NOT_FOUND": 404,
    "PERMISSION_DENIED": 403,
    "UNAUTHENTICATED": 401,
    "FAILED_PRECONDITION": 409,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 503,
}


class Problem(Exception):
    """A refusal of the console itself (not logged in, CSRF, role...)."""

    def __init__(self, status: int, kind: str, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.kind = kind
        self.detail = detail
        self.extra = extra


def status_of(err: ApogeeError) -> int:
    return _BY_CODE.get(err.kind.code, 500)


def problem_response(status: int, kind: str, detail: str, **extra: Any) -> JSONResponse:
    body = {
        "type": TYPE_BASE + kind.lower(),
        "title": kind,
        "status": status,
        "detail": detail,
        "kind": kind,
        **extra,
    }
    return JSONResponse(body, status_code=status, media_type=MEDIA_TYPE)


def _field(loc: Sequence[Any]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    return ".".join(parts) or "body"


async def _apogee(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApogeeError)
    status = status_of(exc)
    if status == 500:
        log.error("request failed: %s", exc)
    return problem_response(status, exc.kind.name, str(exc))


async def _problem(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Problem)
    return problem_response(exc.status, exc.kind, exc.detail, **exc.extra)


async def _validation(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    field = _field(first.get("loc", ()))
    detail = f"{field}: {first.get('msg', 'invalid')}"
    if len(errors) > 1:
        detail += f" (and {len(errors) - 1} more)"
    return problem_response(
        400,
        "INVALID_ARGUMENT",
        detail,
        field=field,
        errors=[{"field": _field(e.get("loc", ())), "rule": e.get("msg", "")} for e in errors],
    )


async def _http(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    try:
        phrase = HTTPStatus(exc.status_code).phrase
    except ValueError:
        phrase = "Error"
    kind = {404: "NOT_FOUND", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED"}.get(
        exc.status_code, phrase.upper().replace(" ", "_")
    )
    detail = exc.detail if isinstance(exc.detail, str) else phrase
    response = problem_response(exc.status_code, kind, detail)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


def _internal(request: Request | Scope) -> JSONResponse:
    method, path = request["method"], request["path"]
    return problem_response(
        500,
        INTERNAL,
        f"the console failed to answer {method} {path}: an unexpected error, logged with its "
        "traceback on the console; try again, and report it if it persists",
    )


class CatchAll:
    """Answers an exception no handler took with a 500 problem, logging its traceback (pure
    ASGI); once the answer has started, the exception goes on (the connection is closed)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            log.exception("%s %s failed", scope["method"], scope["path"])
            if started:
                raise
            await _internal(scope)(scope, receive, send)


async def _outermost(request: Request, _exc: Exception) -> JSONResponse:
    return _internal(request)


def install(app: FastAPI) -> None:
    app.add_exception_handler(ApogeeError, _apogee)
    app.add_exception_handler(Problem, _problem)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _outermost)
    app.add_middleware(CatchAll)
