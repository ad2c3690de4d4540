"""Sending: check every message of a request, store the good ones in one batch, answer each.

This is the path of requests that carry protobuf messages (raw callers of the protocol, and
the broker's own re-puts through :meth:`SendService.append_internal`). The SDK sends records
encoded once (:mod:`.record_intake`), which go through :meth:`SendService.check` in the same
order with the same errors and are appended as one block.

A request's problems (no messages, too many) fail the whole call. Each message is then checked
on its own, in this order, and a bad one gets its own error while the others are stored:

==============================  ===================  ============================================
check                           error kind           example sentence
==============================  ===================  ============================================
topic name                      INVALID_TOPIC        topic 'a b': has a character outside ...
body present                    INVALID_ARGUMENT     messages[2].body: must not be empty
body size                       MESSAGE_TOO_LARGE    messages[2].body is 5242880 bytes: ...
sys_flag: compressed bit only   INVALID_ARGUMENT     messages[2].sys_flag: only bit 0x1 ...
delay level in the table        INVALID_ARGUMENT     messages[0].delay_level 19: must be between ...
one of delay and time           INVALID_ARGUMENT     messages[0]: delay_level and deliver_at_ms
time within timer_max_delay_s   INVALID_ARGUMENT     messages[0].deliver_at_ms: is 8.00 days ...
topic known (or auto-created)   UNKNOWN_TOPIC        topic 'Orders' does not exist on broker ...
not a system topic              PERMISSION_DENIED    topic 'TBW102': is a system topic; ...
topic writable                  PERMISSION_DENIED    topic 'Orders': is not writable on ...
queue id < write queues         INVALID_QUEUE_ID     queue_id 9: must be between 0 and 7 ...
a compressed body inflates      INVALID_ARGUMENT     messages[2].body: is flagged compressed ...
no broker-only property         INVALID_PROPERTY     property 'REAL_TOPIC': is set by brokers ...
property names printable        INVALID_PROPERTY     property 'a\\nb': a property name must not ...
unique id short and printable   INVALID_ARGUMENT     unique_id: is 129 characters; at most 128 ...
what the store checks           INVALID_PROPERTY,    properties are 40000 bytes: the maximum ...
                                PROPERTIES_TOO_LARGE
==============================  ===================  ============================================

Each message is checked in one pass with the topic's state remembered for the request: once a
message of a topic passed every check, the next ones of that topic need only their own fields
checked (body, flags, delay, queue id); any doubt sends a message through the full sequence
above, so the errors and their order are the same.

The good messages go to the store as one batch, in request order, so a bad message never touches
what is stored. The store checks its own rules (properties, keys, hosts) over the whole batch
before writing anything; in the rare case it refuses the batch, each message is checked alone
with the store's encoder and the batch is stored again without the bad ones. A store failure
(closed, disk full, flush timeout) becomes the outcome of every message of the batch.

Defaults filled in for the good messages: a unique id (:class:`~apogee.common.ids.IdGenerator`),
the born timestamp (the broker's clock) and the born host (the caller's address).

Delayed and timer messages pass the same checks against their real topic, and are then stored
under the schedule topic until the schedule service delivers them (:mod:`.schedule`); their
outcome names the real topic and queue, with no queue offset yet (``scheduled_for`` says when).
A delivery time already past is stored in the real topic at once.

Flushing: with ``flush_mode = async`` an append returns as soon as the bytes are in the page
cache, so it runs directly on the event loop. With ``sync`` the send is acknowledged only once
fsynced: :meth:`MessageStore.append_async` returns at once and calls back from the store's
group-commit thread; a :class:`LoopBridge` settles the waiting futures with one wake-up of the
loop per flush group.

A broker that traces records a store span for each stored message that carries a trace context
(:mod:`.store_spans`); one that does not checks for that once per batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Final, NamedTuple

from opentelemetry.trace import Tracer

from apogee.codec import (
    SYSFLAG_COMPRESSED,
    control_character_rule,
    inflate_problem,
    reserved_property_rule,
    unique_id_rule,
)
from apogee.codec.send import RecordRef
from apogee.common.aio import LoopBridge
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import (
    ApogeeError,
    DiskFullError,
    FlushTimeoutError,
    InternalError,
    InvalidArgumentError,
    InvalidPropertyError,
    InvalidQueueIdError,
    MessageTooLargeError,
    PermissionDeniedError,
)
from apogee.common.ids import IdGenerator
from apogee.common.topics import validate_topic
from apogee.rpc.access import require_topic
from apogee.store import AppendResult, FlushMode, Message, MessageStore
from apogee.store.records import Encoder
from apogee_broker.core.dedup import DedupWindow
from apogee_broker.core.disk_episodes import DiskFullEpisodes
from apogee_broker.core.schedule import (
    DEFAULT_DELAY_LEVELS,
    ScheduleLayout,
    parse_delay_levels,
    to_scheduled,
)
from apogee_broker.core.store_spans import StoreSpans
from apogee_broker.core.topics import TopicConfig, TopicManager, perm_text
from apogee_broker.metrics import BrokerMetrics

DEFAULT_LAYOUT: Final = ScheduleLayout(parse_delay_levels(DEFAULT_DELAY_LEVELS))


class Outgoing(NamedTuple):
    """One message of a send request: what the store keeps, and what only the broker reads."""

    message: Message
    delay_level: int = 0
    deliver_at_ms: int = 0


class SendOutcome(NamedTuple):
    """What became of one message: ``result`` when stored, ``error`` when not (or, for a flush
    timeout, stored but not confirmed durable: both set)."""

    topic: str
    queue_id: int
    unique_id: str
    result: AppendResult | None = None
    error: ApogeeError | None = None
    #: for a delayed or timer message: when it is due (ms); it is not in its queue before
    scheduled_for: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


_new_outcome = tuple.__new__


class SendService:
    """Checks and stores messages for one broker; the Broker servicer's SendMessages."""

    def __init__(
        self,
        store: MessageStore,
        topics: TopicManager,
        *,
        broker_name: str,
        max_message_size: int,
        max_messages_per_request: int,
        clock: Clock = SYSTEM_CLOCK,
        ids: IdGenerator | None = None,
        layout: ScheduleLayout = DEFAULT_LAYOUT,
        timer_max_delay_ms: int = 7 * 86_400_000,
        metrics: BrokerMetrics | None = None,
        tracer: Tracer | None = None,
        dedup: DedupWindow | None = None,
    ) -> None:
        self.store = store
        #: ids of messages that asked for deduplication (:mod:`.dedup`); None: off
        self.dedup = dedup
        #: None unless the broker traces: then each stored message with a trace context gets
        #: its store span (:mod:`.store_spans`)
        self.spans = StoreSpans(tracer, broker_name) if tracer is not None else None
        self.metrics = metrics if metrics is not None else BrokerMetrics()
        self.layout = layout
        self.timer_max_delay_ms = timer_max_delay_ms
        self.topics = topics
        self.broker_name = broker_name
        self.max_message_size = max_message_size
        self.max_messages_per_request = max_messages_per_request
        self.clock = clock
        self.ids = ids or IdGenerator()
        self._sync = store.cfg.flush_mode is FlushMode.SYNC
        self.disk = DiskFullEpisodes(store.root)
        self._max_topic_length = store.cfg.max_topic_length
        self._checker = Encoder(store.cfg)  # the store's own rules, for the rare slow path
        self._bridge: LoopBridge | None = None

    async def send(
        self, items: Sequence[Outgoing], default_born_host: str = ""
    ) -> list[SendOutcome]:
        """Store the good messages of ``items``; one outcome per item, in order. Messages
        without a unique id, born timestamp or born host get one here (``default_born_host``:
        the caller's address). Raises only for request-level problems."""
        return await self.send_messages(
            [item.message for item in items],
            [item.delay_level for item in items],
            default_born_host,
            [item.deliver_at_ms for item in items],
        )

    async def send_messages(
        self,
        messages: Sequence[Message],
        delays: Sequence[int],
        default_born_host: str = "",
        deliver_at: Sequence[int] | None = None,
    ) -> list[SendOutcome]:
        """:meth:`send` of ``messages`` with their delay levels (``delays``, one per message)
        and delivery times (``deliver_at``, ms, 0 for none; one per message when given)."""
        count = len(messages)
        if count == 0:
            raise InvalidArgumentError(field="messages", rule="must not be empty")
        if count > self.max_messages_per_request:
            raise InvalidArgumentError(
                field="messages",
                rule=f"{count} messages in one request; at most {self.max_messages_per_request} "
                "are allowed (max_messages_per_request)",
            )
        outcomes: list[SendOutcome | None] = [None] * count
        good: list[int] = []
        batch: list[Message] = []
        #: topics a message passed every check with in this request, and their write queues
        passed: dict[str, int] = {}
        max_size = self.max_message_size
        #: index -> (real topic, real queue, due ms) of the delayed and timer messages
        scheduled: dict[int, tuple[str, int, int]] = {}
        for i, msg in enumerate(messages):
            delay = delays[i]
            at = deliver_at[i] if deliver_at is not None else 0
            write_queues = passed.get(msg.topic)
            if (
                write_queues is None
                or delay
                or at
                or not 0 < len(msg.body) <= max_size
                or msg.sys_flag & ~SYSFLAG_COMPRESSED
                or not 0 <= msg.queue_id < write_queues
            ):
                try:
                    passed[msg.topic] = self.check(
                        i, msg.topic, len(msg.body), msg.sys_flag, msg.queue_id, delay, at
                    ).write_queues
                except ApogeeError as err:
                    outcomes[i] = _failed(msg, err)
                    continue
            try:
                if msg.sys_flag & SYSFLAG_COMPRESSED:
                    self.check_compressed(i, msg.body)
                if msg.properties:
                    check_client_properties(msg.properties)
                if msg.unique_id:
                    check_unique_id(msg.unique_id)
            except ApogeeError as err:
                outcomes[i] = _failed(msg, err)
                continue
            if delay or at:
                real = (msg.topic, msg.queue_id)
                due = self.schedule(msg, delay, at)
                if due:
                    scheduled[i] = (*real, due)
            good.append(i)
            batch.append(msg)
        if batch:
            self.fill_defaults(batch, default_born_host)
            await self.store_batch(good, batch, outcomes)
        for i, (topic, queue_id, due) in scheduled.items():
            o = outcomes[i]
            if o is not None:
                outcomes[i] = o._replace(topic=topic, queue_id=queue_id, scheduled_for=due)
        return [o for o in outcomes if o is not None]

    async def append_internal(
        self, batch: list[Message], attempts: Sequence[str] | None = None
    ) -> list[SendOutcome]:
        """Store messages the broker built itself (deliveries of the schedule topic, retries,
        dead letters) without the client checks; one outcome per message, in order.
        ``attempts``: per message, the ``traceparent`` of the failed delivery its store span
        links to (``""``: none)."""
        outcomes: list[SendOutcome | None] = [None] * len(batch)
        self.fill_defaults(batch, "")
        await self.store_batch(list(range(len(batch))), batch, outcomes, attempts)
        return [
            o if o is not None else _failed(m, NOT_STORED)
            for o, m in zip(outcomes, batch, strict=True)
        ]

    def schedule(self, msg: Message, delay: int, at: int) -> int:
        """Move a checked delayed or timer message to its schedule queue; returns when it is
        due (0: a time already past, so it stays in its real topic)."""
        now = self.clock.time_ms()
        layout = self.layout
        if delay:
            due = now + layout.delay_ms[delay - 1]
            to_scheduled(msg, layout.level_queue(delay), due, delay)
            return due
        if at > now:
            to_scheduled(msg, layout.slot_queue(at, now), at)
            return at
        return 0

    # -- checks ---------------------------------------------------------------------------------

    def check(
        self,
        i: int | str,
        topic_name: str,
        size: int,
        sys_flag: int,
        queue_id: int,
        delay: int = 0,
        at: int = 0,
    ) -> TopicConfig:
        """Every check of message ``i`` (its topic, body size, flags, queue, delay level and
        delivery time), in order; returns the topic the message may be written to. ``i`` is
        the message's index in ``messages``, or the field that holds it (``"message"``)."""
        msg = _where(i)
        validate_topic(topic_name, self._max_topic_length)
        require_topic(topic_name, "PUB")  # the caller's right, when authentication is on
        if size == 0:
            raise InvalidArgumentError(field=f"{msg}.body", rule="must not be empty")
        if size > self.max_message_size:
            raise MessageTooLargeError(
                field=f"{msg}.body",
                size=size,
                rule=f"the maximum is {self.max_message_size} bytes (max_message_size)",
            )
        if sys_flag & ~SYSFLAG_COMPRESSED:
            raise InvalidArgumentError(
                field=f"{msg}.sys_flag",
                rule=f"only bit 0x1 (body compressed with zlib) may be set, got {sys_flag:#x}",
            )
        levels = self.layout.levels
        if not 0 <= delay <= levels:
            raise InvalidArgumentError(
                field=f"{msg}.delay_level {delay}",
                rule=f"must be between 1 and {levels}, the levels of this broker's delay table "
                "(0: no delay)",
            )
        if delay and at:
            raise InvalidArgumentError(
                field=msg,
                rule="delay_level and deliver_at_ms are both set; give one or the other",
            )
        if at < 0:
            raise InvalidArgumentError(
                field=f"{msg}.deliver_at_ms",
                rule=f"must be a time in ms since the epoch (0: none), got {at}",
            )
        ahead_ms = at - self.clock.time_ms() if at else 0
        if ahead_ms > self.timer_max_delay_ms:
            ahead = ahead_ms / 86_400_000
            cap = self.timer_max_delay_ms / 86_400_000
            raise InvalidArgumentError(
                field=f"{msg}.deliver_at_ms",
                rule=f"is {ahead:.2f} days ahead; the maximum is {cap:g} days "
                f"({self.timer_max_delay_ms // 1000} s, the broker's timer_max_delay_s)",
            )
        topic = self.topics.get_or_create(topic_name)
        if topic.system:
            raise PermissionDeniedError(
                what=f"topic {topic.name!r}", rule="is a system topic; clients cannot send to it"
            )
        if not topic.writable:
            raise PermissionDeniedError(
                what=f"topic {topic.name!r}",
                rule=f"is not writable on broker {self.broker_name} (perm {perm_text(topic.perm)})",
            )
        if not 0 <= queue_id < topic.write_queues:
            raise InvalidQueueIdError(
                value=queue_id,
                rule=f"must be between 0 and {topic.write_queues - 1}: topic {topic.name!r} has "
                f"{topic.write_queues} write queues on broker {self.broker_name}",
            )
        return topic

    def check_compressed(self, i: int | str, body: bytes | memoryview) -> None:
        """Message ``i``'s body is flagged compressed: it must be one zlib stream that inflates
        to at most ``max_message_size`` bytes (else no reader could ever read it)."""
        problem = inflate_problem(body, self.max_message_size)
        if problem is not None:
            raise InvalidArgumentError(
                field=f"{_where(i)}.body",
                rule=f"is flagged compressed (sys_flag 0x1) but {problem}",
            )

    def fill_defaults(self, batch: list[Message], born_host: str) -> None:
        missing: list[Message] = []
        now = self.clock.time_ms()
        for m in batch:
            if not m.unique_id:
                missing.append(m)
            if not m.born_timestamp:
                m.born_timestamp = now
            if not m.born_host:
                m.born_host = born_host
        if missing:
            for m, uid in zip(missing, self.ids.next_ids(len(missing)), strict=True):
                m.unique_id = uid

    # -- storing --------------------------------------------------------------------------------

    async def store_batch(
        self,
        good: list[int],
        batch: list[Message],
        outcomes: list[SendOutcome | None],
        attempts: Sequence[str] | None = None,
    ) -> None:
        began = time.time_ns() if self.spans is not None else 0
        try:
            results, durable_error = await self._append(batch)
        except InvalidArgumentError as refused:
            # The store refused the batch (nothing written): find the bad ones, store the rest.
            keep_idx: list[int] = []
            keep: list[Message] = []
            for i, msg in zip(good, batch, strict=True):
                try:
                    self._checker.prepare([msg])
                except ApogeeError as err:
                    outcomes[i] = _failed(msg, err)
                else:
                    keep_idx.append(i)
                    keep.append(msg)
            if len(keep) == len(batch):  # no single message is to blame: the batch fails
                for i, msg in zip(good, batch, strict=True):
                    outcomes[i] = _failed(msg, refused)
            elif keep:
                await self.store_batch(keep_idx, keep, outcomes)
            return
        except ApogeeError as err:  # closed, failed, disk full: nothing of the batch stored
            for i, msg in zip(good, batch, strict=True):
                outcomes[i] = _failed(msg, err)
            if self.spans is not None:
                self.spans.messages(batch, None, began, err, attempts)
            return
        for i, r in zip(good, results, strict=True):
            outcomes[i] = _new_outcome(
                SendOutcome, (r.topic, r.queue_id, r.unique_id, r, durable_error, 0)
            )
        if self.spans is not None:
            self.spans.messages(batch, results, began, durable_error, attempts)

    async def append_all(
        self, batch: list[Message]
    ) -> tuple[list[AppendResult], ApogeeError | None]:
        """Store ``batch`` (built by the broker, defaults filled) as one append, all or nothing:
        the store checks every message before it writes any. Returns where each went and, when
        durability could not be confirmed, the error saying so (the messages are stored);
        raises when nothing was stored. What a transaction writes together (a commit's message
        and op records) goes this way."""
        if self.spans is None:
            return await self._append(batch)
        began = time.time_ns()
        try:
            results, durable_error = await self._append(batch)
        except ApogeeError as err:
            self.spans.messages(batch, None, began, err)
            raise
        self.spans.messages(batch, results, began, durable_error)
        return results, durable_error

    async def _append(self, batch: list[Message]) -> tuple[list[AppendResult], ApogeeError | None]:
        """Append ``batch``; returns its results and, when durability could not be confirmed,
        the error saying so (the messages are stored)."""
        return await self._appended(
            lambda: self.store.append(batch),
            lambda done: self.store.append_async(batch, done),
            lambda: sum(len(m.body) for m in batch),
        )

    async def append_records(
        self, block: bytes, refs: list[RecordRef], born_host: str
    ) -> tuple[list[AppendResult], ApogeeError | None]:
        """:meth:`_append` of send records (checked by the caller), as one block."""
        return await self._appended(
            lambda: self.store.append_records(block, refs, born_host),
            lambda done: self.store.append_records_async(block, refs, done, born_host),
            lambda: len(block),
        )

    async def _appended(
        self,
        append: Callable[[], list[AppendResult]],
        append_async: Callable[[Callable[[BaseException | None], None]], list[AppendResult]],
        needed: Callable[[], int],
    ) -> tuple[list[AppendResult], ApogeeError | None]:
        """``append()`` (async flush) or ``append_async(on_durable)`` waited for (sync flush);
        a refusal for lack of space, and the first success after one, are told to
        :attr:`disk` (``needed()``: the bytes the refused append wanted)."""
        metrics = self.metrics
        try:
            if not self._sync:
                began = time.perf_counter()
                out: tuple[list[AppendResult], ApogeeError | None] = append(), None
                metrics.append_latency.observe(time.perf_counter() - began)
            else:
                out = await self._durably(append_async)
        except DiskFullError as err:
            self.disk.failed(err, needed())
            raise
        self.disk.stored()
        metrics.stored(out[0])
        return out

    async def _durably(
        self, start: Callable[[Callable[[BaseException | None], None]], list[AppendResult]]
    ) -> tuple[list[AppendResult], ApogeeError | None]:
        """``start(on_durable)`` appends; wait for its durability (sync flush)."""
        if self._bridge is None:
            self._bridge = LoopBridge(asyncio.get_running_loop())
        bridge = self._bridge
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        began = time.perf_counter()
        results = start(lambda err: bridge.post(fut, err))
        self.metrics.append_latency.observe(time.perf_counter() - began)
        # The store answers within sync_flush_timeout_s (or at close); the bound is a backstop.
        limit = self.store.cfg.sync_flush_timeout_s
        try:
            await asyncio.wait_for(fut, limit * 2 + 1)
        except TimeoutError:
            last = results[-1]
            return results, FlushTimeoutError(timeout_s=limit, offset=last.phys_offset + last.size)
        except ApogeeError as err:
            return results, err
        return results, None


NOT_STORED: Final = InternalError(detail="the message was not stored")


def check_client_properties(names: Iterable[str]) -> None:
    """Refuse a property a client may not set: a message's own fields (tags, keys and unique id
    have fields of their own), what only brokers write (:data:`apogee.codec.
    BROKER_PROPERTIES`: where a delayed message goes, where a retry came from, ...), and a name
    holding a control character (the separators ``\\x01`` and ``\\x02`` among them)."""
    for name in names:
        rule = reserved_property_rule(name) or control_character_rule(name)
        if rule is not None:
            raise InvalidPropertyError(field=name, rule=rule)


def check_unique_id(uid: str) -> None:
    """Refuse a unique id a client gave that lookups, lists and logs could not show (too long,
    spaces, control characters), with the sentence the record path and the store give."""
    rule = unique_id_rule(uid)
    if rule is not None:
        raise InvalidArgumentError(field="unique_id", rule=rule)


def _where(i: int | str) -> str:
    """How sentences name message ``i`` of a request (or the field ``i``)."""
    return i if isinstance(i, str) else f"messages[{i}]"


def _failed(msg: Message, err: ApogeeError) -> SendOutcome:
    return SendOutcome(msg.topic, msg.queue_id, msg.unique_id or "", None, err)
