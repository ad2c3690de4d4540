"""The consumers against real nameservers and brokers in this process: push and pull, groups
sharing queues, broadcasting, orderly, tag filters, offsets kept across restarts and reset,
long polling (failures, retries and dead letters: test_retry_*.py)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import pytest

from apogee.cli.main import main
from apogee.client import AdminClient, Message, Producer
from apogee.client.consumer.config import ConsumerOptions
from apogee.client.consumer.pull import PullConsumer
from apogee.client.consumer.push import PushConsumer
from apogee.client.consumer.records import ReceivedMessage
from apogee.client.consumer.sync import SyncPullConsumer, SyncPushConsumer
from apogee.common.errors import InvalidArgumentError, UnknownTopicError
from apogee.testkit.cluster import InProcessCluster, eventually, wait_committed
from apogee.testkit.waiting import wait_until

pytestmark = pytest.mark.integration

TOPIC = "Orders"


def fast(**extra: Any) -> ConsumerOptions:
    """The quick settings of these tests, plus ``extra``."""
    return cast(ConsumerOptions, {**FAST, **extra})


FAST: ConsumerOptions = {
    "rebalance_interval": 1.0,
    "offset_persist_interval": 0.2,
    "long_poll_timeout": 2.0,
}


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster(tmp_path, nameservers=1) as c:
        await c.create_topic(TOPIC, queues=4)
        await c.wait_route(TOPIC, {"broker-a", "broker-b"})
        yield c


async def send_n(namesrv: str, n: int, topic: str = TOPIC) -> list[str]:
    async with Producer(namesrv) as producer:
        results = await asyncio.gather(
            *(producer.send(Message(topic, f"m{i}".encode())) for i in range(n))
        )
    return [r.message_id for r in results]


class Inbox:
    """What listeners received, in arrival order."""

    def __init__(self) -> None:
        self.messages: list[ReceivedMessage] = []
        self.by_consumer: dict[str, list[ReceivedMessage]] = collections.defaultdict(list)

    def listener(self, name: str = "") -> Callable[[list[ReceivedMessage]], Awaitable[None]]:
        async def listen(msgs: list[ReceivedMessage]) -> None:
            self.messages += msgs
            self.by_consumer[name] += msgs

        return listen

    def ids(self) -> list[str]:
        return [m.unique_id for m in self.messages]

    async def until(self, count: int, timeout: float = 15.0) -> None:
        async def enough() -> bool:
            return len(self.messages) >= count

        await eventually(enough, timeout, f"{count} messages received")


async def settled(consumers: list[PushConsumer], queues: int) -> None:
    """Wait until the consumers' assignments partition the topic's queues."""

    since: list[float] = []

    async def partitioned() -> bool:  # and stayed so for a second: rebalances converge
        owned = [mq for c in consumers for mq in c.assignment()]
        if len(owned) != queues or len(set(owned)) != queues:
            since.clear()
            return False
        if not since:
            since.append(time.monotonic())
        return time.monotonic() - since[0] >= 1.0

    await eventually(partitioned, 15, "queues shared among the group")


async def test_a_group_shares_the_queues_and_gets_each_message_once(
    cluster: InProcessCluster,
) -> None:
    inbox = Inbox()
    consumers = [
        PushConsumer(cluster.namesrv, "g-share", inbox.listener(f"c{i}"), **FAST) for i in range(3)
    ]
    try:
        for c in consumers:
            c.subscribe(TOPIC)
            await c.start()
        await settled(consumers, 8)
        sent = await send_n(cluster.namesrv, 600)
        await inbox.until(600)
        # a duplicate reaches the listener before the offset past it is committed
        await wait_committed(cluster.namesrv, "g-share", TOPIC, 8)
    finally:
        for c in consumers:
            await c.close()
    assert sorted(inbox.ids()) == sorted(sent)
    assert len(inbox.by_consumer) == 3
    assert all(len(v) > 0 for v in inbox.by_consumer.values())
    first = inbox.messages[0]
    assert first.topic == TOPIC
    assert first.body.startswith(b"m")
    assert first.broker_name in {"broker-a", "broker-b"}


async def test_a_new_group_starts_at_the_end_unless_told_earliest(
    cluster: InProcessCluster,
) -> None:
    before = await send_n(cluster.namesrv, 20)
    latest, earliest = Inbox(), Inbox()
    a = PushConsumer(cluster.namesrv, "g-latest", latest.listener(), **FAST)
    b = PushConsumer(
        cluster.namesrv,
        "g-earliest",
        earliest.listener(),
        **fast(consume_from="earliest"),
    )
    async with a, b:
        for c in (a, b):
            c.subscribe(TOPIC)
            await c.start()
        after = await send_n(cluster.namesrv, 10)
        await latest.until(10)
        await earliest.until(30)
    assert sorted(latest.ids()) == sorted(after)
    assert sorted(earliest.ids()) == sorted(before + after)


async def test_a_stuck_message_holds_back_only_its_queue_offset(cluster: InProcessCluster) -> None:
    """The committed offset is the smallest still in flight: a restart redelivers the stuck
    message (and those after it in its queue), nothing before it."""
    release = asyncio.Event()
    seen: list[ReceivedMessage] = []

    async def slow(msgs: list[ReceivedMessage]) -> None:
        seen.extend(msgs)
        if msgs[0].body == b"m0":
            await release.wait()

    sent = await send_n(cluster.namesrv, 1)
    c1 = PushConsumer(
        cluster.namesrv, "g-stuck", slow, **fast(consume_from="earliest", close_timeout=0.2)
    )
    c1.subscribe(TOPIC)
    await c1.start()

    async def got_it() -> bool:
        return len(seen) >= 1

    await eventually(got_it, 10, "the first message")
    await c1.close()  # the call is abandoned: its offset must not be committed
    release.set()
    again = Inbox()
    async with PushConsumer(cluster.namesrv, "g-stuck", again.listener(), **FAST) as c2:
        c2.subscribe(TOPIC)
        await c2.start()
        await again.until(1)
    assert again.ids() == sent


async def test_tag_filter(cluster: InProcessCluster) -> None:
    inbox = Inbox()
    async with Producer(cluster.namesrv) as producer:
        for i in range(30):
            await producer.send(Message(TOPIC, f"{i}".encode(), tags="ABC"[i % 3]))
    async with PushConsumer(
        cluster.namesrv,
        "g-tags",
        inbox.listener(),
        **fast(consume_from="earliest"),
    ) as c:
        c.subscribe(TOPIC, "A || C")
        await c.start()
        await inbox.until(20)
        # a B would reach the listener before the offset past it is committed
        await wait_committed(cluster.namesrv, "g-tags", TOPIC, 8)
    assert sorted(m.tags for m in inbox.messages) == ["A"] * 10 + ["C"] * 10


async def test_sql_filter(cluster: InProcessCluster) -> None:
    """subscribe(topic, sql=...): only messages whose properties meet the condition arrive,
    filtered at the broker; a condition that does not parse fails subscribe() itself."""
    inbox = Inbox()
    async with Producer(cluster.namesrv) as producer:
        for i in range(30):
            props = {"n": str(i)} | ({"color": "red"} if i % 3 == 0 else {})
            await producer.send(Message(TOPIC, f"{i}".encode(), properties=props))
    async with PushConsumer(
        cluster.namesrv,
        "g-sql",
        inbox.listener(),
        **fast(consume_from="earliest"),
    ) as c:
        with pytest.raises(
            InvalidArgumentError,
            match=r"sql_expression: syntax error at position 6: expected a value after '>='",
        ):
            c.subscribe(TOPIC, sql="n >= AND")
        with pytest.raises(InvalidArgumentError, match=r"looks like an SQL92 condition"):
            c.subscribe(TOPIC, "color = 'red'")
        c.subscribe(TOPIC, sql="color = 'red' AND n BETWEEN 10 AND 29")
        await c.start()
        await inbox.until(6)
        # a message that should not come would reach the listener before its offset is
        # committed
        await wait_committed(cluster.namesrv, "g-sql", TOPIC, 8)
    assert sorted(int(m.body) for m in inbox.messages) == [12, 15, 18, 21, 24, 27]


async def test_broadcasting_gives_every_consumer_every_message(
    cluster: InProcessCluster, tmp_path: Path
) -> None:
    inbox = Inbox()
    consumers = [
        PushConsumer(
            cluster.namesrv,
            "g-broadcast",
            inbox.listener(f"c{i}"),
            **fast(mode="broadcasting", client_id=f"bc{i}", offset_dir=tmp_path / "offsets"),
        )
        for i in range(3)
    ]
    try:
        for c in consumers:
            c.subscribe(TOPIC)
            await c.start()
        sent = await send_n(cluster.namesrv, 50)
        await inbox.until(150)
    finally:
        for c in consumers:
            await c.close()
    for name in ("c0", "c1", "c2"):
        assert sorted(m.unique_id for m in inbox.by_consumer[name]) == sorted(sent)
    # each consumer's offsets are in its own local file
    assert sorted(p.name for p in (tmp_path / "offsets").glob("*.json")) == [
        "g-broadcast@bc0.json",
        "g-broadcast@bc1.json",
        "g-broadcast@bc2.json",
    ]


async def test_orderly_keeps_each_queue_in_order(cluster: InProcessCluster) -> None:
    got: dict[str, list[int]] = collections.defaultdict(list)
    running: set[tuple[str, int]] = set()
    overlaps: list[tuple[str, int]] = []

    async def listen(msgs: list[ReceivedMessage]) -> None:
        where = (msgs[0].broker_name, msgs[0].queue_id)
        if where in running:
            overlaps.append(where)
        running.add(where)
        await asyncio.sleep(0)  # let others run: they must not enter this queue
        for m in msgs:
            got[m.keys[0]].append(int(m.body))
        running.discard(where)

    async with Producer(cluster.namesrv) as producer:
        for i in range(200):
            key = f"k{i % 10}"
            await producer.send_ordered(Message(TOPIC, str(i).encode(), keys=key), key)
    consumers = [
        PushConsumer(
            cluster.namesrv, "g-orderly", listen, **fast(orderly=True, consume_from="earliest")
        )
        for _ in range(2)
    ]
    try:
        for c in consumers:
            c.subscribe(TOPIC)
            await c.start()

        async def complete() -> bool:
            return sum(len(v) for v in got.values()) >= 200

        await eventually(complete, 20, "200 ordered messages")
    finally:
        for c in consumers:
            await c.close()
    assert not overlaps
    for key, values in got.items():
        assert values == sorted(values), key


async def test_pull_consumer_polls_commits_and_resumes(cluster: InProcessCluster) -> None:
    sent = await send_n(cluster.namesrv, 40)
    seen: list[str] = []
    async with PullConsumer(
        cluster.namesrv, "g-pull", **fast(auto_commit=False, consume_from="earliest")
    ) as c:
        c.subscribe(TOPIC)
        await c.start()
        while len(seen) < 25:
            seen += [m.unique_id for m in await c.poll(timeout=5, max_messages=25 - len(seen))]
        await c.commit()
        extra = await c.poll(timeout=5, max_messages=5)  # polled, never committed
        assert extra
    rest: list[str] = []
    async with PullConsumer(cluster.namesrv, "g-pull", **FAST) as c:
        c.subscribe(TOPIC)
        await c.start()
        async with asyncio.timeout(15):
            async for m in c:
                rest.append(m.unique_id)
                if len(rest) >= 15:
                    break
    assert sorted(seen + rest) == sorted(sent)
    assert set(m.unique_id for m in extra) <= set(rest)


async def test_sync_twins(cluster: InProcessCluster) -> None:
    sent = await send_n(cluster.namesrv, 10)
    got: list[str] = []

    def listen(msgs: list[ReceivedMessage]) -> None:
        got.extend(m.unique_id for m in msgs)

    def run_sync() -> list[str]:
        with SyncPushConsumer(
            cluster.namesrv, "g-sync-push", listen, **fast(consume_from="earliest")
        ) as c:
            c.subscribe(TOPIC)
            c.start()
            wait_until(lambda: len(got) >= 10, 15, "ten messages pushed")
        with SyncPullConsumer(cluster.namesrv, "g-sync-pull", **fast(consume_from="earliest")) as p:
            p.subscribe(TOPIC)
            p.start()
            polled: list[str] = []
            deadline = time.monotonic() + 15
            while len(polled) < 10 and time.monotonic() < deadline:
                polled += [m.unique_id for m in p.poll(timeout=1)]
            return polled

    polled = await asyncio.to_thread(run_sync)
    assert sorted(got) == sorted(sent)
    assert sorted(polled) == sorted(sent)


async def test_long_polling_hands_over_a_new_message_at_once(cluster: InProcessCluster) -> None:
    arrived: list[float] = []

    async def listen(msgs: list[ReceivedMessage]) -> None:
        arrived.append(time.monotonic())

    async with PushConsumer(
        cluster.namesrv, "g-longpoll", listen, long_poll_timeout=15, rebalance_interval=1
    ) as c:
        c.subscribe(TOPIC)
        await c.start()

        def waiting() -> bool:  # each queue's delivery waits at its broker for an arrival
            watches = sum(b.store.notifier.pending() for b in cluster.brokers.values() if b.store)
            return len(c.assignment()) == 8 and watches >= 8

        await eventually(waiting, 10, "every queue's delivery waiting at the brokers")
        async with Producer(cluster.namesrv) as producer:
            sent_at = time.monotonic()
            await producer.send(Message(TOPIC, b"wake"))

            async def got() -> bool:
                return bool(arrived)

            await eventually(got, 5, "the message")
    assert arrived[0] - sent_at < 0.5


async def test_bad_subscriptions_and_options_are_refused_clearly(
    cluster: InProcessCluster,
) -> None:
    async def noop(msgs: list[ReceivedMessage]) -> None:
        return None

    with pytest.raises(InvalidArgumentError, match="group"):
        PushConsumer(cluster.namesrv, "bad group", noop)
    with pytest.raises(InvalidArgumentError, match="orderly"):
        PushConsumer(cluster.namesrv, "g", noop, orderly=True, mode="broadcasting")
    with pytest.raises(InvalidArgumentError, match="mode"):
        PushConsumer(cluster.namesrv, "g", noop, mode="sometimes")
    c = PushConsumer(cluster.namesrv, "g-bad", noop)
    with pytest.raises(InvalidArgumentError, match="empty tag"):
        c.subscribe(TOPIC, "A || || B")
    with pytest.raises(InvalidArgumentError, match="subscribe"):
        await c.start()
    c.subscribe("NoSuchTopic")
    with pytest.raises(UnknownTopicError, match="NoSuchTopic"):
        await c.start()
    await c.close()


async def test_a_reset_makes_running_consumers_start_again(cluster: InProcessCluster) -> None:
    inbox = Inbox()
    sent = await send_n(cluster.namesrv, 20)
    async with PushConsumer(
        cluster.namesrv, "g-reset", inbox.listener(), **fast(consume_from="earliest")
    ) as c:
        c.subscribe(TOPIC)
        await c.start()
        await inbox.until(20)
        await c.rebalance()  # nothing changes; offsets are committed meanwhile
        async with AdminClient(cluster.namesrv) as admin:
            await admin.reset_offsets("g-reset", TOPIC, earliest=True)
        await inbox.until(40)
    assert sorted(inbox.ids()) == sorted(sent + sent)


async def test_a_group_behind_retention_resumes_at_the_earliest_message_kept(
    tmp_path: Path,
) -> None:
    async with InProcessCluster(
        tmp_path,
        nameservers=1,
        brokers=("broker-a",),
        commitlog_file_size=64 * 1024,
        max_message_size=8 * 1024,
        retention_hours=0.0002,  # under a second
        retention_check_interval_s=0.1,
    ) as c:
        await c.create_topic("Aging", queues=1)
        await c.wait_route("Aging", {"broker-a"})
        first = Inbox()
        async with PushConsumer(
            c.namesrv, "g-aging", first.listener(), **fast(consume_from="earliest")
        ) as consumer:
            consumer.subscribe("Aging")
            await consumer.start()
            async with Producer(c.namesrv) as producer:
                await producer.send(Message("Aging", b"x" * 1024))
            await first.until(1)
        # the group stopped at offset 1; 300 KiB more fill several files, then the old go
        async with Producer(c.namesrv) as producer:
            for i in range(300):
                await producer.send(Message("Aging", str(i).encode().ljust(1024, b".")))
        async with AdminClient(c.namesrv) as admin:
            since: list[tuple[int, float]] = []  # the earliest offset kept, and since when

            async def trimmed() -> bool:
                # retention goes on deleting, a few files per round, until only the file being
                # written is left: wait until a second of rounds (every 0.1 s) deleted nothing
                status = await admin.describe_topic("Aging")
                low = status.brokers[0].queues[0].min_offset
                if low <= 1 or not since or since[0][0] != low:
                    since[:] = [(low, time.monotonic())]
                    return False
                return time.monotonic() - since[0][1] >= 1.0

            await eventually(trimmed, 15, "retention deleting the oldest files")
            earliest = since[0][0]
        rest = Inbox()
        async with PushConsumer(c.namesrv, "g-aging", rest.listener(), **fast()) as consumer:
            consumer.subscribe("Aging")
            await consumer.start()
            await rest.until(301 - earliest)
        offsets = [m.queue_offset for m in rest.messages]
        assert sorted(offsets) == list(range(earliest, 301))


async def test_the_consume_command(
    cluster: InProcessCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    async with Producer(cluster.namesrv) as producer:
        sent = [
            await producer.send(Message(TOPIC, f"line {i}\tx".encode(), tags="T", keys=f"k{i}"))
            for i in range(5)
        ]
    base = ["--namesrv", cluster.namesrv, "consume", TOPIC, "--group", "g-cli"]
    cmd = [*base, "--from", "earliest", "--count", "3", "--timeout", "10"]
    assert await asyncio.to_thread(main, cmd) == 0
    first = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert len(first) == 3
    by_id = {r.message_id: r for r in sent}
    for row in first:
        r = by_id[row[0]]
        number = row[5].removeprefix("line ").removesuffix("\\tx")  # the tab shown escaped
        assert row[5] == f"line {number}\\tx"
        assert row[1:5] == [f"{r.broker_name}/{r.queue_id}", str(r.queue_offset), "T", f"k{number}"]
    # the group committed what was printed: the next run prints the other two, then times out
    assert await asyncio.to_thread(main, [*base, "--count", "3", "--timeout", "1.5"]) == 1
    captured = capsys.readouterr()
    rest = [line.split("\t")[0] for line in captured.out.splitlines()]
    assert sorted([row[0] for row in first] + rest) == sorted(by_id)
    assert "received 2 of 3 messages before the timeout" in captured.err


async def test_a_member_joining_under_load_never_has_a_message_another_member_has(
    cluster: InProcessCluster,
) -> None:
    """Regression: a member that joined took its share of the queues at once, while their
    old owners still read them (each member computes the assignment alone), and messages went
    to both at the same time (a hundred with 200 members, measured). The broker now lets one
    member of the group read a queue at a time: the new owner starts once the old one let it
    go, after its listener calls ended, from the offset it committed then."""
    handling: dict[str, list[tuple[str, float, float]]] = collections.defaultdict(list)

    def slow(name: str) -> Callable[[list[ReceivedMessage]], Awaitable[None]]:
        async def listen(msgs: list[ReceivedMessage]) -> None:
            began = time.monotonic()
            await asyncio.sleep(0.3)  # still at it when its queue moves
            ended = time.monotonic()
            for m in msgs:
                handling[m.unique_id].append((name, began, ended))

        return listen

    consumers = [PushConsumer(cluster.namesrv, "g-join", slow(f"c{i}"), **FAST) for i in range(5)]
    sent: list[str] = []
    try:
        for c in consumers[:4]:
            c.subscribe(TOPIC)
            await c.start()
        await settled(consumers[:4], 8)
        async with Producer(cluster.namesrv) as producer:

            async def sending() -> None:
                for i in range(400):
                    sent.append((await producer.send(Message(TOPIC, f"j{i}".encode()))).message_id)
                    await asyncio.sleep(0.005)  # a steady flow across the join

            flow = asyncio.create_task(sending())
            await eventually(lambda: len(handling) >= 40, 15, "the flow under way")
            consumers[4].subscribe(TOPIC)
            await consumers[4].start()
            await settled(consumers, 8)
            await flow
        await eventually(lambda: set(handling) >= set(sent), 30, "every message handled")
    finally:
        for c in consumers:
            await c.close()
    at_once = {
        uid: calls
        for uid, calls in handling.items()
        for (a, a0, a1), (b, b0, b1) in itertools.combinations(calls, 2)
        if a != b and a0 < b1 and b0 < a1
    }
    assert at_once == {}
    assert any(name == "c4" for calls in handling.values() for name, _, _ in calls)
