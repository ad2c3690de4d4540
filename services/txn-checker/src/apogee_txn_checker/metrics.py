"""The transaction checker's Prometheus metrics (docs/metrics.md lists them): its
:class:`~apogee_txn_checker.core.stats.CheckerStats`, read when Prometheus scrapes. Whether this
replica leads (``apogee_txn_checker_leader``) is :class:`apogee.service.leader_app.LeaderApp`'s."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from apogee.service.metrics import session_failures
from apogee_txn_checker.core.stats import CheckerStats

#: label value of ``result`` -> stats field
_RESULTS = (
    ("check_sent", "checks_sent"),
    ("no_producer", "no_producer"),
    ("decided", "decided"),
    ("gave_up", "gave_up"),
    ("gone", "gone"),
    ("closed", "closed"),
    ("error", "errors"),
)


class CheckerCollector(Collector):
    """Exports ``stats``: totals since the process started, active or not."""

    def __init__(self, stats: CheckerStats) -> None:
        self.stats = stats

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        s = self.stats
        checks = CounterMetricFamily(
            "apogee_txn_checker_checks",
            "Checks of half messages, by result: check_sent (asked a producer), no_producer "
            "(none connected: counted as a check), decided (already decided), gave_up (after "
            "the most checks), gone (retention removed it), closed (already done), error (the "
            "call failed).",
            labels=("result",),
        )
        for label, field in _RESULTS:
            checks.add_metric((label,), getattr(s, field))
        yield checks
        yield CounterMetricFamily(
            "apogee_txn_checker_rounds", "Rounds of checks completed, over every broker.", s.rounds
        )
        yield CounterMetricFamily(
            "apogee_txn_checker_skipped_halves",
            "Half messages passed because an op record said they were done (no call made).",
            s.skipped_done,
        )
        yield CounterMetricFamily(
            "apogee_txn_checker_deferred_halves",
            "Half messages left for a later round because their producer group's rate limit "
            "was reached.",
            s.deferred,
        )
        yield session_failures("apogee_txn_checker", s.session_failures)
        yield GaugeMetricFamily(
            "apogee_txn_checker_last_round_duration_seconds",
            "How long the last round of checks took (0 before the first).",
            s.last_round_ms / 1000,
        )
