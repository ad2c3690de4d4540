"""AdminClient (and its synchronous twin) against real nameservers and brokers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from apogee.client import AdminClient, Message, Perm, Producer, SyncAdminClient
from apogee.common.errors import (
    InvalidArgumentError,
    InvalidTopicError,
    NotFoundError,
    PermissionDeniedError,
    UnknownTopicError,
)
from apogee.testkit.cluster import InProcessCluster

pytestmark = pytest.mark.integration


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    """Two nameservers and two brokers, in this process (see apogee.testkit.cluster)."""
    async with InProcessCluster(tmp_path) as c:
        yield c


async def test_cluster_info_lists_live_brokers(cluster: InProcessCluster) -> None:
    async with AdminClient(cluster.namesrv) as admin:
        brokers = await admin.cluster_info()
    assert [(b.cluster, b.broker_name) for b in brokers] == [
        ("TestCluster", "broker-a"),
        ("TestCluster", "broker-b"),
    ]
    assert [b.address for b in brokers] == [
        cluster.brokers["broker-a"].address,
        cluster.brokers["broker-b"].address,
    ]
    assert all(b.last_heartbeat_ms > 0 and not b.auto_create_topics for b in brokers)


async def test_each_broker_tells_its_last_recovery(cluster: InProcessCluster) -> None:
    before_ms = int(time.time() * 1000)
    await cluster.stop_broker("broker-b")  # a clean stop, then a start on the same data
    await cluster.start_broker("broker-b")
    await cluster.wait_registered({"broker-a", "broker-b"})
    async with AdminClient(cluster.namesrv) as admin:
        reports = await admin.last_recoveries()
    assert [r.broker_name for r in reports] == ["broker-a", "broker-b"]
    again = reports[1]
    assert again.clean
    assert again.finished_ms >= before_ms
    assert again.bytes_truncated == 0
    assert again.files_quarantined == ()
    assert again.summary.startswith("recovery after a clean stop: checked ")
    assert again.seconds >= 0


async def test_create_update_list_describe_delete(cluster: InProcessCluster) -> None:
    async with AdminClient(cluster.namesrv) as admin:
        created = await admin.create_or_update_topic("Orders", queues=3)
        assert sorted((u.broker_name, u.created) for u in created) == [
            ("broker-a", True),
            ("broker-b", True),
        ]
        assert all(
            (u.topic.read_queues, u.topic.write_queues, u.topic.perm)
            == (3, 3, Perm.READ | Perm.WRITE)
            for u in created
        )
        updated = await admin.create_or_update_topic("Orders", queues=5, brokers=["broker-b"])
        assert [(u.broker_name, u.created, u.topic.write_queues) for u in updated] == [
            ("broker-b", False, 5)
        ]
        await cluster.wait_route("Orders", {"broker-a", "broker-b"})
        assert "Orders" in await admin.list_topics()

        async with Producer(cluster.namesrv, group="g") as producer:
            for i in range(40):
                await producer.send(Message("Orders", f"m{i}".encode()))
        status = await admin.describe_topic("Orders")
        assert [(b.broker_name, len(b.queues)) for b in status.brokers] == [
            ("broker-a", 3),
            ("broker-b", 5),
        ]
        assert status.messages == 40
        assert all(
            q.min_offset == 0 and q.max_offset >= 0 for b in status.brokers for q in b.queues
        )

        deleted = await admin.delete_topic("Orders")
        assert deleted == ["broker-a", "broker-b"]
        with pytest.raises(UnknownTopicError) as info:
            await admin.describe_topic("Orders")
        assert str(info.value) == "topic 'Orders' is not on any live broker"
        with pytest.raises(UnknownTopicError):
            await admin.delete_topic("Orders")


async def test_read_only_topic_refuses_sends(cluster: InProcessCluster) -> None:
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic("ReadOnly", queues=2, perm=Perm.READ)
        await cluster.wait_route("ReadOnly", {"broker-a", "broker-b"})
    async with Producer(cluster.namesrv, group="g") as producer:
        with pytest.raises(PermissionDeniedError, match="no live broker accepts writes"):
            await producer.send(Message("ReadOnly", b"x"))


async def test_admin_input_errors(cluster: InProcessCluster) -> None:
    async with AdminClient(cluster.namesrv) as admin:
        with pytest.raises(InvalidTopicError):
            await admin.create_or_update_topic("bad name")
        with pytest.raises(PermissionDeniedError) as denied:
            await admin.create_or_update_topic("TBW102")
        assert str(denied.value) == "topic 'TBW102': is a system topic; clients cannot change it"
        with pytest.raises(InvalidArgumentError) as queues:
            await admin.create_or_update_topic("T", queues=0)
        assert str(queues.value) == "queues: must be an integer from 1 to 1024, got 0"
        with pytest.raises(InvalidArgumentError) as brokers:
            await admin.create_or_update_topic("T", brokers=["broker-z"])
        assert str(brokers.value) == (
            "brokers: 'broker-z' is not a live broker (live: broker-a, broker-b)"
        )
        with pytest.raises(InvalidArgumentError, match="cluster: 'Other' has no live broker"):
            await admin.create_or_update_topic("T", cluster="Other")
        # times past what protobuf's int64 holds are refused by name, not by protobuf
        for field in ("begin_ms", "end_ms"):
            with pytest.raises(InvalidArgumentError, match=f"^{field}: must be a time from 1970"):
                await admin.query_messages("Orders", "k", **{field: 10**23})
        with pytest.raises(InvalidArgumentError, match=r"^end_ms: must not be before begin_ms"):
            await admin.query_messages("Orders", "k", begin_ms=2, end_ms=1)


async def test_get_message_finds_it_on_whichever_broker(cluster: InProcessCluster) -> None:
    await cluster.create_topic("Orders")
    async with (
        Producer(cluster.namesrv, group="g") as producer,
        AdminClient(cluster.namesrv) as admin,
    ):
        results = [await producer.send(Message("Orders", f"m{i}".encode())) for i in range(8)]
        assert {r.broker_name for r in results} == {"broker-a", "broker-b"}
        for i, r in enumerate(results):
            found = await admin.get_message(r.message_id)
            assert (found.body, found.broker_name) == (f"m{i}".encode(), r.broker_name)
        with pytest.raises(NotFoundError) as info:
            await admin.get_message("0" * 32)
        assert str(info.value) == f"message {'0' * 32} not found: no live broker has it"


async def test_query_merges_brokers_newest_first(cluster: InProcessCluster) -> None:
    await cluster.create_topic("Orders")
    async with (
        Producer(cluster.namesrv, group="g") as producer,
        AdminClient(cluster.namesrv) as admin,
    ):
        sent = []
        for i in range(10):
            sent.append(await producer.send(Message("Orders", f"v{i}".encode(), keys=["shared"])))
            await asyncio.sleep(0.002)  # distinct store times, so "newest first" is checkable
        assert {r.broker_name for r in sent} == {"broker-a", "broker-b"}
        found = await admin.query_messages("Orders", "shared")
        assert [m.unique_id for m in found] == [r.message_id for r in reversed(sent)]
        limited = await admin.query_messages("Orders", "shared", max_messages=3)
        assert [m.body for m in limited] == [b"v9", b"v8", b"v7"]
        assert await admin.query_messages("Orders", "nobody") == []
        window = await admin.query_messages(
            "Orders",
            "shared",
            begin_ms=found[4].store_timestamp_ms,
            end_ms=found[2].store_timestamp_ms,
        )
        assert [m.body for m in window] == [b"v7", b"v6", b"v5"]
        # by time alone: both brokers' messages of the window, merged newest first
        between = await admin.messages_between(
            "Orders", found[4].store_timestamp_ms, found[2].store_timestamp_ms
        )
        assert [m.body for m in between.messages] == [b"v7", b"v6", b"v5"]
        assert not between.more
        newest = await admin.messages_between("Orders", 0, max_messages=4)
        assert [m.body for m in newest.messages] == [b"v9", b"v8", b"v7", b"v6"]
        assert newest.more


async def test_sync_admin_client(cluster: InProcessCluster) -> None:
    def use_it() -> tuple[list[str], int]:
        with SyncAdminClient(cluster.namesrv) as admin:
            admin.create_or_update_topic("SyncTopic", queues=2)
            names = [b.broker_name for b in admin.cluster_info()]
            status = admin.describe_topic("SyncTopic")
            queues = sum(len(b.queues) for b in status.brokers)
            with pytest.raises(NotFoundError):
                admin.get_message("F" * 32)
            with pytest.raises(NotFoundError):
                admin.get_messages("F" * 32)
            # the calls the console and the Spark source use, through the blocking twin too
            assert all(h.ok for h in admin.nameserver_health())
            details = admin.describe_brokers()
            assert [d.broker.broker_name for d in details] == names
            assert all(d.value is not None for d in details)
            assert [s.broker.broker_name for s in admin.schedule_states()] == names
            offsets = admin.offsets_for_time("SyncTopic", 0)
            assert len(offsets) == 4
            assert all(o.offset == 0 for o in offsets)
            return names, queues

    names, queues = await asyncio.to_thread(use_it)
    assert names == ["broker-a", "broker-b"]
    assert queues == 4
