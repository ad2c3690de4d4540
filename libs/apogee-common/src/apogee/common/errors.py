"""Apogee's errors, kept as data.

Every error Apogee raises is an :class:`ApogeeError` carrying an :class:`ErrorKind` from the one
registry below: a stable ``name``, the gRPC status ``code`` a server answers with, whether the
operation may be ``retriable``, and the message ``template``. Callers decide on ``kind.retriable``
and ``kind.code``, never on chains of ``isinstance``. Every message names the field and the rule.

Exception tree::

    ApogeeError
     ├── InvalidArgumentError          INVALID_ARGUMENT  bad input, named field and rule
     │    ├── InvalidTopicError
     │    ├── InvalidQueueIdError
     │    ├── MessageTooLargeError
     │    ├── PropertiesTooLargeError
     │    ├── InvalidPropertyError
     │    └── MessageTypeMismatchError  the topic does not accept this type of message
     ├── NotFoundError                 NOT_FOUND
     │    └── OffsetDeletedError       the offset was removed by retention
     ├── StoreError                    problems of the storage engine itself
     │    ├── CorruptRecordError       DATA_LOSS: a record failed its checks while reading
     │    ├── FlushTimeoutError        DEADLINE_EXCEEDED, retriable: stored, durability unconfirmed
     │    ├── StoreClosedError         UNAVAILABLE, retriable
     │    ├── StoreFailedError         UNAVAILABLE, retriable elsewhere: a flush or dispatch failed
     │    ├── StoreLockedError         FAILED_PRECONDITION: another process owns the directory
     │    ├── StoreConfigError         FAILED_PRECONDITION: settings do not match the files
     │    └── DiskFullError            RESOURCE_EXHAUSTED
     ├── UnknownTopicError             NOT_FOUND: no such topic (or no route to it)
     ├── UnauthenticatedError          UNAUTHENTICATED: unsigned, badly signed or unknown caller
     ├── PermissionDeniedError         PERMISSION_DENIED: system topics, read-only topics, a
     │                                 user without the right
     ├── UnsupportedError              FAILED_PRECONDITION: a feature that is not there yet
     └── UnavailableError              UNAVAILABLE, retriable: a broker or nameserver is down

An error may also say that what failed may have been done all the same: ``outcome_unknown``
is true when the SDK gave up after its request may have reached a broker (a send that timed
out, or whose broker died with the request in flight), so the message may have been stored.
Such an error keeps its class and kind (a :class:`DeadlineExceededError` stays one), names the
messages in ``message_id`` / ``message_ids``, and its sentence ends by saying so and what to do
(send again idempotently, or look the message up by id first; docs/client.md). An error raised
before anything was sent (bad input, no route, a refused connection, a closed producer) never
has it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self


@dataclass(frozen=True, slots=True)
class ErrorKind:
    """One kind of error: its name, gRPC status code, retriability and message template."""

    name: str
    code: str
    retriable: bool
    template: str


def _kinds(*kinds: ErrorKind) -> dict[str, ErrorKind]:
    return {k.name: k for k in kinds}


#: The registry. Names are stable: clients and dashboards may key on them.
KINDS: dict[str, ErrorKind] = _kinds(
    ErrorKind("INVALID_ARGUMENT", "INVALID_ARGUMENT", False, "{field}: {rule}"),
    ErrorKind("INVALID_TOPIC", "INVALID_ARGUMENT", False, "topic {value!r}: {rule}"),
    ErrorKind("INVALID_QUEUE_ID", "INVALID_ARGUMENT", False, "queue_id {value}: {rule}"),
    ErrorKind("MESSAGE_TOO_LARGE", "INVALID_ARGUMENT", False, "{field} is {size} bytes: {rule}"),
    ErrorKind(
        "PROPERTIES_TOO_LARGE", "INVALID_ARGUMENT", False, "properties are {size} bytes: {rule}"
    ),
    ErrorKind("INVALID_PROPERTY", "INVALID_ARGUMENT", False, "property {field!r}: {rule}"),
    ErrorKind(
        "MESSAGE_TYPE_MISMATCH",
        "INVALID_ARGUMENT",
        False,
        "topic {topic!r} accepts {accepts} messages only, and message {index} is a {kind} "
        "message ({why}): send it to a {kind} or MIXED topic",
    ),
    ErrorKind("NOT_FOUND", "NOT_FOUND", False, "{what} not found: {detail}"),
    ErrorKind(
        "OFFSET_DELETED",
        "NOT_FOUND",
        False,
        "{what} {offset} was deleted by retention; the earliest available is {earliest}",
    ),
    ErrorKind("CORRUPT_RECORD", "DATA_LOSS", False, "corrupt record in {where}: {detail}"),
    ErrorKind(
        "FLUSH_TIMEOUT",
        "DEADLINE_EXCEEDED",
        True,
        "stored but not confirmed durable within {timeout_s}s (flush to offset {offset})",
    ),
    ErrorKind("STORE_CLOSED", "UNAVAILABLE", True, "the store at {path} is closed"),
    ErrorKind(
        "STORE_FAILED",
        "UNAVAILABLE",
        True,
        "the store at {path} stopped accepting writes: {reason}; reopen it to recover",
    ),
    ErrorKind(
        "STORE_LOCKED",
        "FAILED_PRECONDITION",
        False,
        "the store directory {path} is in use by another process (lock file {lock})",
    ),
    ErrorKind("STORE_CONFIG", "FAILED_PRECONDITION", False, "{field}: {rule}"),
    ErrorKind("DISK_FULL", "RESOURCE_EXHAUSTED", True, "no space left for {path}: {detail}"),
    ErrorKind("UNKNOWN_TOPIC", "NOT_FOUND", False, "topic {topic!r} {detail}"),
    ErrorKind("UNAUTHENTICATED", "UNAUTHENTICATED", False, "{what}: {rule}"),
    ErrorKind("PERMISSION_DENIED", "PERMISSION_DENIED", False, "{what}: {rule}"),
    ErrorKind("UNSUPPORTED", "FAILED_PRECONDITION", False, "{what} {detail}"),
    ErrorKind("TRANSACTION_DECIDED", "FAILED_PRECONDITION", False, "{what} {detail}"),
    ErrorKind("UNAVAILABLE", "UNAVAILABLE", True, "{what} is unavailable: {detail}"),
    ErrorKind(
        "QUEUE_HELD",
        "UNAVAILABLE",
        True,
        "queue {topic}/{queue_id} is read by {holder} of group {group}; it is yours once that "
        "one lets it go (a rebalance moving it)",
    ),
    ErrorKind(
        "NOT_LEADER",
        "UNAVAILABLE",
        True,
        "broker {broker!r}: replica {replica} does not lead its group ({detail}); ask the "
        "nameserver for the route again",
    ),
    ErrorKind(
        "NOT_ENOUGH_REPLICAS",
        "UNAVAILABLE",
        True,
        "broker {broker!r}: {detail} (min_insync_replicas {min_insync}); nothing was stored, "
        "send again",
    ),
    ErrorKind(
        "NOT_REPLICATED",
        "UNAVAILABLE",
        True,
        "broker {broker!r}: stored on the leader, but {detail}: the message may or may not "
        "survive a failover, send again (with a dedup id to store it once)",
    ),
    ErrorKind(
        "STALE_EPOCH",
        "FAILED_PRECONDITION",
        False,
        "{what} carries epoch {epoch}, but the replica group of {broker!r} is at epoch {current}",
    ),
    ErrorKind(
        "DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", True, "{what} took longer than {timeout_s}s"
    ),
    ErrorKind("INTERNAL", "INTERNAL", False, "internal error: {detail}"),
)


class ApogeeError(Exception):
    """Base of every Apogee error. ``kind`` says what it is; ``details`` holds the named values."""

    kind_name: ClassVar[str] = "INVALID_ARGUMENT"
    #: True when the operation may have been done although it failed: a send whose request may
    #: have reached a broker before the SDK gave up (the message may have been stored)
    outcome_unknown: bool = False
    #: of a send whose outcome is unknown: the message's id (a batch's first), and every id
    message_id: str | None = None
    message_ids: tuple[str, ...] = ()

    def __init__(self, **details: Any) -> None:
        self.kind: ErrorKind = KINDS[self.kind_name]
        self.details: dict[str, Any] = details
        super().__init__(self.kind.template.format(**details))

    @classmethod
    def from_wire(cls, kind_name: str, message: str) -> ApogeeError:
        """Rebuild an error received from a server: its kind's class, the server's sentence."""
        err_cls = error_class(kind_name)
        err = err_cls.__new__(err_cls)
        err.kind = KINDS.get(kind_name) or KINDS["INTERNAL"]
        err.details = {}
        Exception.__init__(err, message)
        return err

    def with_unknown_outcome(self, message_ids: Sequence[str], advice: str) -> Self:
        """This error (same class, kind and details) saying the outcome is unknown: its
        sentence followed by ``advice``, ``outcome_unknown`` set and the messages' ids."""
        cls = type(self)
        err = cls.__new__(cls)
        err.__dict__.update(self.__dict__)
        Exception.__init__(err, f"{self}; {advice}")
        err.outcome_unknown = True
        err.message_ids = tuple(message_ids)
        err.message_id = err.message_ids[0] if err.message_ids else None
        err.__cause__ = self.__cause__
        return err

    @property
    def retriable(self) -> bool:
        return self.kind.retriable

    @property
    def code(self) -> str:
        return self.kind.code


class InvalidArgumentError(ApogeeError):
    """Bad input. ``field`` names what was wrong and ``rule`` the rule it broke."""

    kind_name = "INVALID_ARGUMENT"


class InvalidTopicError(InvalidArgumentError):
    kind_name = "INVALID_TOPIC"


class MessageTypeMismatchError(InvalidArgumentError):
    """A message of a type its topic does not accept (``topic``, ``accepts``, ``index``,
    ``kind``, ``why``: what made it that type)."""

    kind_name = "MESSAGE_TYPE_MISMATCH"


class InvalidQueueIdError(InvalidArgumentError):
    kind_name = "INVALID_QUEUE_ID"


class MessageTooLargeError(InvalidArgumentError):
    kind_name = "MESSAGE_TOO_LARGE"


class PropertiesTooLargeError(InvalidArgumentError):
    kind_name = "PROPERTIES_TOO_LARGE"


class InvalidPropertyError(InvalidArgumentError):
    kind_name = "INVALID_PROPERTY"


class NotFoundError(ApogeeError):
    kind_name = "NOT_FOUND"


class OffsetDeletedError(NotFoundError):
    """The asked-for offset is older than what retention kept; ``earliest`` says where to go."""

    kind_name = "OFFSET_DELETED"


class StoreError(ApogeeError):
    kind_name = "CORRUPT_RECORD"


class CorruptRecordError(StoreError):
    kind_name = "CORRUPT_RECORD"


class FlushTimeoutError(StoreError):
    kind_name = "FLUSH_TIMEOUT"


class StoreClosedError(StoreError):
    kind_name = "STORE_CLOSED"


class StoreFailedError(StoreError):
    """A background part of the store failed; it refuses writes until it is reopened."""

    kind_name = "STORE_FAILED"


class StoreLockedError(StoreError):
    kind_name = "STORE_LOCKED"


class StoreConfigError(StoreError):
    kind_name = "STORE_CONFIG"


class DiskFullError(StoreError):
    kind_name = "DISK_FULL"


class UnknownTopicError(ApogeeError):
    kind_name = "UNKNOWN_TOPIC"


class UnauthenticatedError(ApogeeError):
    """The caller could not be identified: the request is unsigned, its signature or date is
    wrong, or its access key is unknown. ``details["reason"]`` (when set) is a short machine
    word for metrics."""

    kind_name = "UNAUTHENTICATED"


class PermissionDeniedError(ApogeeError):
    kind_name = "PERMISSION_DENIED"


class UnsupportedError(ApogeeError):
    kind_name = "UNSUPPORTED"


class TransactionDecidedError(ApogeeError):
    """A transaction was already ended the other way (committed, or rolled back)."""

    kind_name = "TRANSACTION_DECIDED"


class UnavailableError(ApogeeError):
    kind_name = "UNAVAILABLE"


class QueueHeldError(UnavailableError):
    """An exclusive subscription to a queue another member of the group holds (``topic``,
    ``queue_id``, ``group``, ``holder``): asked again shortly, it succeeds once the holder
    lets the queue go."""

    kind_name = "QUEUE_HELD"


class NotLeaderError(UnavailableError):
    """A replica that does not lead its group was asked to do what only the leader does
    (``broker``, ``replica``, ``detail``: who leads, as far as it knows)."""

    kind_name = "NOT_LEADER"


class NotEnoughReplicasError(UnavailableError):
    """A send refused before anything was stored: the in-sync set is smaller than
    ``min_insync_replicas`` (``broker``, ``detail``, ``min_insync``)."""

    kind_name = "NOT_ENOUGH_REPLICAS"


class NotReplicatedError(UnavailableError):
    """Stored on the leader but not confirmed by the in-sync set in time, or leadership was
    lost meanwhile (``broker``, ``detail``): the outcome is unknown."""

    kind_name = "NOT_REPLICATED"


class StaleEpochError(ApogeeError):
    """A replication call or a registration from an older epoch than the group's
    (``what``, ``epoch``, ``broker``, ``current``)."""

    kind_name = "STALE_EPOCH"


class DeadlineExceededError(ApogeeError):
    kind_name = "DEADLINE_EXCEEDED"


class InternalError(ApogeeError):
    kind_name = "INTERNAL"


def error_class(kind_name: str) -> type[ApogeeError]:
    """The most specific class for a kind (used to rebuild errors received over the wire)."""
    return _BY_KIND.get(kind_name, ApogeeError)


def _collect(cls: type[ApogeeError], into: dict[str, type[ApogeeError]]) -> None:
    for sub in cls.__subclasses__():
        into.setdefault(sub.kind_name, sub)
        _collect(sub, into)


_BY_KIND: dict[str, type[ApogeeError]] = {}
_collect(ApogeeError, _BY_KIND)
