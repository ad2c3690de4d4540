"""A replica group's state behaves after a ``kill -9`` of its leader as it would without one
(docs/replication.md, "State records"): a local cluster (``apogee cluster up --replicas 3``: a
nameserver, three replicas of ``broker-a`` on the file coordination, the schedule service and
the transaction checker, as real processes), and before the kill:

- a consumer group commits an offset (with no persistence for an hour: the commit itself must
  travel);
- an official client's POP consumer (``apache.rocketmq.v2``) receives two messages invisible for
  ten minutes and acks one;
- a delay message waits for its time;
- a transaction is left open (its producer answers UNKNOWN to checks until after the kill).

After the kill and the election: the group's offset is the one committed; a receive gets the
messages never handed out, not the acked one and not the invisible one; the delay message is
delivered once, not before its time; the transaction is checked at the new leader, committed and
delivered once."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc.aio
import pytest
from google.protobuf.duration_pb2 import Duration

from apogee.client import (
    AdminClient,
    Message,
    MessageQueue,
    Producer,
    PullConsumer,
    TransactionCheckMessage,
    TransactionDecision,
    TransactionProducer,
)
from apogee.client.replicas import ReplicaGroupStatus
from apogee.rocketmq.v2 import definition_pb2 as v2d
from apogee.rocketmq.v2 import service_pb2 as v2s
from apogee.rocketmq.v2 import service_pb2_grpc as v2g
from e2e.harness import Cluster, eventually, wait_for_route
from e2e.txn_support import deciding

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BROKER_ENV = {
    "APOGEE_BROKER_AUTO_CREATE_TOPICS": "false",
    "APOGEE_BROKER_OFFSET_PERSIST_INTERVAL_S": "3600",
    "APOGEE_BROKER_REPLICA_LEASE_S": "2",
    "APOGEE_BROKER_REPLICA_LAG_MAX_S": "2",
    "APOGEE_BROKER_REPLICATION_TIMEOUT_S": "5",
}
CHECKER_ENV = {
    "APOGEE_TXN_CHECKER_CHECK_INTERVAL_S": "1",
    "APOGEE_TXN_CHECKER_IMMUNITY_S": "1",
    "APOGEE_TXN_CHECKER_BROKER_REFRESH_S": "1",
}
MD = (("x-mq-client-id", "failover@1@1@abc"), ("x-mq-language", "PYTHON"))
#: how long after its due time a delay message may arrive, on a slow shared machine
LATE_S = 15.0


async def group_status(admin: AdminClient, what: str, ok: object) -> ReplicaGroupStatus:
    found: list[ReplicaGroupStatus] = []

    async def ready() -> bool:
        try:
            status = await admin.describe_broker("broker-a")
        except Exception:
            return False
        found[:] = [status]
        return bool(ok(status))  # type: ignore[operator]

    await eventually(ready, 30, what)
    return found[0]


async def pop_receive(address: str, topic: str, batch: int) -> list[v2d.Message]:
    req = v2s.ReceiveMessageRequest(
        group=v2d.Resource(name="poppers"),
        message_queue=v2d.MessageQueue(topic=v2d.Resource(name=topic), id=-1),
        filter_expression=v2d.FilterExpression(type=v2d.TAG, expression="*"),
        batch_size=batch,
        invisible_duration=Duration(seconds=600),
        long_polling_timeout=Duration(seconds=0),
    )
    async with grpc.aio.insecure_channel(address) as ch:
        return [
            r.message
            async for r in v2g.MessagingServiceStub(ch).ReceiveMessage(req, metadata=MD, timeout=10)
            if r.HasField("message")
        ]


async def pop_ack(address: str, topic: str, m: v2d.Message) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        r = await v2g.MessagingServiceStub(ch).AckMessage(
            v2s.AckMessageRequest(
                group=v2d.Resource(name="poppers"),
                topic=v2d.Resource(name=topic),
                entries=[
                    v2s.AckMessageEntry(
                        message_id=m.system_properties.message_id,
                        receipt_handle=m.system_properties.receipt_handle,
                    )
                ],
            ),
            metadata=MD,
            timeout=5,
        )
    assert r.status.code == v2d.OK, r.status.message


async def read_all(namesrv: str, topic: str, until: int) -> list[tuple[float, bytes]]:
    """(arrival time, body) of what a new group reads of ``topic`` from its start, until
    ``until`` messages came (and a moment more, to see a second copy)."""
    got: list[tuple[float, bytes]] = []
    async with PullConsumer(
        namesrv, f"readers-{topic.lower()}", consume_from="earliest", rebalance_interval=1.0
    ) as consumer:
        consumer.subscribe(topic)
        await consumer.start()

        async def enough() -> bool:
            got.extend((time.time(), m.body) for m in await consumer.poll(timeout=0.5))
            return len(got) >= until

        await eventually(enough, 60, f"{until} message(s) of {topic}")
        got.extend((time.time(), m.body) for m in await consumer.poll(timeout=2.0))
    return got


async def test_offsets_pop_delay_and_an_open_transaction_survive_a_kill_9_of_the_leader(
    tmp_path: Path,
) -> None:
    cluster = await asyncio.to_thread(
        Cluster.start,
        tmp_path,
        brokers=1,
        nameservers=1,
        replicas=3,
        broker_env=BROKER_ENV,
        txn_checker_env=CHECKER_ENV,
    )
    decision = TransactionDecision.UNKNOWN

    async def listener(m: TransactionCheckMessage) -> TransactionDecision:
        return decision

    try:
        namesrv = cluster.namesrv
        async with AdminClient(namesrv) as admin:
            before = await group_status(
                admin, "a leader with 3 in sync", lambda s: s.leader and s.in_sync_count == 3
            )
            for topic, kind in (
                ("Kept", "NORMAL"),
                ("Popped", "NORMAL"),
                ("Later", "DELAY"),
                ("Txn", "TRANSACTION"),
            ):
                await admin.create_or_update_topic(
                    topic, queues=1, brokers=["broker-a"], message_type=kind
                )
                await wait_for_route(cluster.nameservers, topic, {"broker-a"})
            async with (
                Producer(namesrv) as producer,
                TransactionProducer(
                    namesrv, "failover-txn", check_listener=listener, topics=["Txn"]
                ) as txn,
            ):
                for i in range(10):
                    await producer.send(Message("Kept", f"k{i}".encode()))
                for i in range(6):
                    await producer.send(Message("Popped", f"p{i}".encode()))
                due = time.time() + 12
                await producer.send(Message("Later", b"later", deliver_at=due))
                await admin.commit_offsets("keepers", {MessageQueue("Kept", "broker-a", 0): 4})
                opened = await txn.send_in_transaction(
                    Message("Txn", b"open"), deciding(TransactionDecision.UNKNOWN)
                )
                assert opened.pending
                popped = await pop_receive(before.leader_address, "Popped", 2)
                assert [m.body for m in popped] == [b"p0", b"p1"]
                await pop_ack(before.leader_address, "Popped", popped[0])
                # a last acknowledged send, after what came before it is on its way
                await producer.send(Message("Kept", b"last"))
                status = await group_status(
                    admin,
                    "every replica at the leader's log end",
                    lambda s: (
                        s.in_sync_count == 3 and all(r.log_end == s.log_end for r in s.replicas)
                    ),
                )
                old = next(p.name for p in cluster.brokers if p.address == status.leader_address)
                cluster.kill(old)
                after = await group_status(
                    admin,
                    "another leader",
                    lambda s: s.leader and s.leader_address != status.leader_address,
                )
                assert after.epoch > status.epoch
                decision = TransactionDecision.COMMIT  # the producer answers checks from now

                described = await admin.describe_group("keepers")
                assert [(q.queue_id, q.consumer_offset) for q in described.queues] == [(0, 4)]
                rest = await pop_receive(after.leader_address, "Popped", 32)
                assert [m.body for m in rest] == [b"p2", b"p3", b"p4", b"p5"]
                later = await read_all(namesrv, "Later", 1)
                assert [body for _, body in later] == [b"later"]
                assert due - 1 <= later[0][0] <= due + LATE_S
                committed = await read_all(namesrv, "Txn", 1)
                assert [body for _, body in committed] == [b"open"]
        cluster.restart(old)  # back as a follower: the group whole again
        async with AdminClient(namesrv) as admin:
            await group_status(admin, "3 in sync again", lambda s: s.in_sync_count == 3)
    finally:
        await asyncio.to_thread(cluster.close)
