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
import collections
import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Coroutine, Iterable, Sequence
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
    InternalError,
    InvalidArgumentError,
    InvalidPropertyError,
    NotFoundError,
    OffsetDeletedError,
    TransactionDecidedError,
    UnknownTopicError,
)
from apogee.common.topics import TRANS_CHECK_MAX_TIME_TOPIC, TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC
from apogee.rpc.access import require_admin, require_topic
from apogee.store import AppendResult, GetStatus, MessageStore
from apogee_broker.core.checks import validate_client_id, validate_group
from apogee_broker.core.lookup import DISPATCH_WAIT_S
from apogee_broker.core.producers import ProducerRegistry
from apogee_broker.core.sending import (
    NOT_STORED,
    Outgoing,
    SendOutcome,
    SendService,
    check_client_properties,
    check_unique_id,
)
from apogee_broker.core.topics import TopicConfig, TopicManager
from apogee_broker.core.txn_records import (
    Decision,
    HalfCopy,
    OpKind,
    copy_key,
    op_kind_of,
    op_message,
    parse_op,
    read_copy,
    real_message,
    stored_copy,
    to_half,
)
from apogee_broker.core.txn_state import (
    ClosedHalves,
    Decided,
    DecidedTransactions,
    RebuildReport,
    RecentHalves,
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


@dataclass(frozen=True, slots=True)
class _Plan:
    """What deciding one transaction writes: ``records`` (the real message first, when a commit
    has one: ``heads`` is then 1) and the half-queue offsets its op records close."""

    req: End
    group: str
    heads: int
    records: list[Message]
    halves: list[int]


#: An end of a batch that got no outcome (cannot happen: every path sets one).
_NOT_ENDED: Final = InternalError(detail="the end was not applied")


async def _all(work: list[Coroutine[Any, Any, None]]) -> None:
    """Run ``work`` concurrently to its end (each takes its own failures)."""
    if len(work) == 1:
        await work[0]
    else:
        await asyncio.gather(*work)


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

    @contextlib.asynccontextmanager
    async def hold_many(self, keys: Iterable[str]) -> AsyncIterator[None]:
        """The locks of every key of ``keys``, taken in the order of the keys (so two tasks
        taking several never wait for each other in a circle)."""
        async with contextlib.AsyncExitStack() as stack:
            for key in sorted(set(keys)):
                await stack.enter_async_context(self.hold(key))
            yield


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
        self.recent = RecentHalves()
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
        queue_id = self._prepare_half("message", producer_group, msg, delay_level, deliver_at_ms)
        self.sending.fill_defaults([msg], host)
        results, err = await self.sending.append_all([msg])
        if err is not None:
            raise err
        r = results[0]
        self.recent.add(stored_copy(msg, r))
        return HalfSent(r.unique_id, r.queue_offset, r.store_timestamp, queue_id)

    async def send_halves(
        self, producer_group: str, items: Sequence[Outgoing], host: str = ""
    ) -> list[HalfSent | ApogeeError]:
        """:meth:`send_half` of each of ``items`` (SendHalves): one outcome per item, in order;
        those that pass their checks are stored as one append. Raises only for what is wrong
        with the request as a whole (its group, its size)."""
        validate_group(producer_group, "producer_group")
        count = len(items)
        self.check_batch(count, "messages", "half messages")
        out: list[HalfSent | ApogeeError | None] = [None] * count
        good: list[int] = []
        batch: list[Message] = []
        queues: dict[int, int] = {}
        for i, (msg, delay, at) in enumerate(items):
            try:
                queues[i] = self._prepare_half(i, producer_group, msg, delay, at)
            except ApogeeError as err:
                out[i] = err
                continue
            good.append(i)
            batch.append(msg)
        if batch:
            self.sending.fill_defaults(batch, host)
            stored: list[SendOutcome | None] = [None] * count
            await self.sending.store_batch(good, batch, stored)
            for i in good:
                o = stored[i]
                if o is None or o.result is None:
                    out[i] = o.error if o is not None and o.error is not None else NOT_STORED
                elif o.error is not None:
                    out[i] = o.error  # stored, durability not confirmed: as send_half raises
                else:
                    r = o.result
                    self.recent.add(stored_copy(items[i].message, r))
                    out[i] = HalfSent(r.unique_id, r.queue_offset, r.store_timestamp, queues[i])
        return [o if o is not None else NOT_STORED for o in out]

    def check_batch(self, count: int, field: str, what: str) -> None:
        """A request of ``count`` items (``what``) in ``field``: at least one, at most
        ``max_messages_per_request``."""
        if count == 0:
            raise InvalidArgumentError(field=field, rule="must not be empty")
        limit = self.sending.max_messages_per_request
        if count > limit:
            raise InvalidArgumentError(
                field=field,
                rule=f"{count} {what} in one request; at most {limit} are allowed "
                "(max_messages_per_request)",
            )

    def _prepare_half(
        self, i: int | str, producer_group: str, msg: Message, delay_level: int, deliver_at_ms: int
    ) -> int:
        """Every check of half ``i`` (``"message"``, or its index in ``messages``); then make
        ``msg`` the half: its real topic and queue in properties (the broker's turn over the
        topic's queues when it asked for -1). Returns that real queue."""
        where = i if isinstance(i, str) else f"messages[{i}]"
        if delay_level:
            raise InvalidArgumentError(
                field=f"{where}.delay_level", rule=f"is {delay_level}; {_DELAYED}"
            )
        if deliver_at_ms:
            raise InvalidArgumentError(
                field=f"{where}.deliver_at_ms", rule=f"is {deliver_at_ms}; {_DELAYED}"
            )
        props = msg.properties or {}
        for name in (PROP_DELAY, PROP_DELIVER_AT):
            if name in props:
                raise InvalidPropertyError(field=name, rule=f"is set by brokers only; {_DELAYED}")
        asked = msg.queue_id
        topic = self.sending.check(
            i, msg.topic, len(msg.body), msg.sys_flag, 0 if asked == -1 else asked
        )
        if msg.sys_flag & SYSFLAG_COMPRESSED:
            self.sending.check_compressed(i, msg.body)
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
        return queue_id

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

    async def end_many(self, reqs: Sequence[End]) -> list[Ended | ApogeeError]:
        """:meth:`end` of each of ``reqs`` (EndTransactions): one outcome per end, in order.

        The ends that name their copy by offset, one per transaction, are decided together:
        their copies read in one pass, their locks taken in order, and what they write stored
        as one append. The others (by id, or a transaction named twice) go one by one as
        :meth:`end`. Raises only for what is wrong with the request as a whole."""
        count = len(reqs)
        self.check_batch(count, "ends", "ends")
        out: list[Ended | ApogeeError | None] = [None] * count
        checked: list[int] = []
        for i, req in enumerate(reqs):
            try:
                self._check_end(req)
            except ApogeeError as err:
                out[i] = err
            else:
                checked.append(i)
        named = collections.Counter(reqs[i].unique_id for i in checked)
        together = [
            i for i in checked if reqs[i].half_offset >= 0 and named[reqs[i].unique_id] == 1
        ]
        joined = set(together)
        alone = [i for i in checked if i not in joined]
        work: list[Coroutine[Any, Any, None]] = []
        if together:
            work.append(self._end_together([reqs[i] for i in together], together, out))
        for i in alone:
            work.append(self._end_alone(reqs[i], i, out))
        what = f"ending {len(checked)} transactions"
        await to_the_end(_all(work), what)
        return [o if o is not None else _NOT_ENDED for o in out]

    async def _end_alone(self, req: End, i: int, out: list[Ended | ApogeeError | None]) -> None:
        try:
            out[i] = await self._end(req)
        except ApogeeError as err:
            out[i] = err

    async def _end_together(
        self, reqs: list[End], where: list[int], out: list[Ended | ApogeeError | None]
    ) -> None:
        """Ends of distinct transactions, each naming its copy by offset (see :meth:`end_many`);
        their outcomes go to ``out`` at ``where``."""
        async with self.locks.hold_many(r.unique_id for r in reqs):
            found = await self._halves_of(reqs)
            plans: list[tuple[int, _Plan]] = []
            for req, i, copy in zip(reqs, where, found, strict=True):
                try:
                    if isinstance(copy, ApogeeError):
                        raise copy
                    copies = self._named_copies(req, [] if copy is None else [copy])
                    got = await self._answer_or_plan(req, copies)
                    if isinstance(got, _Plan):
                        plans.append((i, got))
                    else:
                        out[i] = got
                except ApogeeError as refused:
                    out[i] = refused
            if not plans:
                return
            records = [m for _, plan in plans for m in plan.records]
            halves = [h for _, plan in plans for h in plan.halves]
            try:
                results, err = await self.store_ops(records, halves)
            except ApogeeError as failed:  # nothing stored
                for i, _ in plans:
                    out[i] = failed
                return
            at = 0
            for i, plan in plans:
                n = len(plan.records)
                try:
                    out[i] = self._note(plan, results[at : at + n], err)
                except ApogeeError as e:
                    out[i] = e
                at += n

    async def _halves_of(self, reqs: list[End]) -> list[HalfCopy | ApogeeError | None]:
        """The copy each of ``reqs`` names by offset: remembered (:class:`RecentHalves`), else
        read (one worker thread pass for all those not remembered); None when it is gone, or
        the error that names why its offset is wrong."""
        recent = self.recent
        found: list[HalfCopy | ApogeeError | None] = [recent.get(r.half_offset) for r in reqs]
        missing = [i for i, c in enumerate(found) if c is None]
        if missing:
            read = await asyncio.to_thread(self._halves_at, [reqs[i].half_offset for i in missing])
            for i, c in zip(missing, read, strict=True):
                found[i] = read_copy(c) if isinstance(c, StoredMessage) else c
        return found

    def _halves_at(self, offsets: list[int]) -> list[StoredMessage | ApogeeError | None]:
        """:meth:`half_at` of each offset (a worker thread's pass): the copy, None when it is
        gone, or the error that names why the offset is wrong."""
        found: list[StoredMessage | ApogeeError | None] = []
        for offset in offsets:
            try:
                found.append(self.half_at(offset))
            except ApogeeError as err:
                found.append(err)
        return found

    async def _end(self, req: End) -> Ended:
        uid = req.unique_id
        async with self.locks.hold(uid):
            got = await self._answer_or_plan(req, await self._copies(req))
            if isinstance(got, Ended):
                return got
            results, err = await self.store_ops(got.records, got.halves)
            return self._note(got, results, err)

    async def _answer_or_plan(self, req: End, copies: list[HalfCopy]) -> Ended | _Plan:
        """What ``req`` gets without writing a decision (still pending, already done, or its
        refusal, raised), or the plan of what deciding it writes. Its lock is held."""
        uid = req.unique_id
        oldest = min((c.info.phys_offset for c in copies), default=None)
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
        return await self._plan(req, copies)

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

    async def _copies(self, req: End) -> list[HalfCopy]:
        """The copies ``req`` names, newest first; [] when its copy is gone."""
        if req.half_offset >= 0:
            remembered = self.recent.get(req.half_offset)
            if remembered is not None:
                return self._named_copies(req, [remembered])
            copy = await asyncio.to_thread(self.half_at, req.half_offset)
            found = [] if copy is None else [copy]
        else:
            found = await asyncio.to_thread(self._copies_by_id, req.unique_id)
        return self._named_copies(req, [read_copy(c) for c in found])

    def _named_copies(self, req: End, copies: list[HalfCopy]) -> list[HalfCopy]:
        """``copies``, when every one is of ``req``'s transaction and group; else the error."""
        for copy in copies:
            info = copy.info
            if info.unique_id != req.unique_id:
                raise InvalidArgumentError(
                    field="unique_id",
                    rule=f"{req.unique_id!r} is not the transaction of the half at offset "
                    f"{info.queue_offset} (that is {info.unique_id!r})",
                )
            group = info.producer_group
            if req.producer_group and group != req.producer_group:
                raise InvalidArgumentError(
                    field="producer_group",
                    rule=f"{req.producer_group!r} is not the group of transaction "
                    f"{req.unique_id!r} (its half was sent by group {group!r})",
                )
            # the caller's right, when authentication is on: an operator resolves with the
            # admin write right, a producer ends what it may send to
            if req.source is EndSource.OPERATOR:
                require_admin(True, "resolve transactions")
            else:
                require_topic(info.real_topic, "PUB")
        return copies

    async def _again(self, req: End, copies: list[HalfCopy], decided: Decided) -> Ended:
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

    async def _plan(self, req: End, copies: list[HalfCopy]) -> _Plan:
        """What deciding ``req`` (not decided before) writes: the real message of a commit, and
        the op records of the copies still open."""
        target = copies[0]
        info = target.info
        closing = await self._open_copies(copies) or [target]
        head: list[Message] = []
        real: tuple[str, int] | None = None
        if req.decision is Decision.COMMIT:
            uid = req.unique_id
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
        ops, halves = self.closing_ops(closing, op_kind_of(req.decision), real)
        return _Plan(req, info.producer_group, len(head), [*head, *ops], halves)

    def _note(self, plan: _Plan, results: list[AppendResult], err: ApogeeError | None) -> Ended:
        """Remember the decision ``plan`` stored (``results``: its records' places) and answer
        it; ``err``: the records are stored but their durability was not confirmed."""
        req = plan.req
        uid = req.unique_id
        op = results[plan.heads]
        decided = Decided(req.decision, op.store_timestamp, op.phys_offset)
        if plan.heads:
            r = results[0]
            decided.topic, decided.queue_id, decided.queue_offset = (
                r.topic,
                r.queue_id,
                r.queue_offset,
            )
        self.decided.remember(uid, decided)
        level = logging.INFO if req.source is EndSource.OPERATOR else logging.DEBUG
        if log.isEnabledFor(level):
            log.log(
                level,
                "transaction %s of group %s %s by %s %s",
                uid,
                plan.group,
                "committed" if plan.heads else "rolled back",
                req.source.value,
                _who(req),
            )
        if err is not None:
            raise err
        if not plan.heads:
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
        self.sending.fill_defaults(batch, "")
        results, err = await self.sending.append_all(batch)
        for offset in halves:
            self.closed.add(offset)
            self.recent.forget(offset)
        return results, err

    async def _open_copies(self, copies: list[HalfCopy]) -> list[HalfCopy]:
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
