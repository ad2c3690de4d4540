"""What the broker's transaction tests share: a topic and a producer group, a payment message,
and small clients of ``apogee.v1.Transaction`` and of the queues, over real gRPC.

Kept beside :mod:`apogee.testkit.broker` (which starts brokers) so that the tests of
SendHalf/EndTransaction and those of the checker's calls use one copy.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio

from apogee.codec import StoredMessage
from apogee.rpc.errors import KIND_KEY
from apogee.testkit.broker import decode_records
from apogee.testkit.broker import pull as stream_pull
from apogee.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    consumer_pb2,
    transaction_pb2,
    transaction_pb2_grpc,
)
from apogee_broker.app import BrokerApp

pb = transaction_pb2
GROUP = "txn-producers"
TOPIC = "Payments"
#: The properties a half carries that its committed message must not.
TXN_PROPERTIES = frozenset(
    {
        "REAL_TOPIC",
        "REAL_QID",
        "TRAN_MSG",
        "PGROUP",
        "TRANSACTION_CHECK_TIMES",
        "TRAN_FIRST_STORED",
        "CHECK_IMMUNITY_TIME_IN_SECONDS",
    }
)


async def put_topic(app: BrokerApp, name: str, queues: int) -> None:
    async with grpc.aio.insecure_channel(app.address) as ch:
        await broker_pb2_grpc.BrokerAdminStub(ch).PutTopic(
            broker_pb2.PutTopicRequest(
                topic=common_pb2.TopicConfig(
                    name=name, read_queues=queues, write_queues=queues, perm=6
                )
            ),
            timeout=5,
        )


def payment(body: bytes = b"pay 10", **kw: Any) -> common_pb2.Message:
    values: dict[str, Any] = {
        "topic": TOPIC,
        "body": body,
        "queue_id": 1,
        "tags": "paid",
        "keys": ["order-7"],
        "properties": {"region": "eu"},
    }
    values.update(kw)
    return common_pb2.Message(**values)


async def send_half(
    ch: grpc.aio.Channel, msg: common_pb2.Message | None = None, group: str = GROUP
) -> transaction_pb2.SendHalfResponse:
    return await transaction_pb2_grpc.TransactionStub(ch).SendHalf(
        pb.SendHalfRequest(producer_group=group, message=msg or payment()), timeout=5
    )


async def end(
    ch: grpc.aio.Channel,
    half: transaction_pb2.SendHalfResponse | None,
    decision: pb.TransactionDecision.ValueType,
    *,
    unique_id: str = "",
    half_offset: int | None = None,
    group: str = GROUP,
    source: pb.EndSource.ValueType = pb.PRODUCER,
) -> transaction_pb2.EndTransactionResponse:
    offset = half.half_offset if half is not None else -1
    return await transaction_pb2_grpc.TransactionStub(ch).EndTransaction(
        pb.EndTransactionRequest(
            producer_group=group,
            unique_id=unique_id or (half.unique_id if half is not None else ""),
            half_offset=offset if half_offset is None else half_offset,
            decision=decision,
            source=source,
            client_id="producer-1",
        ),
        timeout=5,
    )


async def refused(call: Any) -> tuple[grpc.StatusCode, str, str]:
    """The status code, sentence and error kind of a call that must fail."""
    try:
        await call
    except grpc.aio.AioRpcError as err:
        kind = dict(err.trailing_metadata() or ()).get(KIND_KEY, "")
        return err.code(), err.details() or "", str(kind)
    raise AssertionError("the call succeeded; it must fail")


async def read(ch: grpc.aio.Channel, topic: str, queue: int) -> list[StoredMessage]:
    reply = await stream_pull(
        ch,
        consumer_pb2.PullRequest(
            group="readers", client_id="t", topic=topic, queue_id=queue, offset=0, max_messages=64
        ),
    )
    return decode_records(reply.records)


async def read_topic(
    app: BrokerApp, ch: grpc.aio.Channel, topic: str = TOPIC
) -> list[StoredMessage]:
    """Every message of ``topic``'s two queues, once the broker dispatched what it stored."""
    assert app.store is not None
    assert await asyncio.to_thread(app.store.wait_dispatched, 5)
    return [m for q in range(2) for m in await read(ch, topic, q)]
