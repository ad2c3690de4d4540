"""A trace context an official client sends (as the ``traceparent`` property, or in
``trace_context``) joins Apogee's traces: the broker's store span is its child, and a consumer
gets the context back."""

from __future__ import annotations

from pathlib import Path

import grpc.aio
import pytest
from google.protobuf.duration_pb2 import Duration
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from apogee.common.topics import TopicConfig
from apogee.rocketmq.v2 import definition_pb2 as d
from apogee.rocketmq.v2 import service_pb2 as s
from apogee.rocketmq.v2 import service_pb2_grpc as sg
from apogee.testkit.broker import small_settings
from apogee_broker.app import BrokerApp

pytestmark = pytest.mark.integration

MD = (("x-mq-client-id", "trace@1@1@x"),)
TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENTS = (0x00F067AA0BA902B7, 0x00F067AA0BA902B8)


def traceparent(span: int) -> str:
    return f"00-{TRACE_ID:032x}-{span:016x}-01"


async def test_a_trace_context_sent_either_way_parents_the_store_span(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = BrokerApp(small_settings(tmp_path / "b"), tracer=provider.get_tracer("test"))
    await app.start()
    try:
        assert app.topics is not None
        app.topics.put(TopicConfig("Traced", 1, 1))
        async with grpc.aio.insecure_channel(app.address) as ch:
            stub = sg.MessagingServiceStub(ch)
            as_property = d.Message(
                topic=d.Resource(name="Traced"),
                body=b"a",
                user_properties={"traceparent": traceparent(PARENTS[0])},
                system_properties=d.SystemProperties(message_id="T1", body_encoding=d.IDENTITY),
            )
            in_field = d.Message(
                topic=d.Resource(name="Traced"),
                body=b"b",
                system_properties=d.SystemProperties(
                    message_id="T2",
                    body_encoding=d.IDENTITY,
                    trace_context=traceparent(PARENTS[1]),
                ),
            )
            for m in (as_property, in_field):
                r = await stub.SendMessage(s.SendMessageRequest(messages=[m]), metadata=MD)
                assert r.status.code == d.OK, r.status
            req = s.ReceiveMessageRequest(
                group=d.Resource(name="g"),
                message_queue=d.MessageQueue(topic=d.Resource(name="Traced"), id=-1),
                filter_expression=d.FilterExpression(type=d.TAG, expression="*"),
                invisible_duration=Duration(seconds=10),
                long_polling_timeout=Duration(seconds=0),
            )
            got = {
                r.message.body: r.message
                async for r in stub.ReceiveMessage(req, metadata=MD, timeout=10)
                if r.HasField("message")
            }
    finally:
        await app.stop()
    spans = exporter.get_finished_spans()
    parents = sorted(
        sp.parent.span_id for sp in spans if sp.parent is not None and sp.context is not None
    )
    assert parents == sorted(PARENTS)
    assert {sp.context.trace_id for sp in spans if sp.context is not None} == {TRACE_ID}
    assert got[b"a"].system_properties.trace_context == traceparent(PARENTS[0])
    assert got[b"a"].user_properties["traceparent"] == traceparent(PARENTS[0])
    assert got[b"b"].system_properties.trace_context == traceparent(PARENTS[1])
