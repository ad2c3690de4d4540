"""The broker's store spans on a real store: one per stored message that carries a trace
context (child of it, where it went), on the record path and the message path, none for the
others; a failed append ends them with its error; a send-back's copy links to the failed
attempt; and a Resolve asked for trace contexts answers them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from apogee.codec import PROP_TRACEPARENT, PROP_TRACESTATE
from apogee.codec.send import encode_properties, encode_send_record
from apogee.common.clock import ManualClock
from apogee.common.topics import SCHEDULE_TOPIC
from apogee.store import Message, MessageStore, StoreConfig
from apogee.testkit.store import dispatched
from apogee_broker.core.consume.send_back import BackItem, SendBackService
from apogee_broker.core.schedule.layout import ScheduleLayout
from apogee_broker.core.schedule.service import Entry, ScheduleService
from apogee_broker.core.send.record_intake import RecordIntake
from apogee_broker.core.send.service import SendService
from apogee_broker.core.storage.store_spans import _value
from apogee_broker.core.topics import TopicConfig, TopicManager

pytestmark = pytest.mark.unit

KiB = 1024
CONFIG = StoreConfig(
    commitlog_file_size=256 * KiB,
    max_message_size=16 * KiB,
    consume_queue_entries_per_file=64,
    index_slots=97,
    index_entries_per_file=400,
)
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
SEND_SPAN = 0xB7AD6B7169203331
PARENT = f"00-{TRACE_ID:032x}-{SEND_SPAN:016x}-01"
FAILED_ATTEMPT = f"00-{TRACE_ID:032x}-{0x1111:016x}-01"
LAYOUT = ScheduleLayout((1000, 2000, 3000))


@dataclass
class Broker:
    store: MessageStore
    sending: SendService
    exporter: InMemorySpanExporter

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    clock = ManualClock()
    store = MessageStore.open(
        tmp_path / "store", CONFIG, clock=clock, store_host="127.0.0.1:10911", start_retention=False
    )
    topics = TopicManager(tmp_path, default_topic_queues=4, broker_name="b1")
    topics.load()
    topics.put(TopicConfig("Orders", 2, 2))
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sending = SendService(
        store,
        topics,
        broker_name="b1",
        max_message_size=1024,
        max_messages_per_request=8,
        clock=clock,
        layout=LAYOUT,
        tracer=provider.get_tracer("test"),
    )
    try:
        yield Broker(store, sending, exporter)
    finally:
        store.close()
        provider.shutdown()


def attr(span: ReadableSpan, key: str) -> object:
    assert span.attributes is not None
    return span.attributes[key]


def record(body: bytes, props: dict[str, str], uid: str, topic: str = "Orders") -> bytes:
    return bytes(
        encode_send_record(topic.encode(), body, encode_properties("T", (), uid, props), 0)
    )


async def test_each_record_with_a_context_gets_its_store_span(broker: Broker) -> None:
    block = b"".join(
        [
            record(b"a", {PROP_TRACEPARENT: PARENT, PROP_TRACESTATE: "rojo=1"}, "ID-A"),
            record(b"b", {"k": "v"}, "ID-B"),
            record(b"c", {PROP_TRACEPARENT: "not a traceparent"}, "ID-C"),
            record(b"d", {"x": "y", PROP_TRACEPARENT: PARENT}, "ID-D"),
            record(b"e", {PROP_TRACEPARENT: PARENT}, "ID-E", topic="Unknown"),
        ]
    )
    began = time.time_ns()
    out = await RecordIntake(broker.sending).send(block, "10.0.0.1:5000")
    assert list(out.queue_offsets) == [0, 1, 2, 3, -1]
    spans = broker.spans()
    assert sorted(str(attr(s, "messaging.message.id")) for s in spans) == ["ID-A", "ID-D"]
    for s in spans:
        assert s.name == "store Orders"
        assert s.kind is SpanKind.CONSUMER
        assert s.context.trace_id == TRACE_ID
        assert s.parent is not None
        assert s.parent.span_id == SEND_SPAN
        assert (s.start_time or 0) >= began
        assert s.attributes is not None
        assert s.attributes["messaging.destination.partition.id"] == "0"
        assert s.attributes["messaging.apogee.broker_name"] == "b1"
        assert s.status.status_code is StatusCode.UNSET
    by_id = {attr(s, "messaging.message.id"): s for s in spans}
    assert attr(by_id["ID-A"], "messaging.apogee.queue_offset") == 0
    assert attr(by_id["ID-D"], "messaging.apogee.queue_offset") == 3
    assert by_id["ID-A"].parent.trace_state.get("rojo") == "1"  # type: ignore[union-attr]


async def test_a_delayed_message_is_stored_under_the_schedule_topic_with_its_real_topic(
    broker: Broker,
) -> None:
    raw = encode_send_record(
        b"Orders",
        b"later",
        encode_properties(None, (), "ID-L", {PROP_TRACEPARENT: PARENT}),
        1,
        delay_level=2,
    )
    await RecordIntake(broker.sending).send(bytes(raw), "10.0.0.1:5000")
    (span,) = broker.spans()
    assert span.name == f"store {SCHEDULE_TOPIC}"
    assert span.attributes is not None
    assert span.attributes["messaging.apogee.real_topic"] == "Orders"
    assert span.attributes["messaging.apogee.message.delay_time_level"] == 2
    assert span.attributes["messaging.destination.partition.id"] == "1"  # level 2's queue


async def test_a_failed_append_ends_the_spans_with_its_error(broker: Broker) -> None:
    broker.store.close()
    messages = [Message("Orders", b"x", 0, properties={PROP_TRACEPARENT: PARENT})]
    outcomes = await broker.sending.writer.append_internal(messages)
    assert outcomes[0].error is not None
    (span,) = broker.spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.attributes is not None
    assert span.attributes["error.type"] == outcomes[0].error.kind.name


async def test_retries_and_dead_letters_link_to_the_failed_attempt(
    broker: Broker, tmp_path: Path
) -> None:
    intake = RecordIntake(broker.sending)
    block = b"".join(
        [
            record(b"a", {PROP_TRACEPARENT: PARENT}, "ID-A"),
            record(b"b", {}, "ID-B"),
            record(b"c", {PROP_TRACEPARENT: PARENT}, "ID-C"),
        ]
    )
    await intake.send(block, "10.0.0.1:5000")
    dispatched(broker.store)
    back = SendBackService(broker.store, broker.sending.topics, broker.sending.writer, LAYOUT)
    stored = [broker.store.get("Orders", 0, i, 1).messages[0] for i in range(3)]
    items = [
        BackItem("Orders", 0, m.queue_offset, m.phys_offset, m.unique_id, "boom", dlq, 0, tp)
        for m, dlq, tp in zip(
            stored, [False, False, True], [FAILED_ATTEMPT, FAILED_ATTEMPT, ""], strict=True
        )
    ]
    broker.exporter.clear()
    outcomes = await back.send_back("g1", items)
    assert [o.error for o in outcomes] == [None, None, None]
    # the copy without a trace context has no span
    retry, dead = sorted(broker.spans(), key=lambda s: str(attr(s, "messaging.message.id")))
    for s in (retry, dead):
        assert s.parent is not None
        assert s.parent.span_id == SEND_SPAN
    assert retry.name == f"store {SCHEDULE_TOPIC}"
    assert attr(retry, "messaging.apogee.real_topic") == "%RETRY%g1"
    assert attr(retry, "messaging.apogee.reconsume_times") == 1
    (link,) = retry.links
    assert (link.context.trace_id, link.context.span_id) == (TRACE_ID, 0x1111)
    assert dead.name == "store %DLQ%g1"  # a dead letter stays in the trace too
    assert dead.links == ()  # its consumer sent no attempt


async def test_resolve_answers_trace_contexts_when_asked(broker: Broker, tmp_path: Path) -> None:
    intake = RecordIntake(broker.sending)
    for uid, props in (("ID-T", {PROP_TRACEPARENT: PARENT}), ("ID-U", {})):
        raw = encode_send_record(
            b"Orders", b"x", encode_properties(None, (), uid, props), 0, delay_level=1
        )
        await intake.send(bytes(raw), "10.0.0.1:5000")
    dispatched(broker.store)
    service = ScheduleService(
        broker.store,
        broker.sending.topics,
        broker.sending.writer,
        LAYOUT,
        tmp_path,
        clock=ManualClock(),
    )
    found = broker.store.get(SCHEDULE_TOPIC, 0, 0, 2).messages
    entries = [(Entry(0, m.queue_offset, m.phys_offset, m.size, 0), True) for m in found]
    plain = await service.resolve(entries[:1])
    assert plain[0].outcome == "RESOLVED"
    assert plain[0].trace is None
    traced = await service.resolve(entries, trace_context=True)
    assert traced[0].trace is not None
    assert traced[0].trace.traceparent == PARENT
    assert traced[0].trace.unique_id == "ID-T"
    assert traced[0].trace.real_topic == "Orders"
    assert traced[0].trace.store_timestamp_ms == found[0].store_timestamp
    assert traced[1].trace is None


@pytest.mark.parametrize(
    ("props", "value"),
    [
        (b"traceparent\x01P\x02", "P"),
        (b"a\x01b\x02traceparent\x01P\x02", "P"),
        (b"a\x01b\x02traceparent\x01P", "P"),
        (b"xtraceparent\x01P\x02", ""),
        (b"a\x01traceparent\x01\x02", ""),
        (b"", ""),
    ],
)
def test_values_are_found_in_the_bytes(props: bytes, value: str) -> None:
    block = b"HEAD" + props + b"TAIL"
    assert _value(block, 4, 4 + len(props), b"traceparent\x01") == value
