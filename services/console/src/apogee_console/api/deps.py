"""Who is asking: the session of a request, and the checks of an action (CSRF, role)."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Coroutine
from typing import Any, Final

from fastapi import Request

from apogee_console.api.state import Console
from apogee_console.core.access import Session
from apogee_console.problems import Problem

COOKIE: Final = "apogee_session"
CSRF_HEADER: Final = "X-CSRF-Token"


def console(request: Request) -> Console:
    c: Console = request.app.state.console
    return c


async def session(request: Request) -> Session:
    """The caller's live session; 401 without one (none, unknown or expired)."""
    c = console(request)
    if not c.login_required:
        return c.open_session
    token = request.cookies.get(COOKIE)
    s = c.sessions.get(token)
    if s is None:
        raise not_logged_in(c, token)
    return s


def not_logged_in(c: Console, token: str | None) -> Problem:
    """The 401 of a request without a live session (``token``: its cookie), counted."""
    c.metrics.refusals.labels("expired" if token else "unauthenticated").inc()
    return Problem(
        401,
        "UNAUTHENTICATED",
        "not logged in: log in with POST /api/v1/session"
        + (" (the session expired or is unknown)" if token else ""),
    )


def check_csrf(request: Request, s: Session) -> None:
    sent = request.headers.get(CSRF_HEADER, "")
    if not sent or not hmac.compare_digest(sent.encode(), s.csrf.encode()):
        console(request).metrics.refusals.labels("csrf").inc()
        raise Problem(
            403,
            "CSRF",
            f"the {CSRF_HEADER} header is missing or does not match the session's csrf token "
            "(GET /api/v1/session gives it)",
        )


def actor(action: str) -> Callable[[Request], Coroutine[Any, Any, Session]]:
    """A dependency for an action: a live session, a matching CSRF header, role admin."""

    async def check(request: Request) -> Session:
        s = await session(request)
        check_csrf(request, s)
        if s.role != "admin":
            c = console(request)
            c.metrics.refusals.labels("role").inc()
            c.audit(s, action, request.url.path, "refused: role read")
            raise Problem(
                403,
                "PERMISSION_DENIED",
                f"user {s.user!r} has role {s.role}; role admin is needed to {action}",
            )
        return s

    return check
