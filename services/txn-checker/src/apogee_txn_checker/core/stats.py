"""Counters of the transaction checker, kept in-process (tests read them;
:mod:`apogee_txn_checker.metrics` exports them).

Every CheckHalf the checker makes is counted once under its outcome (``checks_sent``,
``no_producer``, ``decided``, ``gave_up``, ``gone``, ``closed``) or under ``errors`` when the
call failed.
"""

from __future__ import annotations

from dataclasses import dataclass

from apogee_txn_checker.core.model import CheckOutcome


@dataclass(frozen=True, slots=True)
class StatsSnapshot:
    rounds: int
    checks_sent: int
    no_producer: int
    decided: int
    gave_up: int
    gone: int
    closed: int
    errors: int
    #: halves passed because an op record said they were done (no call made)
    skipped_done: int
    #: halves left for a later round because their group's lane was full (rate limit)
    deferred: int
    #: broker sessions that ended in a failure (restarted with backoff)
    session_failures: int
    #: how long the last round took, over every broker (0 before the first)
    last_round_ms: int

    @property
    def checks(self) -> int:
        """CheckHalf calls answered, whatever the outcome."""
        return (
            self.checks_sent
            + self.no_producer
            + self.decided
            + self.gave_up
            + self.gone
            + self.closed
        )


class CheckerStats:
    """Totals over every broker since the start of the process."""

    def __init__(self) -> None:
        self.rounds = 0
        self.checks_sent = 0
        self.no_producer = 0
        self.decided = 0
        self.gave_up = 0
        self.gone = 0
        self.closed = 0
        self.errors = 0
        self.skipped_done = 0
        self.deferred = 0
        self.session_failures = 0
        self.last_round_ms = 0

    def record(self, outcome: CheckOutcome) -> None:
        match outcome:
            case CheckOutcome.CHECK_SENT:
                self.checks_sent += 1
            case CheckOutcome.NO_PRODUCER:
                self.no_producer += 1
            case CheckOutcome.DECIDED:
                self.decided += 1
            case CheckOutcome.GAVE_UP:
                self.gave_up += 1
            case CheckOutcome.GONE:
                self.gone += 1
            case CheckOutcome.CLOSED:
                self.closed += 1

    def snapshot(self) -> StatsSnapshot:
        return StatsSnapshot(
            rounds=self.rounds,
            checks_sent=self.checks_sent,
            no_producer=self.no_producer,
            decided=self.decided,
            gave_up=self.gave_up,
            gone=self.gone,
            closed=self.closed,
            errors=self.errors,
            skipped_done=self.skipped_done,
            deferred=self.deferred,
            session_failures=self.session_failures,
            last_round_ms=self.last_round_ms,
        )
