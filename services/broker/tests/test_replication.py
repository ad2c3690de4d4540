"""Replica groups in one process: three replicas of one broker name on the file coordination,
a nameserver beside them. What a user checks: sends are acknowledged once the in-sync set has
them, every replica holds the same bytes, a follower refuses clients naming the leader, a
group short of replicas refuses sends before storing anything, a new leader takes over with
everything that was acknowledged, and with the group's state: topics, committed offsets (each
commit as it is made), POP consumption and recalls."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from apogee.client import AdminClient, Message, MessageQueue, Producer
from apogee.common.errors import ApogeeError
from apogee.rocketmq.v2 import definition_pb2 as v2d
from apogee.rocketmq.v2 import service_pb2 as v2s
from apogee.rocketmq.v2 import service_pb2_grpc as v2g
from apogee.rpc.errors import from_rpc_error
from apogee.testkit.cluster import InProcessCluster
from apogee.testkit.replicas import ReplicaGroup as Group
from apogee.testkit.waiting import eventually
from apogee.v1 import broker_pb2, broker_pb2_grpc
from apogee_broker.core.consume.offsets import read_offsets
from apogee_broker.replication.node import HANDOFF_S

pytestmark = pytest.mark.integration

TOPIC = "Replicated"


@pytest.fixture
async def group(tmp_path: Path) -> AsyncIterator[Group]:
    async with (
        InProcessCluster(tmp_path / "ns", nameservers=1, brokers=()) as ns,
        Group(tmp_path, ns.namesrv, 3) as g,
    ):
        await g.start_all()
        yield g


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


async def test_a_follower_answers_an_official_clients_route_query(group: Group) -> None:
    """QueryRoute is what an official client asks of the address it was given: a follower
    answers it with the whole cluster's route, whose broker is the group's leader; a send to
    the follower is refused NOT_LEADER."""
    leader = await group.wait_leader(in_sync=3)
    async with Producer(group.namesrv) as producer:
        await producer.send(Message(TOPIC, b"makes the topic"))
    follower = next(n for n in group.nodes if n is not None and n is not leader)
    md = (("x-mq-client-id", "route@1@1@abc"), ("x-mq-language", "PYTHON"))
    async with grpc.aio.insecure_channel(follower.address) as ch:
        stub = v2g.MessagingServiceStub(ch)
        route = await stub.QueryRoute(
            v2s.QueryRouteRequest(topic=v2d.Resource(name=TOPIC)), metadata=md, timeout=5
        )
        assert route.status.code == v2d.OK, route.status.message
        host, port = leader.address.rsplit(":", 1)
        assert route.message_queues
        for q in route.message_queues:
            assert q.broker.name == "broker-a"
            assert [(a.host, a.port) for a in q.broker.endpoints.addresses] == [(host, int(port))]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.SendMessage(v2s.SendMessageRequest(), metadata=md, timeout=5)
    assert from_rpc_error(refused.value, "the follower").kind.name == "NOT_LEADER"


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
    # with nobody to hand leadership to, a stop does not wait out a handoff (nor the topic
    # snapshot that cannot be replicated either)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await group.stop(group.nodes.index(leader))
    assert loop.time() - start < HANDOFF_S / 2


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
            copies = [read_offsets(n.settings.data_dir) or {} for n in followers]
            return all("Kept@keepers" in c.get("offsets", {}) for c in copies)

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
    async with (
        InProcessCluster(tmp_path / "ns", nameservers=1, brokers=()) as ns,
        Group(tmp_path, ns.namesrv, 3, flush_mode="sync") as g,
    ):
        await g.start_all()
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
            got = {m.unique_id for q in range(8) for m in n.store.get(TOPIC, q, 0, 100).messages}
            # acknowledged: on every replica of the in-sync set, durable and readable
            assert {r.message_id for r in results} <= got


async def test_pop_state_and_recalls_survive_a_change_of_leader(group: Group) -> None:
    """An official client's POP consumption goes on at the new leader where it was: acked
    messages do not come back, those in flight stay invisible, the cursor is not reset to the
    topic's start, and a recalled delay message stays recalled."""
    old = await group.wait_leader(in_sync=3)
    async with AdminClient(group.namesrv) as admin:
        await admin.create_or_update_topic("Popped", queues=1)
    async with Producer(group.namesrv) as producer:
        for i in range(10):
            await producer.send(Message("Popped", f"p{i}".encode()))
    md = (("x-mq-client-id", "pop@1@1@abc"), ("x-mq-language", "PYTHON"))

    async def receive(address: str, batch: int) -> list[v2d.Message]:
        req = v2s.ReceiveMessageRequest(
            group=v2d.Resource(name="poppers"),
            message_queue=v2d.MessageQueue(topic=v2d.Resource(name="Popped"), id=-1),
            filter_expression=v2d.FilterExpression(type=v2d.TAG, expression="*"),
            batch_size=batch,
            invisible_duration=Duration(seconds=600),
            long_polling_timeout=Duration(seconds=0),
        )
        async with grpc.aio.insecure_channel(address) as ch:
            stub = v2g.MessagingServiceStub(ch)
            return [
                r.message
                async for r in stub.ReceiveMessage(req, metadata=md, timeout=10)
                if r.HasField("message")
            ]

    got = await receive(old.address, 4)
    assert [m.body for m in got] == [f"p{i}".encode() for i in range(4)]
    async with grpc.aio.insecure_channel(old.address) as ch:
        stub = v2g.MessagingServiceStub(ch)
        acked = await stub.AckMessage(
            v2s.AckMessageRequest(
                group=v2d.Resource(name="poppers"),
                topic=v2d.Resource(name="Popped"),
                entries=[
                    v2s.AckMessageEntry(
                        message_id=m.system_properties.message_id,
                        receipt_handle=m.system_properties.receipt_handle,
                    )
                    for m in got[:2]
                ],
            ),
            metadata=md,
            timeout=5,
        )
        assert acked.status.code == v2d.OK
        delayed = await stub.SendMessage(
            v2s.SendMessageRequest(
                messages=[
                    v2d.Message(
                        topic=v2d.Resource(name="Popped"),
                        body=b"recalled",
                        system_properties=v2d.SystemProperties(
                            message_id="0100000000000000000000000A",
                            body_encoding=v2d.IDENTITY,
                            delivery_timestamp=Timestamp(seconds=int(time.time()) + 3600),
                        ),
                    )
                ]
            ),
            metadata=md,
            timeout=5,
        )
        (entry,) = delayed.entries
    # the recall goes to a follower, as to the access point an official client was given
    # (a Service in front of every pod): it is forwarded to the leader
    follower = next(n for n in group.nodes if n is not None and n is not old)
    async with grpc.aio.insecure_channel(follower.address) as ch:
        recalled = await v2g.MessagingServiceStub(ch).RecallMessage(
            v2s.RecallMessageRequest(
                topic=v2d.Resource(name="Popped"), recall_handle=entry.recall_handle
            ),
            metadata=md,
            timeout=5,
        )
        assert recalled.status.code == v2d.OK, recalled.status.message
    await group.stop(group.nodes.index(old))  # a handoff: the in-sync successor leads
    new = await group.wait_leader(in_sync=1)
    assert new is not old
    rest = await receive(new.address, 32)
    # not p0..p3 again (two acked, two in flight for ten minutes): the six never handed out
    assert [m.body for m in rest] == [f"p{i}".encode() for i in range(4, 10)]
    assert new.app is not None
    assert new.app.schedule is not None
    assert entry.message_id in new.app.schedule.recalls


async def test_offset_commits_reach_the_followers_as_they_are_made(tmp_path: Path) -> None:
    """With no persistence for an hour, commits still reach every follower's offsets: a
    leader that dies loses none that were replicated."""
    async with (
        InProcessCluster(tmp_path / "ns", nameservers=1, brokers=()) as ns,
        Group(tmp_path, ns.namesrv, 3, offset_persist_interval_s=3600.0) as g,
    ):
        await g.start_all()
        leader = await g.wait_leader(in_sync=3)
        async with AdminClient(g.namesrv) as admin:
            await admin.create_or_update_topic("Committed", queues=2)
            async with Producer(g.namesrv) as producer:
                for i in range(20):
                    await producer.send(Message("Committed", f"c{i}".encode()))
            await admin.commit_offsets(
                "committers", {MessageQueue("Committed", "broker-a", q): 3 for q in range(2)}
            )
        followers = [n for n in g.nodes if n is not None and n is not leader]

        def committed_on_followers() -> bool:
            for n in followers:
                table = (read_offsets(n.settings.data_dir) or {}).get("offsets", {})
                if table.get("Committed@committers") != {"0": 3, "1": 3}:
                    return False
            return True

        await eventually(committed_on_followers, 10, "the commits on every follower")
