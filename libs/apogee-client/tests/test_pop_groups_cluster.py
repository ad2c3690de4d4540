"""A group that official RocketMQ 5 clients consume by POP, as administration shows it, against
real nameservers and brokers in this process: its consumption, the official clients connected
to each broker (language, version, type) and, per queue, the messages in flight and still
invisible; through the SDK (both twins) and ``apogee group describe`` / ``apogee group list``.

The official clients are played with the raw ``apache.rocketmq.v2`` stubs: a Telemetry stream
that sent its settings and a heartbeat each register a client, and a receive hands messages
out by POP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc.aio
import pytest
from google.protobuf.duration_pb2 import Duration

from apogee.cli.main import main
from apogee.client import AdminClient, GroupDescription, OfficialClientInfo, SyncAdminClient
from apogee.rocketmq.v2 import definition_pb2 as d
from apogee.rocketmq.v2 import service_pb2 as s
from apogee.rocketmq.v2 import service_pb2_grpc as sg
from apogee.testkit.cluster import InProcessCluster
from apogee.testkit.waiting import eventually

pytestmark = pytest.mark.integration

TOPIC = "Payments"
GROUP = "pay-pop"
RECEIVER = "pay-java@10.0.0.7@1@a1"
WATCHER = "pay-go@10.0.0.8@1@b2"


def headers(client_id: str, language: str, version: str) -> tuple[tuple[str, str], ...]:
    return (
        ("x-mq-client-id", client_id),
        ("x-mq-language", language),
        ("x-mq-client-version", version),
    )


JAVA = headers(RECEIVER, "JAVA", "5.0.7")
GOLANG = headers(WATCHER, "GOLANG", "5.0.2")


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster(tmp_path, nameservers=1) as c:
        await c.create_topic(TOPIC, queues=2)
        yield c


async def send(stub: sg.MessagingServiceAsyncStub, body: bytes, message_id: str) -> None:
    r = await stub.SendMessage(
        s.SendMessageRequest(
            messages=[
                d.Message(
                    topic=d.Resource(name=TOPIC),
                    body=body,
                    system_properties=d.SystemProperties(
                        message_id=message_id, body_encoding=d.IDENTITY
                    ),
                )
            ]
        ),
        metadata=JAVA,
        timeout=5,
    )
    assert r.status.code == d.OK, r.status


async def receive(stub: sg.MessagingServiceAsyncStub, batch: int, invisible_s: int) -> int:
    """Messages handed out by one receive of the group (each invisible for ``invisible_s``)."""
    req = s.ReceiveMessageRequest(
        group=d.Resource(name=GROUP),
        message_queue=d.MessageQueue(topic=d.Resource(name=TOPIC), id=-1),
        filter_expression=d.FilterExpression(type=d.TAG, expression="*"),
        batch_size=batch,
        invisible_duration=Duration(seconds=invisible_s),
        long_polling_timeout=Duration(seconds=0),
    )
    got = 0
    async for r in stub.ReceiveMessage(req, metadata=JAVA, timeout=10):
        if r.HasField("message"):
            got += 1
        elif r.HasField("status"):
            assert r.status.code == d.OK, r.status
    return got


def subscription_settings() -> d.Settings:
    return d.Settings(
        client_type=d.SIMPLE_CONSUMER,
        subscription=d.Subscription(
            group=d.Resource(name=GROUP),
            subscriptions=[
                d.SubscriptionEntry(
                    topic=d.Resource(name=TOPIC),
                    expression=d.FilterExpression(type=d.TAG, expression="*"),
                )
            ],
        ),
    )


async def test_a_pop_group_shows_its_clients_and_messages_in_flight(
    cluster: InProcessCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    broker_a = cluster.brokers["broker-a"]
    broker_b = cluster.brokers["broker-b"]
    async with (
        grpc.aio.insecure_channel(broker_a.address) as ch_a,
        grpc.aio.insecure_channel(broker_b.address) as ch_b,
    ):
        stub_a, stub_b = sg.MessagingServiceStub(ch_a), sg.MessagingServiceStub(ch_b)
        # the receiving client keeps its Telemetry stream open at broker-a while it is checked
        telemetry = stub_a.Telemetry(metadata=JAVA, timeout=60)
        try:
            await telemetry.write(s.TelemetryCommand(settings=subscription_settings()))
            first = await telemetry.read()
            assert isinstance(first, s.TelemetryCommand)
            assert first.status.code == d.OK, first.status
            # another client of the group heartbeats at broker-b and receives nothing
            beat = await stub_b.Heartbeat(
                s.HeartbeatRequest(group=d.Resource(name=GROUP), client_type=d.SIMPLE_CONSUMER),
                metadata=GOLANG,
                timeout=5,
            )
            assert beat.status.code == d.OK, beat.status
            for i in range(3):
                await send(stub_a, b"pay-%d" % i, f"PAY{i}")
            assert await receive(stub_a, batch=1, invisible_s=1) == 1  # due again in 1 s
            assert await receive(stub_a, batch=32, invisible_s=300) == 2

            async with AdminClient(cluster.namesrv) as admin:

                async def one_due_again() -> GroupDescription | None:
                    got = await admin.describe_group(GROUP)
                    return got if (got.in_flight, got.invisible) == (3, 2) else None

                await eventually(one_due_again, 10, "the 1 s message to be visible again")
                described = await admin.describe_group(GROUP)
                summaries = await admin.list_groups()
            sync_described = await asyncio.to_thread(sync_describe, cluster.namesrv)

            base = ["--namesrv", cluster.namesrv, "group"]
            assert await asyncio.to_thread(main, [*base, "describe", GROUP]) == 0
            described_text = capsys.readouterr().out
            assert await asyncio.to_thread(main, [*base, "list"]) == 0
            listed_text = capsys.readouterr().out
        finally:
            telemetry.cancel()

    assert described.consumption == "POP"
    assert described.members == ()
    watcher, receiver = described.clients  # by client id
    assert watcher == OfficialClientInfo(
        WATCHER, "GOLANG", "5.0.2", "", watcher.host, "broker-b"
    )  # a heartbeat says no type
    assert receiver == OfficialClientInfo(
        RECEIVER, "JAVA", "5.0.7", "SIMPLE_CONSUMER", receiver.host, "broker-a"
    )
    assert watcher.host.startswith("127.0.0.1")
    assert receiver.host.startswith("127.0.0.1")
    a_queues = [q for q in described.queues if q.broker_name == "broker-a"]
    assert sum(q.broker_offset for q in a_queues) == 3
    assert sum(q.in_flight for q in a_queues) == 3
    assert sum(q.invisible for q in a_queues) == 2
    assert all(q.invisible <= q.in_flight for q in described.queues)
    assert sync_described.consumption == "POP"
    assert sync_described.clients == described.clients
    [summary] = [g for g in summaries if g.group == GROUP]
    # known at broker-b too: a client of the group is connected there
    assert (summary.members, summary.topics, summary.brokers) == (
        0,
        (TOPIC,),
        ("broker-a", "broker-b"),
    )

    lines = described_text.splitlines()
    assert lines[0].startswith(f"group {GROUP}: 2 official clients, ")
    assert lines[0].endswith(", 3 in flight (2 invisible)")
    assert lines[1] == "consumption: POP"
    start = lines.index("official clients:")
    assert lines[start + 1].split() == [
        "CLIENT", "ID", "LANGUAGE", "VERSION", "TYPE", "HOST", "BROKER",
    ]  # fmt: skip
    assert [line.split() for line in lines[start + 2 : start + 4]] == [
        [WATCHER, "GOLANG", "5.0.2", "-", watcher.host, "broker-b"],
        [RECEIVER, "JAVA", "5.0.7", "SIMPLE_CONSUMER", receiver.host, "broker-a"],
    ]
    header = next(line for line in lines if line.startswith("TOPIC"))
    assert "IN FLIGHT" in header
    assert "INVISIBLE" in header
    rows = [line.split() for line in lines if line.startswith(TOPIC)]
    a_rows = [r for r in rows if r[1] == "broker-a"]
    assert sum(int(r[7]) for r in a_rows) == 3  # IN FLIGHT
    assert sum(int(r[8]) for r in a_rows) == 2  # INVISIBLE

    listed = [line.split() for line in listed_text.splitlines()]
    assert listed[0] == ["GROUP", "MEMBERS", "MODE", "TOPICS", "BROKERS"]
    assert [GROUP, "0", "unknown", TOPIC, "broker-a,broker-b"] in listed


def sync_describe(namesrv: str) -> GroupDescription:
    with SyncAdminClient(namesrv) as admin:
        return admin.describe_group(GROUP)
