"""OpenTelemetry tracing, set up the same way in every Apogee process: the services and the SDK.

A message's trace context travels with it in its properties, as W3C Trace Context's
``traceparent`` and ``tracestate`` (:data:`apogee.codec.PROP_TRACEPARENT`): the context of the
producer's send span, written once and kept by every copy a broker makes. Every span that
handles the message on its way (the broker's store, the schedule service's hold and deliver,
the transaction checker's check, the consumer's receive and process) is a child of it; an
operation that serves many messages at once links to each of theirs. docs/tracing.md lists the
spans and their attributes.

**Off unless configured.** Spans are exported only when the standard environment asks for it:
``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, or ``console`` for a quick look; ``none``:
off), or, with it unset, ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
is set; ``OTEL_SDK_DISABLED=true`` turns everything off. The rest is OpenTelemetry's own reading
of the environment: ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` (a process without a
service name gets its default, ``apogee-broker`` and so on), ``OTEL_TRACES_SAMPLER`` and
``OTEL_TRACES_SAMPLER_ARG`` (default ``parentbased_always_on``), the exporter's endpoint,
headers, timeout and ``OTEL_EXPORTER_OTLP_INSECURE``, the batch processor's
``OTEL_BSP_*``. Export is OTLP over gRPC (``opentelemetry-exporter-otlp-proto-grpc``, the
``tracing`` extra of apogee-common).

When tracing is off a process holds no tracer: the code on hot paths checks ``tracer is not
None`` once and does nothing else (no span, no property, no decoding).

- :func:`configure`: a service's process sets up export once, at start (the provider becomes
  OpenTelemetry's global one); :func:`service_tracer` is then its tracer, or None
  (:func:`set_service_provider` stands in for :func:`configure` where services run inside
  another process, as in tests).
- :func:`client_tracer`: the SDK's choice for a producer or consumer: the ``tracer_provider``
  it was given, else the application's global provider when one was set, else the one the
  environment configures (the SDK does not make it global), else None.
- :func:`traceparent`, :func:`tracestate`, :func:`remote_context`: the W3C header values of a
  span context, and back.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Final

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
    TracerProvider,
    TraceState,
)

log = logging.getLogger(__name__)

#: W3C Trace Context's header names, which are also the names of the message properties that
#: carry a message's trace context (:data:`apogee.codec.PROP_TRACEPARENT`, for the libraries
#: that read records).
TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"

#: ``messaging.system`` of every span.
SYSTEM: Final = "apogee"
# OpenTelemetry's messaging attributes ...
MESSAGING_SYSTEM: Final = "messaging.system"
OPERATION_NAME: Final = "messaging.operation.name"
OPERATION_TYPE: Final = "messaging.operation.type"
DESTINATION: Final = "messaging.destination.name"
PARTITION: Final = "messaging.destination.partition.id"
MESSAGE_ID: Final = "messaging.message.id"
BATCH_COUNT: Final = "messaging.batch.message_count"
CONSUMER_GROUP: Final = "messaging.consumer.group.name"
CLIENT_ID: Final = "messaging.client.id"
ERROR_TYPE: Final = "error.type"
# ... and Apogee's own, named after OpenTelemetry's messaging.rocketmq.* where one fits.
CLIENT_GROUP: Final = "messaging.apogee.client_group"
TAG: Final = "messaging.apogee.message.tag"
KEYS: Final = "messaging.apogee.message.keys"
DELAY_LEVEL: Final = "messaging.apogee.message.delay_time_level"
DELIVERY_TIMESTAMP: Final = "messaging.apogee.message.delivery_timestamp"
BROKER: Final = "messaging.apogee.broker_name"
QUEUE_OFFSET: Final = "messaging.apogee.queue_offset"
RECONSUME_TIMES: Final = "messaging.apogee.reconsume_times"
SEND_RETRIES: Final = "messaging.apogee.send.retries"
SEND_STATUS: Final = "messaging.apogee.send.status"
REAL_TOPIC: Final = "messaging.apogee.real_topic"
LATENESS_MS: Final = "messaging.apogee.schedule.lateness_ms"
SCHEDULE_ACTION: Final = "messaging.apogee.schedule.action"
TRANSACTION_ID: Final = "messaging.apogee.transaction_id"
TRANSACTION_OUTCOME: Final = "messaging.apogee.transaction.end_outcome"
CHECK_OUTCOME: Final = "messaging.apogee.check.outcome"
CHECK_TIMES: Final = "messaging.apogee.check.times"

#: A context with no span: a span started in it is the root of a new trace (``context=None``
#: would take whatever span is current instead).
ROOT: Final = Context()

_EXPORTERS: Final = frozenset({"otlp", "console"})
_TRUE: Final = frozenset({"true", "1", "yes", "on"})


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment (the process's when None) asks for spans to be exported: see
    the module docstring."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return False
    names = _exporter_names(env)
    if names is not None:
        return bool(names)
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    )


def _exporter_names(env: Mapping[str, str]) -> list[str] | None:
    """The exporters ``OTEL_TRACES_EXPORTER`` names (``none`` dropped), None when unset."""
    raw = env.get("OTEL_TRACES_EXPORTER", "").strip()
    if not raw:
        return None
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    return [n for n in names if n != "none"]


_lock = threading.Lock()
#: The providers made once per process: ``"service"`` by :func:`configure` (or given to
#: :func:`set_service_provider`), ``"client"`` from the environment by :func:`client_tracer`.
_made: dict[str, TracerProvider | None] = {}


def configure(service_name: str) -> TracerProvider | None:
    """Set up export for a service's process as its environment says (once; later calls
    return the same provider) and make the provider OpenTelemetry's global one. None when
    tracing is off, or when the packages it needs are not installed (logged)."""
    with _lock:
        if "service" not in _made:
            provider = _build(service_name)
            if provider is not None:
                trace.set_tracer_provider(provider)
            _made["service"] = provider
        return _made["service"]


def set_service_provider(provider: TracerProvider | None) -> None:
    """Make ``provider`` the one :func:`service_tracer` draws from (None: tracing off), as
    :func:`configure` would; for services run inside another process (in-process test
    clusters). It does not become OpenTelemetry's global provider."""
    with _lock:
        _made["service"] = provider


def service_tracer(name: str) -> Tracer | None:
    """The tracer of a service component (``apogee.broker``, ...) once :func:`configure` set
    tracing up, else None."""
    provider = _made.get("service")
    return None if provider is None else provider.get_tracer(name)


def client_tracer(provider: TracerProvider | None, name: str) -> Tracer | None:
    """The tracer a producer or consumer emits spans with, or None when tracing is off: the
    ``provider`` it was given (a :class:`~opentelemetry.trace.NoOpTracerProvider` turns tracing
    off), else the application's global provider when it set one, else the one the OTEL_*
    environment configures (made once per process, not made global), else None."""
    if provider is None:
        current = trace.get_tracer_provider()
        if not isinstance(current, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            provider = current
        else:
            with _lock:
                if "client" not in _made:
                    _made["client"] = _build("apogee-client")
                provider = _made["client"]
            if provider is None:
                return None
    if isinstance(provider, trace.NoOpTracerProvider):
        return None
    return provider.get_tracer(name)


def _build(service_name: str) -> TracerProvider | None:
    if not enabled():
        return None
    names = _exporter_names(os.environ)
    if names is None:
        names = ["otlp"]
    for name in names:
        if name not in _EXPORTERS:
            log.warning(
                "OTEL_TRACES_EXPORTER names %r, which Apogee does not ship (it has otlp and "
                "console); ignored",
                name,
            )
    names = [n for n in names if n in _EXPORTERS]
    if not names:
        return None
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "")
    ).strip()
    if "otlp" in names and protocol not in ("", "grpc"):
        log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s: Apogee exports OTLP over gRPC only", protocol)
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import (  # noqa: PLC0415
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SpanExporter,
        )
    except ImportError as exc:
        log.warning(
            "tracing is configured (OTEL_*) but the OpenTelemetry SDK is not installed (%s); "
            "install apogee-client[tracing]; spans are not exported",
            exc,
        )
        return None
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    provider = SdkTracerProvider(resource=resource)
    for name in names:
        exporter: SpanExporter
        if name == "console":
            exporter = ConsoleSpanExporter()
        else:
            try:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # noqa: PLC0415
                    OTLPSpanExporter,
                )
            except ImportError as exc:
                log.warning("the OTLP exporter is not installed (%s); spans are not exported", exc)
                continue
            exporter = OTLPSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info(
        "tracing on: service %s, exporting to %s",
        resource.attributes.get(SERVICE_NAME),
        ", ".join(names),
    )
    return provider


# -- W3C Trace Context ---------------------------------------------------------------------------

#: version-traceid-parentid-flags (lower-case hex; later versions may append fields)
_TRACEPARENT: Final = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


def traceparent(ctx: SpanContext) -> str:
    """The ``traceparent`` value of ``ctx``."""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def tracestate(ctx: SpanContext) -> str:
    """The ``tracestate`` value of ``ctx``, ``""`` when it has none."""
    state = ctx.trace_state
    return state.to_header() if state else ""


def remote_context(parent: str, state: str = "") -> SpanContext | None:
    """The span context a ``traceparent`` value (and ``tracestate``) names, or None when it is
    not a valid one (W3C Trace Context level 1: version ``ff`` and all-zero ids are invalid,
    version ``00`` has exactly four fields)."""
    m = _TRACEPARENT.fullmatch(parent.strip()) if parent else None
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    tid, sid = int(trace_id, 16), int(span_id, 16)
    if not tid or not sid:
        return None
    return SpanContext(
        tid,
        sid,
        is_remote=True,
        trace_flags=TraceFlags(int(flags, 16) & TraceFlags.SAMPLED),
        trace_state=TraceState.from_header([state]) if state else None,
    )


def parent(ctx: SpanContext | None) -> Context:
    """The context to start a child of ``ctx`` in (:data:`ROOT` for None: a new trace)."""
    if ctx is None:
        return ROOT
    return trace.set_span_in_context(NonRecordingSpan(ctx), ROOT)


def links(contexts: Sequence[SpanContext | None]) -> list[Link]:
    """One link to each context given (None skipped)."""
    return [Link(c) for c in contexts if c is not None]


def failed(span: Span, error: BaseException | str) -> None:
    """Mark ``span`` failed: status ERROR with the reason, and ``error.type`` (an Apogee
    error's kind, else the exception's class, else ``"failed"``)."""
    if isinstance(error, BaseException):
        kind = getattr(getattr(error, "kind", None), "name", None) or type(error).__name__
        span.set_attribute(ERROR_TYPE, kind)
        span.set_status(Status(StatusCode.ERROR, str(error) or kind))
    else:
        span.set_attribute(ERROR_TYPE, "failed")
        span.set_status(Status(StatusCode.ERROR, error))
