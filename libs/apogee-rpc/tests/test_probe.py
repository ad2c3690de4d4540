"""The health probe of the container images: SERVING is status 0, anything else status 1, with
one line saying what was answered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from grpc_health.v1 import health_pb2

from apogee.rpc import probe
from apogee.rpc.server import GrpcServer

pytestmark = pytest.mark.integration


@pytest.fixture
async def server() -> AsyncIterator[GrpcServer]:
    srv = GrpcServer("127.0.0.1:0", "test")
    await srv.start(["apogee.test.Process"])
    try:
        yield srv
    finally:
        await srv.stop(1.0)


async def test_a_serving_server_and_service_answer_status_0(
    server: GrpcServer, capsys: pytest.CaptureFixture[str]
) -> None:
    address = f"127.0.0.1:{server.port}"
    assert await asyncio.to_thread(probe.main, [address]) == 0
    assert capsys.readouterr().out == f"{address} (overall): SERVING\n"
    assert await asyncio.to_thread(probe.main, [address, "apogee.test.Process"]) == 0
    assert capsys.readouterr().out == f"{address} apogee.test.Process: SERVING\n"


async def test_not_serving_an_unknown_service_and_no_server_answer_status_1(
    server: GrpcServer, capsys: pytest.CaptureFixture[str]
) -> None:
    address = f"127.0.0.1:{server.port}"
    await server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert await asyncio.to_thread(probe.main, [address]) == 1
    assert capsys.readouterr().out == f"{address} (overall): NOT_SERVING\n"
    assert await asyncio.to_thread(probe.main, [address, "no.such.Service"]) == 1
    assert capsys.readouterr().out == f"{address} no.such.Service: NOT_FOUND\n"
    ok, line = await asyncio.to_thread(probe.probe, "127.0.0.1:1", "", 1.0)
    assert not ok
    assert line == "127.0.0.1:1 (overall): UNAVAILABLE"
