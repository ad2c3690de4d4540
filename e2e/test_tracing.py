"""Tracing end to end: a nameserver, a broker and the schedule service as real processes, each
started with the standard OTEL_* environment, export their spans with the OTLP exporter to a
small OTLP/gRPC receiver in this test (``TraceService/Export``, on a free port); the producer and
the consumer run in the test and export to it the same way (``tracer_provider``).

- a message delayed (schedule service), failed once by the consumer's listener (retried through
  ``%RETRY%<group>``) and then consumed is one trace: the producer's send span its root, the
  broker's store spans, the schedule service's hold and deliver spans, the consumer's receive and
  process spans all below it, and the retry's store span linked to the attempt that failed;
- with tracing off in the producer, no ``traceparent`` is added to the message (and the broker,
  which traces, makes no span for it).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from apogee.client import AdminClient, Message, Producer, PushConsumer, ReceivedMessage
from apogee.codec import PROP_TRACEPARENT, PROP_TRACESTATE
from apogee.common import tracing
from apogee.local import cluster as local_cluster
from e2e.harness import (
    BROKER_ENV,
    NAMESERVER_ENV,
    SCHEDULE_ENV,
    START_TIMEOUT,
    Cluster,
    eventually,
    in_thread,
    wait_for_route,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOPIC = "E2ETracing"
GROUP = "e2e-tracing"
RETRY = f"%RETRY%{GROUP}"
SCHEDULE = "SCHEDULE_TOPIC_XXXX"
#: level 1 (the message's delay) waits 500 ms, level 2 (its retry) 300 ms
DELAY_LEVELS = "500ms 300ms 300ms"
APP = "e2e-app"


@dataclass
class Span:
    """One span as the receiver got it."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    links: list[tuple[str, str]]
    status_code: int
    start_ns: int
    end_ns: int


def _value(v: common_pb2.AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


@dataclass
class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """OTLP/gRPC trace receiver: keeps every span exported to it."""

    spans: list[Span] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        got: list[Span] = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            str(resource.get("service.name", "")),
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.kind,
                            {a.key: _value(a.value) for a in s.attributes},
                            [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                            s.status.code,
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                        )
                    )
        with self.lock:
            self.spans += got
        return trace_service_pb2.ExportTraceServiceResponse()

    def all(self) -> list[Span]:
        with self.lock:
            return list(self.spans)


@dataclass
class Traced:
    """The receiver at ``endpoint``, and the cluster exporting to it."""

    receiver: Receiver
    endpoint: str
    cluster: Cluster

    def provider(self) -> TracerProvider:
        """What the test's producers and consumers trace with: the OTLP exporter, batched."""
        provider = TracerProvider(resource=Resource({"service.name": APP}))
        exporter = OTLPSpanExporter(endpoint=self.endpoint, insecure=True)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=100))
        return provider


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Traced]:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    otel = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    data = tmp_path_factory.mktemp("tracing-cluster")
    try:
        state = in_thread(
            lambda: local_cluster.up(
                data,
                brokers=1,
                nameservers=1,
                timeout=START_TIMEOUT,
                nameserver_env=dict(NAMESERVER_ENV),
                broker_env={**BROKER_ENV, "APOGEE_BROKER_DELAY_LEVELS": DELAY_LEVELS, **otel},
                schedule_env={**SCHEDULE_ENV, **otel},
                txn_checker=False,
                console=False,
            )
        )
        cluster = Cluster(state)
        try:
            yield Traced(receiver, endpoint, cluster)
        finally:
            cluster.close()
    finally:
        server.stop(grace=None)


async def make_topic(cluster: Cluster) -> None:
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic(TOPIC, queues=2)
    await wait_for_route(cluster.nameservers, TOPIC, {b.name for b in cluster.brokers})


def in_trace(spans: list[Span], trace_id: str) -> list[Span]:
    return [s for s in spans if s.trace_id == trace_id]


def names(spans: list[Span]) -> list[str]:
    return sorted(s.name for s in spans)


#: The spans of a message delayed, failed once, then consumed (one per name, but where noted).
EXPECTED = sorted(
    [
        f"send {TOPIC}",
        f"store {SCHEDULE}",  # the delayed message under the schedule topic
        f"hold {TOPIC}",
        f"deliver {TOPIC}",
        f"store {TOPIC}",
        f"receive {TOPIC}",
        f"process {TOPIC}",  # failed
        f"store {SCHEDULE}",  # its retry, sent back, under the schedule topic
        f"hold {RETRY}",
        f"deliver {RETRY}",
        f"store {RETRY}",
        f"receive {TOPIC}",  # the retry, shown under its original topic
        f"process {TOPIC}",  # succeeded
    ]
)


async def test_a_delayed_message_retried_once_then_consumed_is_one_trace(traced: Traced) -> None:
    cluster = traced.cluster
    await make_topic(cluster)
    provider = traced.provider()
    calls: list[int] = []

    async def listen(msgs: list[ReceivedMessage]) -> None:
        calls.append(msgs[0].reconsume_times)
        if len(calls) == 1:
            raise RuntimeError("the first attempt fails")

    try:
        consumer = PushConsumer(
            cluster.namesrv,
            GROUP,
            listen,
            consume_from="earliest",
            first_retry_delay_level=2,
            rebalance_interval=1.0,
            long_poll_timeout=2.0,
            tracer_provider=provider,
        )
        consumer.subscribe(TOPIC)
        async with consumer:
            await consumer.start()
            async with Producer(cluster.namesrv, tracer_provider=provider) as producer:
                sent = await producer.send(Message(TOPIC, b"order-7", tags="paid", delay_level=1))

            def the_send() -> Span | None:
                return next(
                    (
                        s
                        for s in traced.receiver.all()
                        if s.name == f"send {TOPIC}"
                        and s.attributes.get("messaging.message.id") == sent.message_id
                    ),
                    None,
                )

            async def whole_trace() -> bool:
                await asyncio.to_thread(provider.force_flush, 1000)
                send = the_send()
                return (
                    send is not None
                    and names(in_trace(traced.receiver.all(), send.trace_id)) == EXPECTED
                )

            await eventually(whole_trace, 30, f"the spans of the message: {EXPECTED}")
        assert calls == [0, 1]
    finally:
        provider.shutdown()

    send = the_send()
    assert send is not None
    spans = in_trace(traced.receiver.all(), send.trace_id)
    by_id = {s.span_id: s for s in spans}
    # the producer's send span is the root, and every span of the trace leads back to it
    assert send.parent_span_id == ""
    assert send.kind == trace_pb2.Span.SPAN_KIND_PRODUCER
    for s in spans:
        hop = s
        while hop.parent_span_id:
            hop = by_id[hop.parent_span_id]
        assert hop is send, s.name
    services = {s.name.split(" ")[0]: s.service for s in spans}
    assert services == {
        "send": APP,
        "store": "apogee-broker",
        "hold": "apogee-schedule",
        "deliver": "apogee-schedule",
        "receive": APP,
        "process": APP,
    }
    for s in spans:
        assert s.attributes["messaging.system"] == "apogee"
        if s.name != f"send {TOPIC}":
            assert s.attributes["messaging.message.id"] == sent.message_id, s.name

    receives = sorted((s for s in spans if s.name.startswith("receive")), key=lambda s: s.start_ns)
    processes = sorted((s for s in spans if s.name.startswith("process")), key=lambda s: s.start_ns)
    assert [r.parent_span_id for r in receives] == [send.span_id] * 2
    assert [p.parent_span_id for p in processes] == [r.span_id for r in receives]
    assert [r.attributes["messaging.apogee.reconsume_times"] for r in receives] == [0, 1]
    assert [p.status_code for p in processes] == [
        trace_pb2.Status.STATUS_CODE_ERROR,
        trace_pb2.Status.STATUS_CODE_UNSET,
    ]
    # the retry keeps the trace, and its store span links to the attempt that failed
    (retry_store,) = [
        s
        for s in spans
        if s.name == f"store {SCHEDULE}"
        and s.attributes.get("messaging.apogee.real_topic") == RETRY
    ]
    assert retry_store.links == [(processes[0].trace_id, processes[0].span_id)]
    assert retry_store.attributes["messaging.apogee.reconsume_times"] == 1
    # the schedule service held the message about its delay, then delivered it
    (hold,) = [s for s in spans if s.name == f"hold {TOPIC}"]
    (deliver,) = [s for s in spans if s.name == f"deliver {TOPIC}"]
    assert hold.end_ns - hold.start_ns >= 300_000_000  # 500 ms, less the clocks' slack
    assert hold.end_ns <= deliver.start_ns
    assert deliver.kind == trace_pb2.Span.SPAN_KIND_PRODUCER
    (delayed_store,) = [
        s
        for s in spans
        if s.name == f"store {SCHEDULE}"
        and s.attributes.get("messaging.apogee.real_topic") == TOPIC
    ]
    assert delayed_store.attributes["messaging.apogee.message.delay_time_level"] == 1


async def test_with_tracing_off_no_traceparent_is_added(
    traced: Traced, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tracing, "_made", {})
    cluster = traced.cluster
    await make_topic(cluster)
    async with Producer(cluster.namesrv) as plain:
        assert plain._tracer is None
        untraced = await plain.send(Message(TOPIC, b"plain"))
    # a traced message stored after it: once its store span is in, any span the broker made
    # for the untraced one would be too (the broker exports its spans in the order they end)
    provider = traced.provider()
    try:
        async with Producer(cluster.namesrv, tracer_provider=provider) as producer:
            marker = await producer.send(Message(TOPIC, b"marker"))
    finally:
        provider.shutdown()

    async def marker_stored() -> bool:
        return any(
            s.name == f"store {TOPIC}"
            and s.attributes.get("messaging.message.id") == marker.message_id
            for s in traced.receiver.all()
        )

    await eventually(marker_stored, 15, "the broker's store span of the traced message")
    async with AdminClient(cluster.namesrv) as admin:
        stored = await admin.get_message(untraced.message_id)
        traced_copy = await admin.get_message(marker.message_id)
    assert PROP_TRACEPARENT not in stored.properties
    assert PROP_TRACESTATE not in stored.properties
    assert PROP_TRACEPARENT in traced_copy.properties
    assert not [
        s
        for s in traced.receiver.all()
        if s.attributes.get("messaging.message.id") == untraced.message_id
    ]
