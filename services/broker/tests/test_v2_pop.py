"""POP consumption over apache.rocketmq.v2 at one in-process broker, through its gRPC port: what
a SimpleConsumer and a PushConsumer rely on (fields, receipt handles, invisible time, attempts,
the dead-letter queue, FIFO order) and that the invisible state survives a restart. The clock
is a manual one, so invisible times run out when the test says."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc.aio
import pytest
from google.protobuf.duration_pb2 import Duration

from apogee.common.clock import ManualClock
from apogee.common.topics import MessageType, TopicConfig
from apogee.rocketmq.v2 import definition_pb2 as d
from apogee.rocketmq.v2 import service_pb2 as s
from apogee.rocketmq.v2 import service_pb2_grpc as sg
from apogee.testkit.broker import running_broker, small_settings
from apogee.testkit.waiting import eventually
from apogee_broker.app import BrokerApp

if TYPE_CHECKING:
    from apogee.rocketmq.v2.service_pb2_grpc import MessagingServiceAsyncStub as Stub

pytestmark = pytest.mark.integration

MD = (("x-mq-client-id", "test@1@1@abc"), ("x-mq-language", "PYTHON"))


def message(topic: str, body: bytes, mid: str, **sp: Any) -> d.Message:
    return d.Message(
        topic=d.Resource(name=topic),
        body=body,
        user_properties={"color": "blue"},
        system_properties=d.SystemProperties(
            message_id=mid, body_encoding=d.IDENTITY, born_host="10.0.0.7", **sp
        ),
    )


async def send(stub: Stub, m: d.Message) -> s.SendMessageResponse:
    r: s.SendMessageResponse = await stub.SendMessage(
        s.SendMessageRequest(messages=[m]), metadata=MD, timeout=5
    )
    return r


async def receive(
    stub: Stub, topic: str, group: str = "g", invisible_s: int = 10, **kw: Any
) -> tuple[d.Status, list[d.Message]]:
    req = s.ReceiveMessageRequest(
        group=d.Resource(name=group),
        message_queue=d.MessageQueue(topic=d.Resource(name=topic), id=-1),
        filter_expression=d.FilterExpression(type=d.TAG, expression=kw.pop("tags", "*")),
        batch_size=kw.pop("batch", 32),
        invisible_duration=Duration(seconds=invisible_s),
        long_polling_timeout=Duration(seconds=kw.pop("poll", 0)),
    )
    status = d.Status()
    out: list[d.Message] = []
    async for r in stub.ReceiveMessage(req, metadata=MD, timeout=30):
        if r.HasField("status"):
            status = r.status
        elif r.HasField("message"):
            out.append(r.message)
    return status, out


async def ack(stub: Stub, topic: str, m: d.Message, group: str = "g") -> d.Status:
    r = await stub.AckMessage(
        s.AckMessageRequest(
            group=d.Resource(name=group),
            topic=d.Resource(name=topic),
            entries=[
                s.AckMessageEntry(
                    message_id=m.system_properties.message_id,
                    receipt_handle=m.system_properties.receipt_handle,
                )
            ],
        ),
        metadata=MD,
        timeout=5,
    )
    return r.status


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def broker(tmp_path: Path, clock: ManualClock) -> AsyncIterator[BrokerApp]:
    async with running_broker(small_settings(tmp_path / "b", max_reconsume_times=2), clock) as app:
        assert app.topics is not None
        app.topics.put(TopicConfig("Plain", 4, 4))
        app.topics.put(TopicConfig("Ordered", 2, 2, message_type=MessageType.FIFO))
        yield app


@pytest.fixture
async def stub(broker: BrokerApp) -> AsyncIterator[Stub]:
    async with grpc.aio.insecure_channel(broker.address) as ch:
        yield sg.MessagingServiceStub(ch)


async def test_receive_gives_every_field_then_nothing_and_an_ack_is_final(
    broker: BrokerApp, stub: Stub, clock: ManualClock
) -> None:
    for i in range(3):
        r = await send(stub, message("Plain", b"m%d" % i, f"ID{i}", tag="a", keys=[f"k{i}"]))
        assert r.status.code == d.OK, r.status
        assert r.entries[0].message_id == f"ID{i}"
    status, got = await receive(stub, "Plain")
    assert status.code == d.OK
    assert sorted(m.body for m in got) == [b"m0", b"m1", b"m2"]
    for m in got:
        sp = m.system_properties
        assert m.topic.name == "Plain"
        assert m.user_properties == {"color": "blue"}
        assert sp.tag == "a"
        assert list(sp.keys) == ["k" + m.body.decode()[1]]
        assert sp.message_id == "ID" + m.body.decode()[1]
        assert sp.delivery_attempt == 1
        assert sp.body_encoding == d.IDENTITY
        assert sp.body_digest.checksum == sp.body_digest.checksum.upper()
        assert sp.born_host == "10.0.0.7"
        assert sp.receipt_handle
    status, again = await receive(stub, "Plain")
    assert status.code == d.MESSAGE_NOT_FOUND
    assert again == []
    assert (await ack(stub, "Plain", got[0])).code == d.OK
    clock.advance(11)
    status, back = await receive(stub, "Plain")
    assert sorted(m.system_properties.message_id for m in back) == sorted(
        m.system_properties.message_id for m in got[1:]
    )
    assert {m.system_properties.delivery_attempt for m in back} == {2}
    stale = await ack(stub, "Plain", got[1])  # the first delivery's handle
    assert stale.code == d.INVALID_RECEIPT_HANDLE, stale
    sample = broker.registry.get_sample_value
    assert sample("apogee_broker_v2_requests_total", {"rpc": "SendMessage", "code": "OK"}) == 3
    assert sample("apogee_broker_v2_requests_total", {"rpc": "ReceiveMessage", "code": "OK"}) == 2
    assert (
        sample(
            "apogee_broker_v2_requests_total",
            {"rpc": "AckMessage", "code": "INVALID_RECEIPT_HANDLE"},
        )
        == 1
    )
    for event, count in (("received", 5), ("acked", 1), ("expired", 2)):
        assert sample("apogee_broker_pop_messages_total", {"group": "g", "event": event}) == count


async def test_change_invisible_duration_gives_a_new_handle_and_the_old_one_is_refused(
    stub: Stub, clock: ManualClock
) -> None:
    await send(stub, message("Plain", b"x", "IDX"))
    _, (m,) = await receive(stub, "Plain")
    r = await stub.ChangeInvisibleDuration(
        s.ChangeInvisibleDurationRequest(
            group=d.Resource(name="g"),
            topic=d.Resource(name="Plain"),
            receipt_handle=m.system_properties.receipt_handle,
            invisible_duration=Duration(seconds=30),
            message_id="IDX",
        ),
        metadata=MD,
        timeout=5,
    )
    assert r.status.code == d.OK
    assert r.receipt_handle != m.system_properties.receipt_handle
    clock.advance(11)
    assert (await receive(stub, "Plain"))[1] == []  # 30 s now, not 10
    assert (await ack(stub, "Plain", m)).code == d.INVALID_RECEIPT_HANDLE
    m.system_properties.receipt_handle = r.receipt_handle
    assert (await ack(stub, "Plain", m)).code == d.OK


async def test_after_the_maximum_attempts_a_message_goes_to_the_dead_letter_queue(
    broker: BrokerApp, stub: Stub, clock: ManualClock
) -> None:
    await send(stub, message("Plain", b"poison", "IDP"))
    attempts = []
    for _ in range(3):  # max_reconsume_times 2: three deliveries
        _, got = await receive(stub, "Plain")
        attempts += [m.system_properties.delivery_attempt for m in got]
        clock.advance(11)
    assert attempts == [1, 2, 3]
    assert (await receive(stub, "Plain"))[1] == []
    status, dead = await receive(stub, "%DLQ%g", group="dlq-reader")
    assert status.code == d.OK, status
    assert [m.system_properties.message_id for m in dead] == ["IDP"]


async def test_a_fifo_queue_gives_nothing_more_while_its_message_is_out(
    stub: Stub, clock: ManualClock
) -> None:
    for i in range(4):
        r = await send(stub, message("Ordered", b"%d" % i, f"F{i}", message_group="one"))
        assert r.status.code == d.OK, r.status
    _, first = await receive(stub, "Ordered", batch=1)
    assert [m.body for m in first] == [b"0"]
    assert first[0].system_properties.message_group == "one"
    assert (await receive(stub, "Ordered"))[1] == []  # 0 is out: its queue waits
    clock.advance(11)
    _, again = await receive(stub, "Ordered", batch=1)
    assert [(m.body, m.system_properties.delivery_attempt) for m in again] == [(b"0", 2)]
    assert (await ack(stub, "Ordered", again[0])).code == d.OK
    rest = []
    for _ in range(3):  # one message of the group at a time, each after the last was acked
        _, got = await receive(stub, "Ordered")
        assert len(got) == 1
        assert (await receive(stub, "Ordered"))[1] == []
        assert (await ack(stub, "Ordered", got[0])).code == d.OK
        rest.append(got[0].body)
    assert rest == [b"1", b"2", b"3"]


async def test_a_fifo_receive_takes_one_message_of_each_group(
    stub: Stub,
) -> None:
    for i in range(2):
        for g in ("one", "two"):
            r = await send(
                stub, message("Ordered", b"%s-%d" % (g.encode(), i), f"{g}{i}", message_group=g)
            )
            assert r.status.code == d.OK
    _, got = await receive(stub, "Ordered")
    firsts = sorted(m.body for m in got)
    assert firsts == [b"one-0", b"two-0"]  # "one" and "two" hash to queues of their own or not
    for m in got:
        assert (await ack(stub, "Ordered", m)).code == d.OK
    _, got = await receive(stub, "Ordered")
    assert sorted(m.body for m in got) == [b"one-1", b"two-1"]


async def test_a_message_of_the_wrong_type_is_refused_naming_the_rule(
    stub: Stub,
) -> None:
    r = await send(stub, message("Ordered", b"plain", "IDN"))
    assert r.status.code == d.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE, r.status
    assert "FIFO" in r.status.message
    assert "'Ordered'" in r.status.message
    assert r.entries[0].status.code == d.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE


async def test_in_flight_and_acked_state_survives_a_restart(tmp_path: Path) -> None:
    clock = ManualClock()
    settings = small_settings(tmp_path / "b")
    async with running_broker(settings, clock) as app:
        assert app.topics is not None
        app.topics.put(TopicConfig("Plain", 2, 2))
        async with grpc.aio.insecure_channel(app.address) as ch:
            stub = sg.MessagingServiceStub(ch)
            for i in range(4):
                await send(stub, message("Plain", b"%d" % i, f"R{i}"))
            _, got = await receive(stub, "Plain")
            assert len(got) == 4
            acked = [m for m in got if m.body in (b"0", b"1")]
            for m in acked:
                assert (await ack(stub, "Plain", m)).code == d.OK
    async with (
        running_broker(settings, clock) as app,
        grpc.aio.insecure_channel(app.address) as ch,
    ):
        stub = sg.MessagingServiceStub(ch)
        assert (await receive(stub, "Plain"))[1] == []  # still invisible
        clock.advance(11)
        _, back = await receive(stub, "Plain")
        assert sorted(m.body for m in back) == [b"2", b"3"]
        assert {m.system_properties.delivery_attempt for m in back} == {2}


async def test_auto_renewal_keeps_the_handle_while_the_client_lives(
    broker: BrokerApp, stub: Stub, clock: ManualClock
) -> None:
    assert broker.renewals is not None
    await send(stub, message("Plain", b"slow", "IDS"))
    req = s.ReceiveMessageRequest(
        group=d.Resource(name="g"),
        message_queue=d.MessageQueue(topic=d.Resource(name="Plain"), id=-1),
        filter_expression=d.FilterExpression(type=d.TAG, expression="*"),
        batch_size=32,
        auto_renew=True,
        long_polling_timeout=Duration(seconds=0),
    )
    got = [
        r.message
        async for r in stub.ReceiveMessage(req, metadata=MD, timeout=10)
        if r.HasField("message")
    ]
    assert len(got) == 1
    for _ in range(4):  # three minutes of work, renewed as it goes
        clock.advance(45)
        beat = await stub.Heartbeat(
            s.HeartbeatRequest(client_type=d.PUSH_CONSUMER), metadata=MD, timeout=5
        )  # as a live client does every 10 s
        assert beat.status.code == d.OK
        assert broker.renewals.renew_due() == 1
        assert (await receive(stub, "Plain"))[1] == []
    assert (await ack(stub, "Plain", got[0])).code == d.OK  # the first handle still holds
    assert len(broker.renewals) == 0


async def test_a_client_that_left_is_renewed_no_more(
    broker: BrokerApp, stub: Stub, clock: ManualClock
) -> None:
    assert broker.renewals is not None
    await send(stub, message("Plain", b"orphan", "IDO"))
    req = s.ReceiveMessageRequest(
        group=d.Resource(name="g"),
        message_queue=d.MessageQueue(topic=d.Resource(name="Plain"), id=-1),
        filter_expression=d.FilterExpression(type=d.TAG, expression="*"),
        auto_renew=True,
        long_polling_timeout=Duration(seconds=0),
    )
    got = [
        r.message
        async for r in stub.ReceiveMessage(req, metadata=MD, timeout=10)
        if r.HasField("message")
    ]
    assert len(got) == 1
    r = await stub.NotifyClientTermination(
        s.NotifyClientTerminationRequest(group=d.Resource(name="g")), metadata=MD, timeout=5
    )
    assert r.status.code == d.OK
    clock.advance(45)
    assert broker.renewals.renew_due() == 0
    clock.advance(16)
    _, back = await receive(stub, "Plain")
    assert [(m.body, m.system_properties.delivery_attempt) for m in back] == [(b"orphan", 2)]


async def test_a_retried_send_with_the_same_message_id_is_stored_once(
    stub: Stub,
) -> None:
    first = await send(stub, message("Plain", b"once", "IDDUP"))
    again = await send(stub, message("Plain", b"once", "IDDUP"))
    assert first.status.code == again.status.code == d.OK
    assert again.entries[0].offset == first.entries[0].offset
    _, got = await receive(stub, "Plain")
    assert [m.body for m in got] == [b"once"]
    assert "APOGEE_DEDUP_ID" not in got[0].user_properties


async def test_a_delay_message_can_be_recalled_before_its_time_only(
    broker: BrokerApp, stub: Stub, clock: ManualClock
) -> None:
    due = d.SystemProperties().delivery_timestamp
    due.FromMilliseconds(clock.time_ms() + 60_000)
    r = await send(stub, message("Plain", b"later", "IDL", delivery_timestamp=due))
    assert r.status.code == d.OK, r.status
    handle = r.entries[0].recall_handle
    assert handle, r

    async def recall(topic: str, h: str) -> s.RecallMessageResponse:
        out: s.RecallMessageResponse = await stub.RecallMessage(
            s.RecallMessageRequest(topic=d.Resource(name=topic), recall_handle=h),
            metadata=MD,
            timeout=5,
        )
        return out

    wrong = await recall("Ordered", handle)
    assert wrong.status.code == d.BAD_REQUEST
    assert "'Plain'" in wrong.status.message
    done = await recall("Plain", handle)
    assert done.status.code == d.OK
    assert done.message_id == "IDL"
    assert broker.schedule is not None
    assert "IDL" in broker.schedule.recalls
    assert (await recall("Plain", "bm90IGEgaGFuZGxl")).status.code == d.BAD_REQUEST
    clock.advance(61)
    late = await recall("Plain", handle)
    assert late.status.code == d.NOT_FOUND
    assert "delivered" in late.status.message


async def test_a_delivery_time_beyond_the_horizon_is_refused(
    stub: Stub, clock: ManualClock
) -> None:
    due = d.SystemProperties().delivery_timestamp
    due.FromMilliseconds(clock.time_ms() + 8 * 86_400_000)
    r = await send(stub, message("Plain", b"too late", "IDH", delivery_timestamp=due))
    assert r.status.code == d.ILLEGAL_DELIVERY_TIME, r.status
    assert "timer_max_delay_s" in r.status.message


async def test_fifo_order_holds_across_a_restart_with_a_message_in_flight(tmp_path: Path) -> None:
    clock = ManualClock()
    settings = small_settings(tmp_path / "b")
    async with running_broker(settings, clock) as app:
        assert app.topics is not None
        app.topics.put(TopicConfig("Ordered", 1, 1, message_type=MessageType.FIFO))
        async with grpc.aio.insecure_channel(app.address) as ch:
            stub = sg.MessagingServiceStub(ch)
            for i in range(3):
                await send(stub, message("Ordered", b"%d" % i, f"O{i}", message_group="one"))
            _, first = await receive(stub, "Ordered", batch=1)
            assert [m.body for m in first] == [b"0"]
    async with (
        running_broker(settings, clock) as app,
        grpc.aio.insecure_channel(app.address) as ch,
    ):
        stub = sg.MessagingServiceStub(ch)
        assert (await receive(stub, "Ordered"))[1] == []  # 0 is still out: 1 must wait
        clock.advance(11)
        _, again = await receive(stub, "Ordered")
        assert [(m.body, m.system_properties.delivery_attempt) for m in again] == [(b"0", 2)]
        assert (await ack(stub, "Ordered", again[0])).code == d.OK
        _, then = await receive(stub, "Ordered")
        assert [m.body for m in then] == [b"1"]


async def test_an_ack_that_frees_a_fifo_queue_wakes_a_held_receive(
    broker: BrokerApp, stub: Stub
) -> None:
    assert broker.pop is not None
    pop = broker.pop
    for i in range(2):
        await send(stub, message("Ordered", b"%d" % i, f"W{i}", message_group="one"))
    _, (first,) = await receive(stub, "Ordered")
    held = asyncio.ensure_future(receive(stub, "Ordered", poll=20))
    await eventually(
        lambda: pop.held == 1,
        timeout=10,
        what="the receive held at the broker",
        detail=lambda: f"held={pop.held} done={held.done()} {held.result() if held.done() else ''}",
    )
    assert not held.done()
    started = asyncio.get_running_loop().time()
    assert (await ack(stub, "Ordered", first)).code == d.OK
    _, got = await asyncio.wait_for(held, timeout=10)
    assert [m.body for m in got] == [b"1"]
    assert asyncio.get_running_loop().time() - started < 5  # woken, not timed out at 20 s
