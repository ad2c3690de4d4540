"""SendStream and PullStream: unary calls multiplexed on one stream (``apogee.rpc.mux``), against
a real broker over gRPC. Answers find their requests by id, one slow request holds back no other,
a bad request fails alone, a stopping broker answers what it read, and a client falls back to
unary calls when the broker has no stream methods."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from apogee.common.errors import ApogeeError, InvalidArgumentError, UnavailableError
from apogee.rpc.errors import call as unary_call
from apogee.rpc.mux import MuxClient
from apogee.testkit.broker import decode_records, running_broker, small_settings
from apogee.v1 import broker_pb2, broker_pb2_grpc, common_pb2, consumer_pb2
from apogee_broker.app import BrokerApp

pytestmark = pytest.mark.integration

SEND_STREAM = "/apogee.v1.Broker/SendStream"
PULL_STREAM = "/apogee.v1.Consumer/PullStream"


@dataclass
class Streams:
    app: BrokerApp
    channel: grpc.aio.Channel
    sends: MuxClient[broker_pb2.SendMessagesResponse]
    pulls: MuxClient[consumer_pb2.PullResponse]

    async def send(self, bodies: list[bytes], queue_id: int = 0) -> broker_pb2.SendMessagesResponse:
        request = send_request(bodies, queue_id)
        return await self.sends.call(request.SerializeToString(), 5.0, no_unary)

    async def pull(self, timeout: float = 5.0, **fields: Any) -> consumer_pb2.PullResponse:
        fields.setdefault("group", "g")
        fields.setdefault("client_id", "c1")
        fields.setdefault("topic", "T")
        fields.setdefault("max_messages", 32)
        request = consumer_pb2.PullRequest(**fields)
        return await self.pulls.call(request.SerializeToString(), timeout, no_unary)


async def no_unary() -> Any:
    raise AssertionError("the broker has the stream methods: no unary fallback expected")


def send_request(bodies: list[bytes], queue_id: int = 0) -> broker_pb2.SendMessagesRequest:
    return broker_pb2.SendMessagesRequest(
        messages=[
            common_pb2.Message(topic="T", body=b, queue_id=queue_id, unique_id=f"U{b.hex()}")
            for b in bodies
        ]
    )


@contextlib.asynccontextmanager
async def serving(service: str, methods: dict[str, Any]) -> AsyncIterator[grpc.aio.Channel]:
    """A bare gRPC server with only ``methods`` of ``service``, and a channel to it."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(None)


@pytest.fixture
async def streams(tmp_path: Path) -> AsyncIterator[Streams]:
    async with (
        running_broker(small_settings(tmp_path / "b", broker_name="b1")) as app,
        grpc.aio.insecure_channel(app.address) as channel,
    ):
        await broker_pb2_grpc.BrokerAdminStub(channel).PutTopic(
            broker_pb2.PutTopicRequest(
                topic=common_pb2.TopicConfig(name="T", read_queues=4, write_queues=4, perm=6)
            ),
            timeout=5,
        )
        sends = MuxClient(
            channel, SEND_STREAM, broker_pb2.SendStreamResponse.FromString, "broker b1"
        )
        pulls = MuxClient(
            channel, PULL_STREAM, consumer_pb2.PullStreamResponse.FromString, "broker b1"
        )
        try:
            yield Streams(app, channel, sends, pulls)
        finally:
            await sends.close()
            await pulls.close()


async def test_concurrent_sends_on_one_stream_each_get_their_own_answer(streams: Streams) -> None:
    bodies = [[f"m{i}-{j}".encode() for j in range(i % 3 + 1)] for i in range(60)]
    answers = await asyncio.gather(*(streams.send(b, queue_id=i % 4) for i, b in enumerate(bodies)))
    for sent, answer in zip(bodies, answers, strict=True):
        assert [r.unique_id for r in answer.results] == [f"U{b.hex()}" for b in sent]
        assert all(r.status.code == 0 for r in answer.results)
    stored: list[bytes] = []
    for queue_id in range(4):
        resp = await streams.pull(queue_id=queue_id, offset=0, max_messages=1000)
        stored += [m.body for m in decode_records(resp.records)]
    assert sorted(stored) == sorted(b for batch in bodies for b in batch)  # each exactly once


async def test_a_held_pull_holds_back_no_other_request_and_wakes_on_a_send(
    streams: Streams,
) -> None:
    held = asyncio.ensure_future(streams.pull(queue_id=1, offset=0, hold_ms=10_000, timeout=15))
    # another pull on the same stream, not held, and a send: both answered while the first waits
    other = await asyncio.wait_for(streams.pull(queue_id=2, offset=0), 3)
    assert other.status == consumer_pb2.PULL_NO_NEW_MESSAGE
    assert not held.done()
    started = time.monotonic()
    await asyncio.wait_for(streams.send([b"wake"], queue_id=1), 3)
    woken = await asyncio.wait_for(held, 3)
    assert woken.status == consumer_pb2.PULL_FOUND
    assert [m.body for m in decode_records(woken.records)] == [b"wake"]
    assert time.monotonic() - started < 2.0  # answered on arrival, not at the hold's end


async def test_a_bad_request_fails_alone_and_the_stream_keeps_serving(streams: Streams) -> None:
    ok = asyncio.ensure_future(streams.pull(queue_id=0, offset=0, hold_ms=5_000))
    with pytest.raises(InvalidArgumentError, match="group"):
        await streams.pull(group="", queue_id=0, offset=0)
    with pytest.raises(ApogeeError, match="queue_id"):
        await streams.pull(queue_id=99, offset=0)
    await streams.send([b"after"])
    assert (await asyncio.wait_for(ok, 3)).status == consumer_pb2.PULL_FOUND


async def test_a_request_not_answered_in_time_fails_with_the_deadline() -> None:
    """A server that reads requests and never answers: each call ends at its own timeout."""

    async def silent(requests: AsyncIterator[bytes], context: Any) -> None:
        async for _ in requests:
            pass

    handler: Any = grpc.stream_stream_rpc_method_handler(silent)
    async with serving("apogee.v1.Consumer", {"PullStream": handler}) as channel:
        mux = MuxClient(
            channel, PULL_STREAM, consumer_pb2.PullStreamResponse.FromString, "broker s"
        )
        for _ in range(2):  # the stream stays usable after a request timed out
            started = time.monotonic()
            with pytest.raises(ApogeeError) as caught:
                await mux.call(b"", 0.3, no_unary)
            assert caught.value.kind.name == "DEADLINE_EXCEEDED"
            assert "broker s did not answer" in str(caught.value)
            assert 0.3 <= time.monotonic() - started < 2.0
        await mux.close()


async def test_the_broker_caps_a_held_pull_by_the_requests_timeout(streams: Streams) -> None:
    started = time.monotonic()
    resp = await streams.pull(queue_id=3, offset=0, hold_ms=30_000, timeout=1.5)
    assert resp.status == consumer_pb2.PULL_NO_NEW_MESSAGE
    assert time.monotonic() - started < 1.5


async def test_a_stopping_broker_answers_held_pulls_then_ends_the_streams(
    streams: Streams,
) -> None:
    held = asyncio.ensure_future(streams.pull(queue_id=0, offset=0, hold_ms=20_000, timeout=25))
    await streams.send([b"x"], queue_id=2)  # both streams open
    await asyncio.sleep(0)
    started = time.monotonic()
    await streams.app.stop()
    assert time.monotonic() - started < 5.0  # the streams did not keep the grace period busy
    assert (await asyncio.wait_for(held, 5)).status == consumer_pb2.PULL_NO_NEW_MESSAGE
    with pytest.raises(UnavailableError) as caught:
        await streams.send([b"too late"])
    assert caught.value.retriable


async def test_closing_the_client_fails_what_is_pending_at_once(streams: Streams) -> None:
    held = asyncio.ensure_future(streams.pull(queue_id=0, offset=0, hold_ms=20_000, timeout=25))
    await streams.send([b"x"], queue_id=2)
    await streams.pulls.close()
    with pytest.raises(UnavailableError, match="closed"):
        await asyncio.wait_for(held, 3)
    with pytest.raises(UnavailableError, match="closed"):
        await streams.pull(queue_id=0, offset=0)


async def test_a_broker_without_stream_methods_is_called_unary(streams: Streams) -> None:
    """An older broker (only the unary SendMessages) behind a proxy: the client notices the
    missing method once and sends unary from then on."""
    forward: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = streams.channel.unary_unary(
        "/apogee.v1.Broker/SendMessages",
        request_serializer=None,
        response_deserializer=None,
    )

    async def send_messages(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await forward(request, timeout=5)

    handler: Any = grpc.unary_unary_rpc_method_handler(send_messages)
    async with serving("apogee.v1.Broker", {"SendMessages": handler}) as channel:
        mux = MuxClient(
            channel, SEND_STREAM, broker_pb2.SendStreamResponse.FromString, "old broker"
        )
        unary: grpc.aio.UnaryUnaryMultiCallable[bytes, broker_pb2.SendMessagesResponse]
        unary = channel.unary_unary(
            "/apogee.v1.Broker/SendMessages",
            request_serializer=None,
            response_deserializer=broker_pb2.SendMessagesResponse.FromString,
        )
        used: list[str] = []

        def fallback(data: bytes) -> Callable[[], Awaitable[broker_pb2.SendMessagesResponse]]:
            async def go() -> broker_pb2.SendMessagesResponse:
                used.append("unary")
                return await unary_call("old broker", unary(data, timeout=5))

            return go

        for body in (b"first", b"second"):
            data = send_request([body]).SerializeToString()
            answer = await mux.call(data, 5.0, fallback(data))
            assert answer.results[0].unique_id == f"U{body.hex()}"
        assert not mux.supported
        assert used == ["unary", "unary"]
        await mux.close()
