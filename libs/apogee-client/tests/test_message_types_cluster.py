"""Topic message types through the SDK, against real nameservers and brokers: the admin client
creates, updates, lists and describes a topic's type; an ordered send is a FIFO message (its
sharding key is its message group), so it is what a FIFO topic takes, and a plain send is not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from apogee.client import AdminClient, Message, MessageType, Producer, SyncAdminClient
from apogee.client.producer.producer import with_message_group
from apogee.common.errors import InvalidArgumentError, MessageTypeMismatchError
from apogee.testkit.cluster import InProcessCluster

pytestmark = pytest.mark.integration


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    """Two nameservers and two brokers, in this process (see apogee.testkit.cluster)."""
    async with InProcessCluster(tmp_path) as c:
        yield c


async def test_a_topic_is_created_with_its_type_and_an_update_keeps_or_changes_it(
    cluster: InProcessCluster,
) -> None:
    async with AdminClient(cluster.namesrv) as admin:
        created = await admin.create_or_update_topic("Seq", queues=2, message_type="fifo")
        assert [u.topic.message_type for u in created] == [MessageType.FIFO] * 2
        plain = await admin.create_or_update_topic("Plain", queues=2)
        assert [u.topic.message_type for u in plain] == [MessageType.MIXED] * 2

        kept = await admin.create_or_update_topic("Seq", queues=3)  # no type: kept
        assert [u.topic.message_type for u in kept] == [MessageType.FIFO] * 2
        changed = await admin.create_or_update_topic(
            "Seq", queues=3, brokers=["broker-b"], message_type=MessageType.DELAY
        )
        assert [(u.broker_name, u.topic.message_type) for u in changed] == [
            ("broker-b", MessageType.DELAY)
        ]

        listed = {t.name: t for t in await admin.list_topic_configs()}
        assert listed["Plain"].message_types == (MessageType.MIXED,)
        assert listed["Seq"].message_types == (MessageType.FIFO, MessageType.DELAY)
        assert [(b, c.message_type) for b, c in listed["Seq"].configs] == [
            ("broker-a", MessageType.FIFO),
            ("broker-b", MessageType.DELAY),
        ]
        assert "TBW102" not in listed  # system topics are the brokers' own

        status = await admin.describe_topic("Seq")
        assert [b.topic.message_type for b in status.brokers] == [
            MessageType.FIFO,
            MessageType.DELAY,
        ]


async def test_a_bad_type_is_refused_by_name_before_any_broker_is_asked(
    cluster: InProcessCluster,
) -> None:
    async with AdminClient(cluster.namesrv) as admin:
        with pytest.raises(InvalidArgumentError) as bad:
            await admin.create_or_update_topic("T", message_type="ORDERED")
        assert str(bad.value) == (
            "message_type: must be one of NORMAL, FIFO, DELAY, TRANSACTION, MIXED, got 'ORDERED'"
        )
        with pytest.raises(InvalidArgumentError, match=r"^message_type: must be a MessageType"):
            await admin.create_or_update_topic("T", message_type=3)  # type: ignore[arg-type]
        assert "T" not in await admin.list_topics()


async def test_ordered_sends_are_fifo_messages(cluster: InProcessCluster) -> None:
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic("Seq", queues=2, message_type=MessageType.FIFO)
        await cluster.wait_route("Seq", {"broker-a", "broker-b"})
        async with Producer(cluster.namesrv, group="g") as producer:
            text = await producer.send_ordered(Message("Seq", b"a", keys="k-text"), "order-7")
            binary = await producer.send_ordered(Message("Seq", b"b", keys="k-bin"), b"\x00\xff")
            with pytest.raises(MessageTypeMismatchError) as refused:
                await producer.send(Message("Seq", b"plain"))
        assert "is a NORMAL message (it has no delay, message group or transaction)" in str(
            refused.value
        )
        got_text = await admin.get_message(text.message_id)
        got_binary = await admin.get_message(binary.message_id)
    assert got_text.properties["__SHARDINGKEY"] == "order-7"
    assert got_binary.properties["__SHARDINGKEY"] == "00ff"


def test_the_message_group_is_set_on_a_copy_and_a_separator_is_refused() -> None:
    msg = Message("Seq", b"x", properties={"region": "eu", "__SHARDINGKEY": "mine"})
    grouped = with_message_group(msg, "order-7")
    assert grouped.properties == {"region": "eu", "__SHARDINGKEY": "order-7"}
    assert msg.properties == {"region": "eu", "__SHARDINGKEY": "mine"}  # the user's, unchanged
    with pytest.raises(InvalidArgumentError, match=r"^sharding_key: must not contain \\x01"):
        with_message_group(msg, "a\x02b")


async def test_a_user_set_message_group_makes_a_plain_send_fifo(cluster: InProcessCluster) -> None:
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic("Seq", queues=2, message_type="FIFO")
        await cluster.wait_route("Seq", {"broker-a", "broker-b"})
    async with Producer(cluster.namesrv, group="g") as producer:
        result = await producer.send(Message("Seq", b"x", properties={"__SHARDINGKEY": "g1"}))
    assert result.queue_offset >= 0


async def test_the_sync_admin_client_takes_and_lists_types(cluster: InProcessCluster) -> None:
    def use_it() -> tuple[MessageType, tuple[MessageType, ...]]:
        with SyncAdminClient(cluster.namesrv) as admin:
            [first, _] = admin.create_or_update_topic("Txn", 1, message_type="transaction")
            [listing] = [t for t in admin.list_topic_configs() if t.name == "Txn"]
            return first.topic.message_type, listing.message_types

    assert await asyncio.to_thread(use_it) == (
        MessageType.TRANSACTION,
        (MessageType.TRANSACTION,),
    )


async def test_a_key_that_only_picks_the_queue_leaves_the_message_normal(
    cluster: InProcessCluster,
) -> None:
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic("Plain", queues=2, message_type=MessageType.NORMAL)
        await cluster.wait_route("Plain", {"broker-a", "broker-b"})
        async with Producer(cluster.namesrv, group="g") as producer:
            first = await producer.send_ordered(Message("Plain", b"a"), "row-1", fifo=False)
            again = await producer.send_ordered(Message("Plain", b"b"), "row-1", fifo=False)
            with pytest.raises(MessageTypeMismatchError):
                await producer.send_ordered(Message("Plain", b"c"), "row-1")
        got = await admin.get_message(first.message_id)
    assert (first.broker_name, first.queue_id) == (again.broker_name, again.queue_id)
    assert "__SHARDINGKEY" not in got.properties
