"""Errors cross the wire intact: kind, sentence and retriability, through a real gRPC server."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest

from apogee.common.errors import (
    ApogeeError,
    DeadlineExceededError,
    InvalidArgumentError,
    InvalidTopicError,
    UnavailableError,
    UnknownTopicError,
)
from apogee.rpc.errors import (
    KIND_KEY,
    MAX_DETAILS_WIRE,
    OK,
    bounded,
    call,
    first_request,
    from_rpc_error,
    from_status,
    rpc_errors,
    to_status,
)
from apogee.rpc.malformed import MalformedRequests, _Malformed
from apogee.rpc.mux import MuxServer
from apogee.rpc.server import GrpcServer, check_health
from apogee.v1 import broker_pb2, common_pb2, nameserver_pb2, nameserver_pb2_grpc

pytestmark = pytest.mark.integration


class Failing(nameserver_pb2_grpc.NameServerServicer):
    @rpc_errors
    async def GetRoute(
        self, request: nameserver_pb2.GetRouteRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> nameserver_pb2.GetRouteResponse:
        if request.topic == "bad name" or request.topic.startswith("long "):
            raise InvalidTopicError(
                value=request.topic, rule="has a character outside [%|a-zA-Z0-9_-]"
            )
        if request.topic == "boom":
            raise RuntimeError("a bug")
        if request.topic == "core":  # what gRPC itself answers when a peer dies mid-call
            await context.abort(grpc.StatusCode.INTERNAL, "Internal error from Core")
        if request.topic == "reset":  # a stream the server ended under the call
            await context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
        raise UnknownTopicError(topic=request.topic, detail="has no route")


@pytest.fixture
async def server() -> AsyncIterator[str]:
    srv = GrpcServer("127.0.0.1:0", "test")
    servicer = Failing()  # type: ignore[abstract]  # only GetRoute is called
    nameserver_pb2_grpc.add_NameServerServicer_to_server(servicer, srv.server)
    port = await srv.start(["apogee.v1.NameServer"])
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await srv.stop(1.0)


async def _route(address: str, topic: str) -> ApogeeError:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = nameserver_pb2_grpc.NameServerStub(channel)
        with pytest.raises(ApogeeError) as caught:
            await call(
                "nameserver", stub.GetRoute(nameserver_pb2.GetRouteRequest(topic=topic), timeout=5)
            )
        return caught.value


async def test_errors_keep_their_kind_and_sentence(server: str) -> None:
    err = await _route(server, "bad name")
    assert isinstance(err, InvalidTopicError)
    assert str(err) == "topic 'bad name': has a character outside [%|a-zA-Z0-9_-]"
    assert err.kind.code == "INVALID_ARGUMENT"
    err = await _route(server, "Nope")
    assert isinstance(err, UnknownTopicError)
    assert str(err) == "topic 'Nope' has no route"


@pytest.mark.parametrize("value", ["x" * 20_000, "漢\x01🚀" * 1_000])
async def test_a_sentence_quoting_a_long_value_is_cut_in_the_middle_not_lost(
    server: str, value: str
) -> None:
    """Regression (found by e2e/test_fuzz.py): a refusal quoting a 10,000-character name made
    trailers over gRPC's 8 KiB limit; the client got RESOURCE_EXHAUSTED ("received metadata
    size exceeds soft limit") instead of the sentence and its kind."""
    async with grpc.aio.insecure_channel(server) as channel:
        stub = nameserver_pb2_grpc.NameServerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.GetRoute(nameserver_pb2.GetRouteRequest(topic=f"long {value}"), timeout=5)
    err = caught.value
    details = err.details() or ""
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, details
    assert (KIND_KEY, "INVALID_TOPIC") in tuple(err.trailing_metadata() or ())
    assert details.startswith("topic 'long ")
    assert details.endswith("': has a character outside [%|a-zA-Z0-9_-]")
    assert "characters cut ...]" in details


def test_bounded_keeps_short_sentences_and_cuts_long_ones_to_the_limit() -> None:
    assert bounded("topic 'T': must not be empty") == "topic 'T': must not be empty"
    for text in ("a" * 5000, "%" * 5000, "é" * 3000, "🚀\n" * 2000, "a" * 4096):
        out = bounded(text, 4096)
        wire = sum(1 if " " <= c <= "~" and c != "%" else 3 * len(c.encode()) for c in out)
        assert wire <= MAX_DETAILS_WIRE
        if out != text:
            note = re.search(r"\[\.\.\. (\d+) characters cut \.\.\.\]", out)
            assert note is not None
            head, tail = out[: note.start()], out[note.end() :]
            assert text.startswith(head)
            assert text.endswith(tail)
            assert len(head) + int(note.group(1)) + len(tail) == len(text)


async def test_a_bug_becomes_internal_and_the_server_goes_on(server: str) -> None:
    err = await _route(server, "boom")
    assert err.kind.name == "INTERNAL"
    assert "RuntimeError: a bug" in str(err)
    assert isinstance(await _route(server, "Nope"), UnknownTopicError)
    assert await check_health(server, 5)


async def test_a_status_of_grpcs_own_is_a_broken_call_and_retriable(server: str) -> None:
    """INTERNAL without Apogee's kind is not a bug report of the server's (those carry their
    kind) but the transport failing: a send that met it is tried again, never failed."""
    err = await _route(server, "core")
    assert isinstance(err, UnavailableError)
    assert err.retriable
    assert "the call broke (INTERNAL: Internal error from Core)" in str(err)


async def test_a_call_the_server_cancelled_is_a_broken_call_and_retriable(server: str) -> None:
    """CANCELLED without Apogee's kind is the server's gRPC ending the stream (seen from a
    broker whose server was stopping as it stepped down), not the caller giving up: that ends
    in asyncio.CancelledError, not a status. Regression (found by
    e2e/test_replication_partition.py): it was an InternalError, so a send to a broker that was
    stepping down failed where it should have been tried again."""
    err = await _route(server, "reset")
    assert isinstance(err, UnavailableError)
    assert err.retriable
    assert "the call broke (CANCELLED: CANCELLED)" in str(err)


async def test_an_unreachable_peer_is_unavailable_and_retriable() -> None:
    async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
        stub = nameserver_pb2_grpc.NameServerStub(channel)
        with pytest.raises(UnavailableError) as caught:
            await call(
                "nameserver 127.0.0.1:1",
                stub.GetRoute(nameserver_pb2.GetRouteRequest(topic="T"), timeout=5),
            )
    assert caught.value.retriable
    assert str(caught.value).startswith("nameserver 127.0.0.1:1 is unavailable")
    assert not await check_health("127.0.0.1:1", 1)


def test_status_round_trip() -> None:
    err = InvalidTopicError(value="", rule="must not be empty")
    back = from_status(to_status(err))
    assert isinstance(back, InvalidTopicError)
    assert str(back) == "topic '': must not be empty"
    assert back.retriable is False
    assert from_status(OK) is None


async def _echo_stream(
    requests: AsyncIterator[nameserver_pb2.GetRouteRequest],
    context: grpc.aio.ServicerContext[Any, Any],
) -> AsyncIterator[nameserver_pb2.GetRouteResponse]:
    async for _ in requests:
        yield nameserver_pb2.GetRouteResponse()


async def test_a_request_that_does_not_parse_is_invalid_and_logged_once_a_minute(
    server: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Unparsable bytes (a fuzzer's) get INVALID_ARGUMENT with Apogee's kind and protobuf's
    reason, never UNKNOWN and a traceback per call; the server goes on serving."""
    async with grpc.aio.insecure_channel(server) as channel:
        raw: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/apogee.v1.NameServer/GetRoute"
        )
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await raw(b"\xff\xff\xff", timeout=5)
            err = from_rpc_error(caught.value, "nameserver")
            assert isinstance(err, InvalidArgumentError)
            assert not err.retriable
            assert str(err).startswith(
                "request: does not parse as the method's message: Error parsing message with "
                "type 'apogee.v1.GetRouteRequest'"
            )
    assert isinstance(await _route(server, "Nope"), UnknownTopicError)
    lines = [r for r in caplog.records if "does not parse" in r.getMessage()]
    assert [r.levelname for r in lines] == ["WARNING"]  # one line for three refusals
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_stream_message_that_does_not_parse_ends_the_stream_as_invalid() -> None:
    srv = GrpcServer("127.0.0.1:0", "test")
    srv.server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Echo",
                {
                    "Chat": grpc.stream_stream_rpc_method_handler(
                        _echo_stream,
                        nameserver_pb2.GetRouteRequest.FromString,
                        nameserver_pb2.GetRouteResponse.SerializeToString,
                    )
                },
            ),
        )
    )
    port = await srv.start([])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            chat: grpc.aio.StreamStreamMultiCallable[bytes, bytes] = channel.stream_stream(
                "/test.Echo/Chat"
            )
            call = chat()
            await call.write(nameserver_pb2.GetRouteRequest(topic="T").SerializeToString())
            assert await call.read() == b""  # an empty GetRouteResponse: the stream works
            await call.write(b"\xff\xff\xff")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call.read()
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "does not parse as the method's message" in (caught.value.details() or "")
    finally:
        await srv.stop(1.0)


async def test_a_stream_whose_first_request_does_not_come_ends_naming_what_was_awaited() -> None:
    """A server stream waits for its first request a bounded time; a client that closes its
    side first ends the stream quietly."""

    async def opening(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        first = await first_request(requests, context, "the first request of Opening", 0.2)
        yield b"none" if first is None else b"got " + first

    srv = await _serve(
        "/test.Streams/Opening", grpc.stream_stream_rpc_method_handler(opening, bytes, bytes)
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            open_: grpc.aio.StreamStreamMultiCallable[bytes, bytes] = channel.stream_stream(
                "/test.Streams/Opening"
            )
            silent = open_()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await asyncio.wait_for(silent.read(), 5)
            err = from_rpc_error(caught.value, "the server")
            assert isinstance(err, DeadlineExceededError)
            assert "the first request of Opening" in str(err)

            closed = open_()
            await closed.done_writing()
            assert await asyncio.wait_for(closed.read(), 5) == b"none"

            talking = open_()
            await talking.write(b"hello")
            assert await asyncio.wait_for(talking.read(), 5) == b"got hello"
    finally:
        await srv.stop(1.0)


async def _serve(method: str, handler: grpc.RpcMethodHandler[Any, Any]) -> GrpcServer:
    srv = GrpcServer("127.0.0.1:0", "test")
    service, _, name = method.strip("/").partition("/")
    srv.server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service, {name: handler}),)
    )
    await srv.start([])
    return srv


class WritingContext:
    """A servicer context whose writes take a while; it notes what an abort found."""

    def __init__(self) -> None:
        self.writing = False
        self.written: list[Any] = []
        self.aborts: list[tuple[grpc.StatusCode, str, bool]] = []

    async def write(self, message: Any) -> None:
        self.writing = True
        await asyncio.sleep(0.05)
        self.writing = False
        self.written.append(message)

    async def abort(self, code: grpc.StatusCode, details: str, **kwargs: Any) -> None:
        self.aborts.append((code, details, self.writing))
        raise grpc.aio.AbortError()


async def test_garbage_after_a_request_on_a_multiplexed_stream_waits_for_the_answer_written() -> (
    None
):
    """Regression: the refusal of a malformed message was sent from inside the stream's
    iterator while MuxServer wrote an answer from another task; gRPC's core refused the second
    operation (TOO_MANY_OPERATIONS, an ERROR with a traceback) and the call hung until its
    deadline. Now the answer being written is written first, then the call ends INVALID_ARGUMENT
    (once)."""
    mux = MuxServer("test")

    async def handle(
        request: broker_pb2.SendMessagesRequest, timeout: float | None
    ) -> broker_pb2.SendMessagesResponse:
        return broker_pb2.SendMessagesResponse(broker_name="b")

    def respond(
        request_id: int,
        response: broker_pb2.SendMessagesResponse | None,
        status: common_pb2.Status | None,
    ) -> broker_pb2.SendStreamResponse:
        return broker_pb2.SendStreamResponse(id=request_id, response=response, status=status)

    async def chat(
        requests: AsyncIterator[broker_pb2.SendStreamRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        await mux.serve(requests, context, handle, respond)

    async def requests() -> AsyncIterator[Any]:
        yield broker_pb2.SendStreamRequest(id=1)
        await asyncio.sleep(0.01)  # the answer to request 1 is being written now
        yield _Malformed("Wire format was corrupt")

    wrapped = MalformedRequests()._wrap(
        grpc.stream_stream_rpc_method_handler(chat, broker_pb2.SendStreamRequest.FromString),
        "/apogee.v1.Broker/SendStream",
    )
    behavior: Any = wrapped.stream_stream  # an async handler; the stubs know sync ones only
    ctx = WritingContext()
    with pytest.raises(grpc.aio.AbortError):
        await behavior(requests(), ctx)
    assert [m.id for m in ctx.written] == [1]
    assert ctx.aborts == [
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "request: does not parse as the method's message: Wire format was corrupt",
            False,
        )
    ]


async def test_a_handler_that_swallows_the_refusal_still_ends_the_call_as_invalid() -> None:
    async def count(
        requests: AsyncIterator[nameserver_pb2.GetRouteRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> nameserver_pb2.ListTopicsResponse:
        topics = []
        try:
            async for r in requests:
                topics.append(r.topic)
        except Exception:  # a handler that treats any failure of its stream as its end
            pass
        return nameserver_pb2.ListTopicsResponse(topics=topics)

    srv = await _serve(
        "/test.Count/Up",
        grpc.stream_unary_rpc_method_handler(
            count,
            nameserver_pb2.GetRouteRequest.FromString,
            nameserver_pb2.ListTopicsResponse.SerializeToString,
        ),
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            up: grpc.aio.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(
                "/test.Count/Up"
            )
            good = nameserver_pb2.GetRouteRequest(topic="T").SerializeToString()
            assert await up(iter([good, good]), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await up(iter([good, b"\xff\xff\xff"]), timeout=5)
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await srv.stop(1.0)


async def test_refusals_are_logged_again_after_a_quiet_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    interceptor = MalformedRequests(clock=lambda: now[0])

    class Ctx:
        async def abort(self, *args: Any, **kwargs: Any) -> None:
            raise grpc.aio.AbortError()

    refuse = interceptor._refuser("/m")
    for at in (0.0, 30.0, 59.0, 61.0):
        now[0] = at
        with pytest.raises(grpc.aio.AbortError):
            await refuse(Ctx(), _Malformed("bad"))  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records if "does not parse" in r.getMessage()]
    assert lines == [
        "/m: refused a request that does not parse: bad",
        "/m: refused a request that does not parse (2 more since the last line): bad",
    ]
