"""Errors cross the wire intact: kind, sentence and retriability, through a real gRPC server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest

from apogee.common.errors import (
    ApogeeError,
    InvalidTopicError,
    UnavailableError,
    UnknownTopicError,
)
from apogee.rpc.errors import OK, call, from_status, rpc_errors, to_status
from apogee.rpc.server import GrpcServer, check_health
from apogee.v1 import nameserver_pb2, nameserver_pb2_grpc

pytestmark = pytest.mark.integration


class Failing(nameserver_pb2_grpc.NameServerServicer):
    @rpc_errors
    async def GetRoute(
        self, request: nameserver_pb2.GetRouteRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> nameserver_pb2.GetRouteResponse:
        if request.topic == "bad name":
            raise InvalidTopicError(
                value=request.topic, rule="has a character outside [%|a-zA-Z0-9_-]"
            )
        if request.topic == "boom":
            raise RuntimeError("a bug")
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


async def test_a_bug_becomes_internal_and_the_server_goes_on(server: str) -> None:
    err = await _route(server, "boom")
    assert err.kind.name == "INTERNAL"
    assert "RuntimeError: a bug" in str(err)
    assert isinstance(await _route(server, "Nope"), UnknownTopicError)
    assert await check_health(server, 5)


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
