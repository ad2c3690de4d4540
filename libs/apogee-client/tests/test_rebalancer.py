"""The rebalancer: a consumer takes its share of the queues, gives queues up when members join
and takes them back when they leave, keeps what it has when the group cannot be read, and
rebalances at once when woken."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any, cast

import pytest

from apogee.client._rpc import ChannelPool, NameServerClient
from apogee.client.consumer.config import ConsumeMode, ConsumerConfig, ConsumerOptions
from apogee.client.consumer.rebalance import ClusterDirectory, ReadRoute, Rebalancer
from apogee.client.producer.routes import MessageQueue
from apogee.common.errors import UnavailableError, UnknownTopicError
from apogee.testkit.ports import free_port

pytestmark = pytest.mark.unit

ME = "me@1"
OTHER = "other@2"


def route(topic: str, per_broker: int = 2) -> ReadRoute:
    queues = tuple(MessageQueue(topic, b, i) for b in ("b1", "b2") for i in range(per_broker))
    return ReadRoute(topic, queues, {"b1": "127.0.0.1:1", "b2": "127.0.0.1:2"})


class Directory:
    """Routes and members as a test sets them; a value that is an exception is raised."""

    def __init__(self) -> None:
        self.routes: dict[str, ReadRoute | Exception] = {}
        self.group: list[str] | Exception = [ME]
        self.route_reads: list[str] = []

    async def route(self, topic: str) -> ReadRoute:
        self.route_reads.append(topic)
        r = self.routes.get(topic)
        if r is None:
            raise UnknownTopicError(topic=topic, detail="is not known")
        if isinstance(r, Exception):
            raise r
        return r

    async def members(self, route: ReadRoute) -> list[str]:
        if isinstance(self.group, Exception):
            raise self.group
        return sorted(self.group)


class Owner:
    """The owned queues; ``changed`` is set whenever they change."""

    def __init__(self) -> None:
        self.queues: dict[MessageQueue, str] = {}
        self.released: list[MessageQueue] = []
        self.changed = asyncio.Event()

    def owned(self) -> Collection[MessageQueue]:
        return list(self.queues)

    def take(self, mq: MessageQueue, address: str) -> None:
        self.queues[mq] = address
        self.changed.set()

    async def release(self, mq: MessageQueue) -> None:
        del self.queues[mq]
        self.released.append(mq)
        self.changed.set()


def config(**options: Any) -> ConsumerConfig:
    return ConsumerConfig.create(
        "127.0.0.1:9876", "g", cast(ConsumerOptions, {"client_id": ME, **options})
    )


def rebalancer(directory: Directory, owner: Owner, topics: list[str], **options: Any) -> Rebalancer:
    cfg = config(**options)
    subscriptions = dict.fromkeys(topics, ("*", None))
    return Rebalancer(
        cfg, directory, owner, subscriptions, lock=asyncio.Lock(), retry_topic="%RETRY%g"
    )


async def test_shares_the_queues_with_members_as_they_join_and_leave() -> None:
    directory, owner = Directory(), Owner()
    directory.routes["T"] = route("T")
    r = rebalancer(directory, owner, ["T"])

    await r.rebalance()
    assert set(owner.queues) == set(route("T").queues)
    assert owner.queues[MessageQueue("T", "b2", 1)] == "127.0.0.1:2"

    directory.group = [ME, OTHER]
    await r.rebalance()
    mine = {MessageQueue("T", "b1", 0), MessageQueue("T", "b1", 1)}  # average: the first half
    assert set(owner.queues) == mine
    assert set(owner.released) == set(route("T").queues) - mine

    directory.group = [OTHER]  # this consumer's session has not reached the brokers
    await r.rebalance()
    assert set(owner.queues) == mine  # kept as they are until it is listed again

    directory.group = [ME]
    await r.rebalance()
    assert set(owner.queues) == set(route("T").queues)
    assert r.rebalances == 4


async def test_keeps_a_topics_queues_while_its_route_or_members_cannot_be_read() -> None:
    directory, owner = Directory(), Owner()
    directory.routes["T"] = route("T")
    r = rebalancer(directory, owner, ["T"])
    await r.rebalance()
    before = set(owner.queues)

    directory.group = UnavailableError(what="every broker of topic 'T'", detail="down")
    await r.rebalance()
    directory.group = [ME, OTHER]
    directory.routes["T"] = UnavailableError(what="every nameserver", detail="down")
    await r.rebalance()
    assert set(owner.queues) == before
    assert owner.released == []


async def test_an_unsubscribed_topic_is_released_and_the_retry_topic_waits_for_its_route() -> None:
    directory, owner = Directory(), Owner()
    directory.routes["T"] = route("T")
    directory.routes["U"] = route("U", per_broker=1)
    topics: dict[str, object] = dict.fromkeys(["T", "U", "%RETRY%g"], ("*", None))
    routes_seen: list[str] = []
    r = Rebalancer(
        config(),
        directory,
        owner,
        topics,
        lock=asyncio.Lock(),
        retry_topic="%RETRY%g",
        on_route=lambda rt: routes_seen.append(rt.topic),
    )
    await r.rebalance()  # no route for the retry topic yet: skipped
    assert {mq.topic for mq in owner.queues} == {"T", "U"}
    assert routes_seen == ["T", "U"]
    assert r.address_of("b2") == "127.0.0.1:2"

    del topics["U"]
    directory.routes["%RETRY%g"] = route("%RETRY%g", per_broker=1)
    await r.rebalance()
    assert {mq.topic for mq in owner.queues} == {"T", "%RETRY%g"}
    assert {mq.topic for mq in owner.released} == {"U"}


async def test_broadcasting_reads_every_queue_whoever_the_members_are() -> None:
    directory, owner = Directory(), Owner()
    directory.routes["T"] = route("T")
    directory.group = [OTHER]
    r = rebalancer(directory, owner, ["T"], mode=ConsumeMode.BROADCASTING)
    await r.rebalance()
    assert set(owner.queues) == set(route("T").queues)


async def test_a_wake_rebalances_at_once_and_stop_ends_rebalancing() -> None:
    directory, owner = Directory(), Owner()
    directory.routes["T"] = route("T")
    r = rebalancer(directory, owner, ["T"], rebalance_interval=3600.0)
    await r.rebalance()
    r.start()
    try:
        owner.changed.clear()
        directory.group = [ME, OTHER]  # a member joined: its session event wakes us
        r.wake()
        async with asyncio.timeout(5):
            await owner.changed.wait()
        assert len(owner.queues) == 2
    finally:
        await r.stop()
    directory.group = [ME]
    await r.rebalance()
    assert len(owner.queues) == 2  # stopped: nothing changes any more


async def test_a_wake_for_changed_members_reads_no_route_and_the_others_do() -> None:
    directory, owner = Directory(), Owner()
    directory.routes["T"] = route("T")
    r = rebalancer(directory, owner, ["T", "%RETRY%g"], rebalance_interval=3600.0)
    await r.rebalance()
    assert directory.route_reads == ["T", "%RETRY%g"]
    r.start()
    try:
        directory.route_reads.clear()
        owner.changed.clear()
        directory.group = [ME, OTHER]
        r.wake(read_routes=False)  # a member joined: no route changed
        async with asyncio.timeout(5):
            await owner.changed.wait()
        assert len(owner.queues) == 2
        # the retry topic has no route yet: it is looked for at each rebalance; T is not
        assert directory.route_reads == ["%RETRY%g"]

        directory.route_reads.clear()
        owner.changed.clear()
        directory.routes["T"] = route("T", per_broker=4)  # a topic grew: its route changed
        r.wake()  # (as a fetch finding its topic changed does)
        async with asyncio.timeout(5):
            await owner.changed.wait()
        assert directory.route_reads == ["T", "%RETRY%g"]
        assert len(owner.queues) == 4
    finally:
        await r.stop()


async def test_the_directory_takes_the_members_a_session_pushed_until_it_ends() -> None:
    pool = ChannelPool(None)
    dead = free_port()  # nothing listens there: asking the broker fails
    directory = ClusterDirectory(NameServerClient([f"127.0.0.1:{dead}"], pool, 1.0), pool, "g", 1.0)
    rt = ReadRoute("T", route("T").queues, {"b1": f"127.0.0.1:{dead}", "b2": "127.0.0.1:2"})
    try:
        directory.members_pushed("127.0.0.1:2", [OTHER, ME])  # b2's list: b1 comes first
        directory.members_pushed(f"127.0.0.1:{dead}", [OTHER, ME])
        assert await directory.members(rt) == [ME, OTHER]  # pushed, sorted: no call made

        directory.session_ended(f"127.0.0.1:{dead}")
        with pytest.raises(UnavailableError) as caught:
            await directory.members(rt)  # asked: b1 is down and b2 is not listening either
        assert "members of 'g'" in str(caught.value)
    finally:
        await pool.close()
