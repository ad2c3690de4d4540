"""Counters of the schedule service, kept in-process (tests read them; :mod:`apogee_schedule.
metrics` exports them).

Delivery lateness is the time a delivery was confirmed by the broker (the service's clock)
minus the entry's ``deliver_at_ms``; it is never negative, since nothing is delivered early.
The last :data:`LATENESS_SAMPLES` samples are kept for percentiles, besides a count, a sum, the
maximum since the start, and counts per :data:`LATENESS_BUCKETS_MS` bucket (the histogram the
metrics export).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from typing import Final

LATENESS_SAMPLES: Final = 100_000
#: Upper bounds (ms, inclusive) of the lateness histogram's buckets; one more counts the rest.
LATENESS_BUCKETS_MS: Final = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000)


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    delivered: int
    parked: int
    dropped: int
    dead_lettered: int
    failed: int
    skipped: int
    scanned: int
    session_failures: int
    lateness_count: int
    lateness_max_ms: int
    lateness_p50_ms: int
    lateness_p99_ms: int


class ScheduleStats:
    """Totals over every broker since the start of the process."""

    def __init__(self, samples: int = LATENESS_SAMPLES) -> None:
        #: entries stored in their real topic
        self.delivered = 0
        #: entries stored again in a later slot
        self.parked = 0
        #: entries the broker answered DROPPED for (record gone to retention or unreadable)
        self.dropped = 0
        #: entries due when their topic was gone: kept in ``%DLQ%SYS_SCHEDULE`` by the broker
        self.dead_lettered = 0
        #: resolutions that failed and were tried again
        self.failed = 0
        #: entries removed by retention before they were scanned
        self.skipped = 0
        #: entries read by scans
        self.scanned = 0
        #: broker sessions that ended in a failure (a call failed; restarted with backoff)
        self.session_failures = 0
        self.lateness_count = 0
        self.lateness_sum_ms = 0
        self.lateness_max_ms = 0
        self.lateness_ms: deque[int] = deque(maxlen=samples)
        #: deliveries per lateness bucket (not cumulative; the last one: above every bound)
        self.lateness_buckets = [0] * (len(LATENESS_BUCKETS_MS) + 1)

    def record_delivery(self, lateness_ms: int) -> None:
        self.delivered += 1
        self.lateness_count += 1
        self.lateness_sum_ms += lateness_ms
        self.lateness_max_ms = max(self.lateness_max_ms, lateness_ms)
        self.lateness_ms.append(lateness_ms)
        self.lateness_buckets[bisect_left(LATENESS_BUCKETS_MS, lateness_ms)] += 1

    def lateness_percentile(self, q: float) -> int:
        """The ``q`` quantile (0..1) of the kept lateness samples, in ms (0 when none)."""
        if not self.lateness_ms:
            return 0
        ordered = sorted(self.lateness_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def snapshot(self) -> StatsSnapshot:
        return StatsSnapshot(
            delivered=self.delivered,
            parked=self.parked,
            dropped=self.dropped,
            dead_lettered=self.dead_lettered,
            failed=self.failed,
            skipped=self.skipped,
            scanned=self.scanned,
            session_failures=self.session_failures,
            lateness_count=self.lateness_count,
            lateness_max_ms=self.lateness_max_ms,
            lateness_p50_ms=self.lateness_percentile(0.50),
            lateness_p99_ms=self.lateness_percentile(0.99),
        )
