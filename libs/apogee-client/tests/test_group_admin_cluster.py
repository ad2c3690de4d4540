"""Group administration and the remote offset store against real nameservers and brokers in
this process: offsets committed and read back, groups listed and described with their lag,
offsets reset (and the group's members told), and the ``apogee group`` commands."""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc.aio
import pytest

from apogee.cli.main import main
from apogee.client import AdminClient, Message, Producer, SyncAdminClient
from apogee.client._rpc import ChannelPool
from apogee.client.consumer.offset_store import RemoteOffsetStore
from apogee.client.producer.routes import MessageQueue
from apogee.common.errors import NotFoundError, UnknownTopicError
from apogee.testkit.cluster import InProcessCluster
from apogee.v1 import consumer_pb2 as pb

pytestmark = pytest.mark.integration

TOPIC = "Orders"
GROUP = "order-workers"
BROKERS = ("broker-a", "broker-b")


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster(tmp_path, nameservers=1) as c:
        await c.create_topic(TOPIC, queues=2)
        yield c


@pytest.fixture
async def pool() -> AsyncIterator[ChannelPool]:
    p = ChannelPool()
    yield p
    await p.close()


def offset_store(cluster: InProcessCluster, pool: ChannelPool, client: str) -> RemoteOffsetStore:
    def address_of(broker: str) -> str | None:
        app = cluster.brokers.get(broker)
        return app.address if app is not None else None

    return RemoteOffsetStore(GROUP, client, pool, address_of, timeout=3.0)


def key_of_queue(index: int, queues: int = 4) -> str:
    """A sharding key that ordered sends map to the ``index``-th queue of the route."""
    return next(k for i in range(1000) if zlib.crc32((k := f"k{i}").encode()) % queues == index)


async def fill(cluster: InProcessCluster, per_queue: int) -> None:
    """``per_queue`` messages in each of the topic's 4 queues (2 per broker)."""
    async with Producer(cluster.namesrv) as producer:
        for i in range(per_queue):
            for index in range(4):
                await producer.send_ordered(Message(TOPIC, f"m{i}".encode()), key_of_queue(index))


async def queue_max(cluster: InProcessCluster) -> dict[MessageQueue, int]:
    async with AdminClient(cluster.namesrv) as admin:
        status = await admin.describe_topic(TOPIC)
    return {
        MessageQueue(TOPIC, b.broker_name, q.queue_id): q.max_offset
        for b in status.brokers
        for q in b.queues
    }


async def open_session(
    cluster: InProcessCluster, pool: ChannelPool, broker: str, client: str
) -> grpc.aio.StreamStreamCall[pb.SessionRequest, pb.SessionEvent]:
    """A member of the group at ``broker``, as a consumer joins: heartbeat, then events."""
    call = pool.consumer(cluster.brokers[broker].address).Session()
    await call.write(
        pb.SessionRequest(
            heartbeat=pb.Heartbeat(
                client_id=client,
                group=GROUP,
                mode=pb.CLUSTERING,
                subscriptions=[pb.Subscription(topic=TOPIC, tag_expression="*")],
                heartbeat_interval_ms=30_000,
            )
        )
    )
    event = await asyncio.wait_for(call.read(), 5.0)
    assert isinstance(event, pb.SessionEvent)
    assert list(event.members_changed.client_ids) == [client]
    return call


async def test_remote_offsets_are_committed_and_read_back(
    cluster: InProcessCluster, pool: ChannelPool
) -> None:
    store = offset_store(cluster, pool, "c1")
    q0, q1, qb = (
        MessageQueue(TOPIC, "broker-a", 0),
        MessageQueue(TOPIC, "broker-a", 1),
        MessageQueue(TOPIC, "broker-b", 0),
    )
    await fill(cluster, 8)
    assert await store.load(q0) is None  # nothing committed yet
    store.update(q0, 3)
    store.update(q1, 7)
    store.update(qb, 2)
    await store.persist_all([q0, q1, qb])
    other = offset_store(cluster, pool, "c2")  # another member of the group sees them
    assert [await other.load(q) for q in (q0, q1, qb)] == [3, 7, 2]
    assert other.read(q1) == 7
    info = await other.query(q0)
    assert (info.committed, info.min_offset) == (3, 0)
    store.update(q0, 4)
    await store.persist(q0)
    assert await other.load(q0) == 4
    store.update(q0, 9)  # beyond the 8 messages of the queue: refused, logged, not raised
    await store.persist(q0)
    assert await other.load(q0) == 4


async def test_list_and_describe_groups_with_lag(
    cluster: InProcessCluster, pool: ChannelPool
) -> None:
    await fill(cluster, 5)
    maxima = await queue_max(cluster)
    assert set(maxima.values()) == {5}
    committed = MessageQueue(TOPIC, "broker-a", 0)
    store = offset_store(cluster, pool, "c1")
    store.update(committed, 1)
    await store.persist_all([committed])
    session = await open_session(cluster, pool, "broker-a", "c1")
    try:
        async with AdminClient(cluster.namesrv) as admin:
            groups = await admin.list_groups()
            [summary] = [g for g in groups if g.group == GROUP]
            assert (summary.members, summary.mode, summary.topics) == (1, "clustering", (TOPIC,))
            assert summary.brokers == ("broker-a",)

            d = await admin.describe_group(GROUP)
            assert [(m.client_id, m.mode, m.brokers) for m in d.members] == [
                ("c1", "clustering", ("broker-a",))
            ]
            assert [(s.topic, s.tag_expression) for s in d.members[0].subscriptions] == [
                (TOPIC, "*")
            ]
            rows = {(q.broker_name, q.queue_id): q for q in d.queues}
            assert set(rows) == {("broker-a", 0), ("broker-a", 1)}  # b knows no member, no offset
            known = rows["broker-a", 0]
            assert known.broker_offset == maxima[committed]
            assert known.consumer_offset == 1
            assert known.lag_messages == maxima[committed] - 1
            if known.lag_messages:
                assert known.lag_seconds is not None
                assert 0 <= known.lag_seconds < 60
            unknown = rows["broker-a", 1]  # subscribed, nothing committed: unknown, not 0
            assert (unknown.consumer_offset, unknown.lag_messages, unknown.lag_seconds) == (
                None,
                None,
                None,
            )
            assert d.lag_messages is None

            with pytest.raises(NotFoundError) as info:
                await admin.describe_group("nobody-here")
            assert "no live broker knows it" in str(info.value)
    finally:
        session.cancel()


async def test_reset_offsets_moves_every_queue_and_tells_members(
    cluster: InProcessCluster, pool: ChannelPool
) -> None:
    before = int(time.time() * 1000)
    await fill(cluster, 3)
    maxima = await queue_max(cluster)
    session = await open_session(cluster, pool, "broker-a", "c1")
    try:
        async with AdminClient(cluster.namesrv) as admin:
            latest = await admin.reset_offsets(GROUP, TOPIC, latest=True)
            assert {(r.broker_name, r.queue_id) for r in latest} == {
                (b, q) for b in BROKERS for q in (0, 1)
            }
            assert all(
                r.offset == maxima[MessageQueue(TOPIC, r.broker_name, r.queue_id)] for r in latest
            )
            event = await asyncio.wait_for(session.read(), 5.0)
            assert isinstance(event, pb.SessionEvent)
            assert event.offsets_reset.topic == TOPIC
            assert sorted((o.queue_id, o.offset) for o in event.offsets_reset.offsets) == sorted(
                (r.queue_id, r.offset) for r in latest if r.broker_name == "broker-a"
            )

            earliest = await admin.reset_offsets(GROUP, TOPIC, earliest=True)
            assert all(r.offset == 0 for r in earliest)
            d = await admin.describe_group(GROUP)
            assert d.lag_messages == sum(maxima.values())

            by_time = await admin.reset_offsets(GROUP, TOPIC, timestamp_ms=before)
            assert all(r.offset == 0 for r in by_time)  # all was stored after `before`
            future = await admin.reset_offsets(GROUP, TOPIC, timestamp_ms=before + 3_600_000)
            assert all(
                r.offset == maxima[MessageQueue(TOPIC, r.broker_name, r.queue_id)] for r in future
            )
            store = offset_store(cluster, pool, "c9")
            assert (
                await store.load(MessageQueue(TOPIC, "broker-b", 1))
                == maxima[MessageQueue(TOPIC, "broker-b", 1)]
            )

            with pytest.raises(UnknownTopicError):
                await admin.reset_offsets(GROUP, "NoSuchTopic", earliest=True)
    finally:
        session.cancel()


async def test_sync_admin_group_calls(cluster: InProcessCluster, pool: ChannelPool) -> None:
    await fill(cluster, 1)
    store = offset_store(cluster, pool, "c1")
    store.update(MessageQueue(TOPIC, "broker-b", 1), 0)
    await store.persist_all([MessageQueue(TOPIC, "broker-b", 1)])

    def use_it() -> tuple[list[str], int, int]:
        with SyncAdminClient(cluster.namesrv) as admin:
            names = [g.group for g in admin.list_groups()]
            queues = len(admin.describe_group(GROUP).queues)
            reset = len(admin.reset_offsets(GROUP, TOPIC, earliest=True))
            return names, queues, reset

    names, queues, reset = await asyncio.to_thread(use_it)
    assert GROUP in names
    assert queues == 2  # every queue of the topic on broker-b, where the group has an offset
    assert reset == 4


async def test_group_commands(
    cluster: InProcessCluster, pool: ChannelPool, capsys: pytest.CaptureFixture[str]
) -> None:
    await fill(cluster, 2)
    session = await open_session(cluster, pool, "broker-b", "c7")
    base = ["--namesrv", cluster.namesrv, "group"]
    try:
        assert await asyncio.to_thread(main, [*base, "list"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split() == ["GROUP", "MEMBERS", "MODE", "TOPICS", "BROKERS"]
        assert lines[1].split() == [GROUP, "1", "clustering", TOPIC, "broker-b"]

        assert await asyncio.to_thread(main, [*base, "describe", GROUP]) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"group {GROUP}: 1 members, 2 queues, lag unknown\n")
        assert "c7" in out
        rows = [line.split() for line in out.splitlines() if line.startswith(TOPIC)]
        assert [r[1:3] for r in rows] == [["broker-b", "0"], ["broker-b", "1"]]
        assert all(r[4:7] == ["none", "unknown", "unknown"] for r in rows)

        cmd = [*base, "reset-offset", GROUP, "--topic", TOPIC, "--to", "earliest"]
        assert await asyncio.to_thread(main, cmd) == 0
        out = capsys.readouterr().out
        assert out.startswith(
            f"reset group {GROUP} on topic {TOPIC} to the earliest message: 4 queues on 2 brokers"
        )
        assert await asyncio.to_thread(main, [*base, "describe", GROUP]) == 0
        out = capsys.readouterr().out
        assert "lag unknown" not in out.splitlines()[0]  # every queue has an offset now

        cmd = [*base, "reset-offset", GROUP, "--topic", TOPIC, "--to", "2020-01-01T00:00:00"]
        assert await asyncio.to_thread(main, cmd) == 0
        assert "to 2020-01-01T00:00:00+00:00" in capsys.readouterr().out

        assert await asyncio.to_thread(main, [*base, "describe", "nobody"]) == 1
        assert "group 'nobody' not found" in capsys.readouterr().err
    finally:
        session.cancel()
