"""Delayed and timer messages end to end: a nameserver, a broker and the schedule service as
real processes, the delay table shortened; the consumers and producers run in the test.

- every delay level arrives no earlier than its delay (and not much later);
- a timer message for now + 3 s arrives between 3 s and 3.5 s; 1,000 timer messages spread over
  20 s all arrive, none early;
- ``kill -9`` of the schedule service, and separately of the broker, mid-way: after restarts
  every delayed message is delivered (duplicates allowed, losses not);
- bad delays get their errors; a delivery time already past is stored at once.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import time
from collections.abc import Callable

import pytest

from apogee.client import AdminClient, Message, Producer
from apogee.client.consumer.push import PushConsumer
from apogee.client.consumer.records import ReceivedMessage
from apogee.common.errors import InvalidArgumentError
from e2e.harness import Cluster, ClusterFactory, eventually, wait_for_route

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: Delay levels of these tests: level L waits L * 400 ms.
LEVELS_MS = [400 * (i + 1) for i in range(6)]
BROKER_ENV = {"APOGEE_BROKER_DELAY_LEVELS": " ".join(f"{ms}ms" for ms in LEVELS_MS)}


class Received:
    """What a push consumer got: per unique id, the wall-clock times of arrival."""

    def __init__(self) -> None:
        self.at: dict[str, list[float]] = collections.defaultdict(list)
        self.messages: dict[str, ReceivedMessage] = {}

    def listener(self) -> Callable[[list[ReceivedMessage]], None]:
        def listen(msgs: list[ReceivedMessage]) -> None:
            now = time.time()
            for m in msgs:
                self.at[m.unique_id].append(now)
                self.messages[m.unique_id] = m

        return listen


async def make_topic(cluster: Cluster, topic: str) -> None:
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic(topic, queues=4)
    await wait_for_route(cluster.nameservers, topic, {b.name for b in cluster.brokers})


async def consume(cluster: Cluster, topic: str, group: str, got: Received) -> PushConsumer:
    consumer = PushConsumer(
        cluster.namesrv,
        group,
        got.listener(),
        consume_from="earliest",
        rebalance_interval=1.0,
        long_poll_timeout=2.0,
    )
    consumer.subscribe(topic)
    await consumer.start()
    return consumer


def start(factory: ClusterFactory, name: str) -> Cluster:
    return factory(name, brokers=1, nameservers=1, broker_env=BROKER_ENV)


async def test_each_delay_level_arrives_no_earlier_than_its_delay(
    start_cluster: ClusterFactory,
) -> None:
    cluster = await asyncio.to_thread(start, start_cluster, "levels")
    await make_topic(cluster, "Delayed")
    got = Received()
    consumer = await consume(cluster, "Delayed", "delay-readers", got)
    try:
        sent: dict[str, tuple[int, float]] = {}
        async with Producer(cluster.namesrv, group="e2e-delay") as producer:
            for level in range(1, len(LEVELS_MS) + 1):
                t0 = time.time()
                r = await producer.send(Message("Delayed", f"L{level}".encode(), delay_level=level))
                sent[r.message_id] = (level, t0)
        await eventually(
            lambda: _async(len(got.at) == len(sent)), 15, "every delayed message delivered"
        )
    finally:
        await consumer.close()
    for uid, (level, t0) in sent.items():
        waited = got.at[uid][0] - t0
        delay = LEVELS_MS[level - 1] / 1000
        assert delay <= waited < delay + 1.0, (level, waited)
        assert got.messages[uid].body == f"L{level}".encode()
        assert got.messages[uid].topic == "Delayed"


async def test_timer_messages_arrive_on_time_and_never_early(
    start_cluster: ClusterFactory,
) -> None:
    cluster = await asyncio.to_thread(start, start_cluster, "timers")
    await make_topic(cluster, "Timers")
    got = Received()
    consumer = await consume(cluster, "Timers", "timer-readers", got)
    rng = random.Random(5)
    due: dict[str, float] = {}
    try:
        async with Producer(cluster.namesrv, group="e2e-timers") as producer:
            t0 = time.time()
            r = await producer.send(Message("Timers", b"in 3 s", deliver_at=t0 + 3.0))
            single = r.message_id
            due[single] = t0 + 3.0
            # 1,000 more, due at random times over the next 20 s
            start_at = time.time()
            spread = [
                Message("Timers", f"t{i}".encode(), deliver_at=start_at + 1 + rng.uniform(0, 20))
                for i in range(1000)
            ]
            results = await asyncio.gather(*(producer.send_nowait(m) for m in spread))
            for m, res in zip(spread, results, strict=True):
                assert isinstance(m.deliver_at, float)
                due[res.message_id] = m.deliver_at
        await eventually(
            lambda: _async(len(got.at) == len(due)), 40, "all 1,001 timer messages delivered"
        )
    finally:
        await consumer.close()
    first_single = got.at[single][0] - t0
    assert 3.0 <= first_single <= 3.5, first_single
    early = {uid: due[uid] - at[0] for uid, at in got.at.items() if at[0] < due[uid]}
    assert early == {}
    late = sorted(at[0] - due[uid] for uid, at in got.at.items())
    assert late[len(late) // 2] < 0.5, late[len(late) // 2]


async def test_kill_9_of_the_schedule_service_or_the_broker_loses_no_delayed_message(
    start_cluster: ClusterFactory,
) -> None:
    cluster = await asyncio.to_thread(start, start_cluster, "kills")
    await make_topic(cluster, "Survivors")
    ids: set[str] = set()
    async with Producer(cluster.namesrv, group="e2e-kills") as producer:
        base = time.time()
        msgs = [
            Message("Survivors", f"s{i}".encode(), deliver_at=base + 1 + i * 0.02)
            for i in range(400)
        ] + [
            Message("Survivors", f"d{i}".encode(), delay_level=1 + i % len(LEVELS_MS))
            for i in range(60)
        ]
        ids |= {r.message_id for r in await asyncio.gather(*map(producer.send_nowait, msgs))}

        # the schedule service dies once part of them is delivered, and comes back
        await delivered_at_least(cluster, "Survivors", 100)
        await asyncio.to_thread(cluster.kill, "schedule")
        more = [
            Message("Survivors", f"m{i}".encode(), deliver_at=time.time() + 2 + i * 0.01)
            for i in range(200)
        ]
        ids |= {r.message_id for r in await asyncio.gather(*map(producer.send_nowait, more))}
        await asyncio.to_thread(cluster.restart, "schedule")

    # then the broker dies while timers are pending, and comes back
    async with Producer(cluster.namesrv, group="e2e-kills-2") as producer:
        late = [
            Message("Survivors", f"b{i}".encode(), deliver_at=time.time() + 3 + i * 0.01)
            for i in range(200)
        ]
        ids |= {r.message_id for r in await asyncio.gather(*map(producer.send_nowait, late))}
    broker = cluster.brokers[0].name
    await delivered_at_least(cluster, "Survivors", len(ids) - 150)  # mid-way through the last lot
    await asyncio.to_thread(cluster.kill, broker)
    await asyncio.to_thread(cluster.restart, broker)

    got = Received()
    consumer = await consume(cluster, "Survivors", "survivor-readers", got)
    try:
        await eventually(
            lambda: _async(ids <= set(got.at)), 40, "every delayed message delivered after kills"
        )
    finally:
        await consumer.close()
    assert ids <= set(got.at)


async def delivered_at_least(cluster: Cluster, topic: str, n: int) -> None:
    async with AdminClient(cluster.namesrv) as admin:

        async def enough() -> bool:
            return (await admin.describe_topic(topic)).messages >= n

        await eventually(enough, 30, f"{n} messages delivered to {topic}")


async def _async(value: bool) -> bool:
    return value


async def test_bad_delays_get_their_errors_and_a_past_time_is_delivered_at_once(
    start_cluster: ClusterFactory,
) -> None:
    cluster = await asyncio.to_thread(start, start_cluster, "bad-delays")
    await make_topic(cluster, "Picky")
    async with Producer(cluster.namesrv, group="e2e-bad-delays", retries=0) as producer:
        with pytest.raises(InvalidArgumentError) as info:
            await producer.send(Message("Picky", b"x", delay_level=len(LEVELS_MS) + 1))
        assert f"delay_level {len(LEVELS_MS) + 1}: must be between 1 and {len(LEVELS_MS)}" in (
            str(info.value)
        )
        with pytest.raises(InvalidArgumentError) as info:
            await producer.send(Message("Picky", b"x", deliver_at=time.time() + 8 * 86_400))
        assert "the maximum is 7 days (604800 s, the broker's timer_max_delay_s)" in str(info.value)
        with pytest.raises(InvalidArgumentError) as info:
            await producer.send_batch(
                [Message("Picky", b"a"), Message("Picky", b"b", delay_level=1)]
            )
        assert "delay" in str(info.value)
        with pytest.raises(InvalidArgumentError) as info:
            await producer.send(Message("Picky", b"x", delay_level=1, deliver_at=time.time() + 5))
        assert "delay_level" in str(info.value)
        assert "deliver_at" in str(info.value)
        past = await producer.send(Message("Picky", b"late", deliver_at=time.time() - 60))
        assert past.queue_offset >= 0  # stored in its queue at once, not scheduled
        async with AdminClient(cluster.namesrv) as admin:
            stored = await admin.get_message(past.message_id)
        assert (stored.topic, stored.body) == ("Picky", b"late")


async def test_a_message_that_always_fails_is_retried_then_dead_lettered_and_redriven(
    start_cluster: ClusterFactory,
) -> None:
    cluster = await asyncio.to_thread(start, start_cluster, "retries")
    await make_topic(cluster, "Payments")
    arrivals: list[tuple[float, int, str]] = []
    healed = asyncio.Event()
    redriven = asyncio.Event()

    def listen(msgs: list[ReceivedMessage]) -> None:
        for m in msgs:
            arrivals.append((time.time(), m.reconsume_times, m.topic))
            if healed.is_set():
                if m.properties.get("ORIGIN_MSG_ID"):
                    redriven.set()
                return
            raise RuntimeError(f"card declined for {m.body.decode()}")

    consumer = PushConsumer(
        cluster.namesrv,
        "payments",
        listen,
        consume_from="earliest",
        rebalance_interval=1.0,
        long_poll_timeout=2.0,
        max_reconsume_times=3,
        first_retry_delay_level=1,
    )
    consumer.subscribe("Payments")
    await consumer.start()
    try:
        async with Producer(cluster.namesrv, group="e2e-payments") as producer:
            sent = await producer.send(Message("Payments", b"order-7", keys="order-7"))
        async with AdminClient(cluster.namesrv) as admin:

            async def dead() -> bool:
                return bool(await admin.list_dead_letters("payments"))

            await eventually(dead, 30, "the message in %DLQ%payments")
            [letter] = await admin.list_dead_letters("payments")
            assert (letter.unique_id, letter.origin_topic, letter.attempts) == (
                sent.message_id,
                "Payments",
                4,
            )
            assert "card declined for order-7" in letter.reason
            assert letter.body == b"order-7"
            healed.set()
            result = await admin.redrive_dead_letters("payments", key="order-7", rate=10)
            assert (result.matched, result.sent, result.failed) == (1, 1, 0)
        await asyncio.wait_for(redriven.wait(), 15)
    finally:
        await consumer.close()
    # the original delivery and three retries, each seen under the original topic, each
    # waiting one delay level more than the one before
    failing = arrivals[:4]
    assert [(times, topic) for _, times, topic in failing] == [
        (0, "Payments"),
        (1, "Payments"),
        (2, "Payments"),
        (3, "Payments"),
    ]
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(failing)]
    for level, gap in enumerate(gaps, start=1):
        assert LEVELS_MS[level - 1] / 1000 <= gap < LEVELS_MS[level - 1] / 1000 + 1.5, gaps
