"""What the scheduler exchanges with a broker, as plain data (the client seam converts)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from apogee_schedule.core.layout import Layout
from apogee_schedule.core.progress import QueueState


@dataclass(frozen=True, slots=True)
class ScheduleEntry:
    """One ConsumeQueue entry of the schedule topic (no body: the broker reads the record)."""

    queue_id: int
    queue_offset: int
    phys_offset: int
    size: int
    deliver_at_ms: int


class ResolveAction(enum.Enum):
    DELIVER = "deliver"
    PARK = "park"


class Outcome(enum.Enum):
    #: stored in the real topic (DELIVER) or again under the schedule topic (PARK)
    RESOLVED = "resolved"
    #: nothing to do any more (retention removed it, its topic is gone): counts as resolved
    DROPPED = "dropped"
    #: not stored; try again
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class TraceInfo:
    """A resolved message's trace context, as a tracing schedule service asks for it."""

    traceparent: str
    tracestate: str = ""
    #: when the schedule topic's copy was stored (ms since the epoch); 0: not known
    store_timestamp_ms: int = 0
    unique_id: str = ""
    real_topic: str = ""


@dataclass(frozen=True, slots=True)
class ResolveResult:
    outcome: Outcome
    reason: str = ""
    #: where a RESOLVED entry was stored
    topic: str = ""
    #: the message's trace context, when asked for and it has one
    trace: TraceInfo | None = None


@dataclass(frozen=True, slots=True)
class BrokerScheduleState:
    """GetScheduleState: the layout, each queue's bounds and the committed progress."""

    broker_name: str
    layout: Layout
    queues: tuple[QueueState, ...]
    #: when progress was last committed (the broker's clock); 0: never
    progress_updated_ms: int
    now_ms: int


@dataclass(frozen=True, slots=True)
class ScanQueue:
    queue_id: int
    offset: int
    #: 0: no limit
    due_before_ms: int = 0


@dataclass(frozen=True, slots=True)
class ScanQueueResult:
    queue_id: int
    next_offset: int
    #: entries removed by retention before they were resolved
    skipped: int


@dataclass(frozen=True, slots=True)
class ScanResult:
    entries: list[ScheduleEntry] = field(default_factory=list)
    queues: list[ScanQueueResult] = field(default_factory=list)
    now_ms: int = 0
