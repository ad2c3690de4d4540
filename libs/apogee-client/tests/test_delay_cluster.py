"""Delayed and timer messages against real nameservers and brokers in this process: what the
brokers accept is parked under the schedule topic (and not in its real topic), what they refuse
reaches the caller as the broker words it, and delayed messages travel in the same requests as
the others. ``apogee send`` with its delay flags, too."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from apogee.cli.main import main
from apogee.client import (
    AdminClient,
    Message,
    Producer,
    PullConsumer,
    ReceivedMessage,
    SendResult,
    StoredMessage,
)
from apogee.common.errors import InvalidArgumentError
from apogee.testkit.cluster import InProcessCluster
from apogee_schedule.app import ScheduleApp
from apogee_schedule.settings import ScheduleSettings

pytestmark = pytest.mark.integration

TOPIC = "Orders"
SCHEDULE_TOPIC = "SCHEDULE_TOPIC_XXXX"
#: the wheel of the brokers' default layout: slots of a minute from queue 32
FIRST_SLOT_QUEUE = 32
SLOT_MS = 60_000
SLOTS = 1440


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster(tmp_path, nameservers=1, brokers=("broker-a",)) as c:
        await c.create_topic(TOPIC, queues=4)
        yield c


async def stored(cluster: InProcessCluster, result: SendResult) -> StoredMessage:
    async with AdminClient(cluster.namesrv) as admin:
        return await admin.get_message(result.message_id)


async def in_real_topic(cluster: InProcessCluster) -> int:
    async with AdminClient(cluster.namesrv) as admin:
        return (await admin.describe_topic(TOPIC)).messages


async def test_the_schedule_service_delivers_them_on_time(
    cluster: InProcessCluster, tmp_path: Path
) -> None:
    """With the schedule service running, a level-1 message (1 s) and a timer message due in
    1.5 s reach their topic, not before their time, as they were sent."""
    schedule = ScheduleApp(
        ScheduleSettings(
            namesrv=cluster.namesrv,
            listen="127.0.0.1:0",
            metrics_listen="127.0.0.1:0",
            lock_file=tmp_path / "schedule.lock",
            scan_hold_ms=200,
            progress_interval_s=0.2,
            broker_refresh_s=0.2,
            rpc_timeout_s=2.0,
            shutdown_grace_s=1.0,
        )
    )
    await schedule.start()
    try:
        await asyncio.wait_for(schedule.wait_active(), 10)
        at = time.time() + 1.5
        async with Producer(cluster.namesrv) as producer:
            level = await producer.send(Message(TOPIC, b"level 1", keys="k1", delay_level=1))
            timer = await producer.send(
                Message(TOPIC, b"timer", tags="due", properties={"p": "v"}, deliver_at=at)
            )
        assert await in_real_topic(cluster) == 0
        got: dict[str, ReceivedMessage] = {}
        async with PullConsumer(cluster.namesrv, "readers", consume_from="earliest") as consumer:
            consumer.subscribe(TOPIC)
            await consumer.start()
            async with asyncio.timeout(15):
                while len(got) < 2:
                    for m in await consumer.poll(timeout=1.0):
                        got[m.unique_id] = m
    finally:
        await schedule.stop()
    assert set(got) == {level.message_id, timer.message_id}
    first, second = got[level.message_id], got[timer.message_id]
    assert (first.topic, first.queue_id, first.body, first.keys) == (
        TOPIC,
        level.queue_id,
        b"level 1",
        ("k1",),
    )
    assert first.store_timestamp_ms >= level.store_timestamp_ms + 1000  # never early
    assert (second.topic, second.queue_id, second.body, second.tags) == (
        TOPIC,
        timer.queue_id,
        b"timer",
        "due",
    )
    due_ms = Message(TOPIC, b"x", deliver_at=at).deliver_at_ms
    # the schedule's own properties are gone; when it was due is kept
    assert second.properties == {"p": "v", "TIMER_DELIVER_MS": str(due_ms)}
    assert second.store_timestamp_ms >= due_ms


async def test_a_delayed_message_waits_in_its_level_queue(cluster: InProcessCluster) -> None:
    async with Producer(cluster.namesrv) as producer:
        before = int(time.time() * 1000)
        result = await producer.send(Message(TOPIC, b"later", keys="o-1", delay_level=3))
    # the result names the real topic and queue; it has no offset there yet
    assert (result.topic, result.broker_name) == (TOPIC, "broker-a")
    assert result.queue_offset == -1
    m = await stored(cluster, result)
    assert (m.topic, m.queue_id) == (SCHEDULE_TOPIC, 2)  # level 3: queue 2
    assert m.properties["REAL_TOPIC"] == TOPIC
    assert m.properties["REAL_QID"] == str(result.queue_id)
    assert m.properties["DELAY"] == "3"
    assert (m.body, m.keys) == (b"later", ("o-1",))
    assert m.born_timestamp_ms >= before
    assert await in_real_topic(cluster) == 0  # not visible before it is delivered


async def test_a_timer_message_waits_in_the_slot_of_its_time(cluster: InProcessCluster) -> None:
    at = datetime.now(UTC) + timedelta(minutes=10)
    async with Producer(cluster.namesrv) as producer:
        result = await producer.send(Message(TOPIC, b"at ten", deliver_at=at))
        in_a_day = time.time() + 86_400 * 1.5  # beyond the wheel: parked for now
        rolled = await producer.send(Message(TOPIC, b"in a day and a half", deliver_at=in_a_day))
    assert result.queue_offset == rolled.queue_offset == -1
    m = await stored(cluster, result)
    expected_ms = Message(TOPIC, b"x", deliver_at=at).deliver_at_ms
    assert m.topic == SCHEDULE_TOPIC
    assert m.queue_id == FIRST_SLOT_QUEUE + (expected_ms // SLOT_MS) % SLOTS
    assert m.properties["REAL_TOPIC"] == TOPIC
    far = await stored(cluster, rolled)
    assert far.topic == SCHEDULE_TOPIC
    assert FIRST_SLOT_QUEUE <= far.queue_id < FIRST_SLOT_QUEUE + SLOTS
    assert await in_real_topic(cluster) == 0


async def test_a_time_already_past_is_delivered_at_once(cluster: InProcessCluster) -> None:
    async with Producer(cluster.namesrv) as producer:
        result = await producer.send(Message(TOPIC, b"now", deliver_at=time.time() - 60))
    assert result.queue_offset >= 0
    m = await stored(cluster, result)
    assert (m.topic, m.queue_id, m.body) == (TOPIC, result.queue_id, b"now")
    assert await in_real_topic(cluster) == 1


async def test_the_brokers_cap_reaches_the_caller_unchanged(cluster: InProcessCluster) -> None:
    async with Producer(cluster.namesrv) as producer:
        with pytest.raises(InvalidArgumentError) as info:
            await producer.send(Message(TOPIC, b"x", deliver_at=time.time() + 8 * 86_400))
        assert producer.stats().retries == 0  # not retriable: asked once
    text = str(info.value)
    assert text.startswith("messages[0].deliver_at_ms: is 8.00 days ahead; the maximum is 7 days")
    assert "timer_max_delay_s" in text
    assert await in_real_topic(cluster) == 0


async def test_bad_delays_are_refused_before_a_request(cluster: InProcessCluster) -> None:
    async with Producer(cluster.namesrv) as producer:
        cases = [
            (Message(TOPIC, b"x", delay_level=19), "delay_level: must be an integer from 0"),
            (
                Message(TOPIC, b"x", delay_level=2, deliver_at=time.time() + 5),
                "deliver_at: cannot be combined with delay_level (2)",
            ),
        ]
        for message, text in cases:
            with pytest.raises(InvalidArgumentError, match=re.escape(text)):
                await producer.send(message)
        with pytest.raises(InvalidArgumentError, match="delay is not supported for batch sends"):
            await producer.send_batch([Message(TOPIC, b"a"), Message(TOPIC, b"b", delay_level=1)])
        assert producer.stats().requests == 0


async def test_delayed_messages_travel_with_the_others(cluster: InProcessCluster) -> None:
    """Independent sends of one turn share requests whatever their delays; each message is
    stored as its own delay says, and one the broker refuses fails alone."""
    soon = datetime.now(UTC) + timedelta(minutes=5)
    messages = []
    for i in range(60):
        kind = i % 3
        messages.append(
            Message(
                TOPIC,
                f"m{i}".encode(),
                delay_level=1 + i % 18 if kind == 1 else 0,
                deliver_at=soon if kind == 2 else None,
            )
        )
    too_far = Message(TOPIC, b"too far", deliver_at=time.time() + 8 * 86_400)
    async with Producer(cluster.namesrv) as producer:
        futures = [producer.send_nowait(m) for m in messages[:30]]
        refused = producer.send_nowait(too_far)  # in the same request: refused alone
        futures += [producer.send_nowait(m) for m in messages[30:]]
        results = await asyncio.gather(*futures)
        with pytest.raises(
            InvalidArgumentError, match=re.escape("deliver_at_ms: is 8.00 days ahead")
        ):
            await refused
        stats = producer.stats()
    assert stats.largest_request > 3  # not one request per message
    assert stats.requests < len(messages) // 3
    plain = [r for i, r in enumerate(results) if i % 3 == 0]
    delayed = [r for i, r in enumerate(results) if i % 3]
    assert all(r.queue_offset >= 0 for r in plain)
    assert all(r.queue_offset == -1 for r in delayed)
    assert await in_real_topic(cluster) == len(plain)
    for i in (1, 2, 4, 5):
        m = await stored(cluster, results[i])
        assert m.topic == SCHEDULE_TOPIC
        assert m.body == f"m{i}".encode()


async def test_apogee_send_with_a_delay(
    cluster: InProcessCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = ["--namesrv", cluster.namesrv, "send", TOPIC]

    async def send(*args: str, stdin: str = "", code: int = 0) -> tuple[list[str], str]:
        out, err = io.StringIO(), io.StringIO()
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert await asyncio.to_thread(main, [*base, *args]) == code
        return out.getvalue().split(), err.getvalue()

    # the body after the flags, as a user types it
    [level], _ = await send("--delay-level", "2", "in five seconds")
    in_an_hour = (datetime.now(UTC) + timedelta(hours=1)).astimezone(UTC).isoformat()
    [timer], _ = await send("--deliver-at", in_an_hour, "in an hour")
    lines, _ = await send("--deliver-in", "90", stdin="one\ntwo\n")
    assert len(lines) == 2
    async with AdminClient(cluster.namesrv) as admin:
        m = await admin.get_message(level)
        assert (m.topic, m.queue_id, m.body) == (SCHEDULE_TOPIC, 1, b"in five seconds")
        m = await admin.get_message(timer)
        at_ms = Message(TOPIC, b"x", deliver_at=datetime.fromisoformat(in_an_hour)).deliver_at_ms
        assert (m.topic, m.queue_id) == (
            SCHEDULE_TOPIC,
            FIRST_SLOT_QUEUE + at_ms // SLOT_MS % SLOTS,
        )
        for uid in lines:
            m = await admin.get_message(uid)
            assert m.topic == SCHEDULE_TOPIC
            assert m.properties["REAL_TOPIC"] == TOPIC
    assert await in_real_topic(cluster) == 0
    # the broker's cap, as the broker words it: one line, exit status 1
    printed, err = await send("--deliver-in", str(30 * 86_400), "next month", code=1)
    assert printed == []
    assert err.startswith("apogee: messages[0].deliver_at_ms: is 30.00 days ahead; the maximum")
    assert err.count("\n") == 1
