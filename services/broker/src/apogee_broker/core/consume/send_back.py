"""Send-back: messages a consumer group failed to consume, stored again for a retry or as dead
letters (RocketMQ's SendMessageBack, reference 003).

For each message the broker reads the record the consumer pulled (it must still be there and be
the one named: topic, queue, offset and unique id agree), then:

- while its ``reconsume_times`` is below the group's ``max_reconsume_times`` (and the consumer
  did not ask for the dead-letter topic): a copy goes to ``%RETRY%<group>`` (one queue, created
  here when needed) through the delay path, at delay level ``first_delay_level +
  reconsume_times`` (capped at the table's last level), with ``reconsume_times + 1``, the
  original topic in ``RETRY_TOPIC`` (kept from an earlier retry) and the first id in
  ``ORIGIN_MSG_ID``;
- otherwise a copy goes to ``%DLQ%<group>`` (one queue, readable: users inspect and redrive it)
  with ``DLQ_ORIGIN_TOPIC``, ``DLQ_REASON`` (the consumer's last failure, at most
  :data:`MAX_REASON` characters) and ``ATTEMPTS`` (deliveries that failed: the consumer's
  count when it gives one, as orderly consumers do, else ``reconsume_times + 1``), its
  ``reconsume_times`` unchanged.

The unique id stays the message's own, so consumers can recognise a redelivery. Every other
property is kept, the trace context (``traceparent``) among them: the retry or dead letter stays
in the message's trace, and its store span links to the failed attempt when the consumer sent
that attempt's context (``BackItem.traceparent``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final, NamedTuple

from apogee.codec import (
    MAX_REASON,
    PROP_ATTEMPTS,
    PROP_DLQ_ORIGIN_TOPIC,
    PROP_DLQ_REASON,
    PROP_ORIGIN_MSG_ID,
    PROP_RETRY_TOPIC,
)
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import (
    ApogeeError,
    InvalidArgumentError,
    NotFoundError,
    OffsetDeletedError,
)
from apogee.common.topics import dlq_topic, retry_topic
from apogee.store import Message, MessageStore, StoredMessage
from apogee_broker.core.checks import validate_group
from apogee_broker.core.schedule.layout import SCHEDULE_PROPERTIES, ScheduleLayout, to_scheduled
from apogee_broker.core.storage.writer import StoreWriter
from apogee_broker.core.topics import TopicManager

log = logging.getLogger(__name__)

MAX_ITEMS: Final = 1024


class BackItem(NamedTuple):
    topic: str
    queue_id: int
    queue_offset: int
    phys_offset: int
    unique_id: str
    reason: str = ""
    to_dlq: bool = False
    attempts: int = 0
    #: the W3C traceparent of the failed attempt (the consumer's process span), "" for none
    traceparent: str = ""


class BackOutcome(NamedTuple):
    """Stored again (``error`` None) under ``topic``, or not (``error``)."""

    topic: str
    reconsume_times: int
    dead_lettered: bool
    deliver_at_ms: int
    error: ApogeeError | None = None


class SendBackService:
    def __init__(
        self,
        store: MessageStore,
        topics: TopicManager,
        writer: StoreWriter,
        layout: ScheduleLayout,
        *,
        max_reconsume_times: int = 16,
        first_delay_level: int = 3,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.store = store
        self.topics = topics
        self.writer = writer
        self.layout = layout
        self.max_reconsume_times = max_reconsume_times
        self.first_delay_level = first_delay_level
        self.clock = clock

    def ensure_retry_topic(self, group: str) -> None:
        """Create ``%RETRY%<group>`` here, so that the group's consumers find a route to it."""
        self.topics.ensure(retry_topic(validate_group(group)))

    async def send_back(
        self,
        group: str,
        items: Sequence[BackItem],
        max_reconsume_times: int = 0,
        first_delay_level: int = 0,
    ) -> list[BackOutcome]:
        validate_group(group)
        if not items:
            raise InvalidArgumentError(field="items", rule="must not be empty")
        if len(items) > MAX_ITEMS:
            raise InvalidArgumentError(
                field="items", rule=f"{len(items)} items; at most {MAX_ITEMS} per call"
            )
        levels = self.layout.levels
        if first_delay_level < 0:
            raise InvalidArgumentError(
                field="first_delay_level",
                rule=f"must be a delay level (0: the broker's {self.first_delay_level}), got "
                f"{first_delay_level}",
            )
        max_times = max_reconsume_times or self.max_reconsume_times
        first = first_delay_level or self.first_delay_level
        outcomes: list[BackOutcome | None] = [None] * len(items)
        batch: list[Message] = []
        where: list[int] = []
        attempts: list[str] = []
        now = self.clock.time_ms()
        for i, item in enumerate(items):
            try:
                stored = self._record(i, item)
            except ApogeeError as err:
                outcomes[i] = BackOutcome("", 0, False, 0, err)
                continue
            props = {k: v for k, v in stored.properties.items() if k not in SCHEDULE_PROPERTIES}
            origin = props.get(PROP_RETRY_TOPIC) or stored.topic
            props.setdefault(PROP_ORIGIN_MSG_ID, stored.unique_id)
            times = stored.reconsume_times
            if item.to_dlq or times >= max_times:
                topic = self.topics.ensure(dlq_topic(group)).name
                props.pop(PROP_RETRY_TOPIC, None)
                props[PROP_DLQ_ORIGIN_TOPIC] = origin
                props[PROP_DLQ_REASON] = (item.reason or "no reason given")[:MAX_REASON]
                props[PROP_ATTEMPTS] = str(item.attempts or times + 1)
                batch.append(stored.copy_to(topic, 0, props))
                outcomes[i] = BackOutcome(topic, times, True, 0)
            else:
                topic = self.topics.ensure(retry_topic(group)).name
                props[PROP_RETRY_TOPIC] = origin
                level = min(first + times, levels)
                due = now + self.layout.delay_ms[level - 1]
                msg = stored.copy_to(topic, 0, props, times + 1)
                to_scheduled(msg, self.layout.level_queue(level), due, level)
                batch.append(msg)
                outcomes[i] = BackOutcome(topic, times + 1, False, due)
            where.append(i)
            attempts.append(item.traceparent)
        if batch:
            results = await self.writer.append_internal(batch, attempts if any(attempts) else None)
            retried = dead = 0
            for i, r in zip(where, results, strict=True):
                o = outcomes[i]
                assert o is not None
                if r.result is None:
                    outcomes[i] = o._replace(error=r.error)
                elif o.dead_lettered:
                    dead += 1
                else:
                    retried += 1
            self.writer.metrics.sent_back(group, retried, dead)
        return [o for o in outcomes if o is not None]

    def _record(self, i: int, item: BackItem) -> StoredMessage:
        try:
            stored = self.store.message_at(item.phys_offset)
        except OffsetDeletedError:
            raise NotFoundError(
                what=f"items[{i}]",
                detail=f"the message at phys offset {item.phys_offset} was removed by retention",
            ) from None
        if (
            stored.topic != item.topic
            or stored.queue_id != item.queue_id
            or stored.queue_offset != item.queue_offset
            or (item.unique_id and stored.unique_id != item.unique_id)
        ):
            raise InvalidArgumentError(
                field=f"items[{i}]",
                rule=f"message {item.unique_id!r} of {item.topic}/{item.queue_id} offset "
                f"{item.queue_offset} is not at phys offset {item.phys_offset} on this broker",
            )
        return stored
