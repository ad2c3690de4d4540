"""NameServerDirectory: the live brokers as the nameservers know them, through real gRPC servers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc.aio
import pytest

from apogee.common.errors import UnavailableError
from apogee.rpc.directory import NameServerDirectory
from apogee.rpc.server import GrpcServer
from apogee.v1 import nameserver_pb2, nameserver_pb2_grpc

pytestmark = pytest.mark.integration

#: A port nothing listens on (connections are refused at once).
NOBODY = "127.0.0.1:1"


class ClusterInfo(nameserver_pb2_grpc.NameServerServicer):
    def __init__(self, brokers: list[nameserver_pb2.BrokerInfo]) -> None:
        self.brokers = brokers

    async def GetClusterInfo(
        self,
        request: nameserver_pb2.GetClusterInfoRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> nameserver_pb2.GetClusterInfoResponse:
        return nameserver_pb2.GetClusterInfoResponse(brokers=self.brokers)


def broker(name: str, address: str, heartbeat_ms: int, cluster: str = "east") -> Any:
    return nameserver_pb2.BrokerInfo(
        cluster=cluster, broker_name=name, address=address, last_heartbeat_ms=heartbeat_ms
    )


@asynccontextmanager
async def nameserver(brokers: list[nameserver_pb2.BrokerInfo]) -> AsyncIterator[str]:
    srv = GrpcServer("127.0.0.1:0", "nameserver")
    servicer = ClusterInfo(brokers)  # type: ignore[abstract]  # only GetClusterInfo is called
    nameserver_pb2_grpc.add_NameServerServicer_to_server(servicer, srv.server)
    port = await srv.start(["apogee.v1.NameServer"])
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await srv.stop(1.0)


async def test_the_union_of_every_nameserver_with_the_latest_heartbeat_winning() -> None:
    async with (
        nameserver([broker("a", "a-old:10911", 100), broker("b", "b:10911", 100)]) as first,
        nameserver([broker("a", "a-new:10911", 200), broker("c", "c:10911", 50, "west")]) as sec,
    ):
        directory = NameServerDirectory([first, sec], timeout_s=5)
        try:
            assert await directory.brokers() == {
                "east/a": "a-new:10911",
                "east/b": "b:10911",
                "west/c": "c:10911",
            }
        finally:
            await directory.close()


async def test_a_nameserver_that_does_not_answer_is_left_out() -> None:
    async with nameserver([broker("a", "a:10911", 100)]) as up:
        directory = NameServerDirectory([NOBODY, up], timeout_s=5)
        try:
            assert await directory.brokers() == {"east/a": "a:10911"}
        finally:
            await directory.close()


async def test_no_nameserver_answering_is_unavailable_and_names_them() -> None:
    directory = NameServerDirectory([NOBODY, "127.0.0.1:2"], timeout_s=5)
    try:
        with pytest.raises(UnavailableError) as caught:
            await directory.brokers()
        assert "every nameserver (127.0.0.1:1;127.0.0.1:2)" in str(caught.value)
        assert caught.value.kind.retriable
    finally:
        await directory.close()
