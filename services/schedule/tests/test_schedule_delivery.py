"""The schedule service against a real broker and nameserver in-process: delayed and timer
messages delivered when due (never early), all of them, once; progress resumed after a stop;
one active replica, the other taking over."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc.aio
import pytest

from apogee.codec import StoredMessage
from apogee.rpc.server import check_health
from apogee.testkit.waiting import eventually
from apogee.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from apogee_schedule.app import PROCESS_HEALTH

pytestmark = [pytest.mark.integration, pytest.mark.slow]

Make = Callable[..., common_pb2.Message]


def by_body(msgs: list[StoredMessage]) -> dict[str, list[StoredMessage]]:
    out: dict[str, list[StoredMessage]] = {}
    for m in msgs:
        out.setdefault(m.body.decode(), []).append(m)
    return out


def assert_once_and_never_early(msgs: list[StoredMessage], due: dict[str, int]) -> None:
    counts = Counter(m.body.decode() for m in msgs)
    assert set(counts) == set(due), set(due) ^ set(counts)
    assert [b for b, n in counts.items() if n > 1] == []
    early = {m.body.decode(): due[m.body.decode()] - m.store_timestamp for m in msgs}
    assert {b: ms for b, ms in early.items() if ms > 0} == {}


async def test_delayed_and_timer_messages_are_delivered_when_due_intact_and_once(
    cluster: Any, make_timer: Make, make_delayed: Make
) -> None:
    app = await cluster.start_schedule()
    await asyncio.wait_for(app.wait_active(), 5)
    assert await check_health(f"127.0.0.1:{app.port}", 2)

    t0 = cluster.now_ms()
    due: dict[str, int] = {}
    timers = [make_timer(f"t{i}", t0 + 300 + 130 * i, queue_id=i % 2) for i in range(25)]
    for m in timers:
        due[m.body.decode()] = m.deliver_at_ms
    await cluster.send(*timers)  # the last ones are more than 2 s ahead: rolled, then parked
    before = cluster.now_ms()
    delayed = [make_delayed(f"d{i}", level=1 + i % 2) for i in range(6)]
    await cluster.send(*delayed)
    for m in delayed:
        due[m.body.decode()] = before + cluster.delays_ms[m.delay_level - 1]
    past = make_timer("past", t0 - 5_000)  # already due: stored in the topic at once
    await cluster.send(past)
    due["past"] = 0

    got = await cluster.wait_delivered(len(due), timeout=15)
    assert_once_and_never_early(got, due)
    for m in got:
        body = m.body.decode()
        assert m.keys == [body]
        assert m.properties["kind"] in ("timer", "delayed")
        assert not {"REAL_TOPIC", "REAL_QID", "DELAY", "DELIVER_AT_MS"} & set(m.properties)
    queues = {m.body.decode(): m.queue_id for m in got}
    assert [queues[f"t{i}"] for i in range(4)] == [0, 1, 0, 1]

    stats = app.stats.snapshot()
    assert stats.delivered == len(due) - 1  # "past" did not need the service
    assert stats.parked >= 1  # the rolled timers
    assert (stats.dropped, stats.failed, stats.skipped) == (0, 0, 0)
    assert stats.lateness_count == stats.delivered
    assert 0 <= stats.lateness_p50_ms <= stats.lateness_max_ms < 2_000


async def test_a_stop_mid_way_loses_nothing_and_the_next_start_resumes(
    cluster: Any, make_timer: Make, make_delayed: Make
) -> None:
    first = await cluster.start_schedule()
    await asyncio.wait_for(first.wait_active(), 5)
    t0 = cluster.now_ms()
    msgs = [make_timer(f"t{i}", t0 + 400 + 100 * i, queue_id=i % 2) for i in range(30)]
    msgs += [make_delayed(f"d{i}", level=2) for i in range(3)]
    await cluster.send(*msgs)
    due = {m.body.decode(): m.deliver_at_ms or t0 + 2000 for m in msgs}

    await cluster.wait_delivered(8, timeout=10)
    await first.stop()
    delivered_first = first.stats.snapshot().delivered
    assert 8 <= delivered_first < len(msgs)
    # while no service runs, more timers fall due (time passing is the point here)
    await asyncio.sleep(0.8)
    second = await cluster.start_schedule()
    got = await cluster.wait_delivered(len(msgs), timeout=15)
    # a graceful stop commits its progress and parks what it held: nothing twice
    assert_once_and_never_early(got, due)
    assert delivered_first + second.stats.snapshot().delivered == len(msgs)


async def test_one_replica_delivers_and_the_standby_takes_over_when_it_stops(
    cluster: Any, make_timer: Make
) -> None:
    first = await cluster.start_schedule()
    await asyncio.wait_for(first.wait_active(), 5)
    second = await cluster.start_schedule()
    assert await check_health(f"127.0.0.1:{second.port}", 2, PROCESS_HEALTH)
    assert not await check_health(f"127.0.0.1:{second.port}", 2)  # a standby: NOT_SERVING
    assert not second.active

    t0 = cluster.now_ms()
    msgs = [make_timer(f"t{i}", t0 + 300 + 100 * i, queue_id=i % 2) for i in range(30)]
    await cluster.send(*msgs)
    await cluster.wait_delivered(6, timeout=10)
    assert second.stats.delivered == 0
    assert not second.active

    await first.stop()
    await asyncio.wait_for(second.wait_active(), 5)
    assert await check_health(f"127.0.0.1:{second.port}", 2)
    got = await cluster.wait_delivered(len(msgs), timeout=15)
    assert_once_and_never_early(got, {m.body.decode(): m.deliver_at_ms for m in msgs})
    assert first.stats.delivered + second.stats.delivered == len(msgs)
    assert second.stats.delivered > 0


async def test_a_broker_that_goes_away_is_served_again_when_it_returns(
    cluster: Any, make_timer: Make
) -> None:
    app = await cluster.start_schedule()
    await asyncio.wait_for(app.wait_active(), 5)
    t0 = cluster.now_ms()
    msgs = [make_timer(f"t{i}", t0 + 300 + 100 * i) for i in range(20)]
    await cluster.send(*msgs)
    await cluster.wait_delivered(3, timeout=10)
    await cluster.stop_broker()  # unregisters: the service drops it
    await asyncio.sleep(0.5)  # some timers fall due while it is away
    await cluster.start_broker()  # the same data, a new port
    got = await cluster.wait_delivered(len(msgs), timeout=20)
    due = {m.body.decode(): m.deliver_at_ms for m in msgs}
    # at-least-once: what was delivered after the last commit may come again
    early = [m.body for m in got if m.store_timestamp < due[m.body.decode()]]
    assert early == []
    assert set(by_body(got)) == set(due)


async def test_messages_whose_topic_was_deleted_are_kept_as_dead_letters_counted_and_logged(
    cluster: Any, make_timer: Make, caplog: pytest.LogCaptureFixture
) -> None:
    app = await cluster.start_schedule()
    await asyncio.wait_for(app.wait_active(), 5)
    async with grpc.aio.insecure_channel(cluster.address) as ch:
        admin = broker_pb2_grpc.BrokerAdminStub(ch)
        await admin.PutTopic(
            broker_pb2.PutTopicRequest(
                topic=common_pb2.TopicConfig(name="Gone", read_queues=1, write_queues=1, perm=6)
            ),
            timeout=5,
        )
        t0 = cluster.now_ms()
        msgs = [make_timer(f"g{i}", t0 + 800) for i in range(3)]
        for m in msgs:
            m.topic = "Gone"
        await cluster.send(*msgs)
        await admin.DeleteTopic(broker_pb2.DeleteTopicRequest(topic="Gone"), timeout=5)

    await eventually(
        lambda: app.stats.dead_lettered >= 3,
        10,
        "three dead letters",
        detail=lambda: str(app.stats.snapshot()),
    )
    assert (app.stats.delivered, app.stats.dropped) == (0, 0)
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "WARNING" and r.name == "apogee_schedule.core.resolving"
    ]
    assert warnings, [r.getMessage() for r in caplog.records]
    assert all(
        "scheduled messages as dead letters in %DLQ%SYS_SCHEDULE (first reason: not delivered "
        "when due: its topic 'Gone' no longer exists on this broker)" in w
        for w in warnings
    ), warnings


async def test_a_service_started_before_its_broker_finds_it_within_seconds(
    cluster: Any, make_timer: Make
) -> None:
    """The broker list is read every `broker_refresh_s` (30 s here), but every second while it
    is empty: a service that came up first does not leave the first messages waiting."""
    await cluster.stop_broker()  # unregisters: the nameserver knows no broker now
    await cluster.start_schedule(broker_refresh_s=30.0)
    await cluster.start_broker()
    due = {"first": cluster.now_ms() + 300}
    await cluster.send(make_timer("first", due["first"]))
    got = await cluster.wait_delivered(1, timeout=5)
    assert_once_and_never_early(got, due)
