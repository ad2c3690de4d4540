"""The consumers' options, checked once, shared by the push and pull consumers and their
synchronous twins (all take them as keyword arguments)."""

from __future__ import annotations

import enum
import os
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from opentelemetry.trace import TracerProvider

from apogee.client._rpc import parse_addresses
from apogee.client.consumer.allocate import AllocateStrategy, strategy_by_name
from apogee.client.producer.config import GROUP_RE, _integer, _number, _shown
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import InvalidArgumentError
from apogee.common.ids import new_id
from apogee.common.settings import doc
from apogee.common.topics import MAX_TOPIC_LENGTH, retry_topic
from apogee.rpc.security import ClientSecurity

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

CLIENT_ID_RE = re.compile(r"[a-zA-Z0-9_.@:%|-]{1,255}")
#: Bounds and defaults of the retry options (RocketMQ's: 16 retries, the first at level 3).
MAX_RECONSUME_TIMES = 1000
MAX_RECONSUME_TIMES_DEFAULT = 16
FIRST_RETRY_DELAY_LEVEL_DEFAULT = 3
MAX_DELAY_LEVEL = 18


class ConsumeMode(enum.Enum):
    #: each message goes to one consumer of the group
    CLUSTERING = "clustering"
    #: each message goes to every consumer of the group
    BROADCASTING = "broadcasting"


class ConsumeFrom(enum.Enum):
    """Where a queue without a committed offset starts."""

    #: at the queue's end: only messages sent from now on
    LATEST = "latest"
    #: at the earliest message still kept
    EARLIEST = "earliest"
    #: at the first message stored at or after ``consume_timestamp_ms``
    TIMESTAMP = "timestamp"


class ConsumerOptions(TypedDict, total=False):
    """Keyword options of the consumers; see :class:`ConsumerConfig` for defaults and meaning."""

    mode: ConsumeMode | str
    consume_from: ConsumeFrom | str
    consume_timestamp_ms: int
    allocate: AllocateStrategy | str
    client_id: str
    rebalance_interval: float
    heartbeat_interval: float
    pull_batch_size: int
    long_poll_timeout: float
    max_cached_messages_per_queue: int
    max_cached_bytes_per_queue: int
    max_span: int
    consume_batch_size: int
    consume_concurrency: int
    consume_timeout: float
    retry_delay: float
    max_retry_delay: float
    max_reconsume_times: int
    first_retry_delay_level: int
    orderly: bool
    lock_renew_interval: float
    offset_persist_interval: float
    offset_dir: str | os.PathLike[str] | None
    verify_crc: bool
    request_timeout: float
    close_timeout: float
    clock: Clock
    tracer_provider: TracerProvider | None
    metrics_registry: CollectorRegistry | None
    security: ClientSecurity | None


@dataclass(frozen=True, slots=True)
class ConsumerConfig:
    """Everything a consumer is configured with."""

    namesrv: tuple[str, ...]
    group: str
    mode: ConsumeMode = doc(
        ConsumeMode.CLUSTERING,
        "`clustering`: each message to one consumer of the group; `broadcasting`: to every one.",
    )
    consume_from: ConsumeFrom = doc(
        ConsumeFrom.LATEST,
        "Where a queue the group has no committed offset for starts: `latest` (new messages "
        "only), `earliest`, or `timestamp` (see `consume_timestamp_ms`).",
    )
    consume_timestamp_ms: int = doc(0, "Start time for `consume_from=timestamp` (epoch ms).")
    allocate: AllocateStrategy = doc(
        strategy_by_name("average"),
        "How the group's queues are shared among its consumers: `average` (contiguous "
        "ranges), `round-robin`, `consistent-hash`, or an `AllocateStrategy` object.",
    )
    client_id: str = doc("", "This consumer's id in its group; default host@pid@random.")
    rebalance_interval: float = doc(
        20.0,
        "Seconds between rebalances; a change of the group's members rebalances at once.",
    )
    heartbeat_interval: float = doc(
        30.0, "Seconds between heartbeats to each broker (brokers drop a member after 120 s)."
    )
    pull_batch_size: int = doc(
        256,
        "Most messages of one queue a broker sends at once; a queue's credit at its broker "
        "(what it may send ahead of the consumer) is twice this.",
    )
    long_poll_timeout: float = doc(
        15.0, "Seconds a queue's fetch waits for pushed messages before looking again."
    )
    max_cached_messages_per_queue: int = doc(
        1000, "Messages pulled and not yet finished, per queue, beyond which pulling pauses."
    )
    max_cached_bytes_per_queue: int = doc(
        100 * 1024 * 1024,
        "Bytes pulled and not yet finished, per queue, beyond which pulling pauses.",
    )
    max_span: int = doc(
        2000,
        "Pulling of a queue pauses while its oldest unfinished message is this many offsets "
        "behind its newest (one slow message holds back the committed offset).",
    )
    consume_batch_size: int = doc(1, "Most messages handed to one listener call.")
    consume_concurrency: int = doc(
        20, "Listener calls running at once (threads for a plain function, tasks for async)."
    )
    consume_timeout: float = doc(
        900.0, "Seconds a listener call may run; a longer one counts as a failure."
    )
    retry_delay: float = doc(
        1.0,
        "Seconds before a failed message is handed to the listener again when it is retried "
        "locally (orderly and broadcasting consumers, and clustering ones whose send-back "
        "failed); doubles with each failure of the same message up to `max_retry_delay`.",
    )
    max_retry_delay: float = doc(60.0, "Longest wait before a local retry.")
    max_reconsume_times: int = doc(
        MAX_RECONSUME_TIMES_DEFAULT,
        "Retries of a failed message before it goes to the dead-letter topic `%DLQ%<group>` "
        "(clustering: retries through `%RETRY%<group>`; orderly: local retries). "
        "Broadcasting: local retries before the message is dropped with a warning. "
        f"0 to {MAX_RECONSUME_TIMES}.",
    )
    first_retry_delay_level: int = doc(
        FIRST_RETRY_DELAY_LEVEL_DEFAULT,
        "Delay level of a message's first retry through `%RETRY%<group>` (the broker's delay "
        "table, `10s` by default); each further retry waits one level more, up to the last.",
    )
    orderly: bool = doc(
        False,
        "Orderly consumption: each queue is locked at its broker and consumed by one listener "
        "call at a time, in queue order.",
    )
    lock_renew_interval: float = doc(
        20.0, "Seconds between renewals of the queue locks of an orderly consumer."
    )
    offset_persist_interval: float = doc(
        5.0, "Seconds between commits of the consumed offsets (and at rebalance and close)."
    )
    offset_dir: Path | None = doc(
        None,
        "Broadcasting: the folder of the local offset file; default "
        "`$APOGEE_HOME/offsets` or `~/.apogee/offsets`.",
    )
    verify_crc: bool = doc(True, "Check each received record's CRC-32.")
    request_timeout: float = doc(5.0, "Seconds a request other than a held pull may take.")
    close_timeout: float = doc(
        10.0, "Seconds close() waits for running listener calls before abandoning them."
    )
    clock: Clock = SYSTEM_CLOCK
    #: OpenTelemetry's provider of the consumer's spans; None: the application's global one
    #: when it set one, else the OTEL_* environment's, else no tracing (docs/tracing.md)
    tracer_provider: TracerProvider | None = None
    #: the ``prometheus_client`` registry that gets the consumer's metrics; None: no metrics
    #: (apogee.client.metrics, docs/client.md)
    metrics_registry: CollectorRegistry | None = None
    #: TLS and the access key of the consumer's calls; None: what the environment sets
    #: (``APOGEE_TLS_*``, ``APOGEE_ACCESS_KEY``...; docs/security.md)
    security: ClientSecurity | None = None
    #: whether ``client_id`` was chosen by the user (a stable name) rather than generated
    client_id_given: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if not isinstance(self.group, str) or not GROUP_RE.fullmatch(self.group):
            raise InvalidArgumentError(
                field="group",
                rule=f"{self.group!r} must be 1 to 255 characters from [%|a-zA-Z0-9_-]",
            )
        if self.mode is ConsumeMode.CLUSTERING and len(retry_topic(self.group)) > MAX_TOPIC_LENGTH:
            most = MAX_TOPIC_LENGTH - len(retry_topic(""))
            raise InvalidArgumentError(
                field="group",
                rule=f"is {len(self.group)} characters; a clustering group's name has at most "
                f"{most}, for its retry topic %RETRY%<group> is a topic name "
                f"(at most {MAX_TOPIC_LENGTH} characters)",
            )
        _integer("consume_timestamp_ms", self.consume_timestamp_ms, 0)
        for name in (
            "rebalance_interval",
            "heartbeat_interval",
            "long_poll_timeout",
            "consume_timeout",
            "retry_delay",
            "max_retry_delay",
            "lock_renew_interval",
            "offset_persist_interval",
            "request_timeout",
        ):
            _number(name, getattr(self, name), 0, above=True)
        _number("close_timeout", self.close_timeout, 0)
        for name in (
            "pull_batch_size",
            "max_cached_messages_per_queue",
            "max_cached_bytes_per_queue",
            "max_span",
            "consume_batch_size",
            "consume_concurrency",
        ):
            _integer(name, getattr(self, name), 1)
        _integer("max_reconsume_times", self.max_reconsume_times, 0)
        if self.max_reconsume_times > MAX_RECONSUME_TIMES:
            raise InvalidArgumentError(
                field="max_reconsume_times",
                rule=f"must be at most {MAX_RECONSUME_TIMES}, got {self.max_reconsume_times}",
            )
        _integer("first_retry_delay_level", self.first_retry_delay_level, 1)
        if self.first_retry_delay_level > MAX_DELAY_LEVEL:
            raise InvalidArgumentError(
                field="first_retry_delay_level",
                rule=f"must be a delay level from 1 to {MAX_DELAY_LEVEL}, "
                f"got {self.first_retry_delay_level}",
            )
        if self.pull_batch_size > 1024:
            raise InvalidArgumentError(
                field="pull_batch_size", rule=f"must be at most 1024, got {self.pull_batch_size}"
            )
        if self.consume_from is ConsumeFrom.TIMESTAMP and self.consume_timestamp_ms <= 0:
            raise InvalidArgumentError(
                field="consume_timestamp_ms",
                rule="must be set (epoch milliseconds) when consume_from is 'timestamp'",
            )
        if self.orderly and self.mode is ConsumeMode.BROADCASTING:
            raise InvalidArgumentError(
                field="orderly", rule="orderly consumption needs clustering mode (queue locks)"
            )
        if not self.client_id:
            object.__setattr__(self, "client_id", default_client_id())
        elif not CLIENT_ID_RE.fullmatch(self.client_id):
            raise InvalidArgumentError(
                field="client_id",
                rule=f"{self.client_id!r} must be 1 to 255 characters from [a-zA-Z0-9_.@:%|-]",
            )
        else:
            object.__setattr__(self, "client_id_given", True)

    @classmethod
    def create(
        cls, namesrv: str | Sequence[str], group: str, options: ConsumerOptions
    ) -> ConsumerConfig:
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown consumer option(s): {', '.join(unknown)}")
        opts: dict[str, Any] = dict(options)
        if "mode" in opts:
            opts["mode"] = _enum(ConsumeMode, "mode", opts["mode"])
        if "consume_from" in opts:
            opts["consume_from"] = _enum(ConsumeFrom, "consume_from", opts["consume_from"])
        if isinstance(opts.get("allocate"), str):
            opts["allocate"] = strategy_by_name(opts["allocate"])
        if opts.get("offset_dir") is not None:
            opts["offset_dir"] = Path(opts["offset_dir"])
        return cls(namesrv=parse_addresses(namesrv), group=group, **opts)


def _enum(cls: type[enum.Enum], name: str, value: object) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in cls)
        raise InvalidArgumentError(
            field=name, rule=f"must be one of {choices}, got {value!r}"
        ) from None


def default_client_id() -> str:
    host = socket.gethostname().split(".")[0] or "host"
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in host)[:100]
    return f"{safe}@{os.getpid()}@{new_id()[-8:]}"


def config_reference() -> str:
    """The consumers' section of docs/configuration.md."""
    lines = [
        "## Consumers (`apogee.client.PushConsumer`, `PullConsumer` and their sync twins)",
        "",
        "Keyword options of every consumer, e.g. `PushConsumer(namesrv, group, listener, "
        "consume_from='earliest')`.",
        "",
        "| option | default | meaning |",
        "| --- | --- | --- |",
    ]
    for f in fields(ConsumerConfig):
        text = f.metadata.get("doc")
        if text:
            default = f.default
            shown = (
                f"`{default.value}`"
                if isinstance(default, enum.Enum)
                else f"`{default.name}`"
                if hasattr(default, "name") and not isinstance(default, str | int | float)
                else _shown(default)
            )
            lines.append(f"| `{f.name}` | {shown} | {text} |")
    return "\n".join(lines) + "\n"
