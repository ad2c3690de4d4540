"""apogee.common.tracing: off unless the OTEL_* environment asks, the provider it builds (service
name, exporters), the SDK's choice of tracer, and W3C traceparent values both ways."""

from __future__ import annotations

import logging

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, TraceFlags, TraceState

from apogee.common import tracing

pytestmark = pytest.mark.unit

_OTEL_VARS = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
)


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    """No OTEL_* setting of the machine leaks in; what the module made is forgotten after."""
    for name in _OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tracing, "_made", {})


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_TRACES_EXPORTER": " OTLP , none"}, True),
    ],
)
def test_tracing_is_off_unless_the_environment_asks(env: dict[str, str], on: bool) -> None:
    assert tracing.enabled(env) is on


def test_nothing_is_built_when_off() -> None:
    assert tracing._build("apogee-test") is None
    assert tracing.client_tracer(None, "apogee.test") is None
    assert tracing.service_tracer("apogee.test") is None


def test_the_provider_built_names_the_service_unless_the_environment_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    provider = tracing._build("apogee-test")
    assert isinstance(provider, TracerProvider)
    try:
        assert provider.resource.attributes["service.name"] == "apogee-test"
    finally:
        provider.shutdown()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "orders-broker")
    named = tracing._build("apogee-test")
    assert isinstance(named, TracerProvider)
    try:
        assert named.resource.attributes["service.name"] == "orders-broker"
    finally:
        named.shutdown()


def test_an_endpoint_alone_exports_otlp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    provider = tracing._build("apogee-test")
    assert isinstance(provider, TracerProvider)
    try:
        processors = provider._active_span_processor._span_processors
        exporters = [type(p.span_exporter).__name__ for p in processors]  # type: ignore[attr-defined]
        assert exporters == ["OTLPSpanExporter"]
    finally:
        provider.shutdown()


def test_unknown_exporters_and_protocols_are_named_in_warnings(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with caplog.at_level(logging.WARNING, logger="apogee.common.tracing"):
        assert tracing._build("apogee-test") is None
    assert "'zipkin'" in caplog.text
    caplog.clear()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    with caplog.at_level(logging.WARNING, logger="apogee.common.tracing"):
        provider = tracing._build("apogee-test")
    assert provider is not None
    provider.shutdown()  # type: ignore[attr-defined]
    assert "gRPC only" in caplog.text


def test_the_sdk_uses_the_provider_given_and_a_noop_one_turns_it_off() -> None:
    provider = TracerProvider()
    tracer = tracing.client_tracer(provider, "apogee.test")
    assert tracer is not None
    with tracer.start_as_current_span("x") as span:
        assert span.get_span_context().is_valid
    assert tracing.client_tracer(trace.NoOpTracerProvider(), "apogee.test") is None


def test_the_sdk_takes_the_environments_provider_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    first = tracing.client_tracer(None, "apogee.a")
    second = tracing.client_tracer(None, "apogee.b")
    assert first is not None
    assert second is not None
    made = tracing._made["client"]
    assert isinstance(made, TracerProvider)
    made.shutdown()


def test_services_draw_from_the_provider_set_for_them() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.set_service_provider(provider)
    tracer = tracing.service_tracer("apogee.test")
    assert tracer is not None
    tracer.start_span("s").end()
    assert [s.name for s in exporter.get_finished_spans()] == ["s"]
    tracing.set_service_provider(None)
    assert tracing.service_tracer("apogee.test") is None


def test_traceparent_values_both_ways() -> None:
    ctx = SpanContext(
        0x0AF7651916CD43DD8448EB211C80319C,
        0xB7AD6B7169203331,
        is_remote=False,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
        trace_state=TraceState([("vendor", "opaque-1"), ("other", "x")]),
    )
    parent = tracing.traceparent(ctx)
    assert parent == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert tracing.tracestate(ctx) == "vendor=opaque-1,other=x"
    back = tracing.remote_context(parent, tracing.tracestate(ctx))
    assert back is not None
    assert (back.trace_id, back.span_id, back.trace_flags) == (
        ctx.trace_id,
        ctx.span_id,
        ctx.trace_flags,
    )
    assert back.is_remote
    assert back.trace_state.get("vendor") == "opaque-1"
    unsampled = tracing.remote_context("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00")
    assert unsampled is not None
    assert not unsampled.trace_flags.sampled
    # a later version may add fields
    assert tracing.remote_context(parent.replace("00-", "01-", 1) + "-extra") is not None


@pytest.mark.parametrize(
    "value",
    [
        "",
        "garbage",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
        "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
    ],
)
def test_invalid_traceparent_values_name_no_context(value: str) -> None:
    assert tracing.remote_context(value) is None


def test_parent_of_nothing_is_a_new_trace() -> None:
    provider = TracerProvider()
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("current"):
        root = tracer.start_span("root", tracing.parent(None))
        assert root.parent is None  # type: ignore[attr-defined]
        root.end()
        ctx = tracing.remote_context("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        child = tracer.start_span("child", tracing.parent(ctx))
        assert child.parent is not None  # type: ignore[attr-defined]
        assert child.parent.span_id == 0xB7AD6B7169203331  # type: ignore[attr-defined]
        assert child.get_span_context().trace_id == 0x0AF7651916CD43DD8448EB211C80319C
        child.end()
