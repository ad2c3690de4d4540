"""The nameserver's Prometheus metrics, declared once (docs/metrics.md lists them).

Counted as things happen: route queries by result, registrations, brokers dropped for silence.
Read at scrape time: the live brokers (on the event loop, where the registry lives)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from apogee.common.metrics import on_loop
from apogee_nameserver.core.registry import RouteRegistry

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
            "Broker registrations (heartbeats included) accepted.",
            registry=r,
        )
        self.expiries = Counter(
            "apogee_nameserver_broker_expiries",
            "Brokers dropped from routes because they stopped sending heartbeats.",
            registry=r,
        )


class NameServerCollector(Collector):
    """The live brokers, read on the loop when Prometheus scrapes."""

    def __init__(self, registry: RouteRegistry, loop: asyncio.AbstractEventLoop) -> None:
        self.routes = registry
        self.loop = loop

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        brokers = on_loop(self.loop, self.routes.cluster_info, LOOP_TIMEOUT_S)
        if brokers is None:
            return
        live = GaugeMetricFamily(
            "apogee_nameserver_live_brokers",
            "Brokers registered and not expired, by cluster.",
            labels=("cluster",),
        )
        by_cluster: dict[str, int] = {}
        for b in brokers:
            by_cluster[b.cluster] = by_cluster.get(b.cluster, 0) + 1
        for cluster, n in sorted(by_cluster.items()):
            live.add_metric((cluster,), n)
        yield live
