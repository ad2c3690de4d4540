"""The checker against a real broker (the ``cluster`` fixture: a nameserver and a broker
in-process, over real gRPC): a connected producer is checked once the immunity time has passed
and its answer commits the message; with no producer a half ends in TRANS_CHECK_MAX_TIME_TOPIC
after max_check_times checks; of two checkers sharing one lock file only one checks, and the
other takes over when it stops."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from apogee.rpc.server import check_health
from apogee.testkit.waiting import eventually
from apogee.v1 import transaction_pb2
from apogee_txn_checker.app import PROCESS_HEALTH

pytestmark = [pytest.mark.integration, pytest.mark.slow]

pb = transaction_pb2
TOPIC = "Orders"
GROUP = "order-service"


async def serving(app: Any) -> None:
    """Until ``app`` leads and serves the broker."""

    async def ready() -> bool:
        return app.active and app.checker is not None and len(app.checker.workers) == 1

    await eventually(ready, 10, "the checker serving broker-a")


async def test_a_connected_producer_is_checked_after_the_immunity_time(cluster: Any) -> None:
    checker = await cluster.start_checker(immunity_s=2.0)
    await serving(checker)
    producer = await cluster.connect("producer-1")
    t0 = time.monotonic()
    sent = await cluster.send_half("order-1", region="eu")

    check = await producer.next_check(timeout=10)
    waited = time.monotonic() - t0
    # not before the immunity time; then within a round (1 s), with slack for a busy machine
    assert 1.99 <= waited <= 2.0 + 1.0 + 3.0
    assert (check.unique_id, check.topic, check.check_times) == (sent.unique_id, TOPIC, 1)
    assert check.half.body == b"order-1"
    assert check.half_offset > sent.half_offset  # the copy put back with one more check

    # the producer answers: the message is committed, and checked no more
    ended = await cluster.end(check, pb.COMMIT)
    assert ended.outcome == pb.COMMITTED
    [msg] = await cluster.delivered()
    assert (msg.unique_id, msg.body, msg.properties.get("region")) == (
        sent.unique_id,
        b"order-1",
        "eu",
    )
    with pytest.raises(TimeoutError):
        await producer.next_check(timeout=2.5)
    assert await cluster.pending() == []
    snap = checker.stats.snapshot()
    assert (snap.checks_sent, snap.no_producer, snap.gave_up, snap.errors) == (1, 0, 0, 0)
    assert snap.rounds >= 3

    # the progress committed at the broker is past every copy
    st = await cluster.state()
    assert (st.half_progress, st.op_progress) == (st.half_max_offset, st.op_max_offset)


async def test_with_no_producer_a_half_ends_in_trans_check_max_time_topic(
    cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    checker = await cluster.start_checker(immunity_s=1.0, max_check_times=3)
    await serving(checker)
    caplog.set_level(logging.WARNING, logger="apogee_txn_checker")
    sent = await cluster.send_half("order-2")

    async def given_up() -> bool:
        return any(not p.checking for p in await cluster.pending())

    await eventually(given_up, 15, "the half moved to TRANS_CHECK_MAX_TIME_TOPIC")
    [p] = await cluster.pending()
    assert (p.unique_id, p.producer_group, p.check_times) == (sent.unique_id, GROUP, 3)
    snap = checker.stats.snapshot()
    assert (snap.no_producer, snap.gave_up, snap.checks_sent, snap.errors) == (3, 1, 0, 0)
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("apogee_txn_checker") and r.levelno == logging.WARNING
    ]
    assert warnings == [
        f"transaction {sent.unique_id} of producer group {GROUP} (topic {TOPIC}) is still "
        "undecided after 3 checks: broker DefaultCluster/broker-a moved it to "
        "TRANS_CHECK_MAX_TIME_TOPIC"
    ]


async def test_of_two_checkers_on_one_lock_file_only_one_checks(
    cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="apogee.service.leadership")
    first = await cluster.start_checker(immunity_s=0.5, max_check_times=1000)
    await serving(first)
    second = await cluster.start_checker(immunity_s=0.5, max_check_times=1000)

    def standby() -> bool:  # its loop tried the lock, found it held, and waits
        return any(r.getMessage().startswith("standby: ") for r in caplog.records)

    await eventually(standby, 5, "the second checker a standby")
    assert not second.active
    assert not await check_health(f"127.0.0.1:{second.port}", 1)
    assert await check_health(f"127.0.0.1:{second.port}", 1, PROCESS_HEALTH)
    assert await check_health(f"127.0.0.1:{first.port}", 1)

    sent = await cluster.send_half("order-3")

    async def first_checked() -> bool:
        return bool(first.stats.no_producer >= 2)

    await eventually(first_checked, 10, "two checks by the first checker")
    assert second.stats.snapshot().rounds == 0

    await first.stop()
    await asyncio.wait_for(second.wait_active(), 5)
    await serving(second)

    async def second_checked() -> bool:
        return bool(second.stats.no_producer >= 2)

    await eventually(second_checked, 10, "two checks by the second checker")
    await second.stop()
    # one transaction, checked by one checker at a time, each copy once: its check count is
    # the sum of both checkers' checks, and no check found its copy already closed
    [p] = await cluster.pending()
    assert p.unique_id == sent.unique_id
    assert p.check_times == first.stats.no_producer + second.stats.no_producer
    assert first.stats.closed == second.stats.closed == 0
