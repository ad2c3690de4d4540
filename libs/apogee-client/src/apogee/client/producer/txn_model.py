"""Transactional messages, the parts without I/O: decisions, results, the rules a transactional
message follows, the wrappers around the user's executor and check listener, and the protocol's
messages both ways (``proto/apogee/v1/transaction.proto``).

:mod:`~apogee.client.producer.transaction` (the producer), :mod:`~apogee.client.producer.
txn_session` (the session streams) and :mod:`~apogee.client.producer.txn_checks` (answering
checks) are built on it.

A transaction's fate, as the producer sees it::

    executor → COMMIT / ROLLBACK ──EndTransaction(PRODUCER)──→ COMMITTED / ROLLED_BACK /
                                                               ALREADY_DONE, or FAILED
             → UNKNOWN (or raised, timed out, answered nonsense) → NOT_ENDED

NOT_ENDED and FAILED are *pending*: the half stays at the broker, whose checks ask a producer
of the group (its check listener) later, so nothing is lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import inspect
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sized
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from apogee.client.message import Message, SendResult, SendStatus, StoredMessage, encode_body
from apogee.codec import (
    OWN_FIELDS,
    PROP_CHECK_IMMUNITY,
    PROP_REAL_QID,
    PROP_REAL_TOPIC,
    check_immunity_rule,
    is_broker_property,
)
from apogee.common.errors import ApogeeError, InvalidArgumentError, InvalidPropertyError
from apogee.v1 import common_pb2, transaction_pb2

log = logging.getLogger("apogee.client.producer.transaction")


class TransactionDecision(enum.Enum):
    """What became of a local transaction: what an executor and a check listener return."""

    #: deliver the message (it is stored under its topic, once)
    COMMIT = "COMMIT"
    #: drop it
    ROLLBACK = "ROLLBACK"
    #: not known yet: the broker asks again later (a check)
    UNKNOWN = "UNKNOWN"

    def as_pb(self) -> transaction_pb2.TransactionDecision.ValueType:
        return transaction_pb2.TransactionDecision.Value(self.value)


class EndOutcome(enum.Enum):
    """What ending a transaction came to (:attr:`TransactionResult.end_outcome`)."""

    #: the message is stored under its topic
    COMMITTED = "COMMITTED"
    #: the half is dropped
    ROLLED_BACK = "ROLLED_BACK"
    #: the same decision was taken before (a check answered first); nothing more was done
    ALREADY_DONE = "ALREADY_DONE"
    #: the decision was UNKNOWN: the transaction was not ended; the broker's checks will ask
    NOT_ENDED = "NOT_ENDED"
    #: ending it failed (``end_error`` says why); the broker's checks will ask (unless the
    #: reason is that the other decision was taken first, by a check or an operator)
    FAILED = "FAILED"


@dataclass(slots=True)
class TransactionMessage(Message):
    """The message handed to the executor: a copy of the one sent, with its
    ``transaction_id`` (the half's unique id, which a check names again: keep it with the local
    transaction to answer checks)."""

    transaction_id: str = ""


@dataclass(frozen=True, slots=True)
class TransactionCheckMessage(StoredMessage):
    """The half message a check listener is asked about: a :class:`~apogee.client.
    StoredMessage` under its real topic and queue (``queue_offset`` -1: it is not there yet),
    with the user's properties only, its ``transaction_id`` (also its ``unique_id``) and which
    check of the transaction this is (``check_times``, 1 for the first)."""

    check_times: int = 0

    @property
    def transaction_id(self) -> str:
        return self.unique_id


@dataclass(frozen=True, slots=True)
class TransactionResult:
    """One transactional send: where the half is, what was decided locally, how ending it went.

    ``queue_offset`` is the committed message's offset in its queue when the broker said it
    (-1 otherwise). ``executor_error`` says why the decision was forced to UNKNOWN (the executor
    raised, ran past ``executor_timeout`` or returned something else), ``end_error`` why ending
    the transaction failed; both are "" when nothing went wrong."""

    message_id: str
    decision: TransactionDecision
    end_outcome: EndOutcome
    topic: str
    queue_id: int
    broker_name: str
    half_offset: int
    store_timestamp_ms: int = 0
    queue_offset: int = -1
    end_error: str = ""
    executor_error: str = ""

    @property
    def transaction_id(self) -> str:
        """The same as :attr:`message_id`: a transaction is named by its half's unique id."""
        return self.message_id

    @property
    def unique_id(self) -> str:
        return self.message_id

    @property
    def committed(self) -> bool:
        """Whether the message is known to be stored under its topic."""
        return self.decision is TransactionDecision.COMMIT and self.end_outcome in (
            EndOutcome.COMMITTED,
            EndOutcome.ALREADY_DONE,
        )

    @property
    def pending(self) -> bool:
        """Whether the broker's checks decide the transaction (not ended, or ending failed)."""
        return self.end_outcome in (EndOutcome.NOT_ENDED, EndOutcome.FAILED)


@dataclass(frozen=True, slots=True)
class HalfSent:
    """A stored half: what the producer needs to end it."""

    message: TransactionMessage
    unique_id: str
    broker_name: str
    address: str
    topic: str
    queue_id: int
    half_offset: int
    store_timestamp_ms: int

    def send_result(self) -> SendResult:
        """The half as a send hook sees it: its real topic and queue, no offset there yet."""
        return SendResult(
            self.unique_id,
            self.topic,
            self.queue_id,
            -1,
            self.broker_name,
            SendStatus.OK,
            self.store_timestamp_ms,
        )


# -- the rules ---------------------------------------------------------------------------------


def check_transactional(msg: object) -> None:
    """The rules a transactional message adds to a message's: one message (not a batch), no
    delay level, no delivery time, and a ``CHECK_IMMUNITY_TIME_IN_SECONDS`` (how long after it
    is stored the half is first checked) of whole seconds. The message's own rules
    (:func:`~apogee.client.producer.validation.validate_message`: no property only brokers set,
    such as ``REAL_TOPIC`` or ``TRAN_MSG``, among them) are checked apart."""
    if not isinstance(msg, Message):
        if isinstance(msg, Iterable) and not isinstance(msg, str | bytes | bytearray):
            n = len(msg) if isinstance(msg, Sized) else "several"
            raise InvalidArgumentError(
                field="message",
                rule=f"send_in_transaction takes one message, got a {type(msg).__name__} of {n} "
                "(a batch cannot be sent in a transaction)",
            )
        return  # the message's own rules name what it is
    level = msg.delay_level
    if isinstance(level, int) and not isinstance(level, bool) and level != 0:
        raise InvalidArgumentError(
            field="delay_level",
            rule=f"a transactional message cannot be delayed; got level {level}, must be 0",
        )
    if msg.deliver_at is not None:
        raise InvalidArgumentError(
            field="deliver_at",
            rule=f"a transactional message cannot be delayed; must be None, got {msg.deliver_at!r}",
        )
    props = msg.properties
    value = props.get(PROP_CHECK_IMMUNITY) if isinstance(props, Mapping) else None
    if value is not None:
        rule = check_immunity_rule(value) if isinstance(value, str) else None
        if rule is not None:
            raise InvalidPropertyError(field=PROP_CHECK_IMMUNITY, rule=rule)


# -- the executor and the listener -------------------------------------------------------------

#: ``executor(message, arg)``: runs the local transaction (a plain or an async function)
TransactionExecutor: TypeAlias = Callable[
    [TransactionMessage, Any],
    "TransactionDecision | Awaitable[TransactionDecision]",
]
#: ``check_listener(message)``: what became of the transaction of ``message`` (its
#: ``transaction_id``); a plain or an async function
CheckListener: TypeAlias = Callable[
    [TransactionCheckMessage], "TransactionDecision | Awaitable[TransactionDecision]"
]


def one_line(text: str, limit: int = 512) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def decision_of(value: object, who: str, uid: str) -> tuple[TransactionDecision, str]:
    """``value`` as a decision, and "" — or UNKNOWN and why, logged, when it is none."""
    if isinstance(value, TransactionDecision):
        return value, ""
    why = one_line(f"{who} returned {value!r}, not a TransactionDecision")
    log.warning("%s; transaction %s is UNKNOWN (the broker's checks will ask)", why, uid)
    return TransactionDecision.UNKNOWN, why


def failed(exc: BaseException, who: str, uid: str) -> tuple[TransactionDecision, str]:
    """UNKNOWN, and why, for a ``who`` (executor, listener) that raised ``exc``; logged."""
    log.warning(
        "%s raised %s for transaction %s; it counts as UNKNOWN (the broker's checks will ask)",
        who,
        type(exc).__name__,
        uid,
        exc_info=exc,
    )
    return TransactionDecision.UNKNOWN, one_line(f"{who} raised {type(exc).__name__}: {exc}")


async def await_decision(
    value: Awaitable[object], timeout: float, who: str, uid: str
) -> tuple[TransactionDecision, str]:
    """Await what an async executor or listener returned, at most ``timeout`` seconds (then it
    is cancelled and the decision is UNKNOWN)."""
    try:
        async with asyncio.timeout(timeout) as scope:
            result = await value
    except TimeoutError as exc:
        if not scope.expired():
            return failed(exc, who, uid)
        log.warning(
            "%s ran past its %.0f s for transaction %s; it counts as UNKNOWN (the broker's "
            "checks will ask)",
            who,
            timeout,
            uid,
        )
        return TransactionDecision.UNKNOWN, f"{who} ran past its timeout of {timeout:g} s"
    except Exception as exc:
        return failed(exc, who, uid)
    return decision_of(result, who, uid)


async def run_executor(
    executor: TransactionExecutor, message: TransactionMessage, arg: object, timeout: float
) -> tuple[TransactionDecision, str]:
    """Run the local transaction: a plain function is called here (on the event loop), an async
    one awaited at most ``timeout`` seconds. Returns the decision and, when it was forced to
    UNKNOWN, why (logged as a warning)."""
    uid = message.transaction_id
    try:
        value = executor(message, arg)
    except Exception as exc:
        return failed(exc, "the executor", uid)
    if inspect.isawaitable(value):
        return await await_decision(value, timeout, "the executor", uid)
    return decision_of(value, "the executor", uid)


# -- the protocol, both ways -------------------------------------------------------------------


def half_request(
    msg: Message, uid: str, group: str, queue_id: int, born_ms: int, compress_over: int
) -> transaction_pb2.SendHalfRequest:
    """``SendHalf`` of a checked message (its body compressed as the producer's other sends)."""
    return transaction_pb2.SendHalfRequest(
        producer_group=group, message=half_message(msg, uid, queue_id, born_ms, compress_over)
    )


def half_message(
    msg: Message, uid: str, queue_id: int, born_ms: int, compress_over: int
) -> common_pb2.Message:
    """The message of a checked half, as ``SendHalf`` and ``SendHalves`` carry it."""
    raw = msg.body if type(msg.body) is bytes else bytes(msg.body)
    body, sys_flag = encode_body(raw, compress_over)
    return common_pb2.Message(
        topic=msg.topic,
        body=body,
        tags=msg.tags,
        keys=list(msg.keys),
        properties=dict(msg.properties),
        unique_id=uid,
        born_timestamp_ms=born_ms,
        queue_id=queue_id,
        sys_flag=sys_flag,
    )


def end_request(
    group: str,
    uid: str,
    half_offset: int,
    decision: TransactionDecision,
    source: transaction_pb2.EndSource.ValueType,
    client_id: str,
) -> transaction_pb2.EndTransactionRequest:
    return transaction_pb2.EndTransactionRequest(
        producer_group=group,
        unique_id=uid,
        half_offset=half_offset,
        decision=decision.as_pb(),
        source=source,
        client_id=client_id,
    )


_OUTCOMES: Final = {
    transaction_pb2.COMMITTED: EndOutcome.COMMITTED,
    transaction_pb2.ROLLED_BACK: EndOutcome.ROLLED_BACK,
    transaction_pb2.ALREADY_DONE: EndOutcome.ALREADY_DONE,
    transaction_pb2.STILL_PENDING: EndOutcome.NOT_ENDED,
}


def transaction_result(
    half: HalfSent,
    decision: TransactionDecision,
    executor_error: str,
    end: transaction_pb2.EndTransactionResponse | BaseException | None,
) -> TransactionResult:
    """The result of a transactional send whose transaction was ended with ``end`` (its
    answer, its failure, or None when the decision was UNKNOWN)."""
    outcome = EndOutcome.NOT_ENDED
    end_error = ""
    queue_offset = -1
    if isinstance(end, BaseException):
        outcome = EndOutcome.FAILED
        end_error = error_text(end)
    elif end is not None:
        known = _OUTCOMES.get(end.outcome)
        if known is None:
            outcome = EndOutcome.FAILED
            end_error = (
                f"the broker answered outcome {end.outcome}, which this client does not know"
            )
        else:
            outcome = known
            if (
                decision is TransactionDecision.COMMIT
                and end.topic
                and known
                in (
                    EndOutcome.COMMITTED,
                    EndOutcome.ALREADY_DONE,
                )
            ):
                queue_offset = end.queue_offset
    return TransactionResult(
        message_id=half.unique_id,
        decision=decision,
        end_outcome=outcome,
        topic=half.topic,
        queue_id=half.queue_id,
        broker_name=half.broker_name,
        half_offset=half.half_offset,
        store_timestamp_ms=half.store_timestamp_ms,
        queue_offset=queue_offset,
        end_error=end_error,
        executor_error=executor_error,
    )


def hidden_property(name: str) -> bool:
    """Whether a check listener does not see property ``name``: brokers' (``REAL_TOPIC``,
    ``TRAN_MSG``, ``PGROUP``, ``TRANSACTION_CHECK_TIMES``, ...), the message's own fields, and
    ``CHECK_IMMUNITY_TIME_IN_SECONDS`` (a transaction's; consumers do not see it either)."""
    return name in OWN_FIELDS or name == PROP_CHECK_IMMUNITY or is_broker_property(name)


def checked_message(
    check: transaction_pb2.TransactionCheckRequest, broker_name: str
) -> TransactionCheckMessage:
    """The half of a check as a check listener sees it: its real topic as ``topic`` and its real
    queue as ``queue_id`` (``queue_offset`` -1: it has none there yet), the transaction id as
    ``unique_id``, the body decompressed, the user's properties only, and the check's number."""
    half = check.half
    base = StoredMessage.from_pb(half, broker_name)
    props = base.properties
    real_qid = props.get(PROP_REAL_QID, "")
    own = {f.name: getattr(base, f.name) for f in dataclasses.fields(StoredMessage)}
    own.update(
        topic=check.topic or props.get(PROP_REAL_TOPIC) or half.topic,
        queue_id=int(real_qid) if real_qid.isdigit() else half.queue_id,
        queue_offset=-1,
        unique_id=check.unique_id or base.unique_id,
        properties={k: v for k, v in props.items() if not hidden_property(k)},
    )
    return TransactionCheckMessage(**own, check_times=check.check_times)


def error_text(exc: BaseException) -> str:
    """One line naming an end's failure, for logs and results."""
    if isinstance(exc, ApogeeError):
        return one_line(str(exc))
    return one_line(f"{type(exc).__name__}: {exc}")
