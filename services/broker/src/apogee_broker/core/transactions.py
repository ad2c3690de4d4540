"""Transactional messages at the broker: half messages, their end, and their checks.

The records are drawn in :mod:`.txn_records`; what the broker remembers (decisions, closed
copies, the checker's progress) is in :mod:`.txn_state`; the checker's CheckHalf is in
:mod:`.txn_checks`, the scans it and operators read in :mod:`.txn_scans`; producers' sessions
in :mod:`.producers`.

- :meth:`TransactionService.send_half` checks a message as a send does (topic known, writable
  and not a system topic; body, size, flags, compression, properties, unique id), refuses what
  would delay it, and stores it under ``RMQ_SYS_TRANS_HALF_TOPIC`` queue 0 with its real topic
  and queue (the broker's turn over the topic's write queues when the producer gave -1). The
  send is acknowledged once stored as any send is (after fsync with ``flush_mode = sync``).
- :meth:`TransactionService.end` finds the copy named by its offset, or every copy of the
  transaction by its id (in the half queue and in ``TRANS_CHECK_MAX_TIME_TOPIC``), checks that
  it is the transaction and group named, and applies the decision: COMMIT stores the real
  message and the op records of the open copies in one append; ROLLBACK stores the op records;
  UNKNOWN changes nothing. The same decision again is ALREADY_DONE (closing copies still open);
  the other one is refused, naming the first and when it was taken.
- :meth:`TransactionService.commit_progress` records the checker's progress.

Refusals (each names the field and the rule):

==========================  ===================  ==============================================
check                       error kind           example sentence
==========================  ===================  ==============================================
producer group              INVALID_ARGUMENT     producer_group: must not be empty
no delay                    INVALID_ARGUMENT     message.delay_level: is 3; a transactional ...
no delay by property        INVALID_PROPERTY     property 'DELAY': is set by brokers only; a ...
immunity                    INVALID_PROPERTY     property 'CHECK_IMMUNITY_TIME_IN_SECONDS': ...
what a send checks          (as a send)          topic 'RMQ_SYS_TRANS_HALF_TOPIC': is a system...
unique id                   INVALID_ARGUMENT     unique_id: must not be empty
half offset                 INVALID_ARGUMENT     half_offset: 99 is beyond the end of ...
the copy's transaction      INVALID_ARGUMENT     unique_id: 'X' is not the transaction of ...
the copy's group            INVALID_ARGUMENT     producer_group: 'g2' is not the group of ...
unknown transaction         NOT_FOUND            transaction 'X' not found: broker b1 holds ...
the other decision          TRANSACTION_DECIDED  transaction 'X' was already committed at ...
                            (FAILED_PRECONDITION)
real topic gone             UNKNOWN_TOPIC        topic 'Orders' does not exist on broker ...
==========================  ===================  ==============================================

Concurrency: every change of one transaction (an end, a check) runs under that transaction's
lock (:class:`KeyedLocks`, keyed by the transaction id; a copy that cannot be read by its
offset), so two commits of one transaction never both store; and it runs to its end once
begun, even when its call is cut off (:func:`to_the_end`), so that what it wrote is remembered.
A task holds at most one such lock, and the progress lock is never taken with one held. Reads
of the store that may touch the disk run on worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, TypeVar

from apogee.codec import (
    PROP_CHECK_IMMUNITY,
    PROP_DELAY,
    PROP_DELIVER_AT,
    SYSFLAG_COMPRESSED,
    Message,
    StoredMessage,
    check_immunity_rule,
    unique_id_rule,
)
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import (
    ApogeeError,
    CorruptRecordError,
    InvalidArgumentError,
    InvalidPropertyError,
    NotFoundError,
    OffsetDeletedError,
    TransactionDecidedError,
    UnknownTopicError,
)
from apogee.common.topics import TRANS_CHECK_MAX_TIME_TOPIC, TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC
from apogee.store import AppendResult, GetStatus, MessageStore
from apogee_broker.core.checks import validate_client_id, validate_group
from apogee_broker.core.lookup import DISPATCH_WAIT_S
from apogee_broker.core.producers import ProducerRegistry
from apogee_broker.core.sending import SendService, check_client_properties, check_unique_id
from apogee_broker.core.topics import TopicConfig, TopicManager
from apogee_broker.core.txn_records import (
    Decision,
    OpKind,
    copy_key,
    half_info,
    op_kind_of,
    op_message,
    parse_op,
    real_message,
    to_half,
)
from apogee_broker.core.txn_state import (
    ClosedHalves,
    Decided,
    DecidedTransactions,
    RebuildReport,
    TransactionProgress,
    decision_of,
    rebuild,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Most copies of one transaction looked up by its id (each check makes one).
MAX_COPIES: Final = 64
_DELAYED: Final = (
    "a transactional message cannot be delayed: it is delivered when committed (send it "
    "without delay_level, deliver_at_ms or the DELAY / DELIVER_AT_MS properties)"
)


class EndSource(enum.Enum):
    UNSPECIFIED = "unspecified"
    PRODUCER = "producer"
    CHECK = "check"
    OPERATOR = "operator"


class EndOutcome(enum.Enum):
    COMMITTED = "COMMITTED"
    ROLLED_BACK = "ROLLED_BACK"
    ALREADY_DONE = "ALREADY_DONE"
    STILL_PENDING = "STILL_PENDING"


@dataclass(frozen=True, slots=True)
class HalfSent:
    unique_id: str
    half_offset: int
    store_timestamp: int
    #: the real topic's queue the message goes to when committed
    queue_id: int


@dataclass(frozen=True, slots=True)
class End:
    """An EndTransaction request."""

    producer_group: str
    unique_id: str
    #: -1: find the transaction by its id
    half_offset: int
    decision: Decision
    source: EndSource = EndSource.PRODUCER
    client_id: str = ""


@dataclass(frozen=True, slots=True)
class Ended:
    outcome: EndOutcome
    #: of a commit: where the real message is
    topic: str = ""
    queue_id: int = 0
    queue_offset: int = 0


async def to_the_end(work: Coroutine[Any, Any, T], what: str) -> T:
    """Await ``work`` in a task of its own that a cancellation of the caller does not stop.

    An end or a check writes its records and then, with ``flush_mode = sync``, waits for them
    to be durable before it notes what it wrote (the decision, the closed copies). A call cut
    off meanwhile (its deadline passed, its caller went away) cancels the handler: cancelled
    there, the records would be stored but not remembered, and the same commit asked again
    would be stored again. So the caller gets its cancellation at once while ``work`` goes on
    to its end (its failure, if any, is logged), holding the transaction's lock until then."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            task.add_done_callback(lambda t: _finished_alone(t, what))
        raise


def _finished_alone(task: asyncio.Task[Any], what: str) -> None:
    if task.cancelled():
        return
    err = task.exception()
    if err is not None:
        log.warning("%s, left to finish after its call was cut off, failed: %s", what, err)


class KeyedLocks:
    """One asyncio lock per key, made on first use and dropped once no task holds or waits."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = (asyncio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0 and self._locks.get(key) is entry:
                del self._locks[key]


class TransactionService:
    """Half messages, their end and their checks at one broker; methods run on the loop."""

    def __init__(
        self,
        store: MessageStore,
        topics: TopicManager,
        sending: SendService,
        producers: ProducerRegistry,
        data_dir: Path,
        *,
        broker_name: str,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.store = store
        self.topics = topics
        self.sending = sending
        self.producers = producers
        self.broker_name = broker_name
        self.clock = clock
        self.progress = TransactionProgress(data_dir, clock)
        self.decided = DecidedTransactions()
        self.closed = ClosedHalves()
        self.locks = KeyedLocks()
        self._progress_lock = asyncio.Lock()
        self._turns: dict[str, int] = {}

    async def load(self) -> RebuildReport:
        """Read the checker's progress and rebuild decisions and closed copies from the op
        queue (:func:`~.txn_state.rebuild`); returns what it read."""
        await asyncio.to_thread(self.progress.load)
        self.decided, self.closed, report = await asyncio.to_thread(
            rebuild, self.store, self.progress.half
        )
        log.info("transactions of broker %s: %s", self.broker_name, report.summary())
        return report

    # -- SendHalf -------------------------------------------------------------------------------

    async def send_half(
        self,
        producer_group: str,
        msg: Message,
        delay_level: int = 0,
        deliver_at_ms: int = 0,
        host: str = "",
    ) -> HalfSent:
        """Check ``msg`` (``queue_id`` -1: the broker picks) and store it as a half."""
        validate_group(producer_group, "producer_group")
        if delay_level:
            raise InvalidArgumentError(
                field="message.delay_level", rule=f"is {delay_level}; {_DELAYED}"
            )
        if deliver_at_ms:
            raise InvalidArgumentError(
                field="message.deliver_at_ms", rule=f"is {deliver_at_ms}; {_DELAYED}"
            )
        props = msg.properties or {}
        for name in (PROP_DELAY, PROP_DELIVER_AT):
            if name in props:
                raise InvalidPropertyError(field=name, rule=f"is set by brokers only; {_DELAYED}")
        asked = msg.queue_id
        topic = self.sending.check(
            "message", msg.topic, len(msg.body), msg.sys_flag, 0 if asked == -1 else asked
        )
        if msg.sys_flag & SYSFLAG_COMPRESSED:
            self.sending.check_compressed("message", msg.body)
        check_client_properties(props)
        immunity = props.get(PROP_CHECK_IMMUNITY)
        if immunity is not None:
            rule = check_immunity_rule(immunity)
            if rule is not None:
                raise InvalidPropertyError(field=PROP_CHECK_IMMUNITY, rule=rule)
        if msg.unique_id:
            check_unique_id(msg.unique_id)
        queue_id = self._next_queue(topic) if asked == -1 else asked
        to_half(msg, producer_group, queue_id)
        self.sending.fill_defaults([msg], host)
        results, err = await self.sending.append_all([msg])
        if err is not None:
            raise err
        r = results[0]
        return HalfSent(r.unique_id, r.queue_offset, r.store_timestamp, queue_id)

    def _next_queue(self, topic: TopicConfig) -> int:
        turn = self._turns.get(topic.name, -1) + 1
        self._turns[topic.name] = turn
        return turn % topic.write_queues

    # -- EndTransaction -------------------------------------------------------------------------

    async def end(self, req: End) -> Ended:
        """Apply ``req``'s decision (see the module docstring); once begun it runs to its end
        even when its caller is cancelled (:func:`to_the_end`)."""
        self._check_end(req)
        return await to_the_end(self._end(req), f"ending transaction {req.unique_id}")

    async def _end(self, req: End) -> Ended:
        uid = req.unique_id
        async with self.locks.hold(uid):
            copies = await self._copies(req)
            oldest = min((c.phys_offset for c in copies), default=None)
            decided = await self.decision(uid, oldest)
            if req.decision is Decision.UNKNOWN:
                if not copies and decided is None:
                    raise self._unknown(req)
                log.debug("transaction %s still unknown to %s %s", uid, req.source.value, _who(req))
                return Ended(EndOutcome.STILL_PENDING)
            if decided is not None:
                return await self._again(req, copies, decided)
            if not copies:
                raise self._unknown(req)
            return await self._decide(req, copies)

    def _check_end(self, req: End) -> None:
        if req.producer_group or req.source is not EndSource.OPERATOR:
            validate_group(req.producer_group, "producer_group")
        rule = unique_id_rule(req.unique_id)
        if rule is not None:
            raise InvalidArgumentError(field="unique_id", rule=rule)
        if req.half_offset < -1:
            raise InvalidArgumentError(
                field="half_offset",
                rule=f"must be the half's offset (0 or more), or -1 to find the transaction by "
                f"its id, got {req.half_offset}",
            )
        if req.client_id:
            validate_client_id(req.client_id)

    async def _copies(self, req: End) -> list[StoredMessage]:
        """The copies ``req`` names, newest first; [] when its copy is gone."""
        if req.half_offset >= 0:
            copy = await asyncio.to_thread(self.half_at, req.half_offset)
            found = [] if copy is None else [copy]
        else:
            found = await asyncio.to_thread(self._copies_by_id, req.unique_id)
        for copy in found:
            if copy.unique_id != req.unique_id:
                raise InvalidArgumentError(
                    field="unique_id",
                    rule=f"{req.unique_id!r} is not the transaction of the half at offset "
                    f"{copy.queue_offset} (that is {copy.unique_id!r})",
                )
            group = half_info(copy).producer_group
            if req.producer_group and group != req.producer_group:
                raise InvalidArgumentError(
                    field="producer_group",
                    rule=f"{req.producer_group!r} is not the group of transaction "
                    f"{req.unique_id!r} (its half was sent by group {group!r})",
                )
        return found

    async def _again(self, req: End, copies: list[StoredMessage], decided: Decided) -> Ended:
        """A transaction decided before: the same decision closes what is still open."""
        uid = req.unique_id
        if decided.decision is not req.decision:
            done = "committed" if decided.decision is Decision.COMMIT else "rolled back"
            asked = "committed" if req.decision is Decision.COMMIT else "rolled back"
            raise TransactionDecidedError(
                what=f"transaction {uid!r}",
                detail=f"was already {done} at {_utc(decided.at_ms)}; it cannot be {asked} now",
            )
        still_open = await self._open_copies(copies)
        if still_open:
            _, err = await self.store_closing([], still_open, op_kind_of(decided.decision))
            if err is not None:
                raise err
        if decided.decision is Decision.COMMIT and decided.queue_offset < 0 and decided.topic:
            await asyncio.to_thread(self._find_committed, uid, decided)
        log.debug(
            "transaction %s already %s (%s %s)",
            uid,
            decided.decision.value,
            req.source.value,
            _who(req),
        )
        return Ended(EndOutcome.ALREADY_DONE, decided.topic, decided.queue_id, decided.queue_offset)

    async def _decide(self, req: End, copies: list[StoredMessage]) -> Ended:
        uid = req.unique_id
        target = copies[0]
        info = half_info(target)
        closing = await self._open_copies(copies) or [target]
        head: list[Message] = []
        real: tuple[str, int] | None = None
        if req.decision is Decision.COMMIT:
            topic = self.topics.get(info.real_topic)
            if topic is None:
                raise UnknownTopicError(
                    topic=info.real_topic,
                    detail=f"does not exist on broker {self.broker_name} any more: transaction "
                    f"{uid!r} stays pending; create the topic again and commit, or roll it back",
                )
            queue_id = info.real_queue_id
            if queue_id >= topic.write_queues:
                queue_id %= topic.write_queues  # the topic lost queues meanwhile
            real = (topic.name, queue_id)
            head.append(real_message(target, topic.name, queue_id))
        results, err = await self.store_closing(head, closing, op_kind_of(req.decision), real)
        op = results[len(head)]
        decided = Decided(req.decision, op.store_timestamp, op.phys_offset)
        if head:
            r = results[0]
            decided.topic, decided.queue_id, decided.queue_offset = (
                r.topic,
                r.queue_id,
                r.queue_offset,
            )
        self.decided.remember(uid, decided)
        level = logging.INFO if req.source is EndSource.OPERATOR else logging.DEBUG
        log.log(
            level,
            "transaction %s of group %s %s by %s %s",
            uid,
            info.producer_group,
            "committed" if head else "rolled back",
            req.source.value,
            _who(req),
        )
        if err is not None:
            raise err
        if not head:
            return Ended(EndOutcome.ROLLED_BACK)
        return Ended(EndOutcome.COMMITTED, decided.topic, decided.queue_id, decided.queue_offset)

    def _unknown(self, req: End) -> NotFoundError:
        where = (
            f"holds no half of it at offset {req.half_offset} (removed by retention?)"
            if req.half_offset >= 0
            else "holds no half message with this id (it may be on another broker, or removed "
            "by retention)"
        )
        return NotFoundError(
            what=f"transaction {req.unique_id!r}", detail=f"broker {self.broker_name} {where}"
        )

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
            await asyncio.to_thread(self.progress.commit, half, op)
            self.closed.advance(half)

    # -- shared steps ---------------------------------------------------------------------------

    async def store_closing(
        self,
        head: list[Message],
        closing: list[StoredMessage],
        kind: OpKind,
        real: tuple[str, int] | None = None,
    ) -> tuple[list[AppendResult], ApogeeError | None]:
        """Store ``head`` and the op records of ``closing`` in one append."""
        ops: list[Message] = []
        halves: list[int] = []
        for copy in closing:
            info = half_info(copy)
            ops.append(
                op_message(
                    copy.queue_offset,
                    kind,
                    info.unique_id,
                    info.producer_group,
                    copy_topic=copy.topic,
                    real=real,
                )
            )
            if info.in_half_queue:
                halves.append(copy.queue_offset)
        return await self.store_ops([*head, *ops], halves)

    async def store_ops(
        self, batch: list[Message], halves: list[int]
    ) -> tuple[list[AppendResult], ApogeeError | None]:
        """Append ``batch`` (raising when nothing was stored); the copies at ``halves`` are
        closed from then on."""
        self.sending.fill_defaults(batch, "")
        results, err = await self.sending.append_all(batch)
        for offset in halves:
            self.closed.add(offset)
        return results, err

    async def _open_copies(self, copies: list[StoredMessage]) -> list[StoredMessage]:
        return [
            c
            for c in copies
            if c.topic == TRANS_HALF_TOPIC
            and not await self.is_closed(c.queue_offset, c.phys_offset)
        ]

    async def is_closed(self, half_offset: int, phys_offset: int) -> bool:
        known = self.closed.known(half_offset, phys_offset)
        if known is not None:
            return known
        return await asyncio.to_thread(self._closed_by_ops, half_offset)

    async def decision(self, unique_id: str, oldest_phys: int | None) -> Decided | None:
        """The transaction's decision: remembered, or read from its op records when it is older
        than what is remembered."""
        if not unique_id:
            return None
        decided = self.decided.get(unique_id)
        if decided is not None or self.decided.complete_for(oldest_phys):
            return decided
        decided = await asyncio.to_thread(self._decision_by_ops, unique_id)
        if decided is not None:
            self.decided.remember(unique_id, decided)
        return decided

    # -- store reads (worker threads) -----------------------------------------------------------

    def half_at(self, offset: int) -> StoredMessage | None:
        """The copy at ``offset`` of the half queue; None when it was removed by retention or
        cannot be read; INVALID_ARGUMENT beyond the end of the queue."""
        if offset >= self.store.max_offset(TRANS_HALF_TOPIC, 0):
            self.store.wait_dispatched(DISPATCH_WAIT_S)
        high = self.store.max_offset(TRANS_HALF_TOPIC, 0)
        if offset >= high:
            raise InvalidArgumentError(
                field="half_offset",
                rule=f"{offset} is beyond the end of {TRANS_HALF_TOPIC} on broker "
                f"{self.broker_name} (its max offset is {high})",
            )
        try:
            got = self.store.get(TRANS_HALF_TOPIC, 0, offset, 1)
        except (CorruptRecordError, OffsetDeletedError) as exc:
            log.warning("the half at offset %d cannot be read: %s", offset, exc)
            return None
        if got.status is GetStatus.FOUND and got.messages:
            copy = got.messages[0]
            if copy.queue_offset == offset:
                return copy
        return None

    def _copies_by_id(self, unique_id: str) -> list[StoredMessage]:
        self.store.wait_dispatched(DISPATCH_WAIT_S)
        found = self.store.all_by_unique_id(unique_id, MAX_COPIES)
        # newest first, each record once (recovery may have indexed a record twice)
        copies = {
            m.phys_offset: m
            for m in found
            if m.topic in (TRANS_HALF_TOPIC, TRANS_CHECK_MAX_TIME_TOPIC)
        }
        return sorted(copies.values(), key=lambda m: m.phys_offset, reverse=True)

    def _decision_by_ops(self, unique_id: str) -> Decided | None:
        self.store.wait_dispatched(DISPATCH_WAIT_S)
        found = self.store.by_key(TRANS_OP_HALF_TOPIC, unique_id, max_count=MAX_COPIES)
        return decision_of([parse_op(m) for m in found], unique_id)

    def _closed_by_ops(self, half_offset: int) -> bool:
        self.store.wait_dispatched(DISPATCH_WAIT_S)
        found = self.store.by_key(TRANS_OP_HALF_TOPIC, copy_key(half_offset), max_count=8)
        return any(parse_op(m).half_offset == half_offset for m in found)

    def _find_committed(self, unique_id: str, decided: Decided) -> None:
        """Where a commit decided before the restart stored its message (when still kept)."""
        self.store.wait_dispatched(DISPATCH_WAIT_S)
        for m in self.store.all_by_unique_id(unique_id, MAX_COPIES):
            if m.topic == decided.topic:
                decided.queue_id, decided.queue_offset = m.queue_id, m.queue_offset
                return


def _who(req: End) -> str:
    return req.client_id or "(no client id)"


def _utc(ms: int) -> str:
    """``ms`` as an ISO 8601 UTC time to the millisecond."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")
