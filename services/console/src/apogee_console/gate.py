"""What every HTTP request passes before the app reads it: :class:`Gate` (pure ASGI, no task
per request), between :class:`~apogee_console.app._Observe` (which counts its answers and adds
the security headers) and the routes.

In order, each refusal an ``application/problem+json`` answer, counted in
``apogee_console_refusals_total`` by its reason:

1. **Host** (reason ``host``): the ``Host`` header must name a host of ``allowed_hosts``
   (:class:`~apogee_console.core.hosts.AllowedHosts`), else 421 Misdirected Request: the
   console is not configured to answer for that name (RFC 9110, 15.5.20). An action (a method
   but GET, HEAD and OPTIONS) whose ``Origin`` header names another host gets 403 (reason
   ``origin``): the host is right but the page that sent it is not the console's; a request
   without ``Origin`` (a script, curl) is fine. ``/healthz`` and ``/readyz`` answer any host:
   kubelet probes them by the pod's IP.
2. **Login** (reason ``unauthenticated`` or ``expired``): when login is required, a request to
   ``/api/v1/...`` (but ``/api/v1/session``, where one logs in) without a live session cookie
   gets 401 before a byte of its body is read.
3. **Body size** (reason ``too_large``): a body of at most :data:`MESSAGE_BODY_CAP` bytes to
   ``POST /api/v1/messages`` (a message of 4 MiB, base64 in JSON, with its keys and
   properties) and :data:`BODY_CAP` to anything else; 413 Content Too Large at once for a
   larger ``Content-Length``, and for a body without one (chunked) as soon as it passes the
   cap, the bytes counted as they arrive. The gate reads the body itself and hands it to the
   app whole; bodies over :data:`BODY_CAP` are read :data:`LARGE_BODIES` at a time (reason
   ``busy``: 503 after :data:`LARGE_BODY_WAIT_S` seconds of waiting for a turn), so that what
   any number of clients send at once stays within a few caps of memory.

A refusal of a request whose body is left unread is sent at once and says ``Connection:
close``: the client need not send the rest. Closing a connection the client still sends on
would reset it and could lose the answer, so the console first lingers (as web servers do): it
reads and drops what follows for at most :data:`LINGER_S` seconds and :data:`LINGER_BYTES`
bytes, never keeping more than one read's worth.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final

from starlette.datastructures import Headers
from starlette.requests import cookie_parser
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from apogee_console.api.deps import COOKIE, not_logged_in
from apogee_console.api.state import Console
from apogee_console.core.hosts import AllowedHosts, host_of
from apogee_console.problems import Problem, problem_response

KiB: Final = 1024
MiB: Final = 1024 * KiB
#: Most bytes of a request body (a login, a topic, a reset...), but :data:`MESSAGE_BODY_CAP`'s.
BODY_CAP: Final = 64 * KiB
#: Most bytes of ``POST /api/v1/messages``: a body of the producer's 4 MiB maximum is 5.33 MiB
#: in base64, and its keys, tags and properties (32 KiB encoded) fit in the rest.
MESSAGE_BODY_CAP: Final = 6 * MiB
#: How long, and how many bytes, a refused body is read and dropped before the connection
#: closes: a client that sends its whole body before it reads the answer (most libraries) and
#: whose body ends within these reads the refusal, not a reset connection.
LINGER_S: Final = 2.0
LINGER_BYTES: Final = 16 * MiB
#: Bodies over :data:`BODY_CAP` read at once (the others wait their turn, at most
#: :data:`LARGE_BODY_WAIT_S` seconds, then get 503): what reading them can hold stays bounded
#: whatever the number of clients that send them.
LARGE_BODIES: Final = 2
LARGE_BODY_WAIT_S: Final = 10.0
MESSAGES_ROUTE: Final = ("POST", "/api/v1/messages")
API_PREFIX: Final = "/api/v1/"
#: Where one logs in (and out): open to requests without a session.
LOGIN_PATH: Final = "/api/v1/session"
#: Probed by kubelet at the pod's IP: answer any host.
PROBES: Final = frozenset({"/healthz", "/readyz"})
SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
HOW_TO_ALLOW: Final = (
    "add it to allowed_hosts (APOGEE_CONSOLE_ALLOWED_HOSTS or --allowed-hosts; in the Helm "
    "chart console.allowedHosts)"
)


def body_cap(method: str, path: str) -> int:
    """The most bytes the body of ``method path`` may have."""
    return MESSAGE_BODY_CAP if (method, path.rstrip("/")) == MESSAGES_ROUTE else BODY_CAP


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n // KiB} KiB"


def too_large(method: str, path: str, cap: int) -> Problem:
    return Problem(
        413,
        "CONTENT_TOO_LARGE",
        f"request body: {method} {path} takes at most {cap} bytes ({_size(cap)}); send a "
        "smaller body",
        limit=cap,
    )


class Gate:
    """Checks each request's host, login and body size (see the module docstring)."""

    def __init__(self, app: ASGIApp, console: Console) -> None:
        self.app = app
        self.console = console
        s = console.settings
        self.hosts = AllowedHosts.of(s.allowed_hosts, s.listen)
        self.login_required = s.login_required
        self.large = asyncio.Semaphore(LARGE_BODIES)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        method: str = scope["method"]
        path: str = scope["path"]
        length = headers.get("content-length", "").strip()
        declared = int(length) if length.isdigit() else None
        has_body = bool(declared) or "chunked" in headers.get("transfer-encoding", "").lower()
        cap = body_cap(method, path)
        refusal = self._refusal(headers, method, path)
        if refusal is None and declared is not None and declared > cap:
            self.console.metrics.refusals.labels("too_large").inc()
            refusal = too_large(method, path, cap)
        if refusal is not None:
            await _answer(send, receive, refusal, unread=has_body)
        elif not has_body:
            await self.app(scope, receive, send)
        elif cap <= BODY_CAP or (declared is not None and declared <= BODY_CAP):
            await self._buffered(scope, receive, send, cap)
        else:
            await self._large(scope, receive, send, cap)

    def _refusal(self, headers: Headers, method: str, path: str) -> Problem | None:
        """The refusal of a request's host, origin or missing login, counted, or None."""
        metrics = self.console.metrics
        if path not in PROBES:
            sent = headers.get("host")
            if not self.hosts.allows(host_of(sent) if sent is not None else None):
                metrics.refusals.labels("host").inc()
                if sent is None:
                    detail = (
                        "the request has no Host header: send the name the console is reached by"
                    )
                else:
                    detail = (
                        f"host {sent!r}: the console does not answer to this name; if it is "
                        f"reached by it, {HOW_TO_ALLOW}"
                    )
                return Problem(421, "HOST_NOT_ALLOWED", detail, host=sent)
            origin = headers.get("origin")
            if (
                origin is not None
                and method not in SAFE_METHODS
                and not self.hosts.allows_origin(origin)
            ):
                metrics.refusals.labels("origin").inc()
                return Problem(
                    403,
                    "ORIGIN_NOT_ALLOWED",
                    f"origin {origin!r}: actions are taken from the console's own pages only; if "
                    f"its pages are served under that host, {HOW_TO_ALLOW}",
                    origin=origin,
                )
        if self.login_required and path.startswith(API_PREFIX) and path.rstrip("/") != LOGIN_PATH:
            token = cookie_parser(headers.get("cookie", "")).get(COOKIE)
            if self.console.sessions.get(token) is None:
                return not_logged_in(self.console, token)
        return None

    async def _large(self, scope: Scope, receive: Receive, send: Send, cap: int) -> None:
        """:meth:`_buffered` once one of the :data:`LARGE_BODIES` turns is free."""
        try:
            async with asyncio.timeout(LARGE_BODY_WAIT_S):
                await self.large.acquire()
        except TimeoutError:
            self.console.metrics.refusals.labels("busy").inc()
            busy = Problem(
                503,
                "UNAVAILABLE",
                f"request body: the console reads {LARGE_BODIES} bodies over "
                f"{_size(BODY_CAP)} at once, and this one waited {LARGE_BODY_WAIT_S:g} s for "
                "its turn; try again",
            )
            await _answer(send, receive, busy, unread=True)
            return
        try:
            await self._buffered(scope, receive, send, cap)
        finally:
            self.large.release()

    async def _buffered(self, scope: Scope, receive: Receive, send: Send, cap: int) -> None:
        """Read the body, then the app with it; past ``cap`` bytes, 413 and no app at all.

        Read here, not by the app: cutting a body the app reads would raise inside it, and
        an exception's traceback keeps what its frames read until the garbage collector runs.
        """
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk: bytes = message.get("body", b"")
            more = bool(message.get("more_body", False))
            size += len(chunk)
            if size > cap:
                chunks.clear()
                self.console.metrics.refusals.labels("too_large").inc()
                refusal = too_large(scope["method"], scope["path"], cap)
                await _answer(send, receive, refusal, unread=more)
                return
            if chunk:
                chunks.append(chunk)
        body = b"".join(chunks)
        chunks.clear()
        replayed = False

        async def replay() -> Message:
            nonlocal body, replayed
            if replayed:
                return await receive()
            replayed = True
            message, body = {"type": "http.request", "body": body, "more_body": False}, b""
            return message

        await self.app(scope, replay, send)


async def _answer(send: Send, receive: Receive, refusal: Problem, *, unread: bool) -> None:
    """Send ``refusal``; with ``unread`` (a body left unread), say ``Connection: close`` and
    linger before the end of the answer closes the connection (see the module docstring)."""
    response = problem_response(refusal.status, refusal.kind, refusal.detail, **refusal.extra)
    if refusal.status == 503:
        response.headers["retry-after"] = "1"
    if unread:
        response.headers["connection"] = "close"
    start = {"type": "http.response.start", "status": response.status_code}
    await send({**start, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body, "more_body": unread})
    if unread:
        await _discard(receive)
        await send({"type": "http.response.body", "body": b""})


async def _discard(receive: Receive) -> None:
    """Read and drop what follows of a refused body, for at most :data:`LINGER_S` seconds and
    :data:`LINGER_BYTES` bytes, or until the client stops sending."""
    dropped = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_S):
            while dropped <= LINGER_BYTES:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return
                dropped += len(message.get("body", b""))
