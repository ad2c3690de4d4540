"""The broker's half of delayed and timer messages and of send-back, over real gRPC: what a
send stores under the schedule topic, Scan / Resolve / CommitProgress, and retry / DLQ copies."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import grpc.aio
import pytest

from apogee.common.errors import StoreConfigError
from apogee.testkit.broker import decode_records, running_broker, small_settings
from apogee.testkit.broker import pull as stream_pull
from apogee.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    consumer_pb2,
    consumer_pb2_grpc,
    schedule_pb2,
    schedule_pb2_grpc,
)
from apogee_broker.app import BrokerApp
from apogee_broker.core.schedule.layout import FIRST_SLOT_QUEUE

pytestmark = pytest.mark.integration

SLOT_MS = 200
SLOTS = 10
SCHEDULE = "SCHEDULE_TOPIC_XXXX"


def settings(data_dir: Path, **extra: Any) -> Any:
    values: dict[str, Any] = {
        "broker_name": "b1",
        "delay_levels": "300ms 600ms 900ms",
        "timer_slot_ms": SLOT_MS,
        "timer_slots": SLOTS,
        "timer_max_delay_s": 60,
        "max_reconsume_times": 2,
        "first_retry_delay_level": 1,
    }
    values.update(extra)
    return small_settings(data_dir, **values)


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[BrokerApp]:
    async with running_broker(settings(tmp_path / "broker")) as app:
        await put_topic(app, "Orders", 2)
        yield app


@pytest.fixture
async def channel(app: BrokerApp) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(app.address) as ch:
        yield ch


async def put_topic(app: BrokerApp, name: str, queues: int) -> None:
    async with grpc.aio.insecure_channel(app.address) as ch:
        await broker_pb2_grpc.BrokerAdminStub(ch).PutTopic(
            broker_pb2.PutTopicRequest(
                topic=common_pb2.TopicConfig(
                    name=name, read_queues=queues, write_queues=queues, perm=6
                )
            ),
            timeout=5,
        )


async def send(ch: grpc.aio.Channel, *msgs: common_pb2.Message) -> list[broker_pb2.SendResult]:
    reply = await broker_pb2_grpc.BrokerStub(ch).SendMessages(
        broker_pb2.SendMessagesRequest(messages=list(msgs)), timeout=5
    )
    return list(reply.results)


async def settled(app: BrokerApp) -> None:
    """Wait until what was stored is readable through its queues (dispatch is asynchronous)."""
    assert app.store is not None
    assert await asyncio.to_thread(app.store.wait_dispatched, 5)


async def pull(ch: grpc.aio.Channel, topic: str, queue: int, offset: int = 0) -> list[Any]:
    reply = await stream_pull(
        ch,
        consumer_pb2.PullRequest(
            group="g", client_id="t", topic=topic, queue_id=queue, offset=offset
        ),
    )
    return decode_records(reply.records)


def order(body: bytes, **kw: Any) -> common_pb2.Message:
    return common_pb2.Message(
        topic="Orders",
        body=body,
        queue_id=1,
        tags="created",
        keys=["o-1"],
        properties={"region": "eu"},
        **kw,
    )


async def test_a_delayed_message_waits_in_its_level_queue_and_is_delivered_intact(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    sched = schedule_pb2_grpc.ScheduleStub(channel)
    before = int(time.time() * 1000)
    [res] = await send(channel, order(b"later", delay_level=2))
    assert (res.status.code, res.topic, res.queue_id, res.queue_offset) == (0, "Orders", 1, -1)
    await settled(app)
    assert await pull(channel, "Orders", 1) == []  # invisible until delivered

    state = await sched.GetScheduleState(schedule_pb2.GetScheduleStateRequest(), timeout=5)
    assert list(state.delay_ms) == [300, 600, 900]
    assert (state.first_slot_queue, state.slots, state.slot_ms) == (32, SLOTS, SLOT_MS)
    assert [(q.queue_id, q.max_offset, q.progress) for q in state.queues] == [(1, 1, -1)]

    scan = await sched.Scan(
        schedule_pb2.ScanRequest(queues=[schedule_pb2.ScanQueue(queue_id=1, offset=0)]), timeout=5
    )
    [entry] = scan.entries
    assert entry.queue_offset == 0
    assert before + 600 <= entry.deliver_at_ms <= int(time.time() * 1000) + 600
    # a level queue read only up to a time stops at the first entry not yet due
    early = await sched.Scan(
        schedule_pb2.ScanRequest(
            queues=[schedule_pb2.ScanQueue(queue_id=1, offset=0, due_before_ms=entry.deliver_at_ms)]
        ),
        timeout=5,
    )
    assert (list(early.entries), early.queues[0].next_offset) == ([], 0)

    resolved = await sched.Resolve(
        schedule_pb2.ResolveRequest(
            items=[schedule_pb2.ResolveItem(entry=entry, action=schedule_pb2.DELIVER)]
        ),
        timeout=5,
    )
    [r] = resolved.results
    assert (r.outcome, r.topic, r.queue_id, r.queue_offset) == (
        schedule_pb2.RESOLVED,
        "Orders",
        1,
        0,
    )
    await settled(app)
    [m] = await pull(channel, "Orders", 1)
    assert (m.body, m.tags, m.keys, m.unique_id) == (b"later", "created", ["o-1"], res.unique_id)
    assert {k: v for k, v in m.properties.items() if k not in {"TAGS", "KEYS", "UNIQ_KEY"}} == {
        "region": "eu",
        "TIMER_DELIVER_MS": str(entry.deliver_at_ms),  # when it was due, for its consumers
    }

    await sched.CommitProgress(schedule_pb2.CommitProgressRequest(offsets={1: 1}), timeout=5)
    state = await sched.GetScheduleState(schedule_pb2.GetScheduleStateRequest(), timeout=5)
    assert [(q.queue_id, q.progress) for q in state.queues] == [(1, 1)]
    assert state.progress_updated_ms >= before


async def test_timer_messages_go_to_their_slot_at_once_or_straight_through(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    sched = schedule_pb2_grpc.ScheduleStub(channel)
    now = int(time.time() * 1000)
    soon, far, past = now + 1000, now + 30_000, now - 5000
    results = await send(
        channel,
        order(b"soon", deliver_at_ms=soon),
        order(b"far", deliver_at_ms=far),
        order(b"past", deliver_at_ms=past),
    )
    assert [(r.status.code, r.queue_offset) for r in results] == [(0, -1), (0, -1), (0, 0)]
    await settled(app)
    [m] = await pull(channel, "Orders", 1)
    assert m.body == b"past"  # a time already passed is delivered at once

    state = await sched.GetScheduleState(schedule_pb2.GetScheduleStateRequest(), timeout=5)
    slot_of_soon = FIRST_SLOT_QUEUE + (soon // SLOT_MS) % SLOTS
    queues = {q.queue_id for q in state.queues}
    assert slot_of_soon in queues
    assert len(queues) == 2  # "far" is beyond the wheel's span: rolled into a nearer slot
    [rolled] = queues - {slot_of_soon}
    scan = await sched.Scan(
        schedule_pb2.ScanRequest(queues=[schedule_pb2.ScanQueue(queue_id=rolled, offset=0)]),
        timeout=5,
    )
    [entry] = scan.entries
    assert entry.deliver_at_ms == far  # the entry keeps the real time

    parked = await sched.Resolve(
        schedule_pb2.ResolveRequest(
            items=[schedule_pb2.ResolveItem(entry=entry, action=schedule_pb2.PARK)]
        ),
        timeout=5,
    )
    [p] = parked.results
    assert (p.outcome, p.topic) == (schedule_pb2.RESOLVED, SCHEDULE)
    assert FIRST_SLOT_QUEUE <= p.queue_id < FIRST_SLOT_QUEUE + SLOTS


async def test_a_delayed_message_whose_topic_was_deleted_is_kept_as_a_dead_letter(
    app: BrokerApp, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    await put_topic(app, "Gone", 1)
    [res] = await send(
        channel,
        common_pb2.Message(
            topic="Gone", body=b"orphan", properties={"region": "eu"}, delay_level=1
        ),
    )
    assert res.status.code == 0
    await broker_pb2_grpc.BrokerAdminStub(channel).DeleteTopic(
        broker_pb2.DeleteTopicRequest(topic="Gone"), timeout=5
    )
    await settled(app)
    sched = schedule_pb2_grpc.ScheduleStub(channel)
    scan = await sched.Scan(
        schedule_pb2.ScanRequest(queues=[schedule_pb2.ScanQueue(queue_id=0, offset=0)]), timeout=5
    )
    [entry] = scan.entries
    resolved = await sched.Resolve(
        schedule_pb2.ResolveRequest(
            items=[schedule_pb2.ResolveItem(entry=entry, action=schedule_pb2.DELIVER)]
        ),
        timeout=5,
    )
    [r] = resolved.results
    assert (r.outcome, r.topic) == (schedule_pb2.RESOLVED, "%DLQ%SYS_SCHEDULE")
    await settled(app)
    [m] = await pull(channel, "%DLQ%SYS_SCHEDULE", 0)
    assert (m.body, m.unique_id) == (b"orphan", res.unique_id)
    assert m.properties["DLQ_ORIGIN_TOPIC"] == "Gone"
    assert m.properties["DLQ_REASON"] == (
        "not delivered when due: its topic 'Gone' no longer exists on this broker"
    )
    assert m.properties["region"] == "eu"
    assert "REAL_TOPIC" not in m.properties
    [line] = [rec for rec in caplog.records if "cannot be delivered" in rec.getMessage()]
    assert line.levelname == "ERROR"
    assert res.unique_id in line.getMessage()
    assert "%DLQ%SYS_SCHEDULE" in line.getMessage()


async def test_a_client_cannot_route_a_delayed_message_with_reserved_properties(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    results = await send(
        channel,
        common_pb2.Message(
            topic="Orders", body=b"x", delay_level=1, properties={"REAL_TOPIC": "Victim"}
        ),
        common_pb2.Message(
            topic="Orders", body=b"x", delay_level=1, properties={"REAL_TOPIC": SCHEDULE}
        ),
        common_pb2.Message(topic="Orders", body=b"x", properties={"DELIVER_AT_MS": "1"}),
    )
    assert [(r.status.code, r.status.reason) for r in results] == [
        (grpc.StatusCode.INVALID_ARGUMENT.value[0], "INVALID_PROPERTY")
    ] * 3
    assert [r.status.message.split(":")[0] for r in results] == [
        "property 'REAL_TOPIC'",
        "property 'REAL_TOPIC'",
        "property 'DELIVER_AT_MS'",
    ]
    await settled(app)
    assert app.store is not None
    assert sum(app.store.queue_max_offsets().values()) == 0


async def test_bad_schedule_input_is_refused_with_the_rule(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    now = int(time.time() * 1000)
    results = await send(
        channel,
        order(b"x", delay_level=4),
        order(b"x", delay_level=1, deliver_at_ms=now + 1000),
        order(b"x", deliver_at_ms=now + 3_600_000),
    )
    assert [r.status.message for r in results] == [
        "messages[0].delay_level 4: must be between 1 and 3, the levels of this broker's "
        "delay table (0: no delay)",
        "messages[1]: delay_level and deliver_at_ms are both set; give one or the other",
        results[2].status.message,
    ]
    assert results[2].status.message.startswith("messages[2].deliver_at_ms: is 0.04 days ahead")
    assert "the maximum is 0.000694444 days (60 s, the broker's timer_max_delay_s)" in (
        results[2].status.message
    )
    sched = schedule_pb2_grpc.ScheduleStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sched.Scan(
            schedule_pb2.ScanRequest(queues=[schedule_pb2.ScanQueue(queue_id=5, offset=0)]),
            timeout=5,
        )
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "queues[0].queue_id: 5 is not a schedule queue of this broker" in str(
        info.value.details()
    )
    nothing_there = schedule_pb2.ScheduleEntry(queue_id=0, queue_offset=3, phys_offset=0)
    reply = await sched.Resolve(
        schedule_pb2.ResolveRequest(
            items=[schedule_pb2.ResolveItem(entry=nothing_there, action=schedule_pb2.DELIVER)]
        ),
        timeout=5,
    )
    [r] = reply.results
    assert r.outcome == schedule_pb2.DROPPED
    assert r.reason.startswith("no schedule entry 0/3: the queue holds offsets below ")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await sched.Resolve(
            schedule_pb2.ResolveRequest(items=[schedule_pb2.ResolveItem(entry=nothing_there)]),
            timeout=5,
        )
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "items[0].action: must be DELIVER or PARK"


async def test_entries_the_queue_does_not_hold_are_dropped_quietly_and_negatives_refused(
    app: BrokerApp, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression (found by e2e/test_fuzz.py): an entry naming no record of its queue (a phys
    offset past the log or inside a record) was read at its phys offset and logged as a lost
    message, an ERROR for every made-up request. Now the queue's own entry is looked up first:
    an entry it does not hold is dropped as naming nothing (a WARNING), and negative offsets are
    refused naming the field."""
    [res] = await send(channel, order(b"later", delay_level=2))
    await settled(app)
    sched = schedule_pb2_grpc.ScheduleStub(channel)
    scan = await sched.Scan(
        schedule_pb2.ScanRequest(queues=[schedule_pb2.ScanQueue(queue_id=1, offset=0)]), timeout=5
    )
    [real] = scan.entries

    def entry(**fields: int) -> schedule_pb2.ResolveItem:
        e = schedule_pb2.ScheduleEntry()
        e.CopyFrom(real)
        for name, value in fields.items():
            setattr(e, name, value)
        return schedule_pb2.ResolveItem(entry=e, action=schedule_pb2.DELIVER)

    reply = await sched.Resolve(
        schedule_pb2.ResolveRequest(
            items=[
                entry(phys_offset=real.phys_offset + 3),  # inside the record
                entry(phys_offset=2**31 - 1),  # past the end of the log
                entry(queue_offset=7),  # past the end of the queue
                entry(queue_id=0),  # a level queue that holds nothing
            ]
        ),
        timeout=5,
    )
    assert [(r.outcome, r.reason) for r in reply.results] == [
        (
            schedule_pb2.DROPPED,
            f"no schedule entry 1/0 at phys offset {real.phys_offset + 3} (the queue's entry "
            f"is at {real.phys_offset})",
        ),
        (
            schedule_pb2.DROPPED,
            f"no schedule entry 1/0 at phys offset {2**31 - 1} (the queue's entry is at "
            f"{real.phys_offset})",
        ),
        (schedule_pb2.DROPPED, "no schedule entry 1/7: the queue holds offsets below 1"),
        (schedule_pb2.DROPPED, "no schedule entry 0/0: the queue holds offsets below 0"),
    ]
    for name in ("queue_offset", "phys_offset"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await sched.Resolve(
                schedule_pb2.ResolveRequest(items=[entry(), entry(**{name: -1})]), timeout=5
            )
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == f"items[1].entry.{name}: must not be negative, got -1"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # the real entry is still there, and delivered
    reply = await sched.Resolve(schedule_pb2.ResolveRequest(items=[entry()]), timeout=5)
    assert [(r.outcome, r.topic) for r in reply.results] == [(schedule_pb2.RESOLVED, "Orders")]
    await settled(app)
    assert [m.unique_id for m in await pull(channel, "Orders", 1)] == [res.unique_id]


async def test_a_held_scan_answers_when_an_entry_lands(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    sched = schedule_pb2_grpc.ScheduleStub(channel)
    held = asyncio.ensure_future(
        sched.Scan(
            schedule_pb2.ScanRequest(
                queues=[schedule_pb2.ScanQueue(queue_id=0, offset=0)], hold_ms=10_000
            ),
            timeout=15,
        )
    )
    assert not held.done()
    t0 = time.monotonic()
    await send(channel, order(b"wake", delay_level=1))
    got = await asyncio.wait_for(held, 5)
    assert time.monotonic() - t0 < 2
    assert [e.queue_offset for e in got.entries] == [0]


async def test_send_back_retries_then_dead_letters(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    consumer = consumer_pb2_grpc.ConsumerStub(channel)
    sched = schedule_pb2_grpc.ScheduleStub(channel)
    [res] = await send(channel, order(b"poison"))
    await settled(app)
    [m] = await pull(channel, "Orders", 1)

    async def back(msg: Any, topic: str, reason: str) -> consumer_pb2.SendBackResult:
        reply = await consumer.SendBack(
            consumer_pb2.SendBackRequest(
                group="billing",
                items=[
                    consumer_pb2.SendBackItem(
                        topic=topic,
                        queue_id=msg.queue_id,
                        queue_offset=msg.queue_offset,
                        phys_offset=msg.phys_offset,
                        unique_id=msg.unique_id,
                        reason=reason,
                    )
                ],
            ),
            timeout=5,
        )
        [r] = reply.results
        return r

    async def deliver_level(level_queue: int, offset: int) -> None:
        await settled(app)
        scan = await sched.Scan(
            schedule_pb2.ScanRequest(
                queues=[schedule_pb2.ScanQueue(queue_id=level_queue, offset=offset)]
            ),
            timeout=5,
        )
        [entry] = scan.entries
        await sched.Resolve(
            schedule_pb2.ResolveRequest(
                items=[schedule_pb2.ResolveItem(entry=entry, action=schedule_pb2.DELIVER)]
            ),
            timeout=5,
        )
        await settled(app)

    retry = "%RETRY%billing"
    first = await back(m, "Orders", "boom 1")
    assert (first.status.code, first.topic, first.reconsume_times, first.dead_lettered) == (
        0,
        retry,
        1,
        False,
    )
    assert first.deliver_at_ms > 0
    await deliver_level(0, 0)  # first_retry_delay_level 1 -> queue 0
    [r1] = await pull(channel, retry, 0)
    assert (r1.body, r1.unique_id, r1.reconsume_times) == (b"poison", res.unique_id, 1)
    assert r1.properties["RETRY_TOPIC"] == "Orders"

    second = await back(r1, retry, "boom 2")
    assert (second.topic, second.reconsume_times) == (retry, 2)
    await deliver_level(1, 0)  # the next level
    [_, r2] = await pull(channel, retry, 0)
    assert r2.reconsume_times == 2

    dead = await back(r2, retry, "boom 3: " + "x" * 2000)
    await settled(app)
    assert (dead.status.code, dead.topic, dead.dead_lettered) == (0, "%DLQ%billing", True)
    [d] = await pull(channel, "%DLQ%billing", 0)
    assert (d.body, d.unique_id, d.reconsume_times) == (b"poison", res.unique_id, 2)
    assert d.properties["DLQ_ORIGIN_TOPIC"] == "Orders"
    assert d.properties["ATTEMPTS"] == "3"
    assert d.properties["DLQ_REASON"].startswith("boom 3: xxx")
    assert len(d.properties["DLQ_REASON"]) == 1024
    assert "RETRY_TOPIC" not in d.properties

    wrong = await back(
        SimpleNamespace(
            queue_id=m.queue_id,
            queue_offset=m.queue_offset,
            phys_offset=m.phys_offset,
            unique_id="NOT-IT",
        ),
        "Orders",
        "x",
    )
    assert wrong.status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "is not at phys offset" in wrong.status.message


async def test_progress_survives_a_restart_and_the_wheel_layout_is_fixed(tmp_path: Path) -> None:
    data = tmp_path / "broker"
    async with (
        running_broker(settings(data)) as app,
        grpc.aio.insecure_channel(app.address) as ch,
    ):
        await schedule_pb2_grpc.ScheduleStub(ch).CommitProgress(
            schedule_pb2.CommitProgressRequest(offsets={0: 7, FIRST_SLOT_QUEUE: 3}), timeout=5
        )
    async with (
        running_broker(settings(data)) as app,
        grpc.aio.insecure_channel(app.address) as ch,
    ):
        state = await schedule_pb2_grpc.ScheduleStub(ch).GetScheduleState(
            schedule_pb2.GetScheduleStateRequest(), timeout=5
        )
    assert {(q.queue_id, q.progress) for q in state.queues} == {(0, 7), (FIRST_SLOT_QUEUE, 3)}
    with pytest.raises(StoreConfigError, match="timer_slot_ms=200 and timer_slots=10"):
        async with running_broker(settings(data, timer_slots=20)):
            pass


async def test_a_held_scan_up_to_a_time_is_not_woken_by_an_entry_not_yet_due(
    app: BrokerApp, channel: grpc.aio.Channel
) -> None:
    await send(channel, order(b"in 900 ms", delay_level=3))
    await settled(app)
    sched = schedule_pb2_grpc.ScheduleStub(channel)
    t0 = time.monotonic()
    got = await sched.Scan(
        schedule_pb2.ScanRequest(
            queues=[schedule_pb2.ScanQueue(queue_id=2, offset=0, due_before_ms=1)],
            hold_ms=300,
        ),
        timeout=5,
    )
    assert list(got.entries) == []
    assert time.monotonic() - t0 >= 0.29  # held for its whole hold, not answered at once


async def test_a_broker_refuses_to_drop_delay_levels_that_still_hold_messages(
    tmp_path: Path,
) -> None:
    data = tmp_path / "broker"
    async with running_broker(settings(data)) as app:
        await put_topic(app, "Orders", 2)
        async with grpc.aio.insecure_channel(app.address) as ch:
            await send(ch, order(b"waiting", delay_level=3))
        await settled(app)
    with pytest.raises(StoreConfigError, match=r"delay level\(s\) 3 \(1 messages\)"):
        async with running_broker(settings(data, delay_levels="300ms 600ms")):
            pass


async def test_a_group_name_too_long_for_its_retry_topic_is_refused(
    channel: grpc.aio.Channel,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await consumer_pb2_grpc.ConsumerStub(channel).SendBack(
            consumer_pb2.SendBackRequest(
                group="g" * 121,
                items=[consumer_pb2.SendBackItem(topic="Orders", unique_id="x")],
            ),
            timeout=5,
        )
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == (
        f"group: {'g' * 121!r} is 121 characters; at most 120 are allowed"
    )
