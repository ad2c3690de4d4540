"""Sending: check every message of a request, store the good ones in one batch, answer each.

This is the path of requests that carry whole messages (raw callers of the protocol). The SDK
sends records encoded once (:mod:`.record_intake`), which go through the same checks in the same
order with the same errors and are appended as one block.

The checks and their errors are drawn in :mod:`.checks`: a request's problems (no messages, too
many) fail the whole call; each message is then checked on its own, and a bad one gets its own
error while the others are stored. Each message is checked in one pass with the topic's state
remembered for the request: once a message of a topic passed every check, the next ones of that
topic need only their own fields checked (body, flags, delay, queue id, and the message's type
against a topic that is not MIXED); any doubt sends a message through the full sequence, so the
errors and their order are the same.

The good messages go to the store as one batch, in request order, so a bad message never touches
what is stored (:meth:`~apogee_broker.core.storage.writer.StoreWriter.store_batch`, which also
fills in the unique id, born timestamp and born host they lack, and waits for durability with
``flush_mode = sync``).

Delayed and timer messages pass the same checks against their real topic, and are then stored
under the schedule topic until the schedule service delivers them
(:mod:`apogee_broker.core.schedule.layout`); their outcome names the real topic and queue, with
no queue offset yet (``scheduled_for`` says when). A delivery time already past is stored in the
real topic at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, NamedTuple

from opentelemetry.trace import Tracer

from apogee.codec import PROP_SHARDING_KEY, SYSFLAG_COMPRESSED
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import ApogeeError
from apogee.common.ids import IdGenerator
from apogee.common.topics import MessageType
from apogee.store import Message, MessageStore
from apogee_broker.core.schedule.layout import (
    DEFAULT_DELAY_LEVELS,
    ScheduleLayout,
    parse_delay_levels,
    to_scheduled,
)
from apogee_broker.core.send.checks import (
    SendChecks,
    check_client_properties,
    check_unique_id,
    message_kind,
)
from apogee_broker.core.send.dedup import DedupWindow
from apogee_broker.core.storage.writer import SendOutcome, StoreWriter, failed
from apogee_broker.core.topics import TopicConfig, TopicManager
from apogee_broker.metrics import BrokerMetrics

DEFAULT_LAYOUT: Final = ScheduleLayout(parse_delay_levels(DEFAULT_DELAY_LEVELS))


class Outgoing(NamedTuple):
    """One message of a send request: what the store keeps, and what only the broker reads."""

    message: Message
    delay_level: int = 0
    deliver_at_ms: int = 0


class SendService:
    """Checks and stores messages for one broker: the Broker servicer's SendMessages.

    Made of its :attr:`checks` (:class:`~.checks.SendChecks`) and its :attr:`writer`
    (:class:`~apogee_broker.core.storage.writer.StoreWriter`), which the broker's other writers
    (transactions, retries, the schedule topic) share."""

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
        self.topics = topics
        #: ids of messages that asked for deduplication (:mod:`.dedup`); None: off
        self.dedup = dedup
        self.layout = layout
        self.clock = clock
        self.writer = StoreWriter(
            store, broker_name=broker_name, clock=clock, ids=ids, metrics=metrics, tracer=tracer
        )
        self.metrics = self.writer.metrics
        self.checks = SendChecks(
            topics,
            broker_name=broker_name,
            max_message_size=max_message_size,
            max_messages_per_request=max_messages_per_request,
            max_topic_length=store.cfg.max_topic_length,
            layout=layout,
            timer_max_delay_ms=timer_max_delay_ms,
            clock=clock,
        )

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
        checks = self.checks
        count = len(messages)
        checks.check_request_size(count, "messages", "messages")
        outcomes: list[SendOutcome | None] = [None] * count
        good: list[int] = []
        batch: list[Message] = []
        #: topics a message passed every check with in this request
        passed: dict[str, TopicConfig] = {}
        max_size = checks.max_message_size
        #: index -> (real topic, real queue, due ms) of the delayed and timer messages
        scheduled: dict[int, tuple[str, int, int]] = {}
        for i, msg in enumerate(messages):
            delay = delays[i]
            at = deliver_at[i] if deliver_at is not None else 0
            config = passed.get(msg.topic)
            if (
                config is None
                or delay
                or at
                or not 0 < len(msg.body) <= max_size
                or msg.sys_flag & ~SYSFLAG_COMPRESSED
                or not 0 <= msg.queue_id < config.write_queues
            ):
                try:
                    config = passed[msg.topic] = checks.check(
                        i, msg.topic, len(msg.body), msg.sys_flag, msg.queue_id, delay, at
                    )
                except ApogeeError as err:
                    outcomes[i] = failed(msg, err)
                    continue
            try:
                if config.message_type is not MessageType.MIXED:
                    grouped = msg.properties is not None and PROP_SHARDING_KEY in msg.properties
                    checks.check_type(i, config, *message_kind(delay, at, grouped))
                if msg.sys_flag & SYSFLAG_COMPRESSED:
                    checks.check_compressed(i, msg.body)
                if msg.properties:
                    check_client_properties(msg.properties)
                if msg.unique_id:
                    check_unique_id(msg.unique_id)
            except ApogeeError as err:
                outcomes[i] = failed(msg, err)
                continue
            if delay or at:
                real = (msg.topic, msg.queue_id)
                due = self.schedule(msg, delay, at)
                if due:
                    scheduled[i] = (*real, due)
            good.append(i)
            batch.append(msg)
        if batch:
            self.writer.fill_defaults(batch, default_born_host)
            await self.writer.store_batch(good, batch, outcomes)
        for i, (topic, queue_id, due) in scheduled.items():
            o = outcomes[i]
            if o is not None:
                outcomes[i] = o._replace(topic=topic, queue_id=queue_id, scheduled_for=due)
        return [o for o in outcomes if o is not None]

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
