"""Every NameServer RPC over a real gRPC channel to an in-process NameServerApp."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest

from apogee.common.clock import ManualClock
from apogee.common.errors import InvalidArgumentError, UnknownTopicError
from apogee.rpc.errors import KIND_KEY, call
from apogee.rpc.server import check_health
from apogee.testkit.waiting import eventually
from apogee.v1 import common_pb2, nameserver_pb2_grpc
from apogee.v1 import nameserver_pb2 as pb
from apogee_nameserver.app import SERVICE_NAME, NameServerApp
from apogee_nameserver.settings import NameServerSettings

pytestmark = pytest.mark.integration

TIMEOUT = 5.0


@dataclass
class Running:
    app: NameServerApp
    clock: ManualClock
    address: str
    stub: nameserver_pb2_grpc.NameServerAsyncStub
    channel: grpc.aio.Channel


@pytest.fixture
async def ns() -> AsyncIterator[Running]:
    clock = ManualClock()
    settings = NameServerSettings(
        listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        scan_interval_s=0.02,
        shutdown_grace_s=1.0,
    )
    app = NameServerApp(settings, clock)
    port = await app.start()
    address = f"127.0.0.1:{port}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            yield Running(app, clock, address, nameserver_pb2_grpc.NameServerStub(channel), channel)
    finally:
        await app.stop()


def registration(
    name: str = "broker-a",
    topics: list[common_pb2.TopicConfig] | None = None,
    **fields: object,
) -> pb.RegisterBrokerRequest:
    req = pb.RegisterBrokerRequest(
        cluster="DefaultCluster",
        broker_name=name,
        address=f"{name}.brokers.apogee.svc:10911",
        heartbeat_interval_ms=30_000,
        topics=topics
        if topics is not None
        else [common_pb2.TopicConfig(name="Orders", read_queues=4, write_queues=4, perm=6)],
    )
    for key, value in fields.items():
        setattr(req, key, value)
    return req


def kind_of(err: grpc.aio.AioRpcError) -> str | None:
    return dict(err.trailing_metadata() or ()).get(KIND_KEY)


async def test_register_then_route(ns: Running) -> None:
    reply = await ns.stub.RegisterBroker(registration(), timeout=TIMEOUT)
    assert reply.expiry_ms == 120_000
    route = await ns.stub.GetRoute(pb.GetRouteRequest(topic="Orders"), timeout=TIMEOUT)
    assert route == pb.GetRouteResponse(
        topic="Orders",
        queues=[
            pb.QueueData(
                broker_name="broker-a",
                read_queues=4,
                write_queues=4,
                perm=6,
                message_type="MIXED",
            )
        ],
        brokers=[
            pb.BrokerData(
                cluster="DefaultCluster",
                broker_name="broker-a",
                address="broker-a.brokers.apogee.svc:10911",
            )
        ],
    )


async def test_unknown_topic_is_not_found_with_its_kind(ns: Running) -> None:
    await ns.stub.RegisterBroker(registration(), timeout=TIMEOUT)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ns.stub.GetRoute(pb.GetRouteRequest(topic="Invoices"), timeout=TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert caught.value.details() == (
        "topic 'Invoices' has no route: no live broker serves it "
        "(create it with `apogee topic create`)"
    )
    assert kind_of(caught.value) == "UNKNOWN_TOPIC"
    # a client gets the same error class back
    with pytest.raises(UnknownTopicError, match="has no route"):
        await call("nameserver", ns.stub.GetRoute(pb.GetRouteRequest(topic="Invoices")))


async def test_bad_registration_is_invalid_argument_and_the_server_keeps_serving(
    ns: Running,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ns.stub.RegisterBroker(registration(address="broker-a"), timeout=TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == (
        "address: 'broker-a' must be host:port, with a port from 1 to 65535"
    )
    assert kind_of(caught.value) == "INVALID_ARGUMENT"

    bad_topic = [common_pb2.TopicConfig(name="a b", read_queues=1, write_queues=1, perm=6)]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ns.stub.RegisterBroker(registration(topics=bad_topic), timeout=TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "topic 'a b': has a character outside [%|a-zA-Z0-9_-]"
    assert kind_of(caught.value) == "INVALID_TOPIC"

    with pytest.raises(InvalidArgumentError, match="cluster: must not be empty"):
        await call("nameserver", ns.stub.RegisterBroker(registration(cluster="")))

    # nothing was registered, and the server still answers
    info = await ns.stub.GetClusterInfo(pb.GetClusterInfoRequest(), timeout=TIMEOUT)
    assert list(info.brokers) == []
    await ns.stub.RegisterBroker(registration(), timeout=TIMEOUT)
    info = await ns.stub.GetClusterInfo(pb.GetClusterInfoRequest(), timeout=TIMEOUT)
    assert [b.broker_name for b in info.brokers] == ["broker-a"]


async def test_invalid_topic_name_in_a_route_request(ns: Running) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ns.stub.GetRoute(pb.GetRouteRequest(topic=""), timeout=TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "topic '': must not be empty"
    assert kind_of(caught.value) == "INVALID_TOPIC"


async def test_auto_create_route_comes_from_tbw102(ns: Running) -> None:
    topics = [
        common_pb2.TopicConfig(name="TBW102", read_queues=8, write_queues=8, perm=7, system=True)
    ]
    await ns.stub.RegisterBroker(
        registration(topics=topics, auto_create_topics=True), timeout=TIMEOUT
    )
    route = await ns.stub.GetRoute(pb.GetRouteRequest(topic="NewTopic"), timeout=TIMEOUT)
    assert route.topic == "NewTopic"
    assert [(q.broker_name, q.read_queues, q.write_queues, q.perm) for q in route.queues] == [
        ("broker-a", 8, 8, 6)
    ]
    assert [b.address for b in route.brokers] == ["broker-a.brokers.apogee.svc:10911"]


async def test_cluster_info_and_list_topics(ns: Running) -> None:
    await ns.stub.RegisterBroker(
        registration(
            "broker-b",
            [
                common_pb2.TopicConfig(name="Payments", read_queues=2, write_queues=2, perm=6),
                common_pb2.TopicConfig(name="TBW102", read_queues=8, write_queues=8, perm=7),
                common_pb2.TopicConfig(name="%DLQ%billing", read_queues=1, write_queues=1, perm=6),
            ],
            auto_create_topics=True,
        ),
        timeout=TIMEOUT,
    )
    ns.clock.advance(2)
    await ns.stub.RegisterBroker(registration("broker-a"), timeout=TIMEOUT)
    info = await ns.stub.GetClusterInfo(pb.GetClusterInfoRequest(), timeout=TIMEOUT)
    start = ns.clock.time_ms() - 2000
    assert list(info.brokers) == [
        pb.BrokerInfo(
            cluster="DefaultCluster",
            broker_name="broker-a",
            address="broker-a.brokers.apogee.svc:10911",
            last_heartbeat_ms=start + 2000,
            topic_count=1,
            auto_create_topics=False,
        ),
        pb.BrokerInfo(
            cluster="DefaultCluster",
            broker_name="broker-b",
            address="broker-b.brokers.apogee.svc:10911",
            last_heartbeat_ms=start,
            topic_count=3,
            auto_create_topics=True,
        ),
    ]
    topics = await ns.stub.ListTopics(pb.ListTopicsRequest(), timeout=TIMEOUT)
    assert list(topics.topics) == ["%DLQ%billing", "Orders", "Payments"]


async def test_unregister_removes_the_route(ns: Running) -> None:
    await ns.stub.RegisterBroker(registration(), timeout=TIMEOUT)
    await ns.stub.UnregisterBroker(
        pb.UnregisterBrokerRequest(
            cluster="DefaultCluster",
            broker_name="broker-a",
            address="broker-a.brokers.apogee.svc:10911",
        ),
        timeout=TIMEOUT,
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ns.stub.GetRoute(pb.GetRouteRequest(topic="Orders"), timeout=TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    # unregistering again is harmless; a malformed request is refused
    await ns.stub.UnregisterBroker(
        pb.UnregisterBrokerRequest(cluster="DefaultCluster", broker_name="broker-a", address="x:1"),
        timeout=TIMEOUT,
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ns.stub.UnregisterBroker(pb.UnregisterBrokerRequest(), timeout=TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "cluster: must not be empty"


async def test_a_silent_broker_is_dropped_by_the_running_service(
    ns: Running, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="apogee_nameserver")
    await ns.stub.RegisterBroker(registration("broker-a"), timeout=TIMEOUT)
    await ns.stub.RegisterBroker(registration("broker-b"), timeout=TIMEOUT)
    ns.clock.advance(90)
    await ns.stub.RegisterBroker(registration("broker-b"), timeout=TIMEOUT)  # heartbeat
    ns.clock.advance(31)  # broker-a silent for 121 s, broker-b for 31 s
    route = await ns.stub.GetRoute(pb.GetRouteRequest(topic="Orders"), timeout=TIMEOUT)
    assert [b.broker_name for b in route.brokers] == ["broker-b"]
    # and the expiry loop drops it, saying so
    await eventually(
        lambda: "broker broker-a (broker-a.brokers.apogee.svc:10911" in caplog.text,
        TIMEOUT,
        "broker-a dropped by the expiry loop",
    )
    assert "broker-b" not in caplog.text


async def test_health_is_serving_for_the_server_and_the_service(ns: Running) -> None:
    assert SERVICE_NAME == "apogee.v1.NameServer"
    assert await check_health(ns.address, TIMEOUT)
    assert await check_health(ns.address, TIMEOUT, service=SERVICE_NAME)
    assert not await check_health(ns.address, TIMEOUT, service="apogee.v1.Nothing")


async def test_stop_is_bounded_and_the_port_closes() -> None:
    app = NameServerApp(
        NameServerSettings(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0", shutdown_grace_s=0.5)
    )
    port = await app.start()
    assert await check_health(f"127.0.0.1:{port}", TIMEOUT)
    started = time.monotonic()
    await app.stop()
    assert time.monotonic() - started < 3.0
    assert not await check_health(f"127.0.0.1:{port}", 0.5)
    await app.stop()  # a second stop does nothing


async def test_a_taken_address_is_an_os_error() -> None:
    first = NameServerApp(NameServerSettings(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0"))
    port = await first.start()
    try:
        second = NameServerApp(
            NameServerSettings(listen=f"127.0.0.1:{port}", metrics_listen="127.0.0.1:0")
        )
        with pytest.raises(OSError, match=f"nameserver cannot listen on 127.0.0.1:{port}"):
            await second.start()
        await second.stop()
    finally:
        await first.stop()


async def test_cluster_info_carries_each_brokers_replica_group_epoch(ns: Running) -> None:
    await ns.stub.RegisterBroker(registration("broker-a", epoch=4), timeout=TIMEOUT)
    await ns.stub.RegisterBroker(registration("broker-b"), timeout=TIMEOUT)  # a lone broker
    info = await ns.stub.GetClusterInfo(pb.GetClusterInfoRequest(), timeout=TIMEOUT)
    assert [(b.broker_name, b.epoch) for b in info.brokers] == [("broker-a", 4), ("broker-b", 0)]
    # a new leader at a higher epoch replaces the old one's address
    moved = "broker-a-1.brokers.apogee.svc:10911"
    await ns.stub.RegisterBroker(registration("broker-a", epoch=5, address=moved), timeout=TIMEOUT)
    info = await ns.stub.GetClusterInfo(pb.GetClusterInfoRequest(), timeout=TIMEOUT)
    assert [(b.address, b.epoch) for b in info.brokers if b.broker_name == "broker-a"] == [
        (moved, 5)
    ]


async def test_a_short_heartbeat_keeps_the_routes_and_the_broker_alive(ns: Running) -> None:
    reply = await ns.stub.RegisterBroker(registration(topics_version=7), timeout=TIMEOUT)
    assert (reply.knows_topics_unchanged, reply.topics_needed) == (True, False)
    ns.clock.advance(100)
    short = registration(topics=[], topics_unchanged=True, topics_version=7)
    reply = await ns.stub.RegisterBroker(short, timeout=TIMEOUT)
    assert (reply.knows_topics_unchanged, reply.topics_needed) == (True, False)
    assert reply.expiry_ms == 120_000
    ns.clock.advance(100)  # 200 s after the topics came, 100 s after the short heartbeat
    route = await ns.stub.GetRoute(pb.GetRouteRequest(topic="Orders"), timeout=TIMEOUT)
    assert [(q.broker_name, q.write_queues) for q in route.queues] == [("broker-a", 4)]
    info = await ns.stub.GetClusterInfo(pb.GetClusterInfoRequest(), timeout=TIMEOUT)
    assert [(b.broker_name, b.topic_count) for b in info.brokers] == [("broker-a", 1)]


async def test_a_short_heartbeat_at_another_version_asks_for_the_topics(ns: Running) -> None:
    await ns.stub.RegisterBroker(registration(topics_version=7), timeout=TIMEOUT)
    ns.clock.advance(100)
    short = registration(topics=[], topics_unchanged=True, topics_version=8)
    reply = await ns.stub.RegisterBroker(short, timeout=TIMEOUT)
    assert (reply.knows_topics_unchanged, reply.topics_needed) == (True, True)
    route = await ns.stub.GetRoute(pb.GetRouteRequest(topic="Orders"), timeout=TIMEOUT)
    assert [q.write_queues for q in route.queues] == [4]  # what it held, untouched
    ns.clock.advance(21)  # and not refreshed: silent for 121 s since the topics came
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ns.stub.GetRoute(pb.GetRouteRequest(topic="Orders"), timeout=TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_restarted_nameserver_asks_for_the_topics_and_holds_nothing_until_then() -> None:
    settings = NameServerSettings(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")
    first = NameServerApp(settings)
    port = await first.start()
    address = f"127.0.0.1:{port}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = nameserver_pb2_grpc.NameServerStub(channel)
            await stub.RegisterBroker(registration(topics_version=7), timeout=TIMEOUT)
    finally:
        await first.stop()
    again = NameServerApp(NameServerSettings(listen=address, metrics_listen="127.0.0.1:0"))
    await again.start()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = nameserver_pb2_grpc.NameServerStub(channel)
            short = registration(topics=[], topics_unchanged=True, topics_version=7)
            reply = await stub.RegisterBroker(short, timeout=TIMEOUT)
            assert (reply.knows_topics_unchanged, reply.topics_needed) == (True, True)
            info = await stub.GetClusterInfo(pb.GetClusterInfoRequest(), timeout=TIMEOUT)
            assert list(info.brokers) == []
            # the full registration the broker sends next brings the routes back
            reply = await stub.RegisterBroker(registration(topics_version=7), timeout=TIMEOUT)
            assert (reply.knows_topics_unchanged, reply.topics_needed) == (True, False)
            route = await stub.GetRoute(pb.GetRouteRequest(topic="Orders"), timeout=TIMEOUT)
            assert [b.broker_name for b in route.brokers] == ["broker-a"]
    finally:
        await again.stop()


async def test_a_short_heartbeat_with_topics_is_invalid(ns: Running) -> None:
    await ns.stub.RegisterBroker(registration(topics_version=7), timeout=TIMEOUT)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ns.stub.RegisterBroker(
            registration(topics_unchanged=True, topics_version=7), timeout=TIMEOUT
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "topics: must be empty when topics_unchanged is set"
