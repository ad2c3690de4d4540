"""Wiring: the registry, its expiry loop, the gRPC server and the metrics endpoint
(``metrics_listen``), started and stopped together."""

from __future__ import annotations

import asyncio
import logging

from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.rpc.server import GrpcServer
from apogee.rpc.tls import server_tls_from
from apogee.service.access import interceptors_from
from apogee.service.metrics import MetricsServer, auth_refusals, new_registry, start_metrics_from
from apogee.v1 import nameserver_pb2, nameserver_pb2_grpc
from apogee_nameserver.core.expiry import ExpiryLoop
from apogee_nameserver.core.registry import RouteRegistry
from apogee_nameserver.metrics import NameServerCollector, NameServerMetrics
from apogee_nameserver.servicers.nameserver import NameServerServicer
from apogee_nameserver.settings import NameServerSettings

log = logging.getLogger(__name__)

SERVICE_NAME = nameserver_pb2.DESCRIPTOR.services_by_name["NameServer"].full_name


class NameServerApp:
    """One nameserver. ``await start()`` returns the bound port; ``await stop()`` is graceful
    (calls in flight get ``shutdown_grace_s``) and bounded."""

    def __init__(self, settings: NameServerSettings, clock: Clock = SYSTEM_CLOCK) -> None:
        self.settings = settings
        self.registry = RouteRegistry(settings.broker_expiry_s, clock)
        #: this nameserver's metrics (a registry of its own)
        self.metrics_registry = new_registry()
        self.metrics = NameServerMetrics(self.metrics_registry)
        self._expiry = ExpiryLoop(
            self.registry, settings.scan_interval_s, clock, self.metrics.expiries.inc
        )
        self._server: GrpcServer | None = None
        self.metrics_server: MetricsServer | None = None
        self.port = 0

    async def start(self) -> int:
        """Serve; returns the bound port. Raises OSError when the address cannot be bound."""
        if self._server is not None:
            raise RuntimeError("the nameserver is already started")
        s = self.settings
        server = GrpcServer(
            s.listen,
            "nameserver",
            tls=server_tls_from(s),
            interceptors=interceptors_from(s, auth_refusals(self.metrics_registry)),
        )
        nameserver_pb2_grpc.add_NameServerServicer_to_server(
            NameServerServicer(self.registry, self.metrics), server.server
        )
        try:
            server.bind()
            self.metrics_registry.register(
                NameServerCollector(self.registry, asyncio.get_running_loop())
            )
            self.metrics_server = start_metrics_from(s, self.metrics_registry, "nameserver")
            self.port = await server.start([SERVICE_NAME])
        except BaseException:
            await self._stop_metrics()
            await server.stop(0)
            raise
        self._server = server
        self._expiry.start()
        log.info(
            "nameserver started: brokers expire after %.1fs of silence, scanned every %.1fs",
            self.settings.broker_expiry_s,
            self.settings.scan_interval_s,
        )
        return self.port

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        grace = self.settings.shutdown_grace_s
        try:
            await server.stop(grace)
        finally:
            await self._expiry.stop(timeout=grace + 1.0)
            await self._stop_metrics()
        log.info("nameserver stopped")

    async def _stop_metrics(self) -> None:
        metrics, self.metrics_server = self.metrics_server, None
        if metrics is not None:
            await metrics.stop()
