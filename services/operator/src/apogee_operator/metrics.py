"""The operator's Prometheus metrics (docs/metrics.md lists them): its
:class:`~apogee_operator.core.stats.OperatorStats`, read when Prometheus scrapes."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from apogee_operator.core.stats import OperatorStats


class OperatorCollector(Collector):
    """``apogee_operator_reconciles_total{kind,result}`` and ``apogee_operator_leader`` (1
    while this replica leads)."""

    def __init__(self, stats: OperatorStats, active: Callable[[], bool]) -> None:
        self.stats = stats
        self.active = active

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
        yield GaugeMetricFamily(
            "apogee_operator_leader",
            "1 while this replica is the active one (holds the Lease), else 0.",
            value=1 if self.active() else 0,
        )
