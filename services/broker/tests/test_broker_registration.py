"""Registration with real nameservers: at start, after a topic change, every heartbeat, and an
unregistration at stop; a nameserver that does not answer delays nobody. A heartbeat with
nothing changed carries no topics, except to a nameserver that does not say it takes that."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from apogee.rpc.server import GrpcServer
from apogee.testkit.broker import running_broker, small_settings
from apogee.testkit.ports import free_port
from apogee.testkit.processes import ServiceProcess
from apogee.testkit.waiting import eventually
from apogee.v1 import broker_pb2, broker_pb2_grpc, common_pb2, nameserver_pb2, nameserver_pb2_grpc
from apogee_broker.app import BrokerApp
from apogee_nameserver.app import NameServerApp
from apogee_nameserver.core.registry import RouteRegistry
from apogee_nameserver.servicers.nameserver import NameServerServicer
from apogee_nameserver.settings import NameServerSettings

pytestmark = pytest.mark.integration


class RecordingNameServer(nameserver_pb2_grpc.NameServerServicer):
    """A nameserver that records what brokers tell it; with ``hang`` it never answers a
    registration (until released at teardown)."""

    def __init__(self, hang: bool = False) -> None:
        self.hang = hang
        self.release = asyncio.Event()
        self.registrations: list[nameserver_pb2.RegisterBrokerRequest] = []
        self.unregistrations: list[nameserver_pb2.UnregisterBrokerRequest] = []

    async def RegisterBroker(
        self, request: nameserver_pb2.RegisterBrokerRequest, context: Any
    ) -> nameserver_pb2.RegisterBrokerResponse:
        self.registrations.append(request)
        if self.hang:
            await self.release.wait()
        return nameserver_pb2.RegisterBrokerResponse(expiry_ms=120_000)

    async def UnregisterBroker(
        self, request: nameserver_pb2.UnregisterBrokerRequest, context: Any
    ) -> nameserver_pb2.UnregisterBrokerResponse:
        self.unregistrations.append(request)
        return nameserver_pb2.UnregisterBrokerResponse()

    async def GetRoute(
        self, request: nameserver_pb2.GetRouteRequest, context: Any
    ) -> nameserver_pb2.GetRouteResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "brokers do not ask for routes")
        raise AssertionError("abort returned")

    async def GetClusterInfo(
        self, request: nameserver_pb2.GetClusterInfoRequest, context: Any
    ) -> nameserver_pb2.GetClusterInfoResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "brokers do not ask for clusters")
        raise AssertionError("abort returned")

    async def ListTopics(
        self, request: nameserver_pb2.ListTopicsRequest, context: Any
    ) -> nameserver_pb2.ListTopicsResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "brokers do not list topics")
        raise AssertionError("abort returned")


class WatchedNameServer(nameserver_pb2_grpc.NameServerServicer):
    """A real nameserver (its servicer over a registry) that records each registration sent to
    it with the round of the broker's loop it came in (``round`` reads it); ``restart()`` gives
    it a fresh registry, as a restarted nameserver has."""

    def __init__(self) -> None:
        self.inner = NameServerServicer(RouteRegistry())
        self.round: Callable[[], int] = lambda: 0
        self.registrations: list[tuple[int, nameserver_pb2.RegisterBrokerRequest]] = []

    def restart(self) -> None:
        self.inner = NameServerServicer(RouteRegistry())

    async def RegisterBroker(
        self, request: nameserver_pb2.RegisterBrokerRequest, context: Any
    ) -> nameserver_pb2.RegisterBrokerResponse:
        self.registrations.append((self.round(), request))
        return await self.inner.RegisterBroker(request, context)

    async def UnregisterBroker(
        self, request: nameserver_pb2.UnregisterBrokerRequest, context: Any
    ) -> nameserver_pb2.UnregisterBrokerResponse:
        return await self.inner.UnregisterBroker(request, context)

    async def GetRoute(
        self, request: nameserver_pb2.GetRouteRequest, context: Any
    ) -> nameserver_pb2.GetRouteResponse:
        return await self.inner.GetRoute(request, context)

    async def GetClusterInfo(
        self, request: nameserver_pb2.GetClusterInfoRequest, context: Any
    ) -> nameserver_pb2.GetClusterInfoResponse:
        return await self.inner.GetClusterInfo(request, context)

    async def ListTopics(
        self, request: nameserver_pb2.ListTopicsRequest, context: Any
    ) -> nameserver_pb2.ListTopicsResponse:
        return await self.inner.ListTopics(request, context)


@pytest.fixture
async def watched() -> AsyncIterator[tuple[WatchedNameServer, str]]:
    servicer = WatchedNameServer()
    server = GrpcServer("127.0.0.1:0", "watched nameserver")
    nameserver_pb2_grpc.add_NameServerServicer_to_server(servicer, server.server)
    port = await server.start(["apogee.v1.NameServer"])
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@pytest.fixture
async def recording() -> AsyncIterator[tuple[RecordingNameServer, str]]:
    async for pair in _recording(hang=False):
        yield pair


@pytest.fixture
async def hanging() -> AsyncIterator[tuple[RecordingNameServer, str]]:
    async for pair in _recording(hang=True):
        yield pair


async def _recording(hang: bool) -> AsyncIterator[tuple[RecordingNameServer, str]]:
    servicer = RecordingNameServer(hang)
    server = GrpcServer("127.0.0.1:0", "recording nameserver")
    nameserver_pb2_grpc.add_NameServerServicer_to_server(servicer, server.server)
    port = await server.start(["apogee.v1.NameServer"])
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        servicer.release.set()
        await server.stop(0)


@pytest.fixture
async def nameservers() -> AsyncIterator[list[str]]:
    """Two real nameservers."""
    apps = [
        NameServerApp(NameServerSettings(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0"))
        for _ in range(2)
    ]
    ports = []
    try:
        for app in apps:
            ports.append(await app.start())
        yield [f"127.0.0.1:{p}" for p in ports]
    finally:
        for app in apps:
            await app.stop()


async def cluster_of(address: str) -> list[nameserver_pb2.BrokerInfo]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = nameserver_pb2_grpc.NameServerStub(ch)
        reply = await stub.GetClusterInfo(nameserver_pb2.GetClusterInfoRequest(), timeout=5)
        return list(reply.brokers)


async def route_of(address: str, topic: str) -> nameserver_pb2.GetRouteResponse | None:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = nameserver_pb2_grpc.NameServerStub(ch)
        try:
            return await stub.GetRoute(nameserver_pb2.GetRouteRequest(topic=topic), timeout=5)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise


async def put_topic(app: BrokerApp, name: str) -> None:
    async with grpc.aio.insecure_channel(app.address) as ch:
        await broker_pb2_grpc.BrokerAdminStub(ch).PutTopic(
            broker_pb2.PutTopicRequest(
                topic=common_pb2.TopicConfig(name=name, read_queues=4, write_queues=4, perm=6)
            ),
            timeout=5,
        )


async def test_registers_with_every_nameserver_and_unregisters_at_stop(
    tmp_path: Path, nameservers: list[str]
) -> None:
    settings = small_settings(tmp_path / "b", broker_name="b1", namesrv=";".join(nameservers))
    async with running_broker(settings) as app:
        for ns in nameservers:  # registration at start is done when start() returns
            [info] = await cluster_of(ns)
            assert (info.cluster, info.broker_name, info.address) == (
                "DefaultCluster",
                "b1",
                app.address,
            )
            route = await route_of(ns, "TBW102")
            assert route is not None
            assert [b.address for b in route.brokers] == [app.address]
            assert await route_of(ns, "Orders") is None

        await put_topic(app, "Orders")
        for ns in nameservers:

            async def has_orders(ns: str = ns) -> bool:
                route = await route_of(ns, "Orders")
                return route is not None and [q.write_queues for q in route.queues] == [4]

            await eventually(has_orders, 3, f"route of Orders at {ns}")
    for ns in nameservers:
        assert await cluster_of(ns) == []


async def test_heartbeats_repeat_and_carry_the_topics(
    tmp_path: Path, recording: tuple[RecordingNameServer, str]
) -> None:
    ns, address = recording
    settings = small_settings(
        tmp_path / "b",
        broker_name="b1",
        namesrv=address,
        heartbeat_interval_s=0.1,
        auto_create_topics=True,
    )
    async with running_broker(settings) as app:
        assert len(ns.registrations) >= 1
        first = ns.registrations[0]
        assert (first.cluster, first.broker_name, first.address) == (
            "DefaultCluster",
            "b1",
            app.address,
        )
        assert first.heartbeat_interval_ms == 100
        assert first.auto_create_topics
        assert "TBW102" in {t.name for t in first.topics}
        await eventually(lambda: len(ns.registrations) >= 4, 5, "three heartbeats")
        assert ns.unregistrations == []
    [bye] = ns.unregistrations
    assert (bye.cluster, bye.broker_name, bye.address) == ("DefaultCluster", "b1", app.address)
    count = len(ns.registrations)
    assert all(r.address == app.address for r in ns.registrations)
    # none may follow the unregistration: three heartbeats of another broker on the same loop
    # and interval, started after it, leave time for one of a heartbeat loop left running
    later = small_settings(
        tmp_path / "b2", broker_name="b2", namesrv=address, heartbeat_interval_s=0.1
    )
    async with running_broker(later):
        await eventually(
            lambda: sum(r.broker_name == "b2" for r in ns.registrations) >= 4,
            5,
            "three heartbeats of the later broker",
        )
    assert {r.broker_name for r in ns.registrations[count:]} == {"b2"}


async def test_a_nameserver_that_does_not_answer_delays_nobody(
    tmp_path: Path,
    hanging: tuple[RecordingNameServer, str],
    recording: tuple[RecordingNameServer, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    slow, slow_address = hanging
    good, good_address = recording
    dead_address = f"127.0.0.1:{free_port()}"  # a port nobody listens on
    settings = small_settings(
        tmp_path / "b",
        namesrv=f"{slow_address};{dead_address};{good_address}",
        register_timeout_s=2.0,
        heartbeat_interval_s=60.0,
    )
    caplog.set_level(logging.WARNING, logger="apogee_broker")
    started = time.monotonic()
    async with running_broker(settings) as app:
        assert time.monotonic() - started < 5
        assert len(good.registrations) == 1
        assert len(slow.registrations) == 1
        warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        assert f"registration with nameserver {slow_address} failed" in warned
        assert f"registration with nameserver {dead_address} failed" in warned
        assert f"nameserver {good_address}" not in warned

        changed_at = time.monotonic()
        await put_topic(app, "Orders")
        await eventually(
            lambda: any("Orders" in {t.name for t in r.topics} for r in good.registrations),
            3,
            "registration after the topic change",
        )
        # the good nameserver heard of it at once, not after the slow one's timeout
        assert time.monotonic() - changed_at < 1.5
    assert len(good.unregistrations) == 1


async def test_a_nameserver_started_after_the_broker_is_registered_with_within_seconds(
    tmp_path: Path,
) -> None:
    address = f"127.0.0.1:{free_port()}"
    settings = small_settings(tmp_path / "b", namesrv=address, heartbeat_interval_s=30.0)
    async with running_broker(settings) as broker:
        late = NameServerApp(NameServerSettings(listen=address, metrics_listen="127.0.0.1:0"))
        await late.start()
        try:
            # well before the 30 s heartbeat: the failed nameserver is retried after 1 s, 2 s...

            async def registered() -> bool:
                try:
                    return bool(await cluster_of(address))
                except grpc.aio.AioRpcError:
                    return False

            await eventually(registered, 8.0, "registered with the late nameserver")
            assert [b.broker_name for b in await cluster_of(address)] == [
                broker.settings.broker_name
            ]
        finally:
            await late.stop()


def names(request: nameserver_pb2.RegisterBrokerRequest) -> set[str]:
    return {t.name for t in request.topics}


async def test_a_heartbeat_with_nothing_changed_carries_no_topics(
    tmp_path: Path, watched: tuple[WatchedNameServer, str]
) -> None:
    ns, address = watched
    settings = small_settings(
        tmp_path / "b", broker_name="b1", namesrv=address, heartbeat_interval_s=0.1
    )
    async with running_broker(settings) as app:
        loop = app.registration
        assert loop is not None
        ns.round = lambda: loop.rounds
        first = ns.registrations[0][1]  # at start: the topics
        assert not first.topics_unchanged
        assert "TBW102" in names(first)
        await eventually(lambda: len(ns.registrations) >= 4, 5, "three heartbeats")
        for _, heartbeat in ns.registrations[1:]:
            assert heartbeat.topics_unchanged
            assert list(heartbeat.topics) == []
            assert heartbeat.topics_version == first.topics_version
        route = await route_of(address, "TBW102")  # the routes stay
        assert route is not None
        assert [b.address for b in route.brokers] == [app.address]

        # a topic change: the next registration carries the topics, then heartbeats are short
        seen = len(ns.registrations)
        await put_topic(app, "Orders")
        await eventually(
            lambda: any(not r.topics_unchanged for _, r in ns.registrations[seen:]),
            3,
            "a registration with the topics after the change",
        )
        _, changed = next(r for r in ns.registrations[seen:] if not r[1].topics_unchanged)
        assert "Orders" in names(changed)
        assert changed.topics_version != first.topics_version
        await eventually(
            lambda: ns.registrations[-1][1].topics_unchanged, 3, "a short heartbeat again"
        )
        assert ns.registrations[-1][1].topics_version == changed.topics_version

        # a nameserver that restarted asks for the topics and gets them in the same round
        seen = len(ns.registrations)
        ns.restart()

        async def routed_again() -> bool:
            return await route_of(address, "Orders") is not None

        await eventually(routed_again, 3, "the route of Orders back after the restart")
        (refused_round, refused), (full_round, full) = ns.registrations[seen : seen + 2]
        assert refused.topics_unchanged
        assert not full.topics_unchanged
        assert {"Orders", "TBW102"} <= names(full)
        assert refused_round == full_round


async def test_a_nameserver_that_does_not_take_short_heartbeats_gets_every_topic_each_time(
    tmp_path: Path, recording: tuple[RecordingNameServer, str]
) -> None:
    ns, address = recording  # answers as an older nameserver: without knows_topics_unchanged
    settings = small_settings(
        tmp_path / "b", broker_name="b1", namesrv=address, heartbeat_interval_s=0.1
    )
    async with running_broker(settings):
        await eventually(lambda: len(ns.registrations) >= 4, 5, "three heartbeats")
        for r in list(ns.registrations):
            assert not r.topics_unchanged
            assert "TBW102" in names(r)


async def test_a_broker_restarted_after_a_crash_with_its_table_held_sends_no_topics(
    tmp_path: Path, watched: tuple[WatchedNameServer, str]
) -> None:
    """kill -9 and start again: the nameserver still holds the broker (it has not expired), at
    the same table, so the first registration of the new process is the short form; once the
    nameserver has lost it (restarted), the new process sends its table."""
    ns, address = watched
    listen = f"127.0.0.1:{free_port()}"
    args = ["--listen", listen, "--name", "b1", "--data-dir", str(tmp_path / "b")]
    args += ["--namesrv", address]
    seen = 0

    def start(n: int) -> ServiceProcess:
        nonlocal seen
        seen = len(ns.registrations)
        return ServiceProcess("apogee_broker", args, tmp_path / f"broker.{n}.log")

    async def registered() -> bool:
        return len(ns.registrations) > seen

    async def orders_routed() -> bool:
        return await route_of(address, "Orders") is not None

    proc = start(1)
    try:
        await proc.wait(registered, "the first registration", 30)
        async with grpc.aio.insecure_channel(listen) as ch:
            await broker_pb2_grpc.BrokerAdminStub(ch).PutTopic(
                broker_pb2.PutTopicRequest(
                    topic=common_pb2.TopicConfig(
                        name="Orders", read_queues=4, write_queues=4, perm=6
                    )
                ),
                timeout=5,
            )
        await proc.wait(orders_routed, "the route of Orders", 10)
        held = [b.topics_version for b in await cluster_of(address)]
        assert held == [ns.registrations[-1][1].topics_version]
        assert held[0] != 0
        proc.kill()

        proc = start(2)
        await proc.wait(registered, "a registration after the restart", 30)
        first = ns.registrations[seen][1]
        assert first.topics_unchanged, "the restarted broker sent its whole table again"
        assert list(first.topics) == []
        assert first.topics_version == held[0]
        assert await orders_routed()
        proc.kill()

        ns.restart()  # the nameserver forgot the broker: the new process must send its table
        proc = start(3)
        await proc.wait(orders_routed, "the route of Orders from a full registration", 30)
        first = ns.registrations[seen][1]
        assert not first.topics_unchanged
        assert {"Orders", "TBW102"} <= names(first)
    finally:
        proc.kill()
