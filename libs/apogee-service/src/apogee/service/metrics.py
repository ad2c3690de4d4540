"""The services' Prometheus plumbing (``prometheus-client``).

- :func:`new_registry`: the registry of one app. Each app owns its own
  :class:`~prometheus_client.CollectorRegistry` (never the library's global one), so several
  brokers in one process (the in-process test cluster) do not collide; the standard process,
  platform and GC collectors are registered on it, and per-thread CPU, wake-ups and
  preemptions (:mod:`apogee.service.thread_metrics`).
- :class:`MetricsServer`: serves ``/metrics`` of a registry over HTTP on the service's
  ``metrics_listen`` address (``host:port``; port 0 picks a free port; empty: no endpoint).
  :meth:`MetricsServer.start` raises :class:`OSError` naming the address when it cannot bind
  (the service's start fails, as for its gRPC port); :meth:`MetricsServer.stop` is bounded.
  Given a certificate and key (the service's ``tls_cert_file`` and ``tls_key_file``) it serves
  HTTPS only: the handshake runs on each connection's own thread (bounded by
  :data:`HANDSHAKE_TIMEOUT_S`), so a client that stalls it holds up no other scrape. With
  ``ca_file`` and ``client_auth`` (``optional``: a client certificate is asked for and checked
  when presented; ``require``: no scrape without one) it verifies scrapers. The files are
  stat'ed (through symlinks: a Kubernetes Secret update) at most once a second, on a
  connection; when they changed, a new :class:`ssl.SSLContext` is built from them and serves
  the connections that follow, while files that do not check out (half written, a key that
  does not match) keep the previous one, with one WARNING per change.
- :func:`start_metrics_from`: a started :class:`MetricsServer` as a service's settings say
  (``metrics_listen`` and the TLS settings), or None when ``metrics_listen`` is empty.
- :func:`on_loop`: runs a function on the service's event loop from the scrape thread and waits
  for its result with a bound, so that a collector reads the loop's objects where they live.
- :func:`auth_refusals`: ``apogee_auth_refusals_total``, counted by the auth interceptor
  (:mod:`apogee.service.access`).
- :func:`session_failures`: ``<prefix>_session_failures_total`` of a service that keeps a
  session per broker (:mod:`apogee.service.workers`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import Any, Final, Protocol, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import MetricsHandler

from apogee.common.errors import InvalidArgumentError
from apogee.common.tls_files import PemFile, check_key_pair, stamp
from apogee.service.thread_metrics import TASKS, ThreadCollector

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long :meth:`MetricsServer.stop` waits for the serving thread.
STOP_TIMEOUT_S: Final = 2.0
#: How long a client of the HTTPS endpoint may take over its handshake and its request.
HANDSHAKE_TIMEOUT_S: Final = 10.0
#: The certificate files are looked at (stat) at most this often.
TLS_CHECK_INTERVAL_S: Final = 1.0
#: The values of ``client_auth``.
CLIENT_AUTH_MODES: Final = ("none", "optional", "require")


def new_registry() -> CollectorRegistry:
    """A registry of its own for one app, with the process, platform and GC collectors and the
    process's threads (:mod:`apogee.service.thread_metrics`, on Linux)."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    if TASKS.is_dir():
        registry.register(ThreadCollector())
    return registry


def split_listen(listen: str) -> tuple[str, int]:
    """``host:port`` (host may be ``[::1]``) as (host, port)."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


class MetricsTls:
    """The TLS of a metrics endpoint: the current :class:`ssl.SSLContext`, rebuilt when the
    files change (see the module docstring). :class:`InvalidArgumentError` names the setting
    when the files are not usable at the start."""

    def __init__(
        self, cert_file: str, key_file: str, ca_file: str = "", client_auth: str = "none"
    ) -> None:
        if client_auth not in CLIENT_AUTH_MODES:
            raise InvalidArgumentError(
                field="tls_client_auth",
                rule=f"{client_auth!r} is not one of {', '.join(CLIENT_AUTH_MODES)}",
            )
        if client_auth != "none" and not ca_file:
            raise InvalidArgumentError(
                field="tls_ca_file", rule=f"must be set when tls_client_auth is {client_auth}"
            )
        self.client_auth = client_auth
        self.files: tuple[PemFile, ...] = (
            PemFile("tls_cert_file", cert_file),
            PemFile("tls_key_file", key_file),
        )
        if ca_file:
            self.files += (PemFile("tls_ca_file", ca_file),)
        self._lock = threading.Lock()
        self._stamp = stamp(self.files)
        self._context = self._load()
        self._checked_at = time.monotonic()
        #: how many times new files were taken
        self.reloads = 0

    def _load(self) -> ssl.SSLContext:
        cert, key, *ca = self.files
        ctx = check_key_pair(cert, key, ca[0] if ca else None)
        ctx.verify_mode = {
            "none": ssl.CERT_NONE,
            "optional": ssl.CERT_OPTIONAL,
            "require": ssl.CERT_REQUIRED,
        }[self.client_auth]
        return ctx

    def context(self) -> ssl.SSLContext:
        """The context for a new connection (the files looked at again when the last look is
        :data:`TLS_CHECK_INTERVAL_S` old)."""
        if time.monotonic() - self._checked_at < TLS_CHECK_INTERVAL_S:
            return self._context
        with self._lock:
            if time.monotonic() - self._checked_at >= TLS_CHECK_INTERVAL_S:
                self._refresh_locked()
            return self._context

    def _refresh_locked(self) -> None:
        self._checked_at = time.monotonic()
        now = stamp(self.files)
        if now == self._stamp:
            return
        try:
            ctx = self._load()
        except InvalidArgumentError as err:
            if stamp(self.files) == now:  # not in the middle of a change: say it once
                self._stamp = now
                log.warning(
                    "metrics TLS files changed but cannot be used, keeping the previous: %s", err
                )
            return
        if stamp(self.files) != now:
            return  # changed while read: read again at the next look
        self._stamp, self._context = now, ctx
        self.reloads += 1
        log.info("metrics TLS certificate reloaded from %s", self.files[0].path)


class _HttpServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` with prometheus_client's handler; over TLS when ``tls`` is set,
    the handshake done on the connection's thread."""

    daemon_threads = True
    tls: MetricsTls | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        tls = self.tls
        if tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            conn = tls.context().wrap_socket(request, server_side=True)
        except (OSError, ValueError) as exc:  # a failed handshake: that client's business
            log.debug("metrics TLS handshake with %s failed: %s", client_address, exc)
            return
        try:
            super().finish_request(conn, client_address)
        finally:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()


#: How often the server's thread looks whether it is asked to stop (seconds).
SHUTDOWN_POLL_S = 0.05


class MetricsServer:
    """``/metrics`` of ``registry`` on ``listen``: ``port = server.start()``,
    ``await server.stop()`` (or :meth:`stop_now` from a thread). With ``cert_file`` and
    ``key_file``: HTTPS (see the module docstring)."""

    def __init__(
        self,
        listen: str,
        registry: CollectorRegistry,
        name: str,
        cert_file: str = "",
        key_file: str = "",
        ca_file: str = "",
        client_auth: str = "none",
    ) -> None:
        self.listen = listen
        self.registry = registry
        self.name = name
        self.cert_file = cert_file
        self.key_file = key_file
        self.ca_file = ca_file
        self.client_auth = client_auth
        self.port = 0
        #: the TLS of the endpoint while it serves HTTPS
        self.tls: MetricsTls | None = None
        self._server: _HttpServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """``host:port`` actually served (the bound port in place of 0)."""
        host, _ = split_listen(self.listen)
        return f"{host}:{self.port}"

    def start(self) -> int:
        """Bind and serve in a daemon thread; returns the bound port. Raises OSError naming the
        address when it is in use or invalid, :class:`InvalidArgumentError` naming the setting
        when the TLS files are not usable."""
        if self._server is not None:
            return self.port
        tls = None
        if self.cert_file or self.key_file:
            tls = MetricsTls(self.cert_file, self.key_file, self.ca_file, self.client_auth)
        host, port = split_listen(self.listen)
        handler = MetricsHandler.factory(self.registry)
        try:
            family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]

            class Server(_HttpServer):
                address_family = family

            server = Server((host, port), handler)
        except OSError as exc:
            raise OSError(
                f"{self.name} cannot serve metrics on {self.listen}: {exc.strerror or exc} "
                "(metrics_listen; empty turns the endpoint off)"
            ) from exc
        server.tls = tls
        thread = threading.Thread(
            target=server.serve_forever,
            # shutdown() waits for the next poll: a replica that starts to lead stops this
            # server before its broker binds the port (docs/replication.md)
            kwargs={"poll_interval": SHUTDOWN_POLL_S},
            name=f"metrics {self.name}",
            daemon=True,
        )
        thread.start()
        self._server, self._thread, self.tls = server, thread, tls
        self.port = int(server.server_address[1])
        log.info("%s serving /metrics on %s%s", self.name, self.address, " (HTTPS)" if tls else "")
        return self.port

    def stop_now(self) -> None:
        """Stop serving, waiting at most :data:`STOP_TIMEOUT_S` for the thread; idempotent."""
        server, self._server = self._server, None
        thread, self._thread = self._thread, None
        if server is None:
            return
        done = threading.Thread(target=server.shutdown, name="metrics-shutdown", daemon=True)
        done.start()
        done.join(STOP_TIMEOUT_S)
        server.server_close()
        if thread is not None:
            thread.join(STOP_TIMEOUT_S)

    async def stop(self) -> None:
        """:meth:`stop_now` off the event loop."""
        if self._server is not None:
            await asyncio.to_thread(self.stop_now)


def start_metrics(
    listen: str,
    registry: CollectorRegistry,
    name: str,
    cert_file: str = "",
    key_file: str = "",
    ca_file: str = "",
    client_auth: str = "none",
) -> MetricsServer | None:
    """A started :class:`MetricsServer` on ``listen`` (HTTPS given ``cert_file`` and
    ``key_file``), or None when ``listen`` is empty."""
    if not listen:
        return None
    server = MetricsServer(listen, registry, name, cert_file, key_file, ca_file, client_auth)
    server.start()
    return server


class MetricsSettings(Protocol):
    """What :func:`start_metrics_from` reads of a service's settings besides their TLS."""

    @property
    def metrics_listen(self) -> str: ...


def start_metrics_from(
    settings: MetricsSettings, registry: CollectorRegistry, name: str
) -> MetricsServer | None:
    """:func:`start_metrics` as a service's settings say: on their ``metrics_listen``, over
    HTTPS with their ``tls_cert_file`` (when set), ``tls_key_file``, ``tls_ca_file`` and
    ``tls_client_auth`` (the fields of :class:`apogee.common.settings.SecuritySettings`; absent:
    plain HTTP)."""
    return start_metrics(
        settings.metrics_listen,
        registry,
        name,
        cert_file=getattr(settings, "tls_cert_file", ""),
        key_file=getattr(settings, "tls_key_file", ""),
        ca_file=getattr(settings, "tls_ca_file", ""),
        client_auth=getattr(settings, "tls_client_auth", "none"),
    )


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], T], timeout: float) -> T | None:
    """``fn()`` run on ``loop`` (from another thread), its result, or None when the loop does
    not run it within ``timeout`` seconds (stopped, busy) or it raises (logged)."""
    if loop.is_closed():
        return None
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:  # collected on the loop itself (a test): no hand-over
        return fn()
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as exc:
            fut.set_exception(exc)

    try:
        loop.call_soon_threadsafe(run)
    except RuntimeError:  # the loop closed meanwhile
        return None
    try:
        return fut.result(timeout)
    except concurrent.futures.TimeoutError:
        fut.cancel()
        return None
    except Exception:
        log.exception("reading metrics on the event loop failed")
        return None


def auth_refusals(registry: CollectorRegistry) -> Callable[[str], None]:
    """``apogee_auth_refusals_total{reason}`` on ``registry``, and a function that counts one
    refusal (what :class:`apogee.service.access.Access` is given): ``reason`` is ``missing``,
    ``malformed``, ``unknown_key``, ``bad_signature``, ``bad_date``, ``clock_skew`` or
    ``permission``."""
    counter = Counter(
        "apogee_auth_refusals",
        "Calls refused with authentication on, by reason: missing (not signed), malformed, "
        "unknown_key, bad_signature, bad_date, clock_skew (UNAUTHENTICATED), permission "
        "(PERMISSION_DENIED: a right the user lacks). Each is an audit line too.",
        ("reason",),
        registry=registry,
    )

    def count(reason: str) -> None:
        counter.labels(reason).inc()

    return count


def session_failures(prefix: str, count: int) -> CounterMetricFamily:
    """``<prefix>_session_failures_total``: ``count`` broker sessions of a service with a
    session per broker (:class:`apogee.service.workers.BrokerWorker`) ended in a failure."""
    return CounterMetricFamily(
        f"{prefix}_session_failures",
        "Broker sessions that ended in a failure (restarted with a backoff).",
        count,
    )
