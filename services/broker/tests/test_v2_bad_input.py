"""Bad input over apache.rocketmq.v2, one in-process broker, through the raw stubs: every kind
of bad request the protocol's field guide lists (section 5, "Limits and validation", and the
field rules of 2.5 to 2.7) is answered inside ``Status`` with the code an official client acts
on, and a sentence naming the field; no refusal is a gRPC error. After the whole table the
broker still takes a good message and hands it out."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import grpc
import grpc.aio
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from apogee.common.topics import MessageType, TopicConfig
from apogee.rocketmq.v2 import definition_pb2 as d
from apogee.rocketmq.v2 import service_pb2 as s
from apogee.rocketmq.v2 import service_pb2_grpc as sg
from apogee.testkit.broker import KiB, running_broker, small_settings
from apogee_broker.app import BrokerApp
from apogee_broker.core.pop.handles import encode_handle_text
from apogee_broker.servicers.v2 import clients_rpc

if TYPE_CHECKING:
    from apogee.rocketmq.v2.service_pb2_grpc import MessagingServiceAsyncStub as Stub

pytestmark = pytest.mark.integration

CLIENT: Final = (("x-mq-client-id", "bad-input@1@1@abc"), ("x-mq-language", "PYTHON"))
NO_CLIENT: Final = (("x-mq-language", "PYTHON"),)
MAX_BODY: Final = 256 * KiB  # small_settings' max_message_size
PLAIN: Final = "Plain"
ORDERED: Final = "Ordered"
DELAYED: Final = "Delayed"
HALVES: Final = "Halves"
ANYTHING: Final = "Anything"
GROUP: Final = "BadInputGroup"
TIMEOUT: Final = 10.0


def r(name: str, namespace: str = "") -> d.Resource:
    return d.Resource(name=name, resource_namespace=namespace)


def msg(
    topic: str = PLAIN,
    body: bytes = b"body",
    props: dict[str, str] | None = None,
    namespace: str = "",
    **sp: Any,
) -> d.Message:
    """A v2 message, good unless the arguments make it bad (``sp``: system properties)."""
    sp.setdefault("message_id", "01BAD00000000000000000000000000001")
    sp.setdefault("body_encoding", d.IDENTITY)
    sp.setdefault("message_type", d.NORMAL)
    return d.Message(
        topic=r(topic, namespace),
        body=body,
        user_properties=props or {},
        system_properties=d.SystemProperties(**sp),
    )


def seconds_from_now(s_: float) -> Timestamp:
    t = Timestamp()
    t.GetCurrentTime()
    t.FromMilliseconds(t.ToMilliseconds() + int(s_ * 1000))
    return t


def dur(ms: int) -> Duration:
    out = Duration()
    out.FromMilliseconds(ms)
    return out


Call = Callable[["Stub"], Awaitable[d.Status]]


def send(m: d.Message, md: tuple[tuple[str, str], ...] = CLIENT) -> Call:
    async def call(stub: Stub) -> d.Status:
        out = await stub.SendMessage(s.SendMessageRequest(messages=[m]), metadata=md, timeout=5)
        if out.status.code != d.OK:  # the entry must say the same as the answer
            assert len(out.entries) in (0, 1), out
            if out.entries:
                assert out.entries[0].status.code == out.status.code, out
        return out.status

    return call


def receive(
    group: str = GROUP,
    topic: str = PLAIN,
    md: tuple[tuple[str, str], ...] = CLIENT,
    filter_type: int = d.TAG,
    expression: str = "*",
    invisible_ms: int | None = 10_000,
    group_namespace: str = "",
) -> Call:
    async def call(stub: Stub) -> d.Status:
        req = s.ReceiveMessageRequest(
            group=r(group, group_namespace),
            message_queue=d.MessageQueue(topic=r(topic), id=-1),
            filter_expression=d.FilterExpression(type=filter_type, expression=expression),  # type: ignore[arg-type]
            batch_size=1,
            long_polling_timeout=dur(0),
        )
        if invisible_ms is not None:
            req.invisible_duration.CopyFrom(dur(invisible_ms))
        status = d.Status()
        messages = 0
        async for answer in stub.ReceiveMessage(req, metadata=md, timeout=5):
            if answer.HasField("status"):
                status = answer.status
            messages += answer.HasField("message")
        assert status.code in (d.OK, d.MESSAGE_NOT_FOUND) or messages == 0, (
            "an error status and messages in one stream"
        )
        return status

    return call


def ack(
    handle: str = "garbage", group: str = GROUP, md: tuple[tuple[str, str], ...] = CLIENT
) -> Call:
    async def call(stub: Stub) -> d.Status:
        out = await stub.AckMessage(
            s.AckMessageRequest(
                group=r(group),
                topic=r(PLAIN),
                entries=[s.AckMessageEntry(message_id="X", receipt_handle=handle)],
            ),
            metadata=md,
            timeout=5,
        )
        return out.status

    return call


def change_invisible(
    handle: str = "garbage", ms: int = 10_000, md: tuple[tuple[str, str], ...] = CLIENT
) -> Call:
    async def call(stub: Stub) -> d.Status:
        out = await stub.ChangeInvisibleDuration(
            s.ChangeInvisibleDurationRequest(
                group=r(GROUP),
                topic=r(PLAIN),
                receipt_handle=handle,
                invisible_duration=dur(ms),
                message_id="X",
            ),
            metadata=md,
            timeout=5,
        )
        return out.status

    return call


def forward_to_dlq(handle: str = "garbage") -> Call:
    async def call(stub: Stub) -> d.Status:
        out = await stub.ForwardMessageToDeadLetterQueue(
            s.ForwardMessageToDeadLetterQueueRequest(
                group=r(GROUP),
                topic=r(PLAIN),
                receipt_handle=handle,
                message_id="X",
                delivery_attempt=17,
                max_delivery_attempts=17,
            ),
            metadata=CLIENT,
            timeout=5,
        )
        return out.status

    return call


def end_transaction(tid: str, md: tuple[tuple[str, str], ...] = CLIENT) -> Call:
    async def call(stub: Stub) -> d.Status:
        out = await stub.EndTransaction(
            s.EndTransactionRequest(
                topic=r(HALVES),
                message_id="X",
                transaction_id=tid,
                resolution=d.COMMIT,
                source=d.SOURCE_CLIENT,
            ),
            metadata=md,
            timeout=5,
        )
        return out.status

    return call


def end_under_another_topic(topic: str) -> Call:
    """End a transaction just begun in topic Halves, naming ``topic``."""

    async def call(stub: Stub) -> d.Status:
        half = msg(
            HALVES, message_type=d.TRANSACTION, message_id="01BAD000000000000000000000000000AA"
        )
        begun = await stub.SendMessage(
            s.SendMessageRequest(messages=[half]), metadata=CLIENT, timeout=5
        )
        assert begun.status.code == d.OK, begun
        out = await stub.EndTransaction(
            s.EndTransactionRequest(
                topic=r(topic),
                message_id=half.system_properties.message_id,
                transaction_id=begun.entries[0].transaction_id,
                resolution=d.COMMIT,
                source=d.SOURCE_CLIENT,
            ),
            metadata=CLIENT,
            timeout=5,
        )
        return out.status

    return call


def recall(handle: str) -> Call:
    async def call(stub: Stub) -> d.Status:
        out = await stub.RecallMessage(
            s.RecallMessageRequest(topic=r(DELAYED), recall_handle=handle),
            metadata=CLIENT,
            timeout=5,
        )
        return out.status

    return call


def query_route(topic: str, namespace: str = "") -> Call:
    async def call(stub: Stub) -> d.Status:
        out = await stub.QueryRoute(
            s.QueryRouteRequest(topic=r(topic, namespace)), metadata=CLIENT, timeout=5
        )
        return out.status

    return call


def query_assignment(
    group: str, md: tuple[tuple[str, str], ...] = CLIENT, topic: str = PLAIN
) -> Call:
    async def call(stub: Stub) -> d.Status:
        out = await stub.QueryAssignment(
            s.QueryAssignmentRequest(topic=r(topic), group=r(group)), metadata=md, timeout=5
        )
        return out.status

    return call


def heartbeat(group: str, md: tuple[tuple[str, str], ...] = CLIENT) -> Call:
    async def call(stub: Stub) -> d.Status:
        out = await stub.Heartbeat(
            s.HeartbeatRequest(group=r(group), client_type=d.SIMPLE_CONSUMER),
            metadata=md,
            timeout=5,
        )
        return out.status

    return call


def telemetry(settings: d.Settings | None, md: tuple[tuple[str, str], ...] = CLIENT) -> Call:
    """The status of the broker's first answer on a Telemetry stream that sent ``settings``
    (None: nothing; a stream refused at once may end before a write would get through)."""

    async def call(stub: Stub) -> d.Status:
        stream = stub.Telemetry(metadata=md, timeout=5)
        if settings is not None:
            await stream.write(s.TelemetryCommand(settings=settings))
        try:
            first = await stream.read()
            assert isinstance(first, s.TelemetryCommand), "the stream ended without an answer"
            return first.status
        finally:
            stream.cancel()

    return call


def subscriber(group: str, topic: str = PLAIN) -> d.Settings:
    return d.Settings(
        client_type=d.SIMPLE_CONSUMER,
        subscription=d.Subscription(
            group=r(group),
            subscriptions=[
                d.SubscriptionEntry(
                    topic=r(topic), expression=d.FilterExpression(type=d.TAG, expression="*")
                )
            ],
        ),
    )


def unserved(rpc: str) -> Call:
    async def call(stub: Stub) -> d.Status:
        queue = d.MessageQueue(topic=r(PLAIN), id=0)
        if rpc == "PullMessage":
            req = s.PullMessageRequest(group=r(GROUP), message_queue=queue, batch_size=1)
            status = d.Status()
            async for answer in stub.PullMessage(req, metadata=CLIENT, timeout=5):
                if answer.HasField("status"):
                    status = answer.status
            return status
        if rpc == "UpdateOffset":
            u = s.UpdateOffsetRequest(group=r(GROUP), message_queue=queue, offset=1)
            return (await stub.UpdateOffset(u, metadata=CLIENT, timeout=5)).status
        if rpc == "GetOffset":
            g = s.GetOffsetRequest(group=r(GROUP), message_queue=queue)
            return (await stub.GetOffset(g, metadata=CLIENT, timeout=5)).status
        if rpc == "QueryOffset":
            q = s.QueryOffsetRequest(message_queue=queue, query_offset_policy=d.BEGINNING)
            return (await stub.QueryOffset(q, metadata=CLIENT, timeout=5)).status
        lite = s.SyncLiteSubscriptionRequest(topic=r(PLAIN), group=r(GROUP), lite_topic_set=["a"])
        return (await stub.SyncLiteSubscription(lite, metadata=CLIENT, timeout=5)).status

    return call


@dataclass(frozen=True)
class Case:
    """A bad request, the code its answer must carry, and words its sentence must contain
    (the field, and where useful the rule)."""

    id: str
    call: Call
    code: int
    words: tuple[str, ...]


GROUP_TOO_LONG: Final = "G" * 300
MANY_PROPS: Final = {f"p{i}": "v" for i in range(129)}
BIG_PROPS: Final = {"big": "v" * (16 * KiB + 1)}

CASES: Final = (
    # topic names (^[%|a-zA-Z0-9_-]+$, at most 127)
    Case("send-topic-space", send(msg("bad topic")), d.ILLEGAL_TOPIC, ("topic", "character")),
    Case("send-topic-slash", send(msg("a/b")), d.ILLEGAL_TOPIC, ("topic", "character")),
    Case("send-topic-newline", send(msg("Plain\n")), d.ILLEGAL_TOPIC, ("topic",)),
    Case("send-topic-128", send(msg("T" * 128)), d.ILLEGAL_TOPIC, ("topic", "127")),
    Case("send-topic-empty", send(msg("")), d.ILLEGAL_TOPIC, ("topic", "empty")),
    Case("route-topic-bad", query_route("a b"), d.ILLEGAL_TOPIC, ("topic",)),
    # the brokers' own topics: never a client's (a receive would hand out uncommitted halves)
    Case(
        "receive-system-topic",
        receive(topic="RMQ_SYS_TRANS_HALF_TOPIC"),
        d.ILLEGAL_TOPIC,
        ("message_queue.topic", "system topic"),
    ),
    Case("send-system-topic", send(msg("TBW102")), d.ILLEGAL_TOPIC, ("message.topic", "system")),
    Case(
        "route-system-topic",
        query_route("SCHEDULE_TOPIC_XXXX"),
        d.ILLEGAL_TOPIC,
        ("topic", "system topic"),
    ),
    Case("receive-topic-bad", receive(topic="x y"), d.ILLEGAL_TOPIC, ("topic",)),
    Case("receive-topic-128", receive(topic="T" * 128), d.ILLEGAL_TOPIC, ("topic", "127")),
    # unknown topic
    Case("send-unknown-topic", send(msg("NoSuchTopic")), d.TOPIC_NOT_FOUND, ("NoSuchTopic",)),
    Case("route-unknown-topic", query_route("NoSuchTopic"), d.TOPIC_NOT_FOUND, ("NoSuchTopic",)),
    Case(
        "assignment-unknown-topic",
        query_assignment(GROUP, topic="NoSuchTopic"),
        d.TOPIC_NOT_FOUND,
        ("NoSuchTopic",),
    ),
    Case(
        "receive-unknown-topic",
        receive(topic="NoSuchTopic"),
        d.TOPIC_NOT_FOUND,
        ("NoSuchTopic",),
    ),
    # consumer groups (the topic rule, at most 120 characters)
    Case("receive-group-space", receive("bad group"), d.ILLEGAL_CONSUMER_GROUP, ("group",)),
    Case("receive-group-empty", receive(""), d.ILLEGAL_CONSUMER_GROUP, ("group", "empty")),
    Case("receive-group-long", receive(GROUP_TOO_LONG), d.ILLEGAL_CONSUMER_GROUP, ("group",)),
    Case("ack-group-bad", ack(group="a/b"), d.ILLEGAL_CONSUMER_GROUP, ("group",)),
    Case("heartbeat-group-bad", heartbeat("a\tb"), d.ILLEGAL_CONSUMER_GROUP, ("group",)),
    Case("assignment-group-bad", query_assignment("a b"), d.ILLEGAL_CONSUMER_GROUP, ("group",)),
    Case(
        "telemetry-group-bad",
        telemetry(subscriber("a b")),
        d.ILLEGAL_CONSUMER_GROUP,
        ("settings.subscription.group",),
    ),
    Case(  # the same client's next stream (its first is gone), a type no client has
        "telemetry-topic-bad",
        telemetry(d.Settings(client_type=99, publishing=d.Publishing(topics=[r("a b")]))),  # type: ignore[arg-type]
        d.ILLEGAL_TOPIC,
        ("topic 'a b'",),
    ),
    # bodies
    Case("body-empty", send(msg(body=b"")), d.MESSAGE_BODY_EMPTY, ("body", "empty")),
    Case(
        "body-too-large",
        send(msg(body=b"x" * (MAX_BODY + 1))),
        d.MESSAGE_BODY_TOO_LARGE,
        ("body", str(MAX_BODY)),
    ),
    # tags, keys, message groups
    Case("tag-bar", send(msg(tag="a|b")), d.ILLEGAL_MESSAGE_TAG, ("tag", "|")),
    Case("tag-control", send(msg(tag="a\x01b")), d.ILLEGAL_MESSAGE_TAG, ("tag",)),
    Case("tag-newline", send(msg(tag="a\nb")), d.ILLEGAL_MESSAGE_TAG, ("tag",)),
    Case("tag-blank", send(msg(tag=" ")), d.ILLEGAL_MESSAGE_TAG, ("tag", "blank")),
    Case("key-blank", send(msg(keys=["k", " "])), d.ILLEGAL_MESSAGE_KEY, ("keys[1]", "blank")),
    Case("key-empty", send(msg(keys=[""])), d.ILLEGAL_MESSAGE_KEY, ("keys[0]", "blank")),
    Case(
        "message-group-64-bytes",
        send(msg(ORDERED, message_group="g" * 64, message_type=d.FIFO)),
        d.ILLEGAL_MESSAGE_GROUP,
        ("message_group", "64"),
    ),
    Case(
        "message-group-64-bytes-cjk",
        send(msg(ORDERED, message_group="漢" * 22, message_type=d.FIFO)),
        d.ILLEGAL_MESSAGE_GROUP,
        ("message_group", "66 bytes"),
    ),
    # delivery time
    Case(
        "delivery-beyond-horizon",
        send(msg(DELAYED, delivery_timestamp=seconds_from_now(8 * 86_400), message_type=d.DELAY)),
        d.ILLEGAL_DELIVERY_TIME,
        ("deliver", "timer_max_delay_s"),
    ),
    Case(
        "delivery-before-epoch",
        send(msg(DELAYED, delivery_timestamp=Timestamp(seconds=-5), message_type=d.DELAY)),
        d.ILLEGAL_DELIVERY_TIME,
        ("delivery_timestamp",),
    ),
    Case(
        "delivery-beyond-timestamps",
        send(msg(DELAYED, delivery_timestamp=Timestamp(seconds=2**62), message_type=d.DELAY)),
        d.ILLEGAL_DELIVERY_TIME,
        ("delivery_timestamp", "not a valid timestamp"),
    ),
    # born time and host: checked, or replaced by what the broker sees
    Case(
        "born-beyond-timestamps",
        send(msg(ANYTHING, born_timestamp=Timestamp(seconds=-(2**62)))),
        d.BAD_REQUEST,
        ("born_timestamp", "not a valid timestamp"),
    ),
    Case(
        "born-nanos-negative",
        send(msg(ANYTHING, born_timestamp=Timestamp(seconds=5, nanos=-1))),
        d.BAD_REQUEST,
        ("born_timestamp", "not a valid timestamp"),
    ),
    Case("born-host-nul", send(msg(ANYTHING, born_host="a\x00b")), d.OK, ("OK",)),
    # invisible time
    Case(
        "receive-invisible-too-short",
        receive(invisible_ms=500),
        d.ILLEGAL_INVISIBLE_TIME,
        ("invisible_duration",),
    ),
    Case(
        "receive-invisible-too-long",
        receive(invisible_ms=13 * 3_600_000),
        d.ILLEGAL_INVISIBLE_TIME,
        ("invisible_duration", "12 h"),
    ),
    Case(
        "receive-invisible-negative",
        receive(invisible_ms=-10_000),
        d.ILLEGAL_INVISIBLE_TIME,
        ("invisible_duration",),
    ),
    Case(
        "change-invisible-negative",
        change_invisible(ms=-1000),
        d.ILLEGAL_INVISIBLE_TIME,
        ("invisible_duration",),
    ),
    Case(
        "change-invisible-too-long",
        change_invisible(ms=13 * 3_600_000),
        d.ILLEGAL_INVISIBLE_TIME,
        ("invisible_duration", "12 h"),
    ),
    # message id
    Case("message-id-missing", send(msg(message_id="")), d.ILLEGAL_MESSAGE_ID, ("message_id",)),
    # user properties
    Case(
        "property-named-tags",
        send(msg(props={"TAGS": "x"})),
        d.ILLEGAL_MESSAGE_PROPERTY_KEY,
        ("user_properties", "TAGS", "system property"),
    ),
    Case(
        "property-named-uniq-key",
        send(msg(props={"UNIQ_KEY": "x"})),
        d.ILLEGAL_MESSAGE_PROPERTY_KEY,
        ("user_properties", "UNIQ_KEY"),
    ),
    Case(
        "property-named-sharding-key",
        send(msg(props={"__SHARDINGKEY": "x"})),
        d.ILLEGAL_MESSAGE_PROPERTY_KEY,
        ("user_properties", "__SHARDINGKEY"),
    ),
    Case(
        "property-named-tran-msg",
        send(msg(props={"TRAN_MSG": "true"})),
        d.ILLEGAL_MESSAGE_PROPERTY_KEY,
        ("user_properties", "TRAN_MSG"),
    ),
    Case(
        "property-name-empty",
        send(msg(props={"": "x"})),
        d.ILLEGAL_MESSAGE_PROPERTY_KEY,
        ("user_properties",),
    ),
    Case(
        "properties-too-many",
        send(msg(props=MANY_PROPS)),
        d.MESSAGE_PROPERTIES_TOO_LARGE,
        ("user_properties", "129", "128"),
    ),
    Case(
        "properties-too-large",
        send(msg(props=BIG_PROPS)),
        d.MESSAGE_PROPERTIES_TOO_LARGE,
        ("user_properties", "16384"),
    ),
    # namespaces
    Case(
        "send-namespace",
        send(msg(namespace="ns")),
        d.BAD_REQUEST,
        ("message.topic.resource_namespace", "namespaces are not supported"),
    ),
    Case(
        "route-namespace",
        query_route(PLAIN, "ns"),
        d.BAD_REQUEST,
        ("topic.resource_namespace", "namespaces are not supported"),
    ),
    Case(
        "receive-group-namespace",
        receive(group_namespace="ns"),
        d.BAD_REQUEST,
        ("group.resource_namespace", "namespaces are not supported"),
    ),
    # filters
    Case(
        "sql-unbalanced",
        receive(filter_type=d.SQL, expression="a = 'b' AND ("),
        d.ILLEGAL_FILTER_EXPRESSION,
        ("filter_expression",),
    ),
    Case(
        "sql-garbage",
        receive(filter_type=d.SQL, expression="))) ?? !!"),
        d.ILLEGAL_FILTER_EXPRESSION,
        ("filter_expression",),
    ),
    # receipt handles, transaction ids, recall handles
    Case("ack-garbage-handle", ack("garbage"), d.INVALID_RECEIPT_HANDLE, ("receipt_handle",)),
    Case("ack-empty-handle", ack(""), d.INVALID_RECEIPT_HANDLE, ("receipt_handle",)),
    Case(
        "ack-base64-handle",
        ack("bm90IGEgaGFuZGxl"),
        d.INVALID_RECEIPT_HANDLE,
        ("receipt_handle",),
    ),
    Case(
        "change-invisible-garbage-handle",
        change_invisible("garbage"),
        d.INVALID_RECEIPT_HANDLE,
        ("receipt_handle",),
    ),
    Case(
        "dlq-garbage-handle",
        forward_to_dlq("garbage"),
        d.INVALID_RECEIPT_HANDLE,
        ("receipt_handle",),
    ),
    Case(
        "transaction-id-garbage",
        end_transaction("garbage"),
        d.INVALID_TRANSACTION_ID,
        ("transaction_id",),
    ),
    Case(
        "transaction-id-empty", end_transaction(""), d.INVALID_TRANSACTION_ID, ("transaction_id",)
    ),
    Case(
        "transaction-id-bad-offset",
        end_transaction("broker-a|x|ID"),
        d.INVALID_TRANSACTION_ID,
        ("transaction_id",),
    ),
    Case(
        "transaction-id-no-such-half",
        end_transaction("broker-a|5|ID"),
        d.INVALID_TRANSACTION_ID,
        ("transaction_id", "half_offset"),
    ),
    Case(
        "transaction-id-offset-beyond-int64",
        end_transaction(f"broker-b|{2**64}|ID"),
        d.INVALID_TRANSACTION_ID,
        ("transaction_id",),
    ),
    Case(
        "transaction-of-another-topic",
        end_under_another_topic(ANYTHING),
        d.BAD_REQUEST,
        ("topic 'Anything'", "'Halves'"),
    ),
    Case("recall-garbage", recall("garbage"), d.BAD_REQUEST, ("recall_handle",)),
    Case(
        "recall-due-beyond-int64",
        recall(encode_handle_text("broker-a", str(2**64), "ID", DELAYED)),
        d.BAD_REQUEST,
        ("recall_handle",),
    ),
    Case("recall-empty", recall(""), d.BAD_REQUEST, ("recall_handle",)),
    # the client id header
    Case("send-no-client-id", send(msg(), NO_CLIENT), d.CLIENT_ID_REQUIRED, ("x-mq-client-id",)),
    Case("receive-no-client-id", receive(md=NO_CLIENT), d.CLIENT_ID_REQUIRED, ("x-mq-client-id",)),
    Case("ack-no-client-id", ack(md=NO_CLIENT), d.CLIENT_ID_REQUIRED, ("x-mq-client-id",)),
    Case(
        "change-invisible-no-client-id",
        change_invisible(md=NO_CLIENT),
        d.CLIENT_ID_REQUIRED,
        ("x-mq-client-id",),
    ),
    Case(
        "heartbeat-no-client-id",
        heartbeat(GROUP, NO_CLIENT),
        d.CLIENT_ID_REQUIRED,
        ("x-mq-client-id",),
    ),
    Case(
        "assignment-no-client-id",
        query_assignment(GROUP, NO_CLIENT),
        d.CLIENT_ID_REQUIRED,
        ("x-mq-client-id",),
    ),
    Case(
        "end-transaction-no-client-id",
        end_transaction("garbage", NO_CLIENT),
        d.CLIENT_ID_REQUIRED,
        ("x-mq-client-id",),
    ),
    Case(
        "telemetry-no-client-id",
        telemetry(None, NO_CLIENT),
        d.CLIENT_ID_REQUIRED,
        ("x-mq-client-id",),
    ),
    # what Apogee does not serve
    Case("type-lite", send(msg(message_type=d.LITE)), d.UNSUPPORTED, ("message_type", "LITE")),
    Case(
        "type-priority",
        send(msg(message_type=d.PRIORITY)),
        d.UNSUPPORTED,
        ("message_type", "PRIORITY"),
    ),
    Case("pull", unserved("PullMessage"), d.NOT_IMPLEMENTED, ("PullMessage",)),
    Case("update-offset", unserved("UpdateOffset"), d.NOT_IMPLEMENTED, ("UpdateOffset",)),
    Case("get-offset", unserved("GetOffset"), d.NOT_IMPLEMENTED, ("GetOffset",)),
    Case("query-offset", unserved("QueryOffset"), d.NOT_IMPLEMENTED, ("QueryOffset",)),
    Case("sync-lite", unserved("SyncLiteSubscription"), d.UNSUPPORTED, ("lite topics",)),
    # a type the topic does not accept
    Case(
        "normal-to-fifo-topic",
        send(msg(ORDERED)),
        d.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE,
        ("'Ordered'", "FIFO", "NORMAL"),
    ),
    Case(
        "fifo-to-normal-topic",
        send(msg(PLAIN, message_group="g1", message_type=d.FIFO)),
        d.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE,
        ("'Plain'", "FIFO", "NORMAL"),
    ),
    Case(
        "delay-to-fifo-topic",
        send(msg(ORDERED, delivery_timestamp=seconds_from_now(60), message_type=d.DELAY)),
        d.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE,
        ("'Ordered'", "DELAY"),
    ),
    Case(
        "transaction-to-normal-topic",
        send(msg(PLAIN, message_type=d.TRANSACTION)),
        d.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE,
        ("'Plain'", "TRANSACTION"),
    ),
)


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[BrokerApp]:
    async with running_broker(small_settings(tmp_path / "b")) as app:
        assert app.topics is not None
        app.topics.put(TopicConfig(PLAIN, 2, 2, message_type=MessageType.NORMAL))
        app.topics.put(TopicConfig(ORDERED, 2, 2, message_type=MessageType.FIFO))
        app.topics.put(TopicConfig(DELAYED, 2, 2, message_type=MessageType.DELAY))
        app.topics.put(TopicConfig(HALVES, 2, 2, message_type=MessageType.TRANSACTION))
        app.topics.put(TopicConfig(ANYTHING, 2, 2, message_type=MessageType.MIXED))
        yield app


async def test_a_clients_next_telemetry_stream_gets_its_answer_at_once(
    broker: BrokerApp, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client whose stream broke opens another: the answer to its Settings goes to the new
    stream, not to what waited on the old one (the broker's second offer of it, a second later,
    is put off here so that only the first can pass)."""
    monkeypatch.setattr(clients_rpc, "SETTINGS_REPEAT_S", 60.0)
    async with grpc.aio.insecure_channel(broker.address) as channel:
        stub: Stub = sg.MessagingServiceStub(channel)
        for group in ("First", "Second", "Third"):
            status = await telemetry(subscriber(group))(stub)
            assert status.code == d.OK, (group, status)


def test_case_ids_are_unique() -> None:
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


async def test_every_bad_input_gets_its_code_and_a_sentence_naming_the_field(
    broker: BrokerApp,
) -> None:
    wrong: list[str] = []
    async with grpc.aio.insecure_channel(broker.address) as channel:
        stub = sg.MessagingServiceStub(channel)
        for case in CASES:
            try:
                status = await case.call(stub)
            except grpc.aio.AioRpcError as exc:
                wrong.append(f"{case.id}: gRPC error {exc.code().name}: {exc.details()}")
                continue
            except AssertionError as exc:  # what a case checks on the way
                wrong.append(f"{case.id}: {exc}")
                continue
            got = d.Code.Name(status.code)
            want = d.Code.Name(case.code)  # type: ignore[arg-type]
            missing = [w for w in case.words if w not in status.message]
            if got != want or missing:
                wrong.append(
                    f"{case.id}: {got} {status.message!r}, expected {want}"
                    + (f" naming {missing}" if missing else "")
                )

        # the broker still serves: its route (it has no nameserver: itself), a good message
        # sent, received and acked
        route = await stub.QueryRoute(
            s.QueryRouteRequest(topic=r(PLAIN)), metadata=CLIENT, timeout=TIMEOUT
        )
        assert route.status.code == d.OK, route
        assert [
            (q.id, q.permission, list(q.accept_message_types)) for q in route.message_queues
        ] == [
            (0, d.READ_WRITE, [d.NORMAL]),
            (1, d.READ_WRITE, [d.NORMAL]),
        ]
        address = route.message_queues[0].broker.endpoints.addresses[0]
        assert f"{address.host}:{address.port}" == broker.address
        good = msg(PLAIN, b"after the bad input", message_id="01BAD000000000000000000000000000FF")
        sent = await stub.SendMessage(
            s.SendMessageRequest(messages=[good]), metadata=CLIENT, timeout=TIMEOUT
        )
        assert sent.status.code == d.OK, sent
        got_back: list[d.Message] = []
        req = s.ReceiveMessageRequest(
            group=r(GROUP),
            message_queue=d.MessageQueue(topic=r(PLAIN), id=-1),
            filter_expression=d.FilterExpression(type=d.TAG, expression="*"),
            batch_size=32,
            invisible_duration=dur(30_000),
            long_polling_timeout=dur(5_000),
        )
        async for answer in stub.ReceiveMessage(req, metadata=CLIENT, timeout=TIMEOUT):
            if answer.HasField("message"):
                got_back.append(answer.message)
        assert [m.body for m in got_back] == [b"after the bad input"], got_back
        acked = await stub.AckMessage(
            s.AckMessageRequest(
                group=r(GROUP),
                topic=r(PLAIN),
                entries=[
                    s.AckMessageEntry(
                        message_id=got_back[0].system_properties.message_id,
                        receipt_handle=got_back[0].system_properties.receipt_handle,
                    )
                ],
            ),
            metadata=CLIENT,
            timeout=TIMEOUT,
        )
        assert acked.status.code == d.OK, acked
    assert not wrong, f"{len(wrong)} of {len(CASES)} answers are not as the guide says:\n" + (
        "\n".join(wrong)
    )
