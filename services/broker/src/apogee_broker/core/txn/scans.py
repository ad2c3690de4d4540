"""What the txn-checker and operators read of this broker's transactions.

- :meth:`TransactionScans.state`: the half and op queues' bounds, the checker's committed
  progress (-1: none), the producers connected per group, the broker's clock.
- :meth:`TransactionScans.scan_half`: half copies from an offset, in queue order, metadata only
  (their records are read, their bodies not answered); each with its transaction's decision when
  the broker remembers one (another copy was ended).
- :meth:`TransactionScans.scan_ops`: op records from an offset, in queue order.
- :meth:`TransactionScans.list_pending`: the transactions nobody decided yet
  (:meth:`TransactionScans.count_pending`: how many, for the metrics).

Bounds, so that no call reads without end:

===============  ==========================================================================
call             reads at most
===============  ==========================================================================
ScanHalf         max_entries records (0: 256; larger than 4096: 4096) and 8 MiB per call,
                 at least one record
ScanOps          max_entries records (0: 1024; larger than 16384: 16384) and 8 MiB per call,
                 at least one record
ListPending      the newest :data:`MAX_PENDING_SCAN` (100,000) records of the half queue from
                 the committed progress on, and of TRANS_CHECK_MAX_TIME_TOPIC; answers
                 max_entries (0: 100; larger than 10000: 10000), oldest first; ``more`` is set
                 when more were pending or older records were left unread
===============  ==========================================================================

A scan starting before the earliest record kept (retention) starts there; one starting beyond
the end answers nothing and ``next_offset`` at the end. Reads run on worker threads.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from apogee.common.errors import InvalidArgumentError
from apogee.common.topics import (
    TRANS_CHECK_MAX_TIME_TOPIC,
    TRANS_HALF_TOPIC,
    TRANS_OP_HALF_TOPIC,
    validate_topic,
)
from apogee.store import GetStatus
from apogee_broker.core.checks import validate_group
from apogee_broker.core.clients.producers import ProducerRegistry
from apogee_broker.core.storage.lookup import DISPATCH_WAIT_S
from apogee_broker.core.txn.ledger import TransactionLedger
from apogee_broker.core.txn.records import (
    Decision,
    HalfInfo,
    OpRecord,
    decode_block,
    half_info,
    parse_op,
)
from apogee_broker.core.txn.state import READ_BYTES, READ_RECORDS

DEFAULT_HALF_ENTRIES: Final = 256
MAX_HALF_ENTRIES: Final = 4096
DEFAULT_OP_ENTRIES: Final = 1024
MAX_OP_ENTRIES: Final = 16384
DEFAULT_PENDING: Final = 100
MAX_PENDING: Final = 10_000
#: Newest records of each queue ListPending reads.
MAX_PENDING_SCAN: Final = 100_000


@dataclass(frozen=True, slots=True)
class TransactionState:
    broker_name: str
    half_min_offset: int
    half_max_offset: int
    op_min_offset: int
    op_max_offset: int
    half_progress: int
    op_progress: int
    progress_updated_ms: int
    #: client ids by producer group
    producers: dict[str, list[str]]
    now_ms: int


@dataclass(frozen=True, slots=True)
class HalfScan:
    entries: list[tuple[HalfInfo, Decision | None]]
    next_offset: int
    max_offset: int


@dataclass(frozen=True, slots=True)
class OpScan:
    entries: list[OpRecord]
    next_offset: int
    max_offset: int


@dataclass(frozen=True, slots=True)
class Pending:
    unique_id: str
    producer_group: str
    topic: str
    first_stored_ms: int
    check_times: int
    #: False: in TRANS_CHECK_MAX_TIME_TOPIC, no longer checked
    checking: bool
    #: the newest copy's offset (in the half queue, or in TRANS_CHECK_MAX_TIME_TOPIC)
    offset: int
    keys: str


@dataclass(frozen=True, slots=True)
class PendingList:
    pending: list[Pending]
    more: bool


class PendingCount(NamedTuple):
    checking: int
    #: in TRANS_CHECK_MAX_TIME_TOPIC, no longer checked
    given_up: int
    #: first store time (ms) of the oldest transaction still checked; None when none is
    oldest_checking_ms: int | None


@dataclass(slots=True)
class _Read:
    """What a read of one queue found: half copies or op records, as read on the thread."""

    halves: list[HalfInfo] = field(default_factory=list)
    ops: list[OpRecord] = field(default_factory=list)
    next_offset: int = 0
    max_offset: int = 0
    #: older records were left unread (a bound)
    truncated: bool = False


class TransactionScans:
    """What the checker and operators read of one broker's transactions; methods run on
    the loop."""

    def __init__(self, ledger: TransactionLedger, producers: ProducerRegistry) -> None:
        self.ledger = ledger
        self.producers = producers
        self.store = ledger.store

    def state(self) -> TransactionState:
        s, store = self.ledger, self.store
        return TransactionState(
            s.broker_name,
            store.min_offset(TRANS_HALF_TOPIC, 0),
            store.max_offset(TRANS_HALF_TOPIC, 0),
            store.min_offset(TRANS_OP_HALF_TOPIC, 0),
            store.max_offset(TRANS_OP_HALF_TOPIC, 0),
            s.progress.half,
            s.progress.op,
            s.progress.updated_ms,
            self.producers.groups(),
            s.clock.time_ms(),
        )

    async def scan_half(self, offset: int, max_entries: int) -> HalfScan:
        """Half copies from ``offset`` (see the module docstring for the bounds)."""
        _check_offset(offset)
        limit = min(max_entries, MAX_HALF_ENTRIES) or DEFAULT_HALF_ENTRIES
        read = await asyncio.to_thread(self._read, TRANS_HALF_TOPIC, offset, limit)
        decided = self.ledger.decided
        entries = []
        for info in read.halves:
            d = decided.get(info.unique_id) if info.unique_id else None
            entries.append((info, d.decision if d is not None else None))
        return HalfScan(entries, read.next_offset, read.max_offset)

    async def scan_ops(self, offset: int, max_entries: int) -> OpScan:
        """Op records from ``offset`` (see the module docstring for the bounds)."""
        _check_offset(offset)
        limit = min(max_entries, MAX_OP_ENTRIES) or DEFAULT_OP_ENTRIES
        read = await asyncio.to_thread(self._read, TRANS_OP_HALF_TOPIC, offset, limit)
        return OpScan(read.ops, read.next_offset, read.max_offset)

    async def list_pending(self, group: str, topic: str, max_entries: int) -> PendingList:
        """The undecided transactions of ``group`` and ``topic`` (empty: any), oldest first."""
        if group:
            validate_group(group, "producer_group")
        if topic:
            validate_topic(topic)
        limit = min(max_entries, MAX_PENDING) or DEFAULT_PENDING
        halves, parked = await asyncio.to_thread(self._read_pending)
        s = self.ledger

        def wanted(info: HalfInfo) -> bool:
            return (
                bool(info.unique_id)
                and (not group or info.producer_group == group)
                and (not topic or info.real_topic == topic)
            )

        newest: dict[str, tuple[HalfInfo, bool]] = {}
        for info in halves.halves:  # queue order: a later copy replaces an earlier one
            if wanted(info) and s.closed.known(info.queue_offset, info.phys_offset) is not True:
                newest[info.unique_id] = (info, True)
        for info in parked.halves:
            if wanted(info) and info.unique_id not in newest:
                newest[info.unique_id] = (info, False)
        pending: list[Pending] = []
        for uid, (info, checking) in newest.items():
            # a decision comes after every copy of its transaction: this one's place will do
            if await s.decision(uid, info.phys_offset) is not None:
                continue
            pending.append(
                Pending(
                    uid,
                    info.producer_group,
                    info.real_topic,
                    info.first_stored_ms,
                    info.check_times,
                    checking,
                    info.queue_offset,
                    info.keys,
                )
            )
        pending.sort(key=lambda p: (p.first_stored_ms, p.unique_id))
        more = len(pending) > limit or halves.truncated or parked.truncated
        return PendingList(pending[:limit], more)

    async def count_pending(self, limit: int) -> PendingCount:
        """How many transactions are undecided and still checked, and given up, each counted
        up to ``limit``, and the oldest still checked (what the metrics show). Each queue is
        read oldest first, :data:`READ_RECORDS` at a time, until ``limit`` undecided ones
        are found: the cost follows ``limit``, not the number pending (reading and decoding
        the newest 100,000 as :meth:`list_pending` does took a scrape of 100,000 pending 3 s
        of the broker, which then left the metrics out)."""
        s = self.ledger
        checking, oldest = await self._count(TRANS_HALF_TOPIC, max(s.progress.half, 0), limit)
        given_up, _ = await self._count(TRANS_CHECK_MAX_TIME_TOPIC, 0, limit)
        return PendingCount(checking, given_up, oldest)

    async def _count(self, topic: str, offset: int, limit: int) -> tuple[int, int | None]:
        """Undecided transactions of ``topic`` from ``offset`` (at most ``limit``, each
        once), and the first store time of the oldest."""
        s = self.ledger
        seen: set[str] = set()
        oldest: int | None = None
        end = offset + MAX_PENDING_SCAN
        while len(seen) < limit and offset < end:
            read = await asyncio.to_thread(self._read, topic, offset, READ_RECORDS)
            for info in read.halves:
                uid = info.unique_id
                if not uid or uid in seen or len(seen) >= limit:
                    continue
                if s.closed.known(info.queue_offset, info.phys_offset) is True:
                    continue
                if await s.decision(uid, info.phys_offset) is not None:
                    continue
                seen.add(uid)
                if oldest is None or info.first_stored_ms < oldest:
                    oldest = info.first_stored_ms
            if read.next_offset <= offset:
                break
            offset = read.next_offset
        return len(seen), oldest

    # -- worker threads -------------------------------------------------------------------------

    def _read(self, topic: str, offset: int, limit: int) -> _Read:
        """Up to ``limit`` records of ``topic`` queue 0 from ``offset`` (one read)."""
        self.store.wait_dispatched(DISPATCH_WAIT_S)
        low = self.store.min_offset(topic, 0)
        high = self.store.max_offset(topic, 0)
        start = min(max(offset, low), high)
        out = _Read(next_offset=start, max_offset=high)
        if start >= high:
            return out
        got = self.store.get_records(topic, 0, start, limit, READ_BYTES)
        if got.status is GetStatus.FOUND:
            _add(out, topic, got.records, start)
        out.next_offset = max(got.next_offset, start)
        return out

    def _read_pending(self) -> tuple[_Read, _Read]:
        s = self.ledger
        return (
            self._read_range(TRANS_HALF_TOPIC, max(s.progress.half, 0)),
            self._read_range(TRANS_CHECK_MAX_TIME_TOPIC, 0),
        )

    def _read_range(self, topic: str, offset: int) -> _Read:
        """The newest :data:`MAX_PENDING_SCAN` records of ``topic`` from ``offset`` on."""
        self.store.wait_dispatched(DISPATCH_WAIT_S)
        low = self.store.min_offset(topic, 0)
        high = self.store.max_offset(topic, 0)
        first = max(offset, low)
        start = max(first, high - MAX_PENDING_SCAN)
        out = _Read(next_offset=start, max_offset=high, truncated=start > first)
        pos = start
        while pos < high:
            got = self.store.get_records(topic, 0, pos, READ_RECORDS, READ_BYTES)
            if got.status is GetStatus.FOUND:
                _add(out, topic, got.records, pos)
            elif got.next_offset <= pos:
                break
            pos = max(got.next_offset, pos + 1)
        out.next_offset = pos
        return out


def _add(out: _Read, topic: str, block: bytes, offset: int) -> None:
    """Decode ``block`` (records of ``topic`` from ``offset``) into ``out``."""
    records, _ = decode_block(block, f"{topic} from offset {offset}")
    if topic == TRANS_OP_HALF_TOPIC:
        out.ops.extend(parse_op(m) for m in records)
    else:
        out.halves.extend(half_info(m) for m in records)


def _check_offset(offset: int) -> None:
    if offset < 0:
        raise InvalidArgumentError(field="offset", rule=f"must not be negative, got {offset}")
