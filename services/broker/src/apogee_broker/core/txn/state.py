"""What the broker remembers of its transactions, all of it rebuilt from the CommitLog at start.

- :class:`DecidedTransactions` - each decided transaction's decision, by transaction id, so that
  a transaction is committed at most once however many copies or answers there are.
- :class:`ClosedHalves` - the half-queue offsets of the copies that have an op record, at or
  after the checker's committed progress, so that CheckHalf of a closed copy does nothing.
- :class:`RecentHalves` - the halves this process stored lately and not ended yet, as they
  were stored, so that the end that follows its half within moments needs no read of the store
  (and no wait for the half's ConsumeQueue entry). Bounded; not rebuilt: after a restart, or
  for a half it forgot, an end reads the half as before.
- :class:`TransactionProgress` - the checker's progress in both queues,
  ``<data dir>/transactionProgress.json``, written atomically (temp file, fsync, rename) before
  the call that commits it returns.

**The bound.** At start, :func:`rebuild` reads at most the last :data:`MAX_OP_SCAN` (1,000,000)
op records. The memory is bounded the same way: at most :data:`MAX_REMEMBERED` decisions and
closed offsets are kept; beyond, the oldest are forgotten. Neither bound loses a decision: each
structure knows from which point of the CommitLog it is complete (``complete_from_phys``, and
for closed copies also ``complete_from_offset``), and a question about a copy stored before that
point is answered from the op records themselves, found through the IndexFile by the keys every
op record carries (:mod:`.records`). Such lookups read the disk; they happen only for
transactions older than the last million op records.

Everything here runs on the event loop except :func:`rebuild`, which reads the store and runs on
a worker thread before the broker serves.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from apogee.common.clock import Clock
from apogee.common.errors import CorruptRecordError
from apogee.common.topics import TRANS_OP_HALF_TOPIC
from apogee.store import GetStatus, MessageStore
from apogee.store.metadata import read_json, write_json_atomic
from apogee_broker.core.txn.records import Decision, HalfCopy, OpRecord, decode_block, parse_op

log = logging.getLogger(__name__)

PROGRESS_FILE: Final = "transactionProgress.json"
#: Most op records read at start (the newest ones).
MAX_OP_SCAN: Final = 1_000_000
#: Most decisions, and most closed offsets, kept in memory.
MAX_REMEMBERED: Final = 1_000_000
#: Most halves, and most bytes of their bodies, :class:`RecentHalves` keeps.
RECENT_HALVES: Final = 16_384
RECENT_HALF_BYTES: Final = 32 * 1024 * 1024
#: ``complete_from_phys`` when no op record could be read: every question goes to the index.
NOTHING_KNOWN: Final = 1 << 62
#: Records and bytes read per step of a scan.
READ_RECORDS: Final = 1024
READ_BYTES: Final = 8 << 20


@dataclass(slots=True)
class Decided:
    """A transaction's decision and where it was recorded."""

    decision: Decision
    #: store time of the op record that recorded it (ms)
    at_ms: int
    #: CommitLog offset of that op record
    phys_offset: int
    #: of a commit: where the real message went (queue_offset -1: not known since the restart)
    topic: str = ""
    queue_id: int = 0
    queue_offset: int = -1


class DecidedTransactions:
    """Decisions by transaction id, complete for every op record at or after
    ``complete_from_phys``."""

    def __init__(self, complete_from_phys: int = 0, limit: int = MAX_REMEMBERED) -> None:
        self._by_id: dict[str, Decided] = {}
        self.complete_from_phys = complete_from_phys
        self.limit = limit

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, unique_id: str) -> Decided | None:
        return self._by_id.get(unique_id)

    def complete_for(self, phys_offset: int | None) -> bool:
        """Whether a transaction whose oldest known copy is at ``phys_offset`` (None: no copy
        known) is decided only if :meth:`get` says so."""
        if phys_offset is None:
            return self.complete_from_phys == 0
        return phys_offset >= self.complete_from_phys

    def remember(self, unique_id: str, decided: Decided) -> None:
        """Keep a decision (the first one of an id wins); the oldest go beyond the limit."""
        if unique_id in self._by_id:
            return
        self._by_id[unique_id] = decided
        if len(self._by_id) > self.limit:
            drop = max(1, self.limit // 10)
            for uid in list(self._by_id)[:drop]:
                gone = self._by_id.pop(uid)
                self.complete_from_phys = max(self.complete_from_phys, gone.phys_offset + 1)


class ClosedHalves:
    """Half-queue offsets of the closed copies: complete for copies at or after
    ``complete_from_offset`` stored at or after ``complete_from_phys``."""

    def __init__(
        self,
        complete_from_offset: int = 0,
        complete_from_phys: int = 0,
        limit: int = MAX_REMEMBERED,
    ) -> None:
        self._offsets: set[int] = set()
        self.complete_from_offset = complete_from_offset
        self.complete_from_phys = complete_from_phys
        self.limit = limit

    def __len__(self) -> int:
        return len(self._offsets)

    def __contains__(self, offset: object) -> bool:
        return offset in self._offsets

    def known(self, offset: int, phys_offset: int) -> bool | None:
        """Whether the copy at ``offset`` (stored at ``phys_offset``; -1: not known) is
        closed; None when only its op records can tell."""
        if offset in self._offsets:
            return True
        if offset >= self.complete_from_offset and phys_offset >= self.complete_from_phys:
            return False
        return None

    def add(self, offset: int) -> None:
        if offset < self.complete_from_offset:
            return
        self._offsets.add(offset)
        if len(self._offsets) > self.limit:
            keep = sorted(self._offsets)[max(1, self.limit // 10) :]
            self.complete_from_offset = keep[0] if keep else offset + 1
            self._offsets = set(keep)

    def advance(self, progress: int) -> int:
        """The checker has passed every copy before ``progress``: forget them (a later question
        about one is answered from its op records). Returns how many were forgotten."""
        if progress <= self.complete_from_offset:
            return 0
        before = len(self._offsets)
        self._offsets = {o for o in self._offsets if o >= progress}
        self.complete_from_offset = progress
        return before - len(self._offsets)


class RecentHalves:
    """Halves stored lately, by half-queue offset, oldest first: at most ``max_count`` of them
    and ``max_bytes`` of their bodies (beyond, the oldest are forgotten)."""

    def __init__(self, max_count: int = RECENT_HALVES, max_bytes: int = RECENT_HALF_BYTES) -> None:
        # an OrderedDict, not a dict: taking the oldest of a dict whose front was popped
        # walks over the holes left there (42 us an add past 16,384 halves, measured)
        self._copies: OrderedDict[int, HalfCopy] = OrderedDict()
        self._bytes = 0
        self.max_count = max_count
        self.max_bytes = max_bytes

    def __len__(self) -> int:
        return len(self._copies)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def add(self, copy: HalfCopy) -> None:
        offset = copy.info.queue_offset
        old = self._copies.pop(offset, None)
        if old is not None:
            self._bytes -= len(old.body)
        self._copies[offset] = copy
        self._bytes += len(copy.body)
        while self._copies and (len(self._copies) > self.max_count or self._bytes > self.max_bytes):
            _, oldest = self._copies.popitem(last=False)
            self._bytes -= len(oldest.body)

    def get(self, offset: int) -> HalfCopy | None:
        return self._copies.get(offset)

    def forget(self, offset: int) -> None:
        copy = self._copies.pop(offset, None)
        if copy is not None:
            self._bytes -= len(copy.body)


class TransactionProgress:
    """The checker's committed progress at this broker (``transactionProgress.json``)::

    {"version": 1, "updated_ms": 1767225600000, "half_progress": 120, "op_progress": 118}
    """

    def __init__(self, data_dir: Path, clock: Clock) -> None:
        self.path = Path(data_dir) / PROGRESS_FILE
        self.clock = clock
        #: -1: nothing committed
        self.half = -1
        self.op = -1
        self.updated_ms = 0

    def load(self) -> None:
        try:
            data = read_json(self.path)
        except CorruptRecordError:
            log.exception("transaction progress unreadable; the checker starts from the start")
            return
        if not isinstance(data, dict):
            return
        self.half = _offset(data.get("half_progress"))
        self.op = _offset(data.get("op_progress"))
        raw: Any = data.get("updated_ms", 0)
        self.updated_ms = raw if isinstance(raw, int) and raw > 0 else 0

    def commit(self, half: int, op: int) -> dict[str, Any]:
        """Write both offsets (atomically); they count once the file is in place. Returns the
        file's content."""
        now = self.clock.time_ms()
        content = {"version": 1, "updated_ms": now, "half_progress": half, "op_progress": op}
        write_json_atomic(self.path, content)
        self.half, self.op, self.updated_ms = half, op, now
        return content


def _offset(raw: Any) -> int:
    return raw if isinstance(raw, int) and raw >= 0 else -1


@dataclass(frozen=True, slots=True)
class RebuildReport:
    """What :func:`rebuild` read and found."""

    first_offset: int
    op_records: int
    decisions: int
    closed: int
    #: the op queue held more than MAX_OP_SCAN records: older ones were not read
    truncated: bool
    unreadable: int

    def summary(self) -> str:
        head = (
            f"{self.op_records} op records read from offset {self.first_offset}"
            + (f" (the older ones left to the index, over {MAX_OP_SCAN})" if self.truncated else "")
            + f": {self.decisions} decided transactions, {self.closed} closed half copies"
        )
        return head + (f", {self.unreadable} unreadable" if self.unreadable else "")


def rebuild(
    store: MessageStore, half_progress: int, max_records: int = MAX_OP_SCAN
) -> tuple[DecidedTransactions, ClosedHalves, RebuildReport]:
    """Read the newest ``max_records`` op records: the decided transactions, and the closed
    copies at or after ``half_progress``. Runs on a worker thread."""
    store.wait_dispatched(10.0)
    low = store.min_offset(TRANS_OP_HALF_TOPIC, 0)
    high = store.max_offset(TRANS_OP_HALF_TOPIC, 0)
    start = max(low, high - max_records)
    floor = max(half_progress, 0)
    decided = DecidedTransactions()
    closed = ClosedHalves(complete_from_offset=floor)
    read = unreadable = 0
    window_phys: int | None = None
    offset = start
    while offset < high:
        got = store.get_records(TRANS_OP_HALF_TOPIC, 0, offset, READ_RECORDS, READ_BYTES)
        if got.status is not GetStatus.FOUND:
            if got.next_offset <= offset:
                break
            offset = got.next_offset  # past entries removed under the scan
            continue
        records, bad = decode_block(got.records, f"{TRANS_OP_HALF_TOPIC} from offset {offset}")
        unreadable += bad
        for stored in records:
            op = parse_op(stored)
            if window_phys is None:
                window_phys = op.phys_offset
            read += 1
            _apply(op, decided, closed)
        offset = max(got.next_offset, offset + 1)
    truncated = start > low
    if truncated:
        # what is older than the first record read is known only to the op records themselves
        since = window_phys if window_phys is not None else NOTHING_KNOWN
        decided.complete_from_phys = closed.complete_from_phys = since
    report = RebuildReport(start, read, len(decided), len(closed), truncated, unreadable)
    return decided, closed, report


def _apply(op: OpRecord, decided: DecidedTransactions, closed: ClosedHalves) -> None:
    if op.half_offset >= 0:
        closed.add(op.half_offset)
    decision = op.kind.decision if op.kind is not None else None
    if decision is not None and op.unique_id:
        decided.remember(
            op.unique_id,
            Decided(
                decision,
                op.store_timestamp,
                op.phys_offset,
                op.real_topic,
                op.real_queue_id,
            ),
        )


def decision_of(ops: list[OpRecord], unique_id: str) -> Decided | None:
    """The first decision among ``ops`` (op records found for ``unique_id``), if any."""
    for op in sorted(ops, key=lambda o: o.phys_offset):
        decision = op.kind.decision if op.kind is not None else None
        if decision is not None and op.unique_id == unique_id:
            return Decided(
                decision, op.store_timestamp, op.phys_offset, op.real_topic, op.real_queue_id
            )
    return None
