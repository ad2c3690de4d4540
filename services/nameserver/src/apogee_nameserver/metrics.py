"""The nameserver's Prometheus metrics, declared once (docs/metrics.md lists them).

Counted as things happen: route queries by result, registrations, brokers dropped for silence.
Read at scrape time (on the event loop, where the registry lives): the live brokers per cluster
and each broker's liveness, for every broker and cluster seen since the start, so that a broker
that left shows as 0 instead of vanishing."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from apogee.service.metrics import on_loop
from apogee_nameserver.core.registry import BrokerLiveness, RouteRegistry

#: How long a scrape waits for the event loop.
LOOP_TIMEOUT_S: Final = 5.0


class NameServerMetrics:
    """The nameserver's counters, on ``registry`` (a fresh one when None)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.route_queries = Counter(
            "apogee_nameserver_route_queries",
            "GetRoute calls, by result: found (brokers hold the topic), auto_create (brokers "
            "would create it), unknown (no route), error (a bad topic name).",
            ("result",),
            registry=r,
        )
        self.registrations = Counter(
            "apogee_nameserver_registrations",
            "Broker registrations (heartbeats included) accepted, by form: full (with the "
            "broker's topics) or short (a heartbeat saying they are unchanged).",
            ("form",),
            registry=r,
        )
        self.expiries = Counter(
            "apogee_nameserver_broker_expiries",
            "Brokers dropped from routes because they stopped sending heartbeats.",
            registry=r,
        )


class NameServerCollector(Collector):
    """The live brokers per cluster and each broker's liveness, read on the loop when
    Prometheus scrapes."""

    def __init__(self, registry: RouteRegistry, loop: asyncio.AbstractEventLoop) -> None:
        self.routes = registry
        self.loop = loop

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        state = on_loop(self.loop, self._read, LOOP_TIMEOUT_S)
        if state is None:
            return
        counts, brokers = state
        live = GaugeMetricFamily(
            "apogee_nameserver_live_brokers",
            "Brokers registered and not expired, by cluster (0 once the last one has left a "
            "cluster seen since the start).",
            labels=("cluster",),
        )
        for cluster, n in counts.items():
            live.add_metric((cluster,), n)
        yield live
        up = GaugeMetricFamily(
            "apogee_nameserver_broker_up",
            "1 while the broker is registered and not expired, 0 once it expired or "
            "unregistered (until it registers again or this nameserver restarts).",
            labels=("cluster", "broker"),
        )
        for b in brokers:
            up.add_metric((b.cluster, b.broker_name), 1 if b.live else 0)
        yield up

    def _read(self) -> tuple[dict[str, int], list[BrokerLiveness]]:
        return self.routes.live_counts(), self.routes.broker_liveness()
