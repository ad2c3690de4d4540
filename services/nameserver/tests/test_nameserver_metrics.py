"""The nameserver's /metrics, scraped over HTTP: live brokers per cluster and each broker's
liveness (0, not vanishing, once it expired or unregistered), route queries by result,
registrations by form and expiries, the process metrics; a metrics port in use fails the start."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import grpc.aio
import pytest

from apogee.common.clock import ManualClock
from apogee.common.metrics import Samples, scrape
from apogee.testkit.processes import taken_address
from apogee.testkit.waiting import eventually
from apogee.v1 import common_pb2, nameserver_pb2_grpc
from apogee.v1 import nameserver_pb2 as pb
from apogee_nameserver.app import NameServerApp
from apogee_nameserver.settings import NameServerSettings

pytestmark = pytest.mark.integration


@pytest.fixture
async def app() -> AsyncIterator[NameServerApp]:
    settings = NameServerSettings(
        listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", scan_interval_s=0.02
    )
    app = NameServerApp(settings, ManualClock())
    await app.start()
    try:
        yield app
    finally:
        await app.stop()


async def metrics(app: NameServerApp) -> Samples:
    assert app.metrics_server is not None
    return await asyncio.to_thread(scrape, app.metrics_server.address)


async def test_live_brokers_routes_and_expiries(app: NameServerApp) -> None:
    clock = app.registry._clock
    assert isinstance(clock, ManualClock)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
        stub = nameserver_pb2_grpc.NameServerStub(ch)
        await stub.RegisterBroker(
            pb.RegisterBrokerRequest(
                cluster="C1",
                broker_name="broker-a",
                address="127.0.0.1:10911",
                heartbeat_interval_ms=30_000,
                topics=[common_pb2.TopicConfig(name="Orders", read_queues=4, write_queues=4)],
            ),
            timeout=5,
        )
        await stub.GetRoute(pb.GetRouteRequest(topic="Orders"), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.GetRoute(pb.GetRouteRequest(topic="Nowhere"), timeout=5)
    m = await metrics(app)
    assert m.get_sample("apogee_nameserver_live_brokers", cluster="C1") == 1
    assert m.get_sample("apogee_nameserver_broker_up", cluster="C1", broker="broker-a") == 1
    assert m.get_sample("apogee_nameserver_route_queries_total", result="found") == 1
    assert m.get_sample("apogee_nameserver_route_queries_total", result="unknown") == 1
    assert m.get_sample("apogee_nameserver_registrations_total", form="full") == 1
    assert m.get_sample("apogee_nameserver_registrations_total", form="short") == 0
    assert m.get_sample("apogee_nameserver_broker_expiries_total") == 0
    assert "process_resident_memory_bytes" in m.names()

    clock.advance(121)

    async def counted() -> bool:
        nonlocal m
        m = await metrics(app)
        return m.get_sample("apogee_nameserver_broker_expiries_total") == 1

    await eventually(counted, 5, "the expiry counted")
    # the cluster's last broker left: both say 0 instead of vanishing
    assert m.get_sample("apogee_nameserver_live_brokers", cluster="C1") == 0
    assert m.get_sample("apogee_nameserver_broker_up", cluster="C1", broker="broker-a") == 0


def registration(cluster: str, name: str, address: str) -> pb.RegisterBrokerRequest:
    return pb.RegisterBrokerRequest(
        cluster=cluster, broker_name=name, address=address, heartbeat_interval_ms=30_000
    )


async def test_a_broker_that_unregisters_reads_0_until_it_registers_again(
    app: NameServerApp,
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
        stub = nameserver_pb2_grpc.NameServerStub(ch)
        await stub.RegisterBroker(registration("C1", "broker-a", "127.0.0.1:10911"), timeout=5)
        await stub.RegisterBroker(registration("C2", "broker-b", "127.0.0.1:10921"), timeout=5)
        m = await metrics(app)
        assert m.get_sample("apogee_nameserver_broker_up", cluster="C1", broker="broker-a") == 1
        assert m.get_sample("apogee_nameserver_broker_up", cluster="C2", broker="broker-b") == 1

        await stub.UnregisterBroker(
            pb.UnregisterBrokerRequest(
                cluster="C1", broker_name="broker-a", address="127.0.0.1:10911"
            ),
            timeout=5,
        )
        m = await metrics(app)
        assert m.get_sample("apogee_nameserver_broker_up", cluster="C1", broker="broker-a") == 0
        assert m.get_sample("apogee_nameserver_live_brokers", cluster="C1") == 0
        assert m.get_sample("apogee_nameserver_broker_up", cluster="C2", broker="broker-b") == 1
        assert m.get_sample("apogee_nameserver_live_brokers", cluster="C2") == 1

        await stub.RegisterBroker(registration("C1", "broker-a", "127.0.0.1:10911"), timeout=5)
        m = await metrics(app)
        assert m.get_sample("apogee_nameserver_broker_up", cluster="C1", broker="broker-a") == 1
        assert m.get_sample("apogee_nameserver_live_brokers", cluster="C1") == 1


async def test_registrations_are_counted_by_form(app: NameServerApp) -> None:
    full = registration("C1", "broker-a", "127.0.0.1:10911")
    full.topics_version = 3
    short = registration("C1", "broker-a", "127.0.0.1:10911")
    short.topics_unchanged, short.topics_version = True, 3
    stale = registration("C1", "broker-a", "127.0.0.1:10911")
    stale.topics_unchanged, stale.topics_version = True, 2
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
        stub = nameserver_pb2_grpc.NameServerStub(ch)
        await stub.RegisterBroker(full, timeout=5)
        await stub.RegisterBroker(short, timeout=5)
        await stub.RegisterBroker(short, timeout=5)
        assert (await stub.RegisterBroker(stale, timeout=5)).topics_needed  # not counted
    m = await metrics(app)
    assert m.get_sample("apogee_nameserver_registrations_total", form="full") == 1
    assert m.get_sample("apogee_nameserver_registrations_total", form="short") == 2


async def test_a_metrics_port_in_use_fails_the_start_naming_it() -> None:
    with taken_address() as taken:
        app = NameServerApp(NameServerSettings(listen="127.0.0.1:0", metrics_listen=taken))
        with pytest.raises(OSError, match=f"nameserver cannot serve metrics on {taken}"):
            await app.start()
        await app.stop()
