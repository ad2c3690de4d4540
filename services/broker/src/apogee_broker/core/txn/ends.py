"""EndTransaction: a transaction's decision, applied to its half copies.

:meth:`TransactionEnds.end` finds the copy named by its offset, or every copy of the transaction
by its id (in the half queue and in ``TRANS_CHECK_MAX_TIME_TOPIC``), checks that it is the
transaction and group named, and applies the decision: COMMIT stores the real message and the op
records of the open copies in one append; ROLLBACK stores the op records; UNKNOWN changes
nothing. The same decision again is ALREADY_DONE (closing copies still open); the other one is
refused, naming the first and when it was taken. :meth:`TransactionEnds.end_many` decides the
ends of one EndTransactions request together where it can.

Both ladders share one step, :meth:`TransactionEnds._answer_or_plan`: still pending, already
decided, unknown transaction, or the plan of what deciding writes. Each end runs under its
transaction's lock and to its end once begun (:mod:`.locks`).

Refusals (each names the field and the rule):

==========================  ===================  ==============================================
check                       error kind           example sentence
==========================  ===================  ==============================================
producer group              INVALID_ARGUMENT     producer_group: must not be empty
unique id                   INVALID_ARGUMENT     unique_id: must not be empty
half offset                 INVALID_ARGUMENT     half_offset: 99 is beyond the end of ...
the copy's transaction      INVALID_ARGUMENT     unique_id: 'X' is not the transaction of ...
the copy's group            INVALID_ARGUMENT     producer_group: 'g2' is not the group of ...
unknown transaction         NOT_FOUND            transaction 'X' not found: broker b1 holds ...
the other decision          TRANSACTION_DECIDED  transaction 'X' was already committed at ...
                            (FAILED_PRECONDITION)
real topic gone             UNKNOWN_TOPIC        topic 'Orders' does not exist on broker ...
==========================  ===================  ==============================================
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from apogee.codec import Message, StoredMessage, unique_id_rule
from apogee.common.errors import (
    ApogeeError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    TransactionDecidedError,
    UnknownTopicError,
)
from apogee.service.rights import require_admin, require_topic
from apogee.store import AppendResult
from apogee_broker.core.checks import validate_client_id, validate_group
from apogee_broker.core.send.checks import SendChecks
from apogee_broker.core.topics import TopicManager
from apogee_broker.core.txn import lookups
from apogee_broker.core.txn.ledger import TransactionLedger
from apogee_broker.core.txn.locks import run_all, to_the_end
from apogee_broker.core.txn.records import Decision, HalfCopy, op_kind_of, read_copy, real_message
from apogee_broker.core.txn.state import Decided

log = logging.getLogger(__name__)


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


class TransactionEnds:
    """EndTransaction and EndTransactions at one broker; methods run on the loop."""

    def __init__(self, ledger: TransactionLedger, topics: TopicManager, checks: SendChecks) -> None:
        self.ledger = ledger
        self.topics = topics
        self.checks = checks
        self.broker_name = ledger.broker_name

    def check_count(self, count: int) -> None:
        """An EndTransactions request of ``count`` ends: at least one, at most
        ``max_messages_per_request``."""
        self.checks.check_request_size(count, "ends", "ends")

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
        self.check_count(count)
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
        await to_the_end(run_all(work), what)
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
        async with self.ledger.locks.hold_many(r.unique_id for r in reqs):
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
                results, err = await self.ledger.store_ops(records, halves)
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
        recent = self.ledger.recent
        found: list[HalfCopy | ApogeeError | None] = [recent.get(r.half_offset) for r in reqs]
        missing = [i for i, c in enumerate(found) if c is None]
        if missing:
            read = await asyncio.to_thread(
                lookups.halves_at,
                self.ledger.store,
                self.broker_name,
                [reqs[i].half_offset for i in missing],
            )
            for i, c in zip(missing, read, strict=True):
                found[i] = read_copy(c) if isinstance(c, StoredMessage) else c
        return found

    async def _end(self, req: End) -> Ended:
        uid = req.unique_id
        async with self.ledger.locks.hold(uid):
            got = await self._answer_or_plan(req, await self._copies(req))
            if isinstance(got, Ended):
                return got
            results, err = await self.ledger.store_ops(got.records, got.halves)
            return self._note(got, results, err)

    async def _answer_or_plan(self, req: End, copies: list[HalfCopy]) -> Ended | _Plan:
        """What ``req`` gets without writing a decision (still pending, already done, or its
        refusal, raised), or the plan of what deciding it writes. Its lock is held."""
        uid = req.unique_id
        oldest = min((c.info.phys_offset for c in copies), default=None)
        decided = await self.ledger.decision(uid, oldest)
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
            remembered = self.ledger.recent.get(req.half_offset)
            if remembered is not None:
                return self._named_copies(req, [remembered])
            copy = await asyncio.to_thread(self.ledger.half_at, req.half_offset)
            found = [] if copy is None else [copy]
        else:
            found = await asyncio.to_thread(lookups.copies_by_id, self.ledger.store, req.unique_id)
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
        still_open = await self.ledger.open_copies(copies)
        if still_open:
            _, err = await self.ledger.store_closing([], still_open, op_kind_of(decided.decision))
            if err is not None:
                raise err
        if decided.decision is Decision.COMMIT and decided.queue_offset < 0 and decided.topic:
            await asyncio.to_thread(lookups.find_committed, self.ledger.store, uid, decided)
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
        closing = await self.ledger.open_copies(copies) or [target]
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
        ops, halves = self.ledger.closing_ops(closing, op_kind_of(req.decision), real)
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
        self.ledger.decided.remember(uid, decided)
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


def _who(req: End) -> str:
    return req.client_id or "(no client id)"


def _utc(ms: int) -> str:
    """``ms`` as an ISO 8601 UTC time to the millisecond."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")
