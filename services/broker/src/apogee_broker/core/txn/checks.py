"""CheckHalf: the txn-checker's step on one half copy at this broker.

The checker scans the half queue (:mod:`.scans`) and, for each copy that is not closed and
whose immunity has passed, asks this broker to check it. The broker then, under the
transaction's lock (:class:`~.locks.KeyedLocks`):

==============  ==============================================================================
outcome         when, and what was done
==============  ==============================================================================
CLOSED          the copy already has an op record (checked or ended before): nothing
DECIDED         the transaction was decided meanwhile: the copy's op record (the decision)
GAVE_UP         the copy was checked ``max_check_times`` times (0: 15): it is kept, every
                property with it, in TRANS_CHECK_MAX_TIME_TOPIC queue 0, where an operator can
                still end it (EndTransaction by id), and its op record (GAVE_UP) written; one
                append
GONE            the copy was removed by retention or cannot be read: its op record (GONE)
CHECK_SENT      else: a new copy at the end of the half queue (TRANSACTION_CHECK_TIMES one
NO_PRODUCER     higher) and the op record of this one (CHECKED), in one append; then the check
                is sent to a live producer of the group in turn (CHECK_SENT, naming it), or
                there is none connected here (NO_PRODUCER: the new copy is checked next time)
==============  ==============================================================================

So CheckHalf is idempotent per copy: a second call on a copy answers CLOSED. A check that
cannot be sent is never lost for good: its copy stays open until a later CheckHalf.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from dataclasses import dataclass
from typing import Final

from apogee.common.errors import InvalidArgumentError
from apogee.common.topics import TRANS_CHECK_MAX_TIME_TOPIC, TRANS_HALF_TOPIC
from apogee_broker.core.clients.producers import CheckEvent, ProducerRegistry
from apogee_broker.core.txn.ledger import TransactionLedger
from apogee_broker.core.txn.locks import to_the_end
from apogee_broker.core.txn.records import (
    OpKind,
    copy_key,
    given_up_copy,
    next_copy,
    op_kind_of,
    op_message,
    read_copy,
    stored_as,
)

log = logging.getLogger(__name__)

#: Checks a half gets when CheckHalf says 0 (RocketMQ's transactionCheckMax).
DEFAULT_MAX_CHECK_TIMES: Final = 15
#: Most checks CheckHalf may be asked to allow.
MAX_CHECK_TIMES: Final = 10_000


class CheckOutcome(enum.Enum):
    CHECK_SENT = "CHECK_SENT"
    NO_PRODUCER = "NO_PRODUCER"
    DECIDED = "DECIDED"
    GAVE_UP = "GAVE_UP"
    GONE = "GONE"
    CLOSED = "CLOSED"


@dataclass(frozen=True, slots=True)
class Checked:
    outcome: CheckOutcome
    #: CHECK_SENT, NO_PRODUCER: the new copy's offset
    new_half_offset: int = 0
    producer_client_id: str = ""
    check_times: int = 0


class HalfChecks:
    """CheckHalf at one broker; methods run on the loop."""

    def __init__(self, ledger: TransactionLedger, producers: ProducerRegistry) -> None:
        self.ledger = ledger
        self.producers = producers

    async def check_half(self, half_offset: int, max_check_times: int = 0) -> Checked:
        """Check the copy at ``half_offset`` (see the module docstring); once begun it runs to
        its end even when its caller is cancelled (:func:`~.locks.to_the_end`)."""
        if half_offset < 0:
            raise InvalidArgumentError(
                field="half_offset", rule=f"must not be negative, got {half_offset}"
            )
        if not 0 <= max_check_times <= MAX_CHECK_TIMES:
            raise InvalidArgumentError(
                field="max_check_times",
                rule=f"must be between 0 (the default, {DEFAULT_MAX_CHECK_TIMES}) and "
                f"{MAX_CHECK_TIMES}, got {max_check_times}",
            )
        limit = max_check_times or DEFAULT_MAX_CHECK_TIMES
        return await to_the_end(
            self._check_half(half_offset, limit), f"checking the half at offset {half_offset}"
        )

    async def _check_half(self, half_offset: int, limit: int) -> Checked:
        s = self.ledger
        copy = await asyncio.to_thread(s.half_at, half_offset)
        if copy is None:
            return await self._gone(half_offset)
        read = read_copy(copy)
        info = read.info
        async with s.locks.hold(info.unique_id or copy_key(half_offset)):
            if await s.is_closed(half_offset, copy.phys_offset):
                return Checked(CheckOutcome.CLOSED, check_times=info.check_times)
            decided = await s.decision(info.unique_id, copy.phys_offset)
            if decided is not None:
                _, err = await s.store_closing([], [read], op_kind_of(decided.decision))
                if err is not None:
                    raise err
                return Checked(CheckOutcome.DECIDED, check_times=info.check_times)
            if info.check_times >= limit:
                kept = given_up_copy(copy, info)
                _, err = await s.store_closing([kept], [read], OpKind.GAVE_UP)
                log.warning(
                    "transaction %s of group %s still unknown after %d checks; kept in %s, "
                    "where an operator can end it",
                    info.unique_id,
                    info.producer_group,
                    info.check_times,
                    TRANS_CHECK_MAX_TIME_TOPIC,
                )
                if err is not None:
                    raise err
                return Checked(CheckOutcome.GAVE_UP, check_times=info.check_times)
            new, props = next_copy(copy, info)
            results, err = await s.store_closing([new], [read], OpKind.CHECKED)
            if err is not None:
                raise err
        put = results[0]
        times = info.check_times + 1
        event = CheckEvent(
            stored_as(copy, props, put), info.unique_id, put.queue_offset, times, info.real_topic
        )
        producer = self.producers.pick(info.producer_group, info.real_topic)
        if producer is not None and producer.client_id and producer.offer(event):
            return Checked(CheckOutcome.CHECK_SENT, put.queue_offset, producer.client_id, times)
        return Checked(CheckOutcome.NO_PRODUCER, put.queue_offset, check_times=times)

    async def _gone(self, half_offset: int) -> Checked:
        """A copy that cannot be read: closed as GONE, once."""
        s = self.ledger
        async with s.locks.hold(copy_key(half_offset)):
            if await s.is_closed(half_offset, -1):
                return Checked(CheckOutcome.CLOSED)
            _, err = await s.store_ops([op_message(half_offset, OpKind.GONE)], [half_offset])
            log.warning(
                "the half at offset %d of %s cannot be read (removed by retention?); closed",
                half_offset,
                TRANS_HALF_TOPIC,
            )
            if err is not None:
                raise err
            return Checked(CheckOutcome.GONE)
