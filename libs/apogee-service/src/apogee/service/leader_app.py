"""One replica of a leader-elected service: the health server, leadership, and the service's
work while this replica leads.

Schedule, the transaction checker and the operator run this way; each subclasses
:class:`LeaderApp` with its names, the work it does while active (the scheduler, the checker,
the controller) and its log lines. Start:
serve grpc.health.v1 (overall NOT_SERVING until active; the service's ``process_health``
SERVING while the process runs), make a first attempt at the lock or Lease the settings choose
(:func:`apogee.service.leader_settings.new_leadership`; an unusable lock file, or a Lease the
service account may not touch, fails the start), then in the background wait for leadership
(a standby says so in the log), start the work and go SERVING; when leadership is lost, the
work stops and the replica is a standby again. Stop, bounded: the background task gets
``shutdown_grace_s + 5`` seconds, the work stops (its own stop is bounded by
``shutdown_grace_s``), the lock or Lease is released (a standby takes over), the server stops
(calls in flight get at most a second).

TLS (:mod:`apogee.rpc.tls`): when the settings have ``tls_cert_file`` (every service's settings
inherit :class:`apogee.common.settings.SecuritySettings`), the health port and the metrics
endpoint serve TLS only.

Metrics: each app owns a registry (:func:`apogee.service.metrics.new_registry`) with the
gauge ``apogee_<service>_leader`` (1 while this replica leads, 0 on a standby) and the
collectors of :meth:`LeaderApp._collectors`, served on ``metrics_listen`` from the start (a port
in use fails it, naming the address) until the stop, standby or active; the service's counters
are totals since the process started.

A service's command line is :func:`leader_parser`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import ClassVar, Generic, Protocol, TypeVar

from grpc_health.v1 import health_pb2
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.rpc.server import GrpcServer
from apogee.rpc.tls import server_tls_from
from apogee.service.leader_settings import LeaderServiceSettings, new_leadership
from apogee.service.leadership import Leadership
from apogee.service.metrics import MetricsServer, new_registry, start_metrics_from
from apogee.service.process import service_parser

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class LeaderWork(Protocol):
    """What a service does while its replica leads."""

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Stop, bounded by the service's ``shutdown_grace_s``."""


S = TypeVar("S", bound=LeaderServiceSettings)
W = TypeVar("W", bound=LeaderWork)


class LeaderApp(Generic[S, W]):
    """``port = await app.start()``, ``await app.stop()``; ``active`` says whether this replica
    leads, ``work`` is what it does meanwhile (None on a standby).

    A subclass names the service (``name``: its server, in logs and errors; ``title``: what
    "already started" calls it; ``process_health``: the liveness health service;
    ``leader_help``: the help of its gauge ``apogee_<name>_leader``) and implements
    :meth:`_new_work`, :meth:`_log_active` and :meth:`_log_stopped`. Every line is logged under
    the subclass's module."""

    name: ClassVar[str]
    title: ClassVar[str]
    process_health: ClassVar[str]
    leader_help: ClassVar[str] = (
        "1 while this replica is the active one (holds the leadership), 0 on a standby."
    )

    def __init__(
        self, settings: S, clock: Clock = SYSTEM_CLOCK, leadership: Leadership | None = None
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.leadership = leadership or new_leadership(settings)
        self.work: W | None = None
        self.port = 0
        self.log = logging.getLogger(type(self).__module__)
        self._server: GrpcServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._active = asyncio.Event()
        #: this app's metrics (a registry of its own), served while it runs
        self.registry = new_registry()
        self.metrics_server: MetricsServer | None = None
        self._collectors_added = False

    def _collectors(self) -> list[Collector]:
        """The service's own metrics collectors (registered once, at the first start, beside
        the leader gauge)."""
        return []

    def _new_work(self) -> W:
        """The work of one term of leadership (not started yet)."""
        raise NotImplementedError

    def _log_active(self, work: W) -> None:
        """Says that this replica is active, once ``work`` has started."""
        raise NotImplementedError

    def _log_stopped(self) -> None:
        """Says that the service stopped (its counters, say)."""
        raise NotImplementedError

    @property
    def active(self) -> bool:
        return self._active.is_set()

    @property
    def metrics_prefix(self) -> str:
        """The start of the service's metrics' names: ``apogee_<name>`` (``apogee_txn_checker``)."""
        return "apogee_" + self.name.replace("-", "_")

    async def wait_active(self) -> None:
        """Returns once this replica leads and its work has started."""
        await self._active.wait()

    async def start(self) -> int:
        """Serve health and start leading (or waiting to); returns the bound port. Raises
        OSError when the address cannot be bound or the lock file cannot be opened."""
        if self._server is not None:
            raise RuntimeError(f"{self.title} is already started")
        s = self.settings
        server = GrpcServer(s.listen, self.name, tls=server_tls_from(s))
        self.port = server.bind()
        if not self._collectors_added:
            leader = LeaderGauge(
                f"{self.metrics_prefix}_leader", self.leader_help, lambda: self.active
            )
            for collector in (leader, *self._collectors()):
                self.registry.register(collector)
            self._collectors_added = True
        try:
            self.metrics_server = start_metrics_from(s, self.registry, self.name)
        except BaseException:
            await server.server.stop(0)
            raise
        await server.server.start()
        self._server = server
        await server.health.set("", NOT_SERVING)
        await server.health.set(self.process_health, SERVING)
        self.log.info("%s health service listening on port %d", self.name, self.port)
        try:
            await self.leadership.try_acquire()
        except BaseException:
            await self.stop()
            raise
        self._task = asyncio.create_task(self._lead(), name="leadership")
        self._task.add_done_callback(self._lead_ended)
        return self.port

    def _lead_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.log.error("leadership failed: %r", task.exception())

    async def _lead(self) -> None:
        while True:
            await self.leadership.acquire()
            await self._activate()
            await self.leadership.wait_lost()
            self.log.warning("leadership lost: this replica becomes a standby")
            await self._deactivate()

    async def _activate(self) -> None:
        assert self._server is not None
        work = self.work = self._new_work()
        await work.start()
        await self._server.health.set("", SERVING)
        self._active.set()
        self._log_active(work)

    async def _deactivate(self) -> None:
        self._active.clear()
        if self._server is not None:
            await self._server.health.set("", NOT_SERVING)
        work, self.work = self.work, None
        if work is not None:
            await work.stop()

    async def stop(self) -> None:
        """Stop gracefully (see the module docstring); safe to call twice."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=self.settings.shutdown_grace_s + 5.0)
        try:
            await self._deactivate()
        finally:
            await self.leadership.release()
            server, self._server = self._server, None
            if server is not None:
                await server.stop(min(1.0, self.settings.shutdown_grace_s))
            metrics, self.metrics_server = self.metrics_server, None
            if metrics is not None:
                await metrics.stop()
            if server is not None:
                self._log_stopped()


class LeaderGauge(Collector):
    """The gauge ``name``: 1 while ``leading()``, else 0."""

    def __init__(self, name: str, help_text: str, leading: Callable[[], bool]) -> None:
        self.name = name
        self.help_text = help_text
        self.leading = leading

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(self.name, self.help_text, value=1 if self.leading() else 0)


def leader_parser(prog: str, description: str, listen: str) -> argparse.ArgumentParser:
    """The command line of a leader-elected service (for
    :func:`apogee.service.process.run_service`): ``--config``, ``--namesrv``, ``--listen``
    (``listen`` is its default, for the help), ``--lock-file``, then ``--log-level``."""
    return service_parser(prog, description, lambda p: _add_leader_flags(p, listen))


def _add_leader_flags(parser: argparse.ArgumentParser, listen: str) -> None:
    parser.add_argument("--namesrv", help="nameservers, host:port separated by ';'")
    parser.add_argument(
        "--listen", metavar="HOST:PORT", help=f"host:port of the health service (default {listen})"
    )
    parser.add_argument(
        "--lock-file", type=Path, metavar="PATH", help="the lock that makes one replica active"
    )
