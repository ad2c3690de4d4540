"""Failed messages against real nameservers and brokers in this process, without the schedule
service: sent back and dead-lettered with their reason, consumed again here when the send-back
fails (the offset never passing them), orderly and broadcasting consumers' local retries, the
pull consumer's send_back, and the group's retry topic read and shown under the original topic.
The full retry path through the schedule service is in test_retry_schedule.py."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest

from apogee.client import AdminClient, ConsumeResult, Message, Producer, ReceivedMessage
from apogee.client.consumer.config import ConsumerOptions
from apogee.client.consumer.pull import PullConsumer
from apogee.client.consumer.push import PushConsumer
from apogee.codec import PROP_RETRY_TOPIC
from apogee.codec import Message as StoredRecord
from apogee.common.errors import InvalidArgumentError, UnknownTopicError, UnsupportedError
from apogee.testkit.cluster import InProcessCluster, eventually

pytestmark = pytest.mark.integration

TOPIC = "Orders"


def fast(**extra: Any) -> ConsumerOptions:
    return cast(
        ConsumerOptions,
        {
            "rebalance_interval": 1.0,
            "offset_persist_interval": 0.2,
            "long_poll_timeout": 2.0,
            "consume_from": "earliest",
            **extra,
        },
    )


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster(
        tmp_path, nameservers=1, brokers=("broker-a",), delay_levels="100ms 200ms 300ms"
    ) as c:
        await c.create_topic(TOPIC, queues=2)
        yield c


def stored_retry(cluster: InProcessCluster, retry_topic: str, body: bytes) -> str:
    """A retry of a message of TOPIC as broker-a's send-back stores it (RETRY_TOPIC is the
    brokers' to set: a client's send carrying it is refused); returns its unique id."""
    store = cluster.brokers["broker-a"].store
    assert store is not None
    unique_id = f"RETRY-{body.hex()}"
    props = {PROP_RETRY_TOPIC: TOPIC}
    store.append(StoredRecord(retry_topic, body, 0, properties=props, unique_id=unique_id))
    return unique_id


async def send(namesrv: str, bodies: list[str], topic: str = TOPIC) -> dict[str, str]:
    """Send one message per body (key = body); returns body -> message id."""
    async with Producer(namesrv) as producer:
        results = [
            await producer.send(Message(topic, b.encode(), keys=b, tags="T")) for b in bodies
        ]
    return {b: r.message_id for b, r in zip(bodies, results, strict=True)}


async def committed(namesrv: str, group: str, topic: str) -> dict[int, int | None]:
    async with AdminClient(namesrv) as admin:
        d = await admin.describe_group(group)
    return {q.queue_id: q.consumer_offset for q in d.queues if q.topic == topic}


async def caught_up(namesrv: str, group: str, topic: str) -> bool:
    async with AdminClient(namesrv) as admin:
        d = await admin.describe_group(group)
    queues = [q for q in d.queues if q.topic == topic]
    return bool(queues) and all(q.consumer_offset == q.broker_offset for q in queues)


async def test_failures_are_sent_back_and_dead_lettered_with_their_reason(
    cluster: InProcessCluster,
) -> None:
    ids = await send(cluster.namesrv, ["ok-0", "raise", "later", "slow", "ok-4"])
    calls: collections.Counter[str] = collections.Counter()
    done: list[str] = []

    async def listen(msgs: list[ReceivedMessage]) -> ConsumeResult | None:
        body = msgs[0].body.decode()
        calls[body] += 1
        if body == "raise":
            raise ValueError("bad order 7\n  second line")
        if body == "later":
            return ConsumeResult.RETRY_LATER
        if body == "slow":
            await asyncio.Event().wait()  # cut off by consume_timeout
        done.append(body)
        return None

    options = fast(max_reconsume_times=0, consume_timeout=0.3)
    async with PushConsumer(cluster.namesrv, "g-dead", listen, **options) as consumer:
        consumer.subscribe(TOPIC)
        await consumer.start()
        async with AdminClient(cluster.namesrv) as admin:

            async def three_dead() -> bool:
                return len(await admin.list_dead_letters("g-dead")) >= 3

            await eventually(three_dead, 15, "three dead letters")
            letters = await admin.list_dead_letters("g-dead")

        async def all_committed() -> bool:
            return await caught_up(cluster.namesrv, "g-dead", TOPIC)

        await eventually(all_committed, 10, "offsets past every message")
    reasons = {d.unique_id: d.reason for d in letters}
    assert reasons == {
        ids["raise"]: "ValueError: bad order 7 second line",
        ids["later"]: "listener returned RETRY_LATER",
        ids["slow"]: "consume timeout of 0.3 s",
    }
    for d in letters:
        assert (d.origin_topic, d.attempts, d.tags, d.broker_name) == (TOPIC, 1, "T", "broker-a")
        assert d.keys == (d.body.decode(),)
    assert sorted(done) == ["ok-0", "ok-4"]
    assert calls == {"ok-0": 1, "raise": 1, "later": 1, "slow": 1, "ok-4": 1}

    # the group goes on after them: a restart finds nothing old to consume
    again: list[str] = []

    async def record(msgs: list[ReceivedMessage]) -> None:
        again.extend(m.body.decode() for m in msgs)

    async with PushConsumer(cluster.namesrv, "g-dead", record, **fast()) as consumer:
        consumer.subscribe(TOPIC)
        await consumer.start()
        await send(cluster.namesrv, ["new"])

        async def got_new() -> bool:
            return "new" in again

        await eventually(got_new, 10, "the new message")
    assert again == ["new"]


async def test_a_failed_send_back_is_consumed_again_here_and_holds_the_offset(
    cluster: InProcessCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker cannot store the retry copy (m0's properties are 30 bytes short of the
    store's 32,767-byte limit, and a retry adds RETRY_TOPIC and ORIGIN_MSG_ID): the message is
    handed to the listener again here, and its queue's committed offset stays at it until a
    call succeeds."""
    await cluster.create_topic("Solo", queues=1)
    # TAGS=T, KEYS=m0, a 32-character UNIQ_KEY and pad=..., each with its two separators
    overhead = (4 + 1 + 2) + (4 + 2 + 2) + (8 + 32 + 2) + (3 + 2)
    async with Producer(cluster.namesrv) as producer:
        await producer.send(
            Message(
                "Solo",
                b"m0",
                keys="m0",
                tags="T",
                properties={"pad": "x" * (32_767 - overhead - 30)},
            )
        )
    await send(cluster.namesrv, [f"m{i}" for i in range(1, 5)], topic="Solo")
    release = asyncio.Event()
    seen: list[tuple[str, int]] = []
    done: list[str] = []

    async def listen(msgs: list[ReceivedMessage]) -> None:
        m = msgs[0]
        seen.append((m.body.decode(), m.reconsume_times))
        if m.body == b"m0" and not release.is_set():
            raise RuntimeError("downstream is down")
        done.append(m.body.decode())

    options = fast(retry_delay=0.02, max_retry_delay=0.1)
    caplog.set_level(logging.WARNING, logger="apogee.client.consumer.push")
    async with PushConsumer(cluster.namesrv, "g-refused", listen, **options) as consumer:
        consumer.subscribe("Solo")
        await consumer.start()

        async def stuck_at_m0() -> bool:
            if len(done) < 4 or sum(1 for b, _ in seen if b == "m0") < 3:
                return False
            return (await committed(cluster.namesrv, "g-refused", "Solo")) == {0: 0}

        await eventually(stuck_at_m0, 10, "m0 failing, the rest done, offset 0 committed")
        assert "m0" not in done
        release.set()

        async def all_done() -> bool:
            return (await committed(cluster.namesrv, "g-refused", "Solo")) == {0: 5}

        await eventually(all_done, 10, "the offset past m0 once it succeeded")
    assert sorted(done) == ["m0", "m1", "m2", "m3", "m4"]
    assert [rt for b, rt in seen if b == "m0"] == [0] * len([b for b, _ in seen if b == "m0"])
    refused = [r.getMessage() for r in caplog.records if "back to broker" in r.getMessage()]
    assert refused
    assert "properties are" in refused[0]
    async with AdminClient(cluster.namesrv) as admin:  # the brokers stored nothing again
        assert (await admin.describe_topic("%RETRY%g-refused")).messages == 0
        with pytest.raises(UnknownTopicError):
            await admin.describe_topic("%DLQ%g-refused")


async def test_orderly_retries_locally_then_dead_letters_and_moves_on(
    cluster: InProcessCluster,
) -> None:
    await cluster.create_topic("Seq", queues=1)
    async with Producer(cluster.namesrv) as producer:
        for i in range(4):
            await producer.send_ordered(Message("Seq", f"m{i}".encode(), keys="k"), "k")
    calls: list[tuple[str, int]] = []

    async def listen(msgs: list[ReceivedMessage]) -> None:
        m = msgs[0]
        calls.append((m.body.decode(), m.reconsume_times))
        if m.body == b"m1":
            raise KeyError("no such account")

    options = fast(orderly=True, max_reconsume_times=2, retry_delay=0.02)
    async with PushConsumer(cluster.namesrv, "g-orderly-dlq", listen, **options) as consumer:
        consumer.subscribe("Seq")
        await consumer.start()

        async def through() -> bool:
            return await caught_up(cluster.namesrv, "g-orderly-dlq", "Seq")

        await eventually(through, 15, "the queue consumed past m1")
    assert calls == [("m0", 0), ("m1", 0), ("m1", 1), ("m1", 2), ("m2", 0), ("m3", 0)]
    await cluster.wait_route("%DLQ%g-orderly-dlq", {"broker-a"})
    async with AdminClient(cluster.namesrv) as admin:
        (letter,) = await admin.list_dead_letters("g-orderly-dlq")
    assert (letter.body, letter.origin_topic, letter.reason, letter.attempts) == (
        b"m1",
        "Seq",
        "KeyError: 'no such account'",
        3,
    )


async def test_broadcasting_retries_locally_then_drops_with_a_warning(
    cluster: InProcessCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ids = await send(cluster.namesrv, ["bad", "ok-1", "ok-2"])
    calls: collections.Counter[str] = collections.Counter()

    def listen(msgs: list[ReceivedMessage]) -> ConsumeResult:  # a plain function: threads
        calls[msgs[0].body.decode()] += 1
        return ConsumeResult.RETRY_LATER if msgs[0].body == b"bad" else ConsumeResult.SUCCESS

    caplog.set_level(logging.WARNING, logger="apogee.client.consumer.push")
    options = fast(
        mode="broadcasting",
        max_reconsume_times=3,
        retry_delay=0.02,
        offset_dir=tmp_path / "offsets",
    )
    async with PushConsumer(cluster.namesrv, "g-bc", listen, **options) as consumer:
        consumer.subscribe(TOPIC)
        await consumer.start()

        async def dropped() -> bool:
            return any("giving up" in r.getMessage() for r in caplog.records)

        await eventually(dropped, 10, "the failing message dropped")
    assert calls == {"bad": 4, "ok-1": 1, "ok-2": 1}
    (warning,) = [r.getMessage() for r in caplog.records if "giving up" in r.getMessage()]
    assert ids["bad"] in warning
    assert "after 4 failed call(s)" in warning
    async with AdminClient(cluster.namesrv) as admin:  # broadcasting: no retry, no DLQ
        for topic in ("%RETRY%g-bc", "%DLQ%g-bc"):
            with pytest.raises(UnknownTopicError):
                await admin.describe_topic(topic)


async def test_the_pull_consumer_sends_messages_back(cluster: InProcessCluster) -> None:
    await send(cluster.namesrv, ["a", "b", "c"])
    async with PullConsumer(
        cluster.namesrv, "g-pull-back", auto_commit=False, **fast(first_retry_delay_level=2)
    ) as consumer:
        consumer.subscribe(TOPIC)
        await consumer.start()
        polled: list[ReceivedMessage] = []
        while len(polled) < 3:
            polled += await consumer.poll(timeout=5)
        first, second = polled[0], polled[1]
        before = time.time() * 1000
        retried = await consumer.send_back(first, "cannot parse")
        assert (retried.topic, retried.reconsume_times, retried.dead_lettered) == (
            "%RETRY%g-pull-back",
            1,
            False,
        )
        # level 2 of this broker's table is 200 ms
        assert before + 150 <= retried.deliver_at_ms <= time.time() * 1000 + 250
        with pytest.raises(InvalidArgumentError, match="message: must be a message returned"):
            await consumer.send_back(first)  # sent back already: no longer outstanding
        await consumer.commit()
        with pytest.raises(InvalidArgumentError, match="not committed yet"):
            await consumer.send_back(second)
    async with PullConsumer(
        cluster.namesrv, "g-pull-dead", auto_commit=False, **fast(max_reconsume_times=0)
    ) as consumer:
        consumer.subscribe(TOPIC)
        await consumer.start()
        polled = []
        while len(polled) < 3:
            polled += await consumer.poll(timeout=5)
        dead = await consumer.send_back(polled[2], "schema mismatch")
        assert (dead.topic, dead.dead_lettered, dead.deliver_at_ms) == (
            "%DLQ%g-pull-dead",
            True,
            0,
        )
    await cluster.wait_route("%DLQ%g-pull-dead", {"broker-a"})
    async with AdminClient(cluster.namesrv) as admin:
        (letter,) = await admin.list_dead_letters("g-pull-dead")
    assert (letter.unique_id, letter.reason) == (polled[2].unique_id, "schema mismatch")
    async with PullConsumer(
        cluster.namesrv, "g-pull-bc", **fast(mode="broadcasting", offset_dir=cluster.root)
    ) as consumer:
        consumer.subscribe(TOPIC)
        await consumer.start()
        polled = []
        while not polled:
            polled = await consumer.poll(timeout=5)
        with pytest.raises(UnsupportedError, match="send_back needs clustering mode"):
            await consumer.send_back(polled[0])


async def test_the_group_reads_its_retry_topic_under_the_original_topic(
    cluster: InProcessCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker makes %RETRY%<group> when the member's session starts; the member finds its
    route at a later rebalance, without complaint, and shows its messages under RETRY_TOPIC."""
    caplog.set_level(logging.WARNING)
    got: list[ReceivedMessage] = []

    async def listen(msgs: list[ReceivedMessage]) -> None:
        got.extend(msgs)

    async with PushConsumer(cluster.namesrv, "g-reads-retry", listen, **fast()) as consumer:
        consumer.subscribe(TOPIC)
        await consumer.start()
        await cluster.wait_route("%RETRY%g-reads-retry", {"broker-a"})
        stored_retry(cluster, "%RETRY%g-reads-retry", b"again")

        async def arrived() -> bool:
            return bool(got)

        await eventually(arrived, 10, "the message of the retry topic")
        assert [mq.topic for mq in consumer.assignment()] == [TOPIC, TOPIC]
    assert (got[0].topic, got[0].body, got[0].properties["RETRY_TOPIC"]) == (
        TOPIC,
        b"again",
        TOPIC,
    )
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_retries_waiting_before_the_group_starts_are_not_skipped(
    cluster: InProcessCluster,
) -> None:
    """consume_from=latest applies to the subscribed topics, never to the group's retries."""
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic("%RETRY%g-late", queues=1)
    await cluster.wait_route("%RETRY%g-late", {"broker-a"})
    waiting = stored_retry(cluster, "%RETRY%g-late", b"retry me")
    async with Producer(cluster.namesrv) as producer:
        await producer.send(Message(TOPIC, b"old news"))
    got: list[ReceivedMessage] = []

    async def listen(msgs: list[ReceivedMessage]) -> None:
        got.extend(msgs)

    options = fast(consume_from="latest")
    async with PushConsumer(cluster.namesrv, "g-late", listen, **options) as consumer:
        consumer.subscribe(TOPIC)
        await consumer.start()

        async def arrived() -> bool:
            return bool(got)

        await eventually(arrived, 10, "the waiting retry")
        await send(cluster.namesrv, ["fresh"])

        async def fresh() -> bool:
            return len(got) >= 2

        await eventually(fresh, 10, "the fresh message")
    assert [(m.unique_id, m.topic) for m in got[:1]] == [(waiting, TOPIC)]
    assert [m.body for m in got] == [b"retry me", b"fresh"]


async def test_where_brokers_create_topics_the_retry_topic_comes_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nameservers answer for a topic no broker has yet with the auto-create route: the
    group's retry topic queues it does not have yet are looked at again without warnings."""
    caplog.set_level(logging.WARNING, logger="apogee.client.consumer")
    async with InProcessCluster(
        tmp_path / "auto", nameservers=1, brokers=("broker-a",), auto_create_topics=True
    ) as c:
        await c.create_topic(TOPIC, queues=1)
        got: list[ReceivedMessage] = []

        async def listen(msgs: list[ReceivedMessage]) -> None:
            got.extend(msgs)

        async with PushConsumer(c.namesrv, "g-auto", listen, **fast()) as consumer:
            consumer.subscribe(TOPIC)
            await consumer.start()
            await c.wait_route("%RETRY%g-auto", {"broker-a"})
            async with AdminClient(c.namesrv) as admin:

                async def one_retry_queue() -> bool:
                    status = await admin.describe_topic("%RETRY%g-auto")
                    return [len(b.queues) for b in status.brokers] == [1]

                await eventually(one_retry_queue, 5, "the retry topic made by the broker")
            stored_retry(c, "%RETRY%g-auto", b"again")

            async def arrived() -> bool:
                return bool(got)

            await eventually(arrived, 10, "the retried message")
    assert (got[0].topic, got[0].body) == (TOPIC, b"again")
    assert [r.getMessage() for r in caplog.records] == []
