"""Every bad input gets its own error - the right kind and status code, a sentence naming the
field and the rule - and the broker keeps serving without anything stored being touched.

Bad messages go through the SDK (which refuses most of them before sending, with the broker's
own sentences) and, to reach the broker's checks, through raw ``apogee.v1.Broker/SendMessages``
calls in which each bad message travels with a good one: the bad one gets its error, the good
one is stored. The shared cluster does not create topics automatically and takes bodies of at
most 64 KiB.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
import pytest

from apogee.client import AdminClient, Message, Producer, SendResult, SyncProducer
from apogee.common.errors import ApogeeError, UnknownTopicError
from apogee.rpc.errors import KIND_KEY
from apogee.rpc.server import check_health
from apogee.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from e2e.harness import SHARED_MAX_MESSAGE_SIZE, Cluster, wait_for_route

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOPIC = "E2EInput"
QUEUES = 8
BROKERS = {"broker-a", "broker-b"}
LONG_TOPIC = "T" * 128
UNKNOWN = "E2ENoSuchTopic"
TOO_LARGE = SHARED_MAX_MESSAGE_SIZE + 1
BIG_PROPERTIES = {"note": "p" * 40_000}


@dataclass(frozen=True)
class Case:
    """A bad message and what must come back: the error kind, its gRPC status code and
    fragments of the sentence (the field and the rule)."""

    name: str
    message: Callable[[], Message]
    kind: str
    code: str
    says: tuple[str, ...]


def incompressible(size: int) -> bytes:
    return os.urandom(size)  # the SDK compresses large bodies only when that makes them smaller


#: Through the SDK: the first five are refused by the SDK itself, the broker answers the others.
SDK_CASES = [
    Case(
        "bad topic name",
        lambda: Message("bad topic", b"x"),
        "INVALID_TOPIC",
        "INVALID_ARGUMENT",
        ("topic 'bad topic'", "character outside [%|a-zA-Z0-9_-]"),
    ),
    Case(
        "too long topic",
        lambda: Message(LONG_TOPIC, b"x"),
        "INVALID_TOPIC",
        "INVALID_ARGUMENT",
        ("is 128 characters; at most 127",),
    ),
    Case(
        "empty body",
        lambda: Message(TOPIC, b""),
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        ("body: must not be empty",),
    ),
    Case(
        "properties too large",
        lambda: Message(TOPIC, b"x", properties=BIG_PROPERTIES),
        "PROPERTIES_TOO_LARGE",
        "INVALID_ARGUMENT",
        ("properties are", "the maximum is 32767 bytes (max_properties_size)"),
    ),
    Case(
        "delay level 19",
        lambda: Message(TOPIC, b"x", delay_level=19),
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        ("delay_level", "from 0 to 18, got 19"),
    ),
    Case(
        "system topic TBW102",
        lambda: Message("TBW102", b"x"),
        "PERMISSION_DENIED",
        "PERMISSION_DENIED",
        ("topic 'TBW102'", "is a system topic"),
    ),
    Case(
        "system topic SCHEDULE_TOPIC_XXXX",
        lambda: Message("SCHEDULE_TOPIC_XXXX", b"x"),
        "PERMISSION_DENIED",
        "PERMISSION_DENIED",
        ("topic 'SCHEDULE_TOPIC_XXXX'", "is a system topic"),
    ),
    Case(
        "unknown topic",
        lambda: Message(UNKNOWN, b"x"),
        "UNKNOWN_TOPIC",
        "NOT_FOUND",
        (f"topic '{UNKNOWN}'", "has no route"),
    ),
    # the SDK takes bodies up to 4 MiB; this broker only up to 64 KiB
    Case(
        "body over the broker's maximum",
        lambda: Message(TOPIC, incompressible(TOO_LARGE)),
        "MESSAGE_TOO_LARGE",
        "INVALID_ARGUMENT",
        (
            f"body is {TOO_LARGE} bytes",
            f"the maximum is {SHARED_MAX_MESSAGE_SIZE} bytes (max_message_size)",
        ),
    ),
    Case(
        "delivery time beyond the broker's cap",
        lambda: Message(TOPIC, b"x", deliver_at=time.time() + 30 * 86_400),
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        ("deliver_at_ms", "the maximum is 7 days"),
    ),
]


def pb(topic: str = TOPIC, body: bytes = b"x", **fields: object) -> common_pb2.Message:
    return common_pb2.Message(topic=topic, body=body, **fields)  # type: ignore[arg-type]


@dataclass(frozen=True)
class RawCase:
    name: str
    message: common_pb2.Message
    kind: str
    code: grpc.StatusCode
    says: tuple[str, ...]


RAW_CASES = [
    RawCase(
        "bad topic name",
        pb("bad topic"),
        "INVALID_TOPIC",
        grpc.StatusCode.INVALID_ARGUMENT,
        ("topic 'bad topic'", "character outside [%|a-zA-Z0-9_-]"),
    ),
    RawCase(
        "too long topic",
        pb(LONG_TOPIC),
        "INVALID_TOPIC",
        grpc.StatusCode.INVALID_ARGUMENT,
        ("is 128 characters; at most 127",),
    ),
    RawCase(
        "empty body",
        pb(body=b""),
        "INVALID_ARGUMENT",
        grpc.StatusCode.INVALID_ARGUMENT,
        ("messages[0].body: must not be empty",),
    ),
    RawCase(
        "body over the maximum",
        pb(body=b"b" * TOO_LARGE),
        "MESSAGE_TOO_LARGE",
        grpc.StatusCode.INVALID_ARGUMENT,
        (
            f"messages[0].body is {TOO_LARGE} bytes",
            f"the maximum is {SHARED_MAX_MESSAGE_SIZE} bytes (max_message_size)",
        ),
    ),
    RawCase(
        "properties too large",
        pb(properties=BIG_PROPERTIES),
        "PROPERTIES_TOO_LARGE",
        grpc.StatusCode.INVALID_ARGUMENT,
        ("properties are", "the maximum is 32767 bytes (max_properties_size)"),
    ),
    RawCase(
        "separator in a property",
        pb(properties={"note": "a\x01b"}),
        "INVALID_PROPERTY",
        grpc.StatusCode.INVALID_ARGUMENT,
        ("property 'note'",),
    ),
    RawCase(
        "unknown topic",
        pb(UNKNOWN),
        "UNKNOWN_TOPIC",
        grpc.StatusCode.NOT_FOUND,
        (f"topic '{UNKNOWN}' does not exist on broker", "auto_create_topics is off"),
    ),
    RawCase(
        "system topic TBW102",
        pb("TBW102"),
        "PERMISSION_DENIED",
        grpc.StatusCode.PERMISSION_DENIED,
        ("topic 'TBW102'", "is a system topic"),
    ),
    RawCase(
        "system topic SCHEDULE_TOPIC_XXXX",
        pb("SCHEDULE_TOPIC_XXXX"),
        "PERMISSION_DENIED",
        grpc.StatusCode.PERMISSION_DENIED,
        ("topic 'SCHEDULE_TOPIC_XXXX'", "is a system topic"),
    ),
    RawCase(
        "delay level 19",
        pb(delay_level=19),
        "INVALID_ARGUMENT",
        grpc.StatusCode.INVALID_ARGUMENT,
        ("delay_level 19", "between 1 and 18"),
    ),
    RawCase(
        "queue id past the topic's queues",
        pb(queue_id=QUEUES),
        "INVALID_QUEUE_ID",
        grpc.StatusCode.INVALID_ARGUMENT,
        (f"queue_id {QUEUES}", f"between 0 and {QUEUES - 1}"),
    ),
    RawCase(
        "unknown system flag",
        pb(sys_flag=0x4),
        "INVALID_ARGUMENT",
        grpc.StatusCode.INVALID_ARGUMENT,
        ("messages[0].sys_flag", "only bit 0x1"),
    ),
]


def check_error(err: BaseException, kind: str, code: str, says: tuple[str, ...]) -> None:
    assert isinstance(err, ApogeeError), repr(err)
    assert (err.kind.name, err.kind.code, err.retriable) == (kind, code, False), str(err)
    for fragment in says:
        assert fragment in str(err), f"{fragment!r} not in {str(err)!r}"


async def test_every_bad_input_gets_its_error_and_the_broker_keeps_serving(
    cluster: Cluster,
) -> None:
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic(TOPIC, queues=QUEUES)
        await wait_for_route(cluster.nameservers, TOPIC, BROKERS)
        async with Producer(cluster.namesrv, group="e2e-input") as producer:
            before = list(
                await asyncio.gather(
                    *(producer.send(Message(TOPIC, f"before-{i}".encode())) for i in range(40))
                )
            )
            for case in SDK_CASES:
                with pytest.raises(ApogeeError) as caught:
                    await producer.send(case.message())
                check_error(caught.value, case.kind, case.code, case.says)

        def sync_sends() -> None:
            with SyncProducer(cluster.namesrv, group="e2e-input-sync") as sync:
                for case in SDK_CASES:
                    with pytest.raises(ApogeeError) as caught:
                        sync.send(case.message())
                    check_error(caught.value, case.kind, case.code, case.says)

        await asyncio.to_thread(sync_sends)

        raw_good: list[str] = []
        for broker in cluster.brokers:
            raw_good += await raw_bad_sends(broker.address, broker.name)

        # the broker still serves, and good sends work
        for broker in cluster.brokers:
            assert await check_health(broker.address, 2.0)
        async with Producer(cluster.namesrv, group="e2e-input") as producer:
            after = await asyncio.gather(
                *(producer.send(Message(TOPIC, f"after-{i}".encode())) for i in range(40))
            )
        assert {r.broker_name for r in after} == BROKERS

        # nothing stored was touched: every message is where it was, with its body
        async def same(r: SendResult, body: bytes) -> None:
            m = await admin.get_message(r.message_id)
            assert (m.broker_name, m.queue_id, m.queue_offset, m.body) == (
                r.broker_name,
                r.queue_id,
                r.queue_offset,
                body,
            )

        await asyncio.gather(*(same(r, f"before-{i}".encode()) for i, r in enumerate(before)))
        for uid in raw_good:
            assert (await admin.get_message(uid)).body.startswith(b"raw-good")
        status = await admin.describe_topic(TOPIC)
        assert status.messages == len(before) + len(raw_good) + len(after)
        assert all(q.min_offset == 0 for b in status.brokers for q in b.queues)

        # nothing was created by the bad sends
        with pytest.raises(UnknownTopicError):
            await admin.describe_topic(UNKNOWN)
        assert UNKNOWN not in await admin.list_topics()
        system = await admin.describe_topic("TBW102")
        assert system.messages == 0

    for broker in cluster.brokers:
        log = await asyncio.to_thread(Path(broker.log).read_text)
        errors = [line for line in log.splitlines() if " ERROR " in line]
        assert not errors, f"{broker.name} logged errors: {errors[:3]}"


async def raw_bad_sends(address: str, broker: str) -> list[str]:
    """Each raw case with a good message behind it: the bad one gets its status, the good one
    is stored. Then the request-level problems. Returns the ids of the good messages."""
    good_ids = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = broker_pb2_grpc.BrokerStub(channel)
        for i, case in enumerate(RAW_CASES):
            good = pb(body=f"raw-good-{broker}-{i}".encode(), queue_id=i % QUEUES)
            resp = await stub.SendMessages(
                broker_pb2.SendMessagesRequest(messages=[case.message, good]), timeout=5
            )
            assert resp.broker_name == broker
            bad_status, good_status = (r.status for r in resp.results)
            assert (bad_status.code, bad_status.reason, bad_status.retriable) == (
                case.code.value[0],
                case.kind,
                False,
            ), f"{case.name}: {bad_status}"
            for fragment in case.says:
                assert fragment in bad_status.message, f"{case.name}: {bad_status.message!r}"
            assert good_status.code == 0, f"{case.name}: the good message {good_status}"
            good_ids.append(resp.results[1].unique_id)

        # request-level problems fail the call, with the kind in the trailing metadata
        too_many = [pb(body=b"m") for _ in range(1025)]
        for messages, says in (
            ([], "messages: must not be empty"),
            (too_many, "1025 messages in one request; at most 1024"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.SendMessages(
                    broker_pb2.SendMessagesRequest(messages=messages), timeout=5
                )
            err = caught.value
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert says in (err.details() or "")
            assert (KIND_KEY, "INVALID_ARGUMENT") in tuple(err.trailing_metadata() or ())
    return good_ids
