"""The schedule service's Prometheus metrics (docs/metrics.md lists them): its
:class:`~apogee_schedule.core.stats.ScheduleStats`, read when Prometheus scrapes. Whether this
replica leads (``apogee_schedule_leader``) is :class:`apogee.service.leader_app.LeaderApp`'s."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from apogee.service.metrics import session_failures
from apogee_schedule.core.stats import LATENESS_BUCKETS_MS, ScheduleStats

#: (metric name without ``apogee_schedule_`` and ``_total``, stats field, help)
_COUNTERS = (
    ("delivered_messages", "delivered", "Delayed and timer messages stored in their real topic."),
    ("parked_messages", "parked", "Timer messages stored again in a later slot of the wheel."),
    (
        "dropped_messages",
        "dropped",
        "Entries whose record was gone (retention) or unreadable: not delivered.",
    ),
    (
        "dead_lettered_messages",
        "dead_lettered",
        "Messages due when their topic was gone, kept in %DLQ%SYS_SCHEDULE.",
    ),
    ("failed_resolutions", "failed", "Deliveries that failed and were tried again."),
    ("skipped_entries", "skipped", "Entries removed by retention before they were scanned."),
    ("scanned_entries", "scanned", "Entries read from the brokers' schedule queues."),
)


class ScheduleCollector(Collector):
    """Exports ``stats``: totals since the process started, active or not."""

    def __init__(self, stats: ScheduleStats) -> None:
        self.stats = stats

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        s = self.stats
        for name, field, text in _COUNTERS:
            yield CounterMetricFamily(f"apogee_schedule_{name}", text, value=getattr(s, field))
        yield session_failures("apogee_schedule", s.session_failures)
        counts = list(s.lateness_buckets)
        total = sum(counts)
        buckets: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip(LATENESS_BUCKETS_MS, counts, strict=False):
            running += n
            buckets.append((repr(bound / 1000), running))
        buckets.append(("+Inf", total))
        yield HistogramMetricFamily(
            "apogee_schedule_delivery_lateness_seconds",
            "How late delayed and timer messages were delivered: the broker's confirmation "
            "minus the time they were due.",
            buckets=buckets,
            sum_value=s.lateness_sum_ms / 1000,
        )
