"""What the checker exchanges with a broker, as plain data (the client seam converts).

The fields mirror ``apogee.v1.TransactionCheck`` (``proto/apogee/v1/transaction.proto``): the
half queue is ``RMQ_SYS_TRANS_HALF_TOPIC`` queue 0, the op queue ``RMQ_SYS_TRANS_OP_HALF_TOPIC``
queue 0; a half's copies (one per check) share its unique id, the transaction id.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Decision(enum.Enum):
    """A transaction's decision, as the broker knows it."""

    NONE = "none"
    COMMIT = "commit"
    ROLLBACK = "rollback"
    UNKNOWN = "unknown"


class CheckOutcome(enum.Enum):
    """What CheckHalf did with one copy of a half."""

    #: put again with one more check; the check went to a producer of the group
    CHECK_SENT = "check_sent"
    #: put again with one more check; no producer of the group is connected to the broker
    NO_PRODUCER = "no_producer"
    #: the transaction was decided meanwhile: this copy's op record was written
    DECIDED = "decided"
    #: checked max_check_times times: moved to TRANS_CHECK_MAX_TIME_TOPIC
    GAVE_UP = "gave_up"
    #: removed by retention or unreadable: its op record was written
    GONE = "gone"
    #: this copy already had an op record: nothing was done
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class TransactionState:
    """GetTransactionState: both queues' bounds and the progress committed at the broker."""

    broker_name: str
    half_min_offset: int
    half_max_offset: int
    op_min_offset: int
    op_max_offset: int
    #: the first half not processed yet; -1: nothing committed
    half_progress: int
    #: the first op record not known to be done; -1: nothing committed
    op_progress: int
    #: the broker's clock when it answered
    now_ms: int
    #: producer group -> client ids connected to this broker
    producers: dict[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HalfEntry:
    """One copy of a half message (metadata only)."""

    queue_offset: int
    unique_id: str
    producer_group: str
    #: the real topic
    topic: str
    store_timestamp_ms: int
    #: checks so far (0: never checked)
    check_times: int = 0
    #: CHECK_IMMUNITY_TIME_IN_SECONDS in ms; 0: the checker's default
    immunity_ms: int = 0
    decided: Decision = Decision.NONE
    #: when the transaction's first copy was stored; 0: not known (the store timestamp counts)
    first_stored_ms: int = 0


@dataclass(frozen=True, slots=True)
class OpEntry:
    """One op record: the half copy at ``half_offset`` is done."""

    queue_offset: int
    half_offset: int
    unique_id: str = ""
    decision: Decision = Decision.NONE


@dataclass(frozen=True, slots=True)
class HalfScan:
    entries: list[HalfEntry]
    #: where the next scan starts (past entries removed by retention too)
    next_offset: int
    max_offset: int


@dataclass(frozen=True, slots=True)
class OpScan:
    entries: list[OpEntry]
    next_offset: int
    max_offset: int


@dataclass(frozen=True, slots=True)
class CheckResult:
    outcome: CheckOutcome
    #: CHECK_SENT, NO_PRODUCER: the new copy's offset
    new_half_offset: int = -1
    producer_client_id: str = ""
    check_times: int = 0
