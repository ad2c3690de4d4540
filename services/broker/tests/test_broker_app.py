"""BrokerApp in-process on 127.0.0.1, every RPC over a real gRPC channel."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from apogee.rpc.server import check_health
from apogee.store import MessageStore
from apogee.testkit.broker import running_broker, small_settings
from apogee.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from apogee_broker.app import BrokerApp

pytestmark = pytest.mark.integration

KIND_KEY = "apogee-error-kind"


@pytest.fixture
async def app(tmp_path: Path) -> AsyncIterator[BrokerApp]:
    async with running_broker(small_settings(tmp_path / "broker", broker_name="b1")) as app:
        yield app


@pytest.fixture
async def channel(app: BrokerApp) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(app.address) as ch:
        yield ch


@pytest.fixture
def broker(channel: grpc.aio.Channel) -> broker_pb2_grpc.BrokerAsyncStub:
    return broker_pb2_grpc.BrokerStub(channel)


@pytest.fixture
def admin(channel: grpc.aio.Channel) -> broker_pb2_grpc.BrokerAdminAsyncStub:
    return broker_pb2_grpc.BrokerAdminStub(channel)


def kind_of(exc: grpc.aio.AioRpcError) -> str:
    for key, value in exc.trailing_metadata() or ():
        if key == KIND_KEY:
            return value if isinstance(value, str) else value.decode()
    return ""


async def put_topic(
    admin: broker_pb2_grpc.BrokerAdminAsyncStub, name: str, queues: int = 4, perm: int = 6
) -> broker_pb2.PutTopicResponse:
    return await admin.PutTopic(
        broker_pb2.PutTopicRequest(
            topic=common_pb2.TopicConfig(
                name=name, read_queues=queues, write_queues=queues, perm=perm
            )
        ),
        timeout=5,
    )


async def test_health_is_serving_and_the_address_is_reachable(app: BrokerApp) -> None:
    assert app.address == f"127.0.0.1:{app.port}"
    assert await check_health(app.address, timeout=5)
    assert await check_health(app.address, timeout=5, service="apogee.v1.Broker")
    assert await check_health(app.address, timeout=5, service="apogee.v1.BrokerAdmin")


async def test_send_one_and_find_it_by_id_and_key(
    app: BrokerApp,
    broker: broker_pb2_grpc.BrokerAsyncStub,
    admin: broker_pb2_grpc.BrokerAdminAsyncStub,
) -> None:
    await put_topic(admin, "Orders")
    before = int(time.time() * 1000)
    reply = await broker.SendMessages(
        broker_pb2.SendMessagesRequest(
            messages=[
                common_pb2.Message(
                    topic="Orders",
                    body=b"order 17",
                    tags="created",
                    keys=["o-17"],
                    properties={"region": "eu"},
                    queue_id=2,
                )
            ]
        ),
        timeout=5,
    )
    assert reply.broker_name == "b1"
    [res] = reply.results
    assert res.status.code == 0
    assert (res.topic, res.queue_id, res.queue_offset) == ("Orders", 2, 0)
    assert len(res.unique_id) == 32
    assert res.store_timestamp_ms >= before

    got = await broker.GetMessage(broker_pb2.GetMessageRequest(unique_id=res.unique_id), timeout=5)
    m = got.message
    assert (m.topic, m.queue_id, m.queue_offset, m.phys_offset) == ("Orders", 2, 0, res.phys_offset)
    assert (m.body, m.tags, list(m.keys), dict(m.properties)) == (
        b"order 17",
        "created",
        ["o-17"],
        {"region": "eu"},
    )
    assert m.unique_id == res.unique_id
    assert m.store_host == app.address
    assert m.born_host.startswith("127.0.0.1:")
    assert m.broker_name == "b1"
    assert m.born_timestamp_ms >= before

    query = await broker.QueryMessages(
        broker_pb2.QueryMessagesRequest(topic="Orders", key="o-17"), timeout=5
    )
    assert [q.unique_id for q in query.messages] == [res.unique_id]
    none = await broker.QueryMessages(
        broker_pb2.QueryMessagesRequest(topic="Orders", key="o-17", begin_ms=1, end_ms=2),
        timeout=5,
    )
    assert list(none.messages) == []


async def test_a_batch_answers_each_message_in_order(
    broker: broker_pb2_grpc.BrokerAsyncStub, admin: broker_pb2_grpc.BrokerAdminAsyncStub
) -> None:
    await put_topic(admin, "Orders")
    messages = [
        common_pb2.Message(topic="Orders", body=b"m0", queue_id=0),
        common_pb2.Message(topic="Orders", body=b"", queue_id=0),
        common_pb2.Message(topic="Nope", body=b"m2"),
        common_pb2.Message(topic="Orders", body=b"m3", queue_id=9),
        common_pb2.Message(topic="Orders", body=b"m4", queue_id=0, delay_level=19),
        common_pb2.Message(topic="TBW102", body=b"m5"),
        common_pb2.Message(topic="Orders", body=b"m6", queue_id=0),
    ]
    reply = await broker.SendMessages(broker_pb2.SendMessagesRequest(messages=messages), timeout=5)
    statuses = [(r.status.code, r.status.reason) for r in reply.results]
    assert statuses == [
        (0, ""),
        (grpc.StatusCode.INVALID_ARGUMENT.value[0], "INVALID_ARGUMENT"),
        (grpc.StatusCode.NOT_FOUND.value[0], "UNKNOWN_TOPIC"),
        (grpc.StatusCode.INVALID_ARGUMENT.value[0], "INVALID_QUEUE_ID"),
        (grpc.StatusCode.INVALID_ARGUMENT.value[0], "INVALID_ARGUMENT"),
        (grpc.StatusCode.PERMISSION_DENIED.value[0], "PERMISSION_DENIED"),
        (0, ""),
    ]
    assert reply.results[1].status.message == "messages[1].body: must not be empty"
    assert reply.results[4].status.message == (
        "messages[4].delay_level 19: must be between 1 and 18, the levels of this broker's "
        "delay table (0: no delay)"
    )
    assert [r.queue_offset for r in reply.results if r.status.code == 0] == [0, 1]
    assert not any(r.status.retriable for r in reply.results)

    described = await admin.DescribeTopic(
        broker_pb2.DescribeTopicRequest(topic="Orders"), timeout=5
    )
    q0 = described.queues[0]
    assert (q0.queue_id, q0.min_offset, q0.max_offset) == (0, 0, 2)
    assert q0.last_store_timestamp_ms == reply.results[6].store_timestamp_ms
    assert [(q.max_offset, q.last_store_timestamp_ms) for q in described.queues[1:]] == [(0, 0)] * 3
    assert described.broker_name == "b1"


async def test_request_level_problems_fail_the_call(
    broker: broker_pb2_grpc.BrokerAsyncStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await broker.SendMessages(broker_pb2.SendMessagesRequest(), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == "messages: must not be empty"
    assert kind_of(caught.value) == "INVALID_ARGUMENT"

    too_many = [common_pb2.Message(topic="Orders", body=b"x")] * 1025
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await broker.SendMessages(broker_pb2.SendMessagesRequest(messages=too_many), timeout=5)
    assert caught.value.details() == (
        "messages: 1025 messages in one request; at most 1024 are allowed "
        "(max_messages_per_request)"
    )


async def test_lookups_that_find_nothing(broker: broker_pb2_grpc.BrokerAsyncStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await broker.GetMessage(broker_pb2.GetMessageRequest(unique_id="NOPE"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert caught.value.details() == (
        "message 'NOPE' not found: broker b1 stores no message with this unique id (it may be "
        "on another broker, or removed by retention)"
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await broker.QueryMessages(
            broker_pb2.QueryMessagesRequest(topic="Nope", key="k"), timeout=5
        )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert kind_of(caught.value) == "UNKNOWN_TOPIC"


async def test_topic_admin(admin: broker_pb2_grpc.BrokerAdminAsyncStub) -> None:
    created = await put_topic(admin, "Orders", queues=4)
    assert created.created
    assert (created.topic.name, created.topic.read_queues, created.topic.perm) == ("Orders", 4, 6)
    updated = await put_topic(admin, "Orders", queues=2, perm=4)
    assert not updated.created
    assert (updated.topic.write_queues, updated.topic.perm) == (2, 4)

    listed = await admin.ListTopics(broker_pb2.BrokerListTopicsRequest(), timeout=5)
    assert [t.name for t in listed.topics] == ["Orders"]
    with_system = await admin.ListTopics(
        broker_pb2.BrokerListTopicsRequest(include_system=True), timeout=5
    )
    system = {t.name for t in with_system.topics if t.system}
    assert system == {
        "TBW102",
        "SCHEDULE_TOPIC_XXXX",
        "RMQ_SYS_TRANS_HALF_TOPIC",
        "RMQ_SYS_TRANS_OP_HALF_TOPIC",
        "TRANS_CHECK_MAX_TIME_TOPIC",
    }

    described = await admin.DescribeTopic(
        broker_pb2.DescribeTopicRequest(topic="Orders"), timeout=5
    )
    assert [q.queue_id for q in described.queues] == [0, 1]

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await put_topic(admin, "TBW102")
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert caught.value.details() == "topic 'TBW102': is a system topic; it cannot be changed"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await put_topic(admin, "bad topic")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert kind_of(caught.value) == "INVALID_TOPIC"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await put_topic(admin, "Orders", queues=0)
    assert caught.value.details() == "topic.read_queues: must be between 1 and 1024, got 0"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await admin.PutTopic(broker_pb2.PutTopicRequest(), timeout=5)
    assert caught.value.details() == "topic: is required"

    await admin.DeleteTopic(broker_pb2.DeleteTopicRequest(topic="Orders"), timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await admin.DescribeTopic(broker_pb2.DescribeTopicRequest(topic="Orders"), timeout=5)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert caught.value.details() == "topic 'Orders' does not exist on broker b1"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await admin.DeleteTopic(
            broker_pb2.DeleteTopicRequest(topic="SCHEDULE_TOPIC_XXXX"), timeout=5
        )
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_broker_info(
    app: BrokerApp,
    broker: broker_pb2_grpc.BrokerAsyncStub,
    admin: broker_pb2_grpc.BrokerAdminAsyncStub,
) -> None:
    await put_topic(admin, "Orders")
    await broker.SendMessages(
        broker_pb2.SendMessagesRequest(messages=[common_pb2.Message(topic="Orders", body=b"x")]),
        timeout=5,
    )
    info = await admin.GetBrokerInfo(broker_pb2.GetBrokerInfoRequest(), timeout=5)
    assert (info.cluster, info.broker_name, info.address) == ("DefaultCluster", "b1", app.address)
    assert (info.flush_mode, info.auto_create_topics) == ("async", False)
    assert info.commitlog_min_offset == 0
    assert info.commitlog_max_offset > 0
    assert info.topic_count == 6


@pytest.mark.parametrize("flush_mode", ["async", "sync"])
async def test_auto_create_on(tmp_path: Path, flush_mode: str) -> None:
    settings = small_settings(
        tmp_path / "b", auto_create_topics=True, default_topic_queues=2, flush_mode=flush_mode
    )
    async with (
        running_broker(settings) as app,
        grpc.aio.insecure_channel(app.address) as ch,
    ):
        stub = broker_pb2_grpc.BrokerStub(ch)
        reply = await stub.SendMessages(
            broker_pb2.SendMessagesRequest(
                messages=[common_pb2.Message(topic="Fresh", body=b"x", queue_id=1)]
            ),
            timeout=5,
        )
        assert reply.results[0].status.code == 0
        listed = await broker_pb2_grpc.BrokerAdminStub(ch).ListTopics(
            broker_pb2.BrokerListTopicsRequest(), timeout=5
        )
        assert [(t.name, t.read_queues, t.write_queues, t.perm) for t in listed.topics] == [
            ("Fresh", 2, 2, 6)
        ]
    # the topic was persisted with the store: a restart still has it
    async with (
        running_broker(settings) as app,
        grpc.aio.insecure_channel(app.address) as ch,
    ):
        described = await broker_pb2_grpc.BrokerAdminStub(ch).DescribeTopic(
            broker_pb2.DescribeTopicRequest(topic="Fresh"), timeout=5
        )
        assert [q.max_offset for q in described.queues] == [0, 1]


async def test_auto_create_off(
    broker: broker_pb2_grpc.BrokerAsyncStub, admin: broker_pb2_grpc.BrokerAdminAsyncStub
) -> None:
    reply = await broker.SendMessages(
        broker_pb2.SendMessagesRequest(messages=[common_pb2.Message(topic="Fresh", body=b"x")]),
        timeout=5,
    )
    status = reply.results[0].status
    assert (status.reason, status.message) == (
        "UNKNOWN_TOPIC",
        "topic 'Fresh' does not exist on broker b1 and auto_create_topics is off: "
        "create it first (PutTopic)",
    )
    listed = await admin.ListTopics(broker_pb2.BrokerListTopicsRequest(), timeout=5)
    assert list(listed.topics) == []


async def test_stop_is_clean_and_the_data_stays(tmp_path: Path) -> None:
    settings = small_settings(tmp_path / "b")
    app = BrokerApp(settings)
    await app.start()
    address = app.address
    await app.stop()
    await app.stop()  # twice is harmless
    assert not await check_health(address, timeout=1)
    with MessageStore.open(settings.data_dir, settings.store_config()) as store:
        assert store.recovery.clean_shutdown


async def test_a_second_broker_on_the_same_data_dir_is_refused(app: BrokerApp) -> None:
    other = BrokerApp(small_settings(app.settings.data_dir))
    with pytest.raises(Exception, match="in use by another process"):
        await other.start()
