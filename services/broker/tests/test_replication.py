"""Replica groups in one process: three replicas of one broker name on the file coordination,
a nameserver beside them. What a user checks: sends are acknowledged once the in-sync set has
them, every replica holds the same bytes, a follower refuses clients naming the leader, a
group short of replicas refuses sends before storing anything, and a new leader takes over
with everything that was acknowledged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from apogee.client import AdminClient, Message, MessageQueue, Producer
from apogee.common.errors import ApogeeError
from apogee.rpc.errors import from_rpc_error
from apogee.testkit.broker import small_settings
from apogee.testkit.cluster import InProcessCluster
from apogee.testkit.waiting import eventually
from apogee.v1 import broker_pb2, broker_pb2_grpc
from apogee_broker.replication.node import ReplicaNode

pytestmark = pytest.mark.integration

TOPIC = "Replicated"


class Group:
    def __init__(self, root: Path, namesrv: str, count: int, **options: Any) -> None:
        self.root = root
        self.namesrv = namesrv
        self.options = options
        self.nodes: list[ReplicaNode | None] = [None] * count

    async def start(self, i: int) -> ReplicaNode:
        settings = small_settings(
            self.root / f"replica-{i}",
            broker_name="broker-a",
            namesrv=self.namesrv,
            shutdown_grace_s=0.5,
            replication="file",
            replica_group_dir=self.root / "group",
            replica_lag_max_s=2.0,
            replication_timeout_s=3.0,
            auto_create_topics=True,
            offset_persist_interval_s=0.2,
            **self.options,
        )
        node = ReplicaNode(settings)
        await node.start()
        self.nodes[i] = node
        return node

    async def stop(self, i: int) -> None:
        node = self.nodes[i]
        self.nodes[i] = None
        if node is not None:
            await node.stop()

    def leader(self) -> ReplicaNode | None:
        for n in self.nodes:
            if n is not None and n.app is not None and n.leader is not None and not n.leader.ended:
                return n
        return None

    async def wait_leader(self, in_sync: int = 1) -> ReplicaNode:
        async def led() -> bool:
            n = self.leader()
            return n is not None and n.leader is not None and len(n.leader.in_sync) >= in_sync

        await eventually(led, 20, f"a leader with {in_sync} in sync")
        found = self.leader()
        assert found is not None
        return found


@pytest.fixture
async def group(tmp_path: Path) -> AsyncIterator[Group]:
    async with InProcessCluster(tmp_path / "ns", nameservers=1, brokers=()) as ns:
        g = Group(tmp_path, ns.namesrv, 3)
        try:
            for i in range(3):
                await g.start(i)
            yield g
        finally:  # the followers first: a leader stopping last has nobody to hand over to
            lead = g.leader()
            for i, n in enumerate(g.nodes):
                if n is not lead:
                    await g.stop(i)
            for i in range(3):
                await g.stop(i)


async def test_sends_are_held_by_every_in_sync_replica_byte_for_byte(group: Group) -> None:
    leader = await group.wait_leader(in_sync=3)
    async with Producer(group.namesrv) as producer:
        results = [await producer.send(Message(TOPIC, f"m{i}".encode())) for i in range(50)]
    assert {r.broker_name for r in results} == {"broker-a"}
    term = leader.leader
    assert term is not None
    await eventually(lambda: term.hw == term.written_end, 5, "the set at the log end")
    end = term.written_end
    followers = [n for n in group.nodes if n is not None and n is not leader]

    async def copied() -> bool:
        return all(n.store is not None and n.store.commitlog.max_offset == end for n in followers)

    await eventually(copied, 10, "the followers at the leader's log end")
    assert leader.store is not None
    ours = leader.store.commitlog.read(0, end)
    for n in followers:
        assert n.store is not None
        assert n.store.commitlog.read(0, end) == ours


async def test_a_follower_refuses_clients_and_names_the_leader(group: Group) -> None:
    leader = await group.wait_leader(in_sync=3)
    follower = next(n for n in group.nodes if n is not None and n is not leader)
    async with grpc.aio.insecure_channel(follower.address) as channel:
        admin = broker_pb2_grpc.BrokerAdminStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await admin.ListTopics(broker_pb2.BrokerListTopicsRequest(), timeout=5)
        # a stream is refused the same way, before anything is read from it
        sends = broker_pb2_grpc.BrokerStub(channel).SendStream()
        with pytest.raises(grpc.aio.AioRpcError) as streamed:
            await sends.read()
    for call in (refused.value, streamed.value):
        err = from_rpc_error(call, "the follower")
        assert err.kind.name == "NOT_LEADER"
        assert err.retriable
        assert leader.replica_id in str(err)
        assert leader.address in str(err)


async def test_without_enough_replicas_a_send_is_refused_before_it_is_stored(
    group: Group,
) -> None:
    leader = await group.wait_leader(in_sync=3)
    for i, n in enumerate(group.nodes):
        if n is not leader:
            await group.stop(i)
    assert leader.leader is not None

    async def shrunk() -> bool:
        return leader.leader is not None and len(leader.leader.in_sync) == 1

    await eventually(shrunk, 10, "the in-sync set down to the leader")
    assert leader.store is not None
    before = leader.store.commitlog.max_offset
    async with Producer(group.namesrv, retries=0) as producer:
        with pytest.raises(ApogeeError) as refused:
            await producer.send(Message(TOPIC, b"nobody to copy it"))
    assert refused.value.kind.name == "NOT_ENOUGH_REPLICAS"
    assert "min_insync_replicas 2" in str(refused.value)
    assert leader.store.commitlog.max_offset == before  # nothing was stored


async def test_a_new_leader_has_everything_acknowledged(group: Group) -> None:
    old = await group.wait_leader(in_sync=3)
    async with Producer(group.namesrv, route_refresh_interval=0.2) as producer:
        acked = [
            (await producer.send(Message(TOPIC, f"before-{i}".encode()))).message_id
            for i in range(30)
        ]
        await group.stop(group.nodes.index(old))
        new = await group.wait_leader(in_sync=2)
        assert new is not old
        assert new.leader is not None
        assert new.leader.epoch > 1

        async def sent() -> bool:
            try:
                await producer.send(Message(TOPIC, b"after"))
            except ApogeeError:
                return False
            return True

        await eventually(sent, 15, "a send acknowledged by the new leader")
    assert new.store is not None
    found = {m.unique_id for q in range(8) for m in new.store.get(TOPIC, q, 0, 1000).messages}
    assert set(acked) <= found


async def test_a_handoff_fails_no_send(group: Group) -> None:
    old = await group.wait_leader(in_sync=3)
    assert old.leader is not None
    old_epoch = old.leader.epoch
    errors: list[ApogeeError] = []
    acked: list[str] = []
    stop = False

    async with Producer(group.namesrv, route_refresh_interval=5) as producer:

        async def send(w: int) -> None:
            n = 0
            while not stop:
                n += 1
                try:
                    r = await producer.send(Message(TOPIC, f"w{w}-{n}".encode()))
                except ApogeeError as err:
                    errors.append(err)
                else:
                    acked.append(r.message_id)

        senders = [asyncio.create_task(send(w)) for w in range(4)]
        await eventually(lambda: len(acked) > 100, 10, "sends before the handoff")
        record = await old.hand_off("")
        count = len(acked)
        await eventually(lambda: len(acked) > count + 100, 10, "sends after the handoff")
        stop = True
        await asyncio.gather(*senders)
    assert not errors, errors[:3]
    new = group.leader()
    assert new is not None
    assert new is not old
    assert record.leader == new.replica_id
    assert new.leader is not None
    assert new.leader.epoch == record.epoch > old_epoch
    await eventually(lambda: old.role == "FOLLOWER", 10, "the old leader following")
    assert new.store is not None
    found = {m.unique_id for q in range(8) for m in new.store.get(TOPIC, q, 0, 10_000).messages}
    assert set(acked) <= found


async def test_topics_and_committed_offsets_survive_a_change_of_leader(group: Group) -> None:
    old = await group.wait_leader(in_sync=3)
    async with AdminClient(group.namesrv) as admin:
        await admin.create_or_update_topic("Kept", queues=3, message_type="FIFO")
        async with Producer(group.namesrv) as producer:
            for i in range(30):  # thirty keys: every queue gets some
                await producer.send_ordered(Message("Kept", f"k{i}".encode()), f"key{i}")
        committed = {MessageQueue("Kept", "broker-a", q): 2 for q in range(3)}
        await admin.commit_offsets("keepers", committed)
        followers = [n for n in group.nodes if n is not None and n is not old]

        def offsets_copied() -> bool:
            files = [n.settings.data_dir / "consumerOffset.json" for n in followers]
            return all(f.exists() and "keepers" in f.read_text() for f in files)

        # the leader persists every offset_persist_interval_s; the followers' files follow
        await eventually(offsets_copied, 10, "the offsets on every follower")
        await group.stop(group.nodes.index(old))
        new = await group.wait_leader(in_sync=2)
        assert new is not old
        topic = await admin.describe_topic("Kept")
        (on_broker,) = topic.brokers
        assert (on_broker.topic.read_queues, on_broker.topic.write_queues) == (3, 3)
        assert on_broker.topic.message_type.value == "FIFO"
        described = await admin.describe_group("keepers")
    assert {(q.queue_id, q.consumer_offset) for q in described.queues} == {
        (0, 2),
        (1, 2),
        (2, 2),
    }


async def test_with_sync_flush_sends_are_replicated_too(tmp_path: Path) -> None:
    async with InProcessCluster(tmp_path / "ns", nameservers=1, brokers=()) as ns:
        g = Group(tmp_path, ns.namesrv, 3, flush_mode="sync")
        try:
            for i in range(3):
                await g.start(i)
            leader = await g.wait_leader(in_sync=3)
            async with Producer(g.namesrv) as producer:
                results = await asyncio.gather(
                    *(producer.send(Message(TOPIC, f"s{i}".encode())) for i in range(40))
                )
            term = leader.leader
            assert term is not None
            # the term's own state record may still be on its way to the followers
            await eventually(lambda: term.hw == term.written_end, 5, "the set at the log end")
            for n in g.nodes:
                assert n is not None
                assert n.store is not None
                # a replica's queues are built from its log on the dispatch thread
                assert await asyncio.to_thread(n.store.wait_dispatched, 5.0)
                got = {
                    m.unique_id for q in range(8) for m in n.store.get(TOPIC, q, 0, 100).messages
                }
                # acknowledged: on every replica of the in-sync set, durable and readable
                assert {r.message_id for r in results} <= got
        finally:
            for i in range(3):
                await g.stop(i)
