"""The operator's Prometheus metrics (docs/metrics.md lists them): its
:class:`~apogee_operator.core.stats.OperatorStats`, read when Prometheus scrapes. Whether this
replica leads (``apogee_operator_leader``) is :class:`apogee.service.leader_app.LeaderApp`'s."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from apogee_operator.core.stats import OperatorStats


class OperatorCollector(Collector):
    """``apogee_operator_reconciles_total{kind,result}``."""

    def __init__(self, stats: OperatorStats) -> None:
        self.stats = stats

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        reconciles = CounterMetricFamily(
            "apogee_operator_reconciles",
            "Reconciles of Topic and ConsumerGroup resources, by result: ready, not_ready "
            "(the spec is refused), retry (brokers or API server failing), deleted.",
            labels=["kind", "result"],
        )
        for (kind, result), n in sorted(self.stats.reconciles.items()):
            reconciles.add_metric([kind, result], n)
        yield reconciles
