"""The producer's options, checked once, shared by :class:`~apogee.client.Producer` and
:class:`~apogee.client.SyncProducer` (both take them as keyword arguments)."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypedDict

from opentelemetry.trace import TracerProvider

from apogee.client._rpc import parse_addresses
from apogee.client.message import Message, SendResult
from apogee.client.producer.accumulator import BatchingConfig
from apogee.client.producer.validation import MAX_MESSAGE_SIZE
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import InvalidArgumentError
from apogee.common.settings import doc
from apogee.rpc.security import ClientSecurity

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

GROUP_RE = re.compile(r"[%|a-zA-Z0-9_-]{1,255}")
DEFAULT_GROUP = "DEFAULT_PRODUCER"


@dataclass(frozen=True, slots=True)
class SendHook:
    """Called around every send: ``before(msg)`` once before the first attempt, ``after(msg,
    outcome)`` once with the :class:`SendResult` or the exception. A hook that raises is logged
    and does not affect the send."""

    before: Callable[[Message], None] | None = None
    after: Callable[[Message, SendResult | BaseException], None] | None = None


class ProducerOptions(TypedDict, total=False):
    """Keyword options of a producer; see :class:`ProducerConfig` for defaults and meaning."""

    send_timeout: float
    retries: int
    idempotent: bool
    compress_over: int
    max_message_size: int
    max_in_flight: int
    send_streams: int
    batch_max_messages: int
    batch_max_bytes: int
    linger_ms: float
    coalesce_ms: float
    route_refresh_interval: float
    latency_fault_tolerance: bool
    max_pending: int
    close_timeout: float
    hooks: Sequence[SendHook]
    clock: Clock
    rng: random.Random | None
    tracer_provider: TracerProvider | None
    metrics_registry: CollectorRegistry | None
    security: ClientSecurity | None


def _number(name: str, value: Any, minimum: float, above: bool = False) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if ok and (value > minimum if above else value >= minimum):
        return
    word = "above" if above else "of at least"
    raise InvalidArgumentError(field=name, rule=f"must be a number {word} {minimum}, got {value!r}")


def _integer(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidArgumentError(
            field=name, rule=f"must be an integer of at least {minimum}, got {value!r}"
        )


@dataclass(frozen=True, slots=True)
class ProducerConfig:
    """Everything a producer is configured with."""

    namesrv: tuple[str, ...]
    group: str = doc(DEFAULT_GROUP, "Producer group, sent with every request.")
    send_timeout: float = doc(
        3.0, "Seconds one send may take in all: waiting in a batch and retries included."
    )
    retries: int = doc(
        2,
        "Further attempts after a retriable failure that left the message unstored, each on "
        "another broker when the topic has one (ordered sends stay on their queue unless "
        "`failover=True`). After a failure that may have stored it (a timeout, a broker gone "
        "with the request in flight) a plain send is not tried again: its error says so "
        "(`outcome_unknown`); an idempotent one is, on the same queue.",
    )
    idempotent: bool = doc(
        False,
        "Send every message with `APOGEE_DEDUP_ID` (its own, else its message id) to the queue "
        "that id hashes to, so that the broker stores it once within its `dedup_window_s`: the "
        "producer's retries, and the application's (`send(msg, message_id=err.message_id)`), "
        "cannot store it twice. See docs/client.md.",
    )
    compress_over: int = doc(
        4096,
        "Bodies longer than this many bytes travel zlib-compressed (system flag 0x1) when that "
        "makes them smaller; -1: never.",
    )
    max_message_size: int = doc(
        MAX_MESSAGE_SIZE, "Largest body, and largest batch (bodies together), in bytes."
    )
    max_in_flight: int = doc(
        4,
        "Requests on the wire per broker at once; messages sent while all are busy wait and "
        "leave together in the next request.",
    )
    send_streams: int = doc(
        4,
        "Streams per broker that requests travel on (gRPC writes one message at a time per "
        "stream): a request takes the stream with the fewest requests waiting, and another "
        "opens only while every open one is busy. More than `max_in_flight` are never used.",
    )
    batch_max_messages: int = doc(256, "Most messages one request carries.")
    batch_max_bytes: int = doc(
        4 * 1024 * 1024, "Most bytes one request carries (a larger single message goes alone)."
    )
    linger_ms: float = doc(
        0.0,
        "Milliseconds a request that is not full may wait for more messages; 0: a send leaves "
        "at once when a request slot is free.",
    )
    coalesce_ms: float = doc(
        1.0,
        "While a request to a broker is in flight, a send behind fewer than 32 others waits for "
        "its answer, or this many milliseconds at most, so that sends at moderate rates share "
        "requests; a send to an idle broker leaves at once. 0: off.",
    )
    route_refresh_interval: float = doc(
        30.0, "Seconds between refreshes of the cached topic routes (failures refresh too)."
    )
    latency_fault_tolerance: bool = doc(
        True,
        "Avoid for a while brokers whose last request was slow or failed (RocketMQ's "
        "sendLatencyFaultEnable, latency bands 50 ms to 15 s → 0 to 10 min).",
    )
    max_pending: int = doc(
        8192,
        "Sends not yet settled (stored or failed), at most. Past it, awaited sends wait for "
        "room (up to `send_timeout`) and the sync producer's callers block; `send_nowait` is "
        "not held back.",
    )
    close_timeout: float = doc(
        5.0, "Seconds close() lets queued messages leave before failing the rest."
    )
    hooks: tuple[SendHook, ...] = ()
    clock: Clock = SYSTEM_CLOCK
    rng: random.Random | None = None
    #: OpenTelemetry's provider of the producer's spans; None: the application's global one
    #: when it set one, else the OTEL_* environment's, else no tracing (docs/tracing.md)
    tracer_provider: TracerProvider | None = None
    #: the ``prometheus_client`` registry that gets the producer's metrics; None: no metrics
    #: (apogee.client.metrics, docs/client.md)
    metrics_registry: CollectorRegistry | None = None
    #: TLS and the access key of the producer's calls; None: what the environment sets
    #: (``APOGEE_TLS_*``, ``APOGEE_ACCESS_KEY``...; docs/security.md)
    security: ClientSecurity | None = None
    batching: BatchingConfig = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.group, str) or not GROUP_RE.fullmatch(self.group):
            raise InvalidArgumentError(
                field="group",
                rule=f"{self.group!r} must be 1 to 255 characters from [%|a-zA-Z0-9_-]",
            )
        _number("send_timeout", self.send_timeout, 0, above=True)
        _integer("retries", self.retries, 0)
        if not isinstance(self.idempotent, bool):
            raise InvalidArgumentError(
                field="idempotent", rule=f"must be True or False, got {self.idempotent!r}"
            )
        _integer("compress_over", self.compress_over, -1)
        _integer("max_message_size", self.max_message_size, 1)
        _number("route_refresh_interval", self.route_refresh_interval, 0, above=True)
        _integer("max_pending", self.max_pending, 1)
        _integer("send_streams", self.send_streams, 1)
        _number("close_timeout", self.close_timeout, 0)
        for hook in self.hooks:
            if not isinstance(hook, SendHook):
                raise InvalidArgumentError(
                    field="hooks", rule=f"must hold SendHook objects, got {type(hook).__name__}"
                )
        batching = BatchingConfig(
            self.max_in_flight,
            self.batch_max_messages,
            self.batch_max_bytes,
            self.linger_ms,
            self.coalesce_ms,
        )
        object.__setattr__(self, "batching", batching)

    @classmethod
    def create(
        cls, namesrv: str | Sequence[str], group: str, options: ProducerOptions
    ) -> ProducerConfig:
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown producer option(s): {', '.join(unknown)}")
        opts: dict[str, Any] = dict(options)
        if "hooks" in opts:
            opts["hooks"] = tuple(opts["hooks"])
        return cls(namesrv=parse_addresses(namesrv), group=group, **opts)


def config_reference() -> str:
    """The producer's section of docs/configuration.md."""
    lines = [
        "## Producer (`apogee.client.Producer`, `apogee.client.SyncProducer`)",
        "",
        "Keyword options of both producers, e.g. `Producer(namesrv, group, linger_ms=2)`.",
        "",
        "| option | default | meaning |",
        "| --- | --- | --- |",
    ]
    for f in fields(ProducerConfig):
        text = f.metadata.get("doc")
        if text:
            lines.append(f"| `{f.name}` | {_shown(f.default)} | {text} |")
    return "\n".join(lines) + "\n"


def _shown(value: object) -> str:
    mib = 1 << 20
    if isinstance(value, int) and not isinstance(value, bool) and value >= mib and value % mib == 0:
        return f"`{value}` ({value >> 20} MiB)"
    return f"`{value}`"
