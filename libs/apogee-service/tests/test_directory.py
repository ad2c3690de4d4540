"""NameServerDirectory: the live brokers as the nameservers know them, through real gRPC servers;
DirectoryWorkers: one worker per broker of that list, following it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc.aio
import pytest

from apogee.common.errors import UnavailableError
from apogee.rpc.server import GrpcServer
from apogee.service import directory as directory_module
from apogee.service.directory import DirectoryWorkers, NameServerDirectory
from apogee.service.workers import BrokerWorker
from apogee.testkit.ports import free_port
from apogee.testkit.waiting import eventually
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
async def nameserver(
    brokers: list[nameserver_pb2.BrokerInfo], listen: str = "127.0.0.1:0"
) -> AsyncIterator[str]:
    srv = GrpcServer(listen, "nameserver")
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


class Session:
    """A session that starts at once and never fails."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
        self.stopped = False

    async def start(self) -> None:
        pass

    async def stop(self, grace_s: float) -> None:
        self.stopped = True


def following(nameservers: list[str], refresh_s: float) -> DirectoryWorkers[Session]:
    def new_worker(broker: str, address: str) -> BrokerWorker[Session]:
        return BrokerWorker(broker, address, Session)

    return DirectoryWorkers(nameservers, 5.0, refresh_s, new_worker, grace_s=1.0)


def addresses(workers: DirectoryWorkers[Session]) -> dict[str, str]:
    return {name: w.address for name, w in workers.workers.items()}


async def test_workers_follow_the_brokers_and_are_kept_while_no_nameserver_answers(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="apogee.service.directory")
    listen = f"127.0.0.1:{free_port()}"
    known = [broker("a", "a:1", 100)]
    workers = following([listen], refresh_s=0.05)
    refreshes: list[None] = []
    refresh = workers.refresh

    async def counted() -> None:
        await refresh()
        refreshes.append(None)

    monkeypatch.setattr(workers, "refresh", counted)
    try:
        async with nameserver(known, listen):
            await workers.start()
            assert addresses(workers) == {"east/a": "a:1"}

            async def b_served() -> bool:
                return addresses(workers) == {"east/a": "a:1", "east/b": "b:1"}

            known.append(broker("b", "b:1", 100))
            await eventually(b_served, 5, "a worker for the new broker")

        async def warned() -> bool:
            return "cannot read the brokers (keeping 2)" in caplog.text

        await eventually(warned, 5, "the nameserver's silence noticed")
        silent = len(refreshes)
        await eventually(lambda: len(refreshes) >= silent + 3, 5, "three more refreshes")
        assert addresses(workers) == {"east/a": "a:1", "east/b": "b:1"}
        assert caplog.text.count("cannot read the brokers") == 1

        async with nameserver([broker("b", "b:2", 200)], listen):

            async def moved() -> bool:
                return addresses(workers) == {"east/b": "b:2"}

            await eventually(moved, 5, "the workers matched to the nameserver again")
            assert "nameservers answer again" in caplog.text
    finally:
        await workers.stop()
    assert workers.workers == {}


async def test_while_no_broker_is_known_the_list_is_read_every_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(directory_module, "EMPTY_REFRESH_S", 0.05)
    known: list[nameserver_pb2.BrokerInfo] = []
    async with nameserver(known) as ns:
        workers = following([ns], refresh_s=30.0)
        await workers.start()
        try:
            assert workers.workers == {}
            known.append(broker("a", "a:1", 100))

            async def found() -> bool:
                return addresses(workers) == {"east/a": "a:1"}

            await eventually(found, 5, "the first broker found before the 30 s refresh")
        finally:
            await workers.stop()
