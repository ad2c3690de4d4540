"""``Consumer.Deliver`` of a BrokerApp in-process, over real gRPC: records pushed as they
arrive within credits, commits on the stream, a queue's error as its status, a bad request
ending the stream with its error, and the broker's stop ending every stream at once."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from apogee.store import Message
from apogee.testkit.broker import decode_records, running_broker, small_settings
from apogee.testkit.waiting import eventually
from apogee.v1 import broker_pb2, broker_pb2_grpc, common_pb2, consumer_pb2, consumer_pb2_grpc
from apogee_broker.app import BrokerApp

pytestmark = pytest.mark.integration

pb = consumer_pb2
DeliverCall = grpc.aio.StreamStreamCall[pb.DeliverRequest, pb.DeliverResponse]


@contextlib.asynccontextmanager
async def broker(tmp_path: Path) -> AsyncIterator[tuple[BrokerApp, grpc.aio.Channel]]:
    settings = small_settings(tmp_path / "b", broker_name="b1")
    async with running_broker(settings) as app, grpc.aio.insecure_channel(app.address) as ch:
        await broker_pb2_grpc.BrokerAdminStub(ch).PutTopic(
            broker_pb2.PutTopicRequest(
                topic=common_pb2.TopicConfig(name="T", read_queues=4, write_queues=4, perm=6)
            ),
            timeout=5,
        )
        yield app, ch


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[BrokerApp, grpc.aio.Channel]]:
    async with broker(tmp_path) as b:
        yield b


async def append(app: BrokerApp, n: int, queue_id: int = 0, topic: str = "T") -> None:
    store = app.store
    assert store is not None
    store.append([Message(topic, f"m{i}".encode(), queue_id=queue_id) for i in range(n)])
    assert await asyncio.to_thread(store.wait_dispatched, 5.0)


def open_stream(ch: grpc.aio.Channel) -> DeliverCall:
    return consumer_pb2_grpc.ConsumerStub(ch).Deliver()


async def read(call: DeliverCall, timeout: float = 5.0) -> pb.DeliverResponse:
    got = await asyncio.wait_for(call.read(), timeout)
    assert isinstance(got, pb.DeliverResponse), got
    return got


def subscribe(sub: int, queue_id: int, offset: int = 0, credit: int = 100) -> pb.DeliverSubscribe:
    return pb.DeliverSubscribe(
        sub=sub, topic="T", queue_id=queue_id, offset=offset, credit_messages=credit
    )


def offsets(batch: pb.DeliverBatch) -> list[int]:
    return [m.queue_offset for m in decode_records(batch.response.records)]


async def test_records_arrive_as_they_are_stored_within_credit(
    served: tuple[BrokerApp, grpc.aio.Channel],
) -> None:
    app, ch = served
    await append(app, 3)
    call = open_stream(ch)
    await call.write(
        pb.DeliverRequest(group="g", client_id="c1", subscribe=[subscribe(1, 0, 0, 2)])
    )
    [b] = (await read(call)).batches
    assert (b.sub, b.response.status, offsets(b), b.response.next_offset) == (
        1,
        pb.PULL_FOUND,
        [0, 1],
        2,
    )
    await call.write(
        pb.DeliverRequest(
            credit=[pb.DeliverCredit(sub=1, messages=10)],
            commit=[pb.QueueOffset(topic="T", queue_id=0, offset=2)],
        )
    )
    [b] = (await read(call)).batches
    assert offsets(b) == [2]
    assert app.offsets is not None
    assert app.offsets.committed("g", "T", 0) == 2
    started = time.monotonic()
    await append(app, 1)  # idle: pushed when it lands, no pull asked for it
    [b] = (await read(call)).batches
    assert offsets(b) == [3]
    assert time.monotonic() - started < 2.0
    await call.done_writing()
    assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK


async def test_a_bad_queue_gets_a_status_and_the_stream_goes_on(
    served: tuple[BrokerApp, grpc.aio.Channel],
) -> None:
    app, ch = served
    call = open_stream(ch)
    bad = pb.DeliverSubscribe(sub=2, topic="Nope", queue_id=0, credit_messages=5)
    await call.write(pb.DeliverRequest(group="g", client_id="c1", subscribe=[subscribe(1, 1), bad]))
    [b] = (await read(call)).batches
    assert b.sub == 2
    assert b.status.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "Nope" in b.status.message
    await append(app, 1, queue_id=1)
    [b] = (await read(call)).batches
    assert (b.sub, offsets(b)) == (1, [0])
    call.cancel()


async def test_a_bad_request_ends_the_stream_with_its_error(
    served: tuple[BrokerApp, grpc.aio.Channel],
) -> None:
    _, ch = served
    call = open_stream(ch)
    await call.write(pb.DeliverRequest(group="", client_id="c1"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(call.read(), 5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    call = open_stream(ch)
    await call.write(pb.DeliverRequest(group="g", client_id="c1"))
    await call.write(pb.DeliverRequest(group="other"))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(call.read(), 5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "group" in (caught.value.details() or "")


async def test_the_brokers_stop_ends_every_stream_at_once(tmp_path: Path) -> None:
    async with broker(tmp_path) as (app, ch):
        calls = [open_stream(ch) for _ in range(3)]
        for i, call in enumerate(calls):
            await call.write(
                pb.DeliverRequest(group="g", client_id=f"c{i}", subscribe=[subscribe(1, 0)])
            )
        delivery = app.delivery
        assert delivery is not None
        await eventually(lambda: delivery.sessions >= 3, 5, "three delivery sessions")
        started = time.monotonic()
        await app.stop()
        assert time.monotonic() - started < 1.5  # under the 2 s grace: nothing waited it out
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await asyncio.wait_for(call.read(), 5)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert delivery.sessions == 0
