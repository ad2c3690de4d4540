"""``/api/v1/session``: log in (password or access key), who am I, log out."""

from __future__ import annotations

import math
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict

from apogee_console.api.deps import COOKIE, check_csrf, console, session
from apogee_console.api.state import Console, audit_line
from apogee_console.core.access import Role, Session
from apogee_console.problems import Problem

router = APIRouter(tags=["session"])


class Login(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user: str | None = None
    password: str | None = None
    access_key: str | None = None
    secret_key: str | None = None


def session_body(c: Console, s: Session) -> dict[str, Any]:
    return {
        "user": s.user,
        "role": s.role,
        "csrf": s.csrf,
        "expires_at": None if math.isinf(s.expires_at) else round(s.expires_at, 3),
        "auth": c.login_required,
        "via": s.via,
    }


def _verify(c: Console, body: Login) -> tuple[str, Role, str]:
    if body.user is not None or body.password is not None:
        if not body.user or body.password is None:
            raise Problem(
                400,
                "INVALID_ARGUMENT",
                "password: give user and password together",
                field="password" if body.user else "user",
            )
        role = c.users.verify(body.user, body.password) if c.users else None
        return body.user, role or "read", "password" if role else ""
    if body.access_key is not None or body.secret_key is not None:
        if not body.access_key or body.secret_key is None:
            raise Problem(
                400,
                "INVALID_ARGUMENT",
                "secret_key: give access_key and secret_key together",
                field="secret_key" if body.access_key else "access_key",
            )
        role = c.keys.verify(body.access_key, body.secret_key) if c.keys else None
        return body.access_key, role or "read", "access_key" if role else ""
    raise Problem(
        400,
        "INVALID_ARGUMENT",
        "user: give user and password, or access_key and secret_key",
        field="user",
    )


@router.post("/session")
async def login(body: Login, request: Request, response: Response) -> dict[str, Any]:
    c = console(request)
    if not c.login_required:
        return session_body(c, c.open_session)
    name, role, via = _verify(c, body)
    if not via:
        c.metrics.logins.labels("refused").inc()
        how = "password" if body.user is not None else "access_key"
        audit_line(name, "-", how, "log in", name, "refused")
        raise Problem(401, "UNAUTHENTICATED", "login refused: unknown user or wrong password")
    s = c.sessions.create(name, role, via)
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
