"""The schedule service's Prometheus metrics (docs/metrics.md lists them): its
:class:`~apogee_schedule.core.stats.ScheduleStats` and whether this replica leads, read when
Prometheus scrapes."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

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
    (
        "session_failures",
        "session_failures",
        "Broker sessions that ended in a failure (restarted with a backoff).",
    ),
)


class ScheduleCollector(Collector):
    """Exports ``stats`` (totals since the process started, active or not) and ``leading()``,
    whether this replica is the active one, as ``apogee_schedule_leader`` (0 or 1)."""

    def __init__(self, stats: ScheduleStats, leading: Callable[[], bool]) -> None:
        self.stats = stats
        self.leading = leading

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(
            "apogee_schedule_leader",
            "1 while this replica is the active one (holds the leadership and delivers), 0 on "
            "a standby.",
            value=1 if self.leading() else 0,
        )
        s = self.stats
        for name, field, text in _COUNTERS:
            yield CounterMetricFamily(f"apogee_schedule_{name}", text, value=getattr(s, field))
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
