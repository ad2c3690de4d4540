"""A consumer group is consumed either by POP (the official RocketMQ 5 clients, over
``apache.rocketmq.v2``) or by queue offsets (Apogee's SDK), not both at once: each keeps its own
record of what was consumed. Against a nameserver and a broker in this process, the official
clients played with the raw v2 stubs, Apogee's SDK as users run it:

- while an SDK consumer of a group is a member, a v2 receive for the group is answered
  UNSUPPORTED, naming the group and why;
- while a group has messages in flight (received by POP, not acked) or official clients
  connected (a heartbeat within 30 s), an SDK consumer of it is not let in (the broker ends its
  session with UNSUPPORTED naming the group); once the messages are acked and the clients'
  heartbeats are older than 30 s (the broker's clock is moved on), it joins, and reads on from
  where POP left off;
- a group the SDK consumed before (offsets committed, consumer stopped) is taken over by a v2
  receive, which starts from the SDK's committed offsets.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc.aio
import pytest
from google.protobuf.duration_pb2 import Duration

from apogee.client import AdminClient, Message, Producer, PushConsumer, ReceivedMessage
from apogee.common.clock import SYSTEM_CLOCK
from apogee.common.errors import ApogeeError
from apogee.rocketmq.v2 import definition_pb2 as d
from apogee.rocketmq.v2 import service_pb2 as s
from apogee.rocketmq.v2 import service_pb2_grpc as sg
from apogee.rpc.errors import from_rpc_error
from apogee.testkit.broker import running_broker, small_settings
from apogee.testkit.cluster import InProcessCluster, eventually, wait_committed
from apogee.v1 import consumer_pb2, consumer_pb2_grpc
from apogee_broker.app import BrokerApp
from apogee_broker.core.clients.official import EXPIRY_S

pytestmark = pytest.mark.integration

TOPIC = "Mixed"
QUEUES = 2
BROKER = "broker-a"
#: the official client the raw v2 calls play
RECEIVER = "mix-java@10.0.0.7@1@a1"
V2_MD = (("x-mq-client-id", RECEIVER), ("x-mq-language", "JAVA"))
#: what every refusal says
EITHER = "a group is consumed either by POP (official clients) or by queue offsets"


class ShiftedClock:
    """The system's clock, moved on by what the test says has passed (:meth:`advance`)."""

    def __init__(self) -> None:
        self.shift_s = 0.0

    def time_ms(self) -> int:
        return SYSTEM_CLOCK.time_ms() + int(self.shift_s * 1000)

    def monotonic(self) -> float:
        return SYSTEM_CLOCK.monotonic() + self.shift_s

    def advance(self, seconds: float) -> None:
        self.shift_s += seconds


@dataclass
class Mixed:
    cluster: InProcessCluster
    broker: BrokerApp
    clock: ShiftedClock
    v2: sg.MessagingServiceAsyncStub

    @property
    def namesrv(self) -> str:
        return self.cluster.namesrv


@pytest.fixture
async def mixed(tmp_path: Path) -> AsyncIterator[Mixed]:
    """A nameserver and broker ``broker-a`` (on a clock the test moves on) with ``TOPIC``."""
    clock = ShiftedClock()
    async with InProcessCluster(tmp_path, nameservers=1, brokers=()) as cluster:
        settings = small_settings(
            tmp_path / BROKER,
            cluster=cluster.cluster,
            broker_name=BROKER,
            namesrv=cluster.namesrv,
            shutdown_grace_s=0.5,
        )
        async with running_broker(settings, clock) as broker:
            await cluster.wait_registered({BROKER})
            async with AdminClient(cluster.namesrv) as admin:
                await admin.create_or_update_topic(TOPIC, queues=QUEUES)
            await cluster.wait_route(TOPIC, {BROKER})
            async with grpc.aio.insecure_channel(broker.address) as channel:
                yield Mixed(cluster, broker, clock, sg.MessagingServiceStub(channel))


def sdk_consumer(m: Mixed, group: str, inbox: list[ReceivedMessage]) -> PushConsumer:
    async def on_message(messages: list[ReceivedMessage]) -> None:
        inbox.extend(messages)

    consumer = PushConsumer(
        m.namesrv,
        group,
        on_message,
        consume_from="earliest",
        rebalance_interval=1.0,
        offset_persist_interval=0.2,
        long_poll_timeout=2.0,
    )
    consumer.subscribe(TOPIC)
    return consumer


async def send(m: Mixed, *bodies: str) -> None:
    async with Producer(m.namesrv) as producer:
        for body in bodies:
            await producer.send(Message(TOPIC, body.encode()))


async def receive(m: Mixed, group: str, invisible_s: int = 60) -> tuple[d.Status, list[d.Message]]:
    """One v2 receive of ``group`` (no long poll): its status and the messages handed out."""
    req = s.ReceiveMessageRequest(
        group=d.Resource(name=group),
        message_queue=d.MessageQueue(topic=d.Resource(name=TOPIC), id=-1),
        filter_expression=d.FilterExpression(type=d.TAG, expression="*"),
        batch_size=32,
        invisible_duration=Duration(seconds=invisible_s),
        long_polling_timeout=Duration(seconds=0),
    )
    status = d.Status()
    got: list[d.Message] = []
    async for r in m.v2.ReceiveMessage(req, metadata=V2_MD, timeout=10):
        if r.HasField("status"):
            status = r.status
        elif r.HasField("message"):
            got.append(r.message)
    return status, got


async def receive_all(m: Mixed, group: str, count: int) -> list[d.Message]:
    """v2 receives of ``group`` until ``count`` messages came."""
    got: list[d.Message] = []

    async def enough() -> bool:
        status, batch = await receive(m, group)
        assert status.code in (d.OK, d.MESSAGE_NOT_FOUND), status
        got.extend(batch)
        return len(got) >= count

    await eventually(enough, 10, f"{count} messages received by {group}")
    return got


async def ack(m: Mixed, group: str, messages: list[d.Message]) -> None:
    entries = [
        s.AckMessageEntry(
            message_id=x.system_properties.message_id,
            receipt_handle=x.system_properties.receipt_handle,
        )
        for x in messages
    ]
    r = await m.v2.AckMessage(
        s.AckMessageRequest(
            group=d.Resource(name=group), topic=d.Resource(name=TOPIC), entries=entries
        ),
        metadata=V2_MD,
        timeout=5,
    )
    assert r.status.code == d.OK, r.status


def bodies(messages: list[d.Message] | list[ReceivedMessage]) -> list[str]:
    return sorted(x.body.decode() for x in messages)


async def try_join(m: Mixed, group: str) -> ApogeeError | None:
    """What the broker answers the first heartbeat of an SDK member of ``group`` on its
    Session stream: None when it is let in (the stream is then ended at once), else the error
    the SDK reads from the answer."""
    heartbeat = consumer_pb2.Heartbeat(
        client_id="probe@10.0.0.9@1",
        group=group,
        mode=consumer_pb2.CLUSTERING,
        subscriptions=[consumer_pb2.Subscription(topic=TOPIC, tag_expression="*")],
    )
    async with grpc.aio.insecure_channel(m.broker.address) as channel:
        call = consumer_pb2_grpc.ConsumerStub(channel).Session(timeout=5)
        try:
            await call.write(consumer_pb2.SessionRequest(heartbeat=heartbeat))
            await call.read()  # the group's members, once let in
        except grpc.aio.AioRpcError as exc:
            return from_rpc_error(exc, f"broker {BROKER}")
        finally:
            call.cancel()
    return None


def members(m: Mixed, group: str) -> list[str]:
    assert m.broker.groups is not None
    return [x.client_id for x in m.broker.groups.members(group)]


async def test_a_v2_receive_is_refused_while_the_sdk_consumes_the_group(mixed: Mixed) -> None:
    group = "mix-offsets"
    inbox: list[ReceivedMessage] = []
    async with sdk_consumer(mixed, group, inbox) as consumer:
        await consumer.start()
        await eventually(lambda: consumer.client_id in members(mixed, group), 10, "a member")

        status, got = await receive(mixed, group)
        assert status.code == d.UNSUPPORTED, status
        assert got == []
        assert f"consumer group {group!r}" in status.message
        assert "is consumed by queue offsets here by 1 Apogee SDK member(s)" in status.message
        assert consumer.client_id in status.message
        assert EITHER in status.message

        # the SDK goes on consuming the group as before
        await send(mixed, "offsets-1")
        await eventually(lambda: bodies(inbox) == ["offsets-1"], 10, "the SDK consumed it")


async def test_the_sdk_joins_a_pop_group_only_once_nothing_is_in_flight_and_no_client_is_left(
    mixed: Mixed, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "apogee.client.consumer.session")
    group = "mix-handoff"
    await send(mixed, "pop-1", "pop-2", "pop-3")
    held = await receive_all(mixed, group, 3)
    assert bodies(held) == ["pop-1", "pop-2", "pop-3"]

    # messages in flight: the SDK is not let in
    refused = await try_join(mixed, group)
    assert refused is not None
    assert refused.kind.name == "UNSUPPORTED", refused
    assert f"consumer group {group!r} is consumed by POP here" in str(refused)
    assert "3 messages it received by POP are not acked yet" in str(refused)
    assert EITHER in str(refused)

    # an SDK consumer starts, is refused as a member and consumes nothing; it tries again
    inbox: list[ReceivedMessage] = []
    async with sdk_consumer(mixed, group, inbox) as consumer:
        await consumer.start()

        def warned() -> bool:
            return any(
                f"consumer group {group!r} is consumed by POP here" in r.getMessage()
                for r in caplog.records
            )

        await eventually(warned, 10, "the SDK's log saying why it is not let in")
        assert members(mixed, group) == []

        # the official client heartbeats as a member of the group, and acks: still refused,
        # since it is connected
        beat = await mixed.v2.Heartbeat(
            s.HeartbeatRequest(group=d.Resource(name=group), client_type=d.SIMPLE_CONSUMER),
            metadata=V2_MD,
            timeout=5,
        )
        assert beat.status.code == d.OK, beat.status
        await ack(mixed, group, held)
        refused = await try_join(mixed, group)
        assert refused is not None
        assert refused.kind.name == "UNSUPPORTED", refused
        assert f"official RocketMQ 5 clients ({RECEIVER}) are connected" in str(refused)
        assert members(mixed, group) == []

        # its last heartbeat is more than 30 s old: the SDK consumer gets in by itself
        mixed.clock.advance(EXPIRY_S + 1)
        await eventually(lambda: members(mixed, group) == [consumer.client_id], 15, "joined")
        assert await try_join(mixed, group) is None

        # and reads on from where POP left off: nothing it acked comes again
        await send(mixed, "offsets-4")
        await eventually(lambda: bodies(inbox) == ["offsets-4"], 15, "the new message")
        await wait_committed(mixed.namesrv, group, TOPIC, QUEUES)
    assert bodies(inbox) == ["offsets-4"]


async def test_a_v2_receive_takes_over_from_the_sdks_committed_offsets(mixed: Mixed) -> None:
    group = "mix-takeover"
    await send(mixed, "old-1", "old-2", "old-3", "old-4")
    inbox: list[ReceivedMessage] = []
    async with sdk_consumer(mixed, group, inbox) as consumer:
        await consumer.start()
        await eventually(lambda: len(inbox) == 4, 15, "the SDK consumed the four")
        await wait_committed(mixed.namesrv, group, TOPIC, QUEUES)
    await eventually(lambda: members(mixed, group) == [], 10, "the SDK consumer gone")
    assert bodies(inbox) == ["old-1", "old-2", "old-3", "old-4"]

    await send(mixed, "new-1", "new-2")
    got = await receive_all(mixed, group, 2)
    assert bodies(got) == ["new-1", "new-2"]
    await ack(mixed, group, got)
    status, more = await receive(mixed, group)
    assert (status.code, more) == (d.MESSAGE_NOT_FOUND, []), status
