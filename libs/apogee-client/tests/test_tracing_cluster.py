"""Tracing against real nameservers, brokers and the schedule service in this process, every
span recorded in memory: one trace from the producer's send through the broker's store, the
schedule service's hold and deliver, a failed attempt and its retry, to the consumer's receive
and process; the send span's parent and links; batches; the pull consumer; and with tracing
off, no span and no trace property. (e2e/test_tracing.py runs the same with real processes and
the OTLP exporter.)"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from apogee.client import (
    AdminClient,
    Message,
    Producer,
    PullConsumer,
    PushConsumer,
    ReceivedMessage,
    TransactionDecision,
    TransactionMessage,
    TransactionProducer,
)
from apogee.client.producer.validation import validate_message
from apogee.codec import PROP_TRACEPARENT, PROP_TRACESTATE
from apogee.common import tracing
from apogee.testkit.cluster import InProcessCluster, eventually
from apogee_schedule.app import ScheduleApp
from apogee_schedule.settings import ScheduleSettings

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOPIC = "Orders"
#: levels 1, 2, 3 wait 100, 200, 300 ms
DELAYS = "100ms 200ms 300ms 400ms 500ms"
FAST = {
    "rebalance_interval": 1.0,
    "offset_persist_interval": 0.2,
    "long_poll_timeout": 2.0,
    "consume_from": "earliest",
}


class Spans:
    """Every span ended in this process, in memory."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def all(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.all() if s.name == name]


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spans]:
    """The spans of this test; the in-process services trace into them too."""
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tracing, "_made", {})
    recorded = Spans()
    tracing.set_service_provider(recorded.provider)
    yield recorded
    recorded.provider.shutdown()


@pytest.fixture
async def cluster(tmp_path: Path, spans: Spans) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster(
        tmp_path, nameservers=1, brokers=("broker-a",), delay_levels=DELAYS
    ) as c:
        await c.create_topic(TOPIC, queues=1)
        app = ScheduleApp(
            ScheduleSettings(
                namesrv=c.namesrv,
                listen="127.0.0.1:0",
                metrics_listen="127.0.0.1:0",
                lock_file=tmp_path / "schedule.lock",
            )
        )
        await app.start()
        try:
            async with asyncio.timeout(10):
                await app.wait_active()
            yield c
        finally:
            await app.stop()


def ids(s: ReadableSpan) -> tuple[int, int]:
    return s.context.trace_id, s.context.span_id


def parent_id(s: ReadableSpan) -> int | None:
    return s.parent.span_id if s.parent is not None else None


async def test_a_delayed_message_retried_once_is_one_trace(
    cluster: InProcessCluster, spans: Spans
) -> None:
    calls: list[int] = []

    async def listen(msgs: list[ReceivedMessage]) -> None:
        calls.append(msgs[0].reconsume_times)
        current = trace.get_current_span()
        assert current.is_recording()  # the listener runs under its process span
        if len(calls) == 1:
            raise RuntimeError("not yet")

    async with Producer(cluster.namesrv, tracer_provider=spans.provider) as producer:
        sent = await producer.send(Message(TOPIC, b"order-1", tags="created", delay_level=1))
    consumer = PushConsumer(
        cluster.namesrv,
        "g-traced",
        listen,
        first_retry_delay_level=1,
        tracer_provider=spans.provider,
        **FAST,  # type: ignore[arg-type]
    )
    consumer.subscribe(TOPIC)
    async with consumer:
        await consumer.start()

        async def processed_twice() -> bool:
            return len(spans.named(f"process {TOPIC}")) >= 2

        await eventually(processed_twice, 20, "the message processed twice")

    (send,) = spans.named(f"send {TOPIC}")
    trace_id = send.context.trace_id
    assert send.parent is None
    assert send.kind is SpanKind.PRODUCER
    assert send.attributes is not None
    assert send.attributes["messaging.message.id"] == sent.message_id
    assert send.attributes["messaging.apogee.message.delay_time_level"] == 1
    mine = [s for s in spans.all() if s.context.trace_id == trace_id]
    by_id = {s.context.span_id: s for s in mine}
    # every span of the trace leads back to the send span
    for s in mine:
        hop = s
        while hop.parent is not None:
            hop = by_id[hop.parent.span_id]
        assert hop is send, s.name

    names = sorted(s.name for s in mine)
    retry = "%RETRY%g-traced"
    assert names.count("store SCHEDULE_TOPIC_XXXX") == 2  # the delayed message, its retry
    assert names.count(f"hold {TOPIC}") == names.count(f"deliver {TOPIC}") == 1
    assert names.count(f"hold {retry}") == names.count(f"deliver {retry}") == 1
    assert names.count(f"store {TOPIC}") == names.count(f"store {retry}") == 1
    assert names.count(f"receive {TOPIC}") == names.count(f"process {TOPIC}") == 2

    receives = sorted(spans.named(f"receive {TOPIC}"), key=lambda s: s.start_time or 0)
    processes = sorted(spans.named(f"process {TOPIC}"), key=lambda s: s.start_time or 0)
    for r, p in zip(receives, processes, strict=True):
        assert parent_id(r) == send.context.span_id
        assert parent_id(p) == r.context.span_id
    assert [r.attributes["messaging.apogee.reconsume_times"] for r in receives] == [0, 1]  # type: ignore[index]
    assert processes[0].status.status_code is StatusCode.ERROR
    assert processes[1].status.status_code is not StatusCode.ERROR
    # the retry's store span links to the attempt that failed
    stored_retry = [
        s
        for s in spans.named("store SCHEDULE_TOPIC_XXXX")
        if s.attributes and s.attributes.get("messaging.apogee.real_topic") == retry
    ]
    assert len(stored_retry) == 1
    assert [ids(link) for link in stored_retry[0].links] == [ids(processes[0])]  # type: ignore[arg-type]
    (hold,) = spans.named(f"hold {TOPIC}")
    assert hold.attributes is not None
    assert hold.attributes["messaging.apogee.schedule.action"] == "deliver"
    assert (hold.end_time or 0) - (hold.start_time or 0) >= 50_000_000  # held ~100 ms


async def test_with_tracing_off_no_span_and_no_trace_property(
    cluster: InProcessCluster, spans: Spans
) -> None:
    async with Producer(cluster.namesrv) as producer:
        assert producer._tracer is None
        sent = await producer.send(Message(TOPIC, b"plain"))
        stats = producer.stats()
    assert stats.messages == 1
    async with AdminClient(cluster.namesrv) as admin:
        stored = await admin.get_message(sent.message_id)
    assert PROP_TRACEPARENT not in stored.properties
    assert PROP_TRACESTATE not in stored.properties
    assert spans.all() == []  # the broker traces, but the message carries no context


async def test_the_send_span_is_a_child_of_the_callers_span_and_links_a_carried_context(
    cluster: InProcessCluster, spans: Spans
) -> None:
    tracer = spans.provider.get_tracer("test")
    carried = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    props = {PROP_TRACEPARENT: carried, PROP_TRACESTATE: "rojo=00f067aa0ba902b7", "k": "v"}
    validate_message(Message(TOPIC, b"x", properties=props))  # clients may set both
    async with Producer(cluster.namesrv, tracer_provider=spans.provider) as producer:
        with tracer.start_as_current_span("checkout") as outer:
            a = await producer.send(Message(TOPIC, b"a", properties=props))
        b = await producer.send(Message(TOPIC, b"b", properties=props))
    sends = {s.attributes["messaging.message.id"]: s for s in spans.named(f"send {TOPIC}")}  # type: ignore[index]
    in_checkout, redriven = sends[a.message_id], sends[b.message_id]
    assert parent_id(in_checkout) == outer.get_span_context().span_id
    assert [ids(link) for link in in_checkout.links] == [  # type: ignore[arg-type]
        (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331)
    ]
    # no span of the caller's: the carried context is the parent (a redrive stays in its trace)
    assert redriven.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert parent_id(redriven) == 0xB7AD6B7169203331
    async with AdminClient(cluster.namesrv) as admin:
        stored = await admin.get_message(a.message_id)
    # the send span's context replaced the one the message carried; other properties stay
    assert stored.properties[PROP_TRACEPARENT] == tracing.traceparent(in_checkout.context)
    assert PROP_TRACESTATE not in stored.properties
    assert stored.properties["k"] == "v"
    (store,) = [s for s in spans.named(f"store {TOPIC}") if parent_id(s) == ids(in_checkout)[1]]
    assert store.kind is SpanKind.CONSUMER
    assert store.attributes is not None
    assert store.attributes["messaging.apogee.queue_offset"] == a.queue_offset
    assert store.attributes["messaging.apogee.broker_name"] == "broker-a"


async def test_a_batch_has_one_send_span_linked_to_each_messages_create_span(
    cluster: InProcessCluster, spans: Spans
) -> None:
    async with Producer(cluster.namesrv, tracer_provider=spans.provider) as producer:
        results = await producer.send_batch([Message(TOPIC, f"m{i}".encode()) for i in range(3)])
    creates = spans.named(f"create {TOPIC}")
    (send,) = spans.named(f"send {TOPIC}")
    assert send.attributes is not None
    assert send.attributes["messaging.batch.message_count"] == 3
    assert sorted(ids(link) for link in send.links) == sorted(ids(c) for c in creates)  # type: ignore[arg-type]
    async with AdminClient(cluster.namesrv) as admin:
        for r in results:
            stored = await admin.get_message(r.message_id)
            (create,) = [
                c
                for c in creates
                if c.attributes and c.attributes["messaging.message.id"] == r.message_id
            ]
            assert stored.properties[PROP_TRACEPARENT] == tracing.traceparent(create.context)


async def test_pull_consumers_end_receive_spans_at_poll_and_threads_see_the_process_span(
    cluster: InProcessCluster, spans: Spans
) -> None:
    async with Producer(cluster.namesrv, tracer_provider=spans.provider) as producer:
        first = await producer.send(Message(TOPIC, b"pulled"))
    async with PullConsumer(
        cluster.namesrv,
        "g-pull",
        tracer_provider=spans.provider,
        **FAST,  # type: ignore[arg-type]
    ) as puller:
        puller.subscribe(TOPIC)
        await puller.start()
        got: list[ReceivedMessage] = []

        async def polled() -> bool:
            got.extend(await puller.poll(timeout=0.2))
            return bool(got)

        await eventually(polled, 10, "a message polled")
    (receive,) = spans.named(f"receive {TOPIC}")
    (send,) = spans.named(f"send {TOPIC}")
    assert parent_id(receive) == send.context.span_id
    assert receive.attributes is not None
    assert receive.attributes["messaging.message.id"] == first.message_id
    assert receive.attributes["messaging.consumer.group.name"] == "g-pull"

    seen: list[tuple[int, str]] = []

    def listen(msgs: list[ReceivedMessage]) -> None:  # a plain function: on the thread pool
        seen.append(
            (trace.get_current_span().get_span_context().span_id, threading.current_thread().name)
        )

    consumer = PushConsumer(
        cluster.namesrv,
        "g-threads",
        listen,
        tracer_provider=spans.provider,
        **FAST,  # type: ignore[arg-type]
    )
    consumer.subscribe(TOPIC)
    async with consumer:
        await consumer.start()

        async def called() -> bool:
            return bool(seen)

        await eventually(called, 10, "the listener called")
    (process,) = spans.named(f"process {TOPIC}")
    assert seen[0][0] == process.context.span_id
    assert seen[0][1].startswith("apogee-consume-")


async def test_a_transactional_send_is_one_trace_with_its_committed_message(
    cluster: InProcessCluster, spans: Spans
) -> None:
    async def commit(m: TransactionMessage, arg: object) -> TransactionDecision:
        assert trace.get_current_span().is_recording()  # the executor runs under the send span
        return TransactionDecision.COMMIT

    async def rollback(m: TransactionMessage, arg: object) -> TransactionDecision:
        return TransactionDecision.ROLLBACK

    async with TransactionProducer(
        cluster.namesrv, "txn-traced", tracer_provider=spans.provider
    ) as producer:
        done = await producer.send_in_transaction(Message(TOPIC, b"paid", tags="t"), commit)
        dropped = await producer.send_in_transaction(Message(TOPIC, b"void"), rollback)
    assert done.committed
    sends = {s.attributes["messaging.message.id"]: s for s in spans.named(f"send {TOPIC}")}  # type: ignore[index]
    send, other = sends[done.transaction_id], sends[dropped.transaction_id]
    assert send.kind is SpanKind.PRODUCER
    assert send.attributes is not None
    assert send.attributes["messaging.apogee.transaction_id"] == done.transaction_id
    assert send.attributes["messaging.apogee.transaction.end_outcome"] == "COMMITTED"
    assert other.attributes is not None
    assert other.attributes["messaging.apogee.transaction.end_outcome"] == "ROLLED_BACK"
    # the half, and the message the commit stored from it, carry the send span's context
    async with AdminClient(cluster.namesrv) as admin:
        stored = await admin.get_message(done.transaction_id)
    assert stored.topic == TOPIC
    carried = stored.properties[PROP_TRACEPARENT]
    assert carried == tracing.traceparent(send.context)
    mine = [s for s in spans.all() if s.context.trace_id == send.context.trace_id]
    stores = [s for s in mine if s.name.startswith("store ")]
    assert stores
    assert all(parent_id(s) == send.context.span_id for s in stores)
