"""The whole retry path with the schedule service, in this process: a message the listener
keeps failing comes back through %RETRY%<group> with reconsume_times 1, 2, 3 after the growing
delays of the broker's table, then lands in %DLQ%<group> with its reason, is listed there, and a
redrive delivers it to the group again."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from apogee.client import AdminClient, Message, Producer, PushConsumer, ReceivedMessage
from apogee.testkit.cluster import InProcessCluster, eventually
from apogee_schedule.app import ScheduleApp
from apogee_schedule.settings import ScheduleSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOPIC = "Orders"
GROUP = "g-retries"
#: levels 1, 2, 3 wait 100, 200, 300 ms
DELAYS = "100ms 200ms 300ms 400ms 500ms 600ms 700ms 800ms 900ms " + "1s " * 8 + "1s"


@dataclass(frozen=True, slots=True)
class Call:
    at: float
    topic: str
    unique_id: str
    reconsume_times: int
    properties: dict[str, str]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster(
        tmp_path, nameservers=1, brokers=("broker-a",), delay_levels=DELAYS
    ) as c:
        await c.create_topic(TOPIC, queues=1)
        app = ScheduleApp(
            ScheduleSettings(
                namesrv=c.namesrv,
                listen="127.0.0.1:0",
                metrics_listen="127.0.0.1:0",
                lock_file=tmp_path / "schedule.lock",
            )
        )
        await app.start()
        try:
            async with asyncio.timeout(10):
                await app.wait_active()
            yield c
        finally:
            await app.stop()


async def test_retries_come_back_later_each_time_then_dead_letter_and_redrive(
    cluster: InProcessCluster,
) -> None:
    calls: list[Call] = []
    broken = True

    async def listen(msgs: list[ReceivedMessage]) -> None:
        m = msgs[0]
        calls.append(
            Call(time.monotonic(), m.topic, m.unique_id, m.reconsume_times, dict(m.properties))
        )
        if broken and m.body == b"doomed":
            raise RuntimeError(f"cannot handle {m.body.decode()}")

    consumer = PushConsumer(
        cluster.namesrv,
        GROUP,
        listen,
        max_reconsume_times=3,
        first_retry_delay_level=1,
        rebalance_interval=1.0,
        offset_persist_interval=0.2,
        long_poll_timeout=2.0,
    )
    async with consumer:
        consumer.subscribe(TOPIC)
        await consumer.start()
        # the broker made the retry topic when the session started: read it before sending
        await cluster.wait_route(f"%RETRY%{GROUP}", {"broker-a"})
        await consumer.rebalance()
        async with Producer(cluster.namesrv) as producer:
            doomed = await producer.send(Message(TOPIC, b"doomed", keys="o-1", tags="T"))
            await producer.send(Message(TOPIC, b"fine"))

        async with AdminClient(cluster.namesrv) as admin:

            async def dead() -> bool:
                return bool(await admin.list_dead_letters(GROUP))

            await eventually(dead, 20, "the message in the dead-letter topic")
            (letter,) = await admin.list_dead_letters(GROUP)
            tries = [c for c in calls if c.unique_id == doomed.message_id]
            assert [c.reconsume_times for c in tries] == [0, 1, 2, 3]
            assert {c.topic for c in tries} == {TOPIC}
            assert [c.properties.get("RETRY_TOPIC") for c in tries] == [None, TOPIC, TOPIC, TOPIC]
            gaps = [b.at - a.at for a, b in itertools.pairwise(tries)]
            # levels 1, 2, 3 of the table: never early, and each wait longer than the one before
            assert gaps[0] >= 0.1
            assert gaps[1] >= 0.2
            assert gaps[2] >= 0.3
            assert gaps[0] < gaps[2]
            assert (letter.unique_id, letter.origin_topic, letter.attempts, letter.keys) == (
                doomed.message_id,
                TOPIC,
                4,
                ("o-1",),
            )
            assert letter.reason == "RuntimeError: cannot handle doomed"

            broken = False
            result = await admin.redrive_dead_letters(GROUP)
            assert (result.matched, result.sent, result.failed) == (1, 1, 0)
            ((old_id, new_id),) = result.redriven
            assert old_id == doomed.message_id

        async def redelivered() -> bool:
            return any(c.unique_id == new_id for c in calls)

        await eventually(redelivered, 10, "the redriven message")
    again = next(c for c in calls if c.unique_id == new_id)
    assert (again.topic, again.reconsume_times) == (TOPIC, 0)
    assert again.properties == {"ORIGIN_MSG_ID": doomed.message_id}
    assert sum(1 for c in calls if c.properties == {} and c.unique_id != doomed.message_id) == 1
