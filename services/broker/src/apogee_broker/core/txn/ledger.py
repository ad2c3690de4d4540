"""One broker's transactions as a whole: what every step of a transaction shares.

:class:`TransactionLedger` holds what the broker remembers of its transactions (decisions,
closed copies, halves stored lately: :mod:`.state`), each transaction's lock (:mod:`.locks`), the
checker's progress, and the writes and reads every step makes: storing op records (that close
copies) with what goes with them, asking whether a copy is closed or a transaction decided, and
reading a copy by its offset. The steps themselves are :mod:`.halves` (SendHalf),
:mod:`.ends` (EndTransaction), :mod:`.checks` (CheckHalf) and :mod:`.scans` (the reads of the
checker and operators).

:meth:`TransactionLedger.commit_progress` records the checker's progress: both offsets checked
(not negative, not beyond their queue's end), then written (atomically) under the progress lock,
which is never taken with a transaction's lock held. Reads of the store that may touch the disk
run on worker threads (:mod:`.lookups`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from apogee.codec import Message, StoredMessage
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import ApogeeError, InvalidArgumentError
from apogee.common.topics import TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC
from apogee.store import AppendResult, MessageStore
from apogee_broker.core.storage.writer import StoreWriter
from apogee_broker.core.txn import lookups
from apogee_broker.core.txn.locks import KeyedLocks
from apogee_broker.core.txn.records import HalfCopy, OpKind, op_message
from apogee_broker.core.txn.state import (
    ClosedHalves,
    Decided,
    DecidedTransactions,
    RebuildReport,
    RecentHalves,
    TransactionProgress,
    rebuild,
)

log = logging.getLogger(__name__)


class TransactionLedger:
    """What one broker's transaction steps share (see the module docstring); methods run on
    the loop."""

    def __init__(
        self,
        store: MessageStore,
        writer: StoreWriter,
        data_dir: Path,
        *,
        broker_name: str,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.store = store
        self.writer = writer
        self.broker_name = broker_name
        self.clock = clock
        self.progress = TransactionProgress(data_dir, clock)
        self.decided = DecidedTransactions()
        self.closed = ClosedHalves()
        self.recent = RecentHalves()
        self.locks = KeyedLocks()
        self._progress_lock = asyncio.Lock()
        #: a replica group's leader: each progress written goes into the log too
        #: (:mod:`apogee_broker.replication.state`); raises when it is not replicated
        self.replicate: Callable[[dict[str, Any]], Awaitable[None]] | None = None

    async def load(self) -> RebuildReport:
        """Read the checker's progress and rebuild decisions and closed copies from the op
        queue (:func:`~.state.rebuild`); returns what it read."""
        await asyncio.to_thread(self.progress.load)
        self.decided, self.closed, report = await asyncio.to_thread(
            rebuild, self.store, self.progress.half
        )
        log.info("transactions of broker %s: %s", self.broker_name, report.summary())
        return report

    # -- progress -------------------------------------------------------------------------------

    async def commit_progress(self, half: int, op: int) -> None:
        """Record the checker's progress (atomically, before returning); copies before
        ``half`` are forgotten by the closed set."""
        for field, value, topic in (
            ("half_progress", half, TRANS_HALF_TOPIC),
            ("op_progress", op, TRANS_OP_HALF_TOPIC),
        ):
            if value < 0:
                raise InvalidArgumentError(field=field, rule=f"must not be negative, got {value}")
            high = self.store.max_offset(topic, 0)
            if value > high:
                raise InvalidArgumentError(
                    field=field,
                    rule=f"{value} is beyond the end of {topic} on broker {self.broker_name} "
                    f"(its max offset is {high})",
                )
        async with self._progress_lock:
            content = await asyncio.to_thread(self.progress.commit, half, op)
            if self.replicate is not None:  # a replica group's leader: into the log too
                await self.replicate(content)
            self.closed.advance(half)

    # -- writes ---------------------------------------------------------------------------------

    async def store_closing(
        self,
        head: list[Message],
        closing: list[HalfCopy],
        kind: OpKind,
        real: tuple[str, int] | None = None,
    ) -> tuple[list[AppendResult], ApogeeError | None]:
        """Store ``head`` and the op records of ``closing`` in one append."""
        ops, halves = self.closing_ops(closing, kind, real)
        return await self.store_ops([*head, *ops], halves)

    @staticmethod
    def closing_ops(
        closing: list[HalfCopy], kind: OpKind, real: tuple[str, int] | None = None
    ) -> tuple[list[Message], list[int]]:
        """The op records that close ``closing``, and the half-queue offsets they close."""
        ops: list[Message] = []
        halves: list[int] = []
        for copy in closing:
            info = copy.info
            ops.append(
                op_message(
                    info.queue_offset,
                    kind,
                    info.unique_id,
                    info.producer_group,
                    copy_topic=info.topic,
                    real=real,
                )
            )
            if info.in_half_queue:
                halves.append(info.queue_offset)
        return ops, halves

    async def store_ops(
        self, batch: list[Message], halves: list[int]
    ) -> tuple[list[AppendResult], ApogeeError | None]:
        """Append ``batch`` (raising when nothing was stored); the copies at ``halves`` are
        closed from then on."""
        self.writer.fill_defaults(batch, "")
        results, err = await self.writer.append_all(batch)
        for offset in halves:
            self.closed.add(offset)
            self.recent.forget(offset)
        return results, err

    # -- questions ------------------------------------------------------------------------------

    async def open_copies(self, copies: list[HalfCopy]) -> list[HalfCopy]:
        """Those of ``copies`` in the half queue that no op record closed yet."""
        return [
            c
            for c in copies
            if c.info.in_half_queue
            and not await self.is_closed(c.info.queue_offset, c.info.phys_offset)
        ]

    async def is_closed(self, half_offset: int, phys_offset: int) -> bool:
        known = self.closed.known(half_offset, phys_offset)
        if known is not None:
            return known
        return await asyncio.to_thread(lookups.closed_by_ops, self.store, half_offset)

    async def decision(self, unique_id: str, oldest_phys: int | None) -> Decided | None:
        """The transaction's decision: remembered, or read from its op records when it is older
        than what is remembered."""
        if not unique_id:
            return None
        decided = self.decided.get(unique_id)
        if decided is not None or self.decided.complete_for(oldest_phys):
            return decided
        decided = await asyncio.to_thread(lookups.decision_by_ops, self.store, unique_id)
        if decided is not None:
            self.decided.remember(unique_id, decided)
        return decided

    def half_at(self, offset: int) -> StoredMessage | None:
        """:func:`~.lookups.half_at` of this broker (on a worker thread)."""
        return lookups.half_at(self.store, self.broker_name, offset)
