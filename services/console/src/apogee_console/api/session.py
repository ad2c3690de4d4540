"""``/api/v1/session``: log in (password or access key), who am I, log out.

A login first asks the login limits (:mod:`apogee_console.core.logins`): a locked-out name or
address is refused with 429 ``TOO_MANY_LOGINS`` and ``Retry-After`` before any password is
checked. A password is checked off the event loop (:class:`PasswordChecks`); too many checks
at once: 503 ``UNAVAILABLE``, as when ``max_sessions`` sessions are live. Each refusal is an
audit line and counted in ``apogee_console_logins_total{result}``."""

from __future__ import annotations

import math
from typing import Annotated, Any, Final, Literal

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from apogee_console.api.deps import COOKIE, check_csrf, console, session
from apogee_console.api.state import Console, audit_line
from apogee_console.core.access import Role, Session, SessionsFull
from apogee_console.core.logins import RETRY_SOON_S, Busy, Refusal
from apogee_console.problems import Problem, problem_response

router = APIRouter(tags=["session"])

#: The longest user name (access key) and password (secret key) a login may give.
MAX_NAME: Final = 256
MAX_SECRET: Final = 1024

How = Literal["password", "access_key"]


class Login(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user: str | None = Field(None, max_length=MAX_NAME)
    password: str | None = Field(None, max_length=MAX_SECRET)
    access_key: str | None = Field(None, max_length=MAX_NAME)
    secret_key: str | None = Field(None, max_length=MAX_SECRET)


def session_body(c: Console, s: Session) -> dict[str, Any]:
    return {
        "user": s.user,
        "role": s.role,
        "csrf": s.csrf,
        "expires_at": None if math.isinf(s.expires_at) else round(s.expires_at, 3),
        "auth": c.login_required,
        "via": s.via,
    }


def _credentials(body: Login) -> tuple[How, str, str]:
    """How the visitor logs in, as whom, with what secret (400 when half given)."""
    if body.user is not None or body.password is not None:
        if not body.user or body.password is None:
            raise Problem(
                400,
                "INVALID_ARGUMENT",
                "password: give user and password together",
                field="password" if body.user else "user",
            )
        return "password", body.user, body.password
    if body.access_key is not None or body.secret_key is not None:
        if not body.access_key or body.secret_key is None:
            raise Problem(
                400,
                "INVALID_ARGUMENT",
                "secret_key: give access_key and secret_key together",
                field="secret_key" if body.access_key else "access_key",
            )
        return "access_key", body.access_key, body.secret_key
    raise Problem(
        400,
        "INVALID_ARGUMENT",
        "user: give user and password, or access_key and secret_key",
        field="user",
    )


async def _check(c: Console, how: How, name: str, secret: str) -> Role | None:
    """The role of a right login, else None; :class:`Busy` when too many checks wait."""
    if how == "password":
        users = c.users
        if users is None:
            return None
        return await c.password_checks.run(lambda: users.verify(name, secret))
    return c.keys.verify(name, secret) if c.keys else None


def _retry_later(status: int, kind: str, detail: str, retry_after_s: int) -> JSONResponse:
    response = problem_response(status, kind, detail, retry_after=retry_after_s)
    response.headers["Retry-After"] = str(retry_after_s)
    return response


def _refused(c: Console, how: How, name: str, address: str, r: Refusal) -> JSONResponse:
    who = f"{'user' if how == 'password' else 'access key'} {name!r}"
    if r.side == "address":
        why = f"too many failed logins from address {address}"
    elif r.locked:
        why = f"too many failed logins of {who}"
    else:
        why = f"too many logins of {who} at once"
    c.metrics.logins.labels("locked").inc()
    audit_line(
        name, "-", how, "log in", name, f"locked: {why}, {r.retry_after_s} s left; from {address}"
    )
    return _retry_later(
        429,
        "TOO_MANY_LOGINS",
        f"login refused: {why}; try again in {r.retry_after_s} s (the console's login_* "
        "settings set the limits)",
        r.retry_after_s,
    )


@router.post("/session", response_model=None)
async def login(body: Login, request: Request, response: Response) -> dict[str, Any] | JSONResponse:
    c = console(request)
    if not c.login_required:
        return session_body(c, c.open_session)
    how, name, secret = _credentials(body)
    address = request.client.host if request.client else "-"
    key = f"{how}:{name}"
    refusal = c.login_limits.begin(key, address)
    if refusal is not None:
        return _refused(c, how, name, address, refusal)
    ok: bool | None = None
    try:
        role = await _check(c, how, name, secret)
        ok = role is not None
    except Busy:
        c.metrics.logins.labels("busy").inc()
        audit_line(name, "-", how, "log in", name, f"busy: too many logins at once, from {address}")
        return _retry_later(
            503,
            "UNAVAILABLE",
            f"login refused: too many logins at once; try again in {RETRY_SOON_S} s",
            RETRY_SOON_S,
        )
    finally:
        lockouts = c.login_limits.end(key, address, ok)
    if role is None:
        c.metrics.logins.labels("refused").inc()
        outcome = f"refused from {address}"
        for lockout in lockouts:
            c.metrics.lockouts.labels(lockout.side).inc()
            outcome += f"; {lockout.side} locked out for {lockout.seconds:g} s"
        audit_line(name, "-", how, "log in", name, outcome)
        raise Problem(401, "UNAUTHENTICATED", "login refused: unknown user or wrong password")
    try:
        s = c.sessions.create(name, role, how)
    except SessionsFull as full:
        wait = math.ceil(full.retry_after_s)
        c.metrics.logins.labels("full").inc()
        audit_line(name, role, how, "log in", name, f"full: {full.limit} sessions are live")
        return _retry_later(
            503,
            "UNAVAILABLE",
            f"login refused: {full.limit} sessions are live, the console's max_sessions; try "
            f"again in {wait} s (when the oldest expires), or raise max_sessions",
            wait,
        )
    c.metrics.logins.labels("ok").inc()
    c.audit(s, "log in", name, "ok")
    response.set_cookie(
        COOKIE,
        s.token,
        max_age=int(c.settings.session_ttl_s),
        path="/",
        httponly=True,
        samesite="strict",
        secure=c.settings.https,
    )
    return session_body(c, s)


@router.get("/session")
async def whoami(request: Request, s: Annotated[Session, Depends(session)]) -> dict[str, Any]:
    return session_body(console(request), s)


@router.delete("/session")
async def logout(request: Request, response: Response) -> dict[str, Any]:
    c = console(request)
    token = request.cookies.get(COOKIE)
    s = c.sessions.get(token)
    if s is not None:
        check_csrf(request, s)
        c.sessions.delete(token)
        c.audit(s, "log out", s.user, "ok")
    response.delete_cookie(
        COOKIE, path="/", httponly=True, samesite="strict", secure=c.settings.https
    )
    return {"logged_out": s is not None}
