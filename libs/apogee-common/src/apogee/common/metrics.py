"""Prometheus metrics plumbing every service shares (``prometheus-client``; the ``metrics``
extra of apogee-common).

- :func:`new_registry`: the registry of one app. Each app owns its own
  :class:`~prometheus_client.CollectorRegistry` (never the library's global one), so several
  brokers in one process (the in-process test cluster) do not collide; the standard process,
  platform and GC collectors are registered on it.
- :class:`MetricsServer`: serves ``/metrics`` of a registry over HTTP on the service's
  ``metrics_listen`` address (``host:port``; port 0 picks a free port; empty: no endpoint).
  :meth:`MetricsServer.start` raises :class:`OSError` naming the address when it cannot bind
  (the service's start fails, as for its gRPC port); :meth:`MetricsServer.stop` is bounded.
- :class:`LabelCap`: bounds the values of one label (topics, groups). The first ``limit``
  distinct values seen are kept as they are, for the life of the process; every later one is
  reported as :data:`OTHER`.
- :func:`on_loop`: runs a function on the service's event loop from the scrape thread and waits
  for its result with a bound, so that a collector reads the loop's objects where they live.
- :func:`scrape`: the samples of a running service's ``/metrics`` (over HTTP), as tools and
  tests read them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import urllib.request
from collections.abc import Callable
from typing import Final, TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

T = TypeVar("T")

#: The label value of every topic or group beyond a :class:`LabelCap`'s limit.
OTHER: Final = "other"
#: How long :meth:`MetricsServer.stop` waits for the serving thread.
STOP_TIMEOUT_S: Final = 2.0


def new_registry() -> CollectorRegistry:
    """A registry of its own for one app, with the process, platform and GC collectors."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def split_listen(listen: str) -> tuple[str, int]:
    """``host:port`` (host may be ``[::1]``) as (host, port)."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


class MetricsServer:
    """``/metrics`` of ``registry`` on ``listen``: ``port = server.start()``,
    ``await server.stop()`` (or :meth:`stop_now` from a thread)."""

    def __init__(self, listen: str, registry: CollectorRegistry, name: str) -> None:
        self.listen = listen
        self.registry = registry
        self.name = name
        self.port = 0
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """``host:port`` actually served (the bound port in place of 0)."""
        host, _ = split_listen(self.listen)
        return f"{host}:{self.port}"

    def start(self) -> int:
        """Bind and serve in a daemon thread; returns the bound port. Raises OSError naming the
        address when it is in use or invalid."""
        if self._server is not None:
            return self.port
        host, port = split_listen(self.listen)
        try:
            server, thread = start_http_server(port, host, self.registry)
        except OSError as exc:
            raise OSError(
                f"{self.name} cannot serve metrics on {self.listen}: {exc.strerror or exc} "
                "(metrics_listen; empty turns the endpoint off)"
            ) from exc
        self._server, self._thread = server, thread
        self.port = int(server.server_port)
        log.info("%s serving /metrics on %s", self.name, self.address)
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


def start_metrics(listen: str, registry: CollectorRegistry, name: str) -> MetricsServer | None:
    """A started :class:`MetricsServer` on ``listen``, or None when ``listen`` is empty."""
    if not listen:
        return None
    server = MetricsServer(listen, registry, name)
    server.start()
    return server


class LabelCap:
    """Bounds the values of a label: the first ``limit`` distinct values are kept (first come,
    first kept, for the life of the process), every later one becomes :data:`OTHER`.

    Thread-safe; a value already kept costs one set lookup."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit must not be negative, got {limit}")
        self.limit = limit
        self._kept: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        if value in self._kept:
            return value
        with self._lock:
            if value in self._kept:
                return value
            if len(self._kept) < self.limit:
                self._kept.add(value)
                return value
        return OTHER

    def __len__(self) -> int:
        return len(self._kept)


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


#: One sample of a scrape: its name (with ``_total``, ``_bucket``, ... as exposed) and labels.
SampleKey = tuple[str, frozenset[tuple[str, str]]]


class Samples(dict[SampleKey, float]):
    """The samples of one scrape; :meth:`get_sample` finds one by name and labels."""

    def get_sample(self, name: str, **labels: str) -> float | None:
        """The value of sample ``name`` with exactly ``labels`` (None when absent)."""
        return self.get((name, frozenset(labels.items())))

    def names(self) -> set[str]:
        return {name for name, _ in self}


def scrape(address: str, timeout: float = 5.0) -> Samples:
    """GET ``http://<address>/metrics`` and parse it (the text format)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    out = Samples()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return out
