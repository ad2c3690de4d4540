"""Rounds one after another on one broker (virtual time, the in-memory broker): their cadence,
a transaction checked until the broker gives up, a session's stop, and a failing broker retried
with backoff while the others go on."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from apogee.service.workers import BrokerWorkers
from apogee_txn_checker.core.model import CheckOutcome
from apogee_txn_checker.core.ratelimit import GroupLimiter
from apogee_txn_checker.core.session import BrokerSession, broker_worker
from apogee_txn_checker.core.stats import CheckerStats

pytestmark = pytest.mark.unit

T0 = 1_700_000_000_000


def session(rounds: Any, broker: Any = None) -> BrokerSession:
    return BrokerSession(
        "cluster/broker-a",
        broker or rounds.broker,
        rounds.settings,
        rounds.vt.clock,
        rounds.stats,
        rounds.limiter,
        random.Random(1),
        sleep=rounds.vt.sleep,
    )


async def test_an_undecided_transaction_is_checked_every_interval_until_given_up(
    rounds: Any,
) -> None:
    rounds.configure(max_check_times=3)
    b = rounds.broker
    b.producers = set()
    b.send_half("stuck")
    s = session(rounds)
    await s.start()
    await rounds.vt.advance(45)
    await s.stop(1.0)
    # round at 0 s: not due (immunity 6 s); then one check a round
    assert [(c.at_ms - T0, c.outcome) for c in b.calls] == [
        (10_000, CheckOutcome.NO_PRODUCER),
        (20_000, CheckOutcome.NO_PRODUCER),
        (30_000, CheckOutcome.NO_PRODUCER),
        (40_000, CheckOutcome.GAVE_UP),
    ]
    assert rounds.stats.rounds == 5
    assert [h.check_times for h in b.moved] == [3]
    assert b.closed


async def test_a_copy_put_back_late_in_a_round_is_checked_one_interval_later(
    rounds: Any,
) -> None:
    rounds.configure(checks_per_group_per_s=1.0, check_burst=1)
    b = rounds.broker
    for i in range(3):
        b.send_half(f"t{i}", stored_ms=T0 - 10_000)
    s = session(rounds)
    await s.start()
    await rounds.vt.advance(15)
    await s.stop(1.0)
    # the rate limit spreads the first checks over 0-2 s; each copy is checked again 10 s
    # after it was put back, in the next round (which waits for it), not a round later
    assert [(c.half_offset, c.at_ms - T0) for c in b.calls] == [
        (0, 0),
        (1, 1000),
        (2, 2000),
        (3, 10_000),
        (4, 11_000),
        (5, 12_000),
    ]


async def test_stopping_a_session_commits_what_its_round_processed(rounds: Any) -> None:
    b = rounds.broker
    for i in range(4):
        b.send_half(f"t{i}", stored_ms=T0 - 10_000)

    def gate_third(offset: int) -> None:
        if offset == 2:
            b.gate = asyncio.Event()

    b.before_check = gate_third
    s = session(rounds)
    await s.start()
    await rounds.vt.advance(1)
    assert b.checked() == [0, 1, 2]
    assert b.commits == []
    await s.stop(1.0)
    assert b.commits == [(2, 0)]  # the check in flight was cut: half 2 is not passed
    assert b.closed


async def test_a_failing_broker_is_retried_with_backoff_while_the_others_go_on(
    rounds: Any,
) -> None:
    vt = rounds.vt
    good = rounds.broker
    bad = type(good)(vt, "broker-b")
    bad.down = 2  # two sessions fail to start: backoff 0.25 s, then 0.5 s
    for b in (good, bad):
        b.send_half("t", stored_ms=T0 - 10_000)
    brokers = {good.address: good, bad.address: bad}
    stats = CheckerStats()
    limiter = GroupLimiter(100, 200, vt.clock, random.Random(1), sleep=vt.sleep)

    def new_worker(name: str, address: str) -> Any:
        return broker_worker(
            name,
            address,
            rounds.settings,
            vt.clock,
            stats,
            limiter,
            random.Random(2),
            brokers.__getitem__,
            sleep=vt.sleep,
        )

    workers = BrokerWorkers(new_worker, grace_s=1.0)
    await workers.sync({"c/a": good.address, "c/b": bad.address})
    await vt.advance(0.5)
    assert [c.at_ms - T0 for c in good.calls] == [0]
    assert (bad.calls, stats.session_failures) == ([], 2)
    await vt.advance(0.5)
    assert [c.at_ms - T0 for c in bad.calls] == [750]
    assert (stats.session_failures, stats.rounds) == (2, 2)
    await workers.stop()
