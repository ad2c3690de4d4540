"""Pulling: messages of one queue from an offset, as whole CommitLog records, with long polling.

Every field of a pull is checked before anything happens (:mod:`apogee_broker.core.checks` for
the shared ones):

==================  =================  =========================================================
field               error kind         rule
==================  =================  =========================================================
group               INVALID_ARGUMENT   a group name (the topic name rule)
client_id           INVALID_ARGUMENT   non-empty printable text
topic               INVALID_TOPIC,     a known topic with read permission on this broker
                    UNKNOWN_TOPIC,
                    PERMISSION_DENIED
queue_id            INVALID_QUEUE_ID   one of the topic's read queues
offset              INVALID_ARGUMENT   not negative
tag_expression      INVALID_ARGUMENT   ``""``, ``*`` or tags separated by ``||``
sql_expression      INVALID_ARGUMENT   ``""`` or an SQL92 condition (:mod:`apogee.common.selector`);
                                       a syntax error names its position
commit_offset       INVALID_ARGUMENT   not negative
==================  =================  =========================================================

``max_messages`` (0: 32) and ``max_bytes`` (0: no limit) are capped by the broker's
``pull_max_messages`` and ``pull_max_bytes``, and ``hold_ms`` by ``long_poll_max_ms``.
A piggybacked ``commit_offset`` is committed before the read, as CommitOffsets would, with one
difference: an offset beyond the queue's max offset (possible only after the broker lost the
unflushed end of its log in a power loss) is not committed but logged, and the pull goes on, so
that its answer (OFFSET_OVERFLOW) can put the consumer right; failing the pull would leave the
consumer stuck.

Reads of records near the end of the CommitLog run on the event loop, older ones on a worker
thread (:mod:`.reads`). A pull that finds nothing new (or, with a tag filter, nothing that
matches up to the end of the queue) and asked to be held registers a store watch on its queue;
the dispatcher calls it from its thread the moment an entry lands there and the callback hands
over to the event loop with ``call_soon_threadsafe``, so the held pull is answered
within milliseconds, with no polling interval (RocketMQ checks held pulls every 5 s and on
arrival). The hold lasts at most ``min(hold_ms, long_poll_max_ms)``, and ends a little before the
call's own deadline, so the answer arrives before the client gives up; the watch is always
cancelled. :meth:`PullService.stop` (broker stopping) answers every held pull at once with
PULL_NO_NEW_MESSAGE, so a graceful stop never waits out a hold.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from functools import partial
from typing import Final

from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import InvalidArgumentError
from apogee.common.filtering import Selection, parse_selection
from apogee.service.longpoll import HeldWaits
from apogee.store import GetStatus, MessageStore, RecordsResult
from apogee_broker.core.checks import (
    check_read_queue,
    readable_topic,
    validate_client_id,
    validate_group,
)
from apogee_broker.core.consume.offsets import ConsumerOffsets
from apogee_broker.core.consume.reads import INLINE_READ_WINDOW, read_records
from apogee_broker.core.holds import within_deadline
from apogee_broker.core.topics import TopicManager
from apogee_broker.metrics import BrokerMetrics

log = logging.getLogger(__name__)

#: Messages a pull asking for 0 gets.
DEFAULT_PULL_MESSAGES: Final = 32


@dataclass(frozen=True, slots=True)
class Pull:
    """One pull, as the Consumer servicer hands it over."""

    group: str
    client_id: str
    topic: str
    queue_id: int
    offset: int
    max_messages: int = 0
    max_bytes: int = 0
    tag_expression: str = ""
    hold_ms: int = 0
    commit_offset: int | None = None
    sql_expression: str = ""


class PullService:
    """Answers pulls for one broker."""

    def __init__(
        self,
        store: MessageStore,
        topics: TopicManager,
        offsets: ConsumerOffsets,
        *,
        pull_max_messages: int = 1024,
        pull_max_bytes: int = 4 << 20,
        long_poll_max_ms: int = 15_000,
        inline_read_window: int = INLINE_READ_WINDOW,
        clock: Clock = SYSTEM_CLOCK,
        metrics: BrokerMetrics | None = None,
    ) -> None:
        self.store = store
        self.topics = topics
        self.offsets = offsets
        self.metrics = metrics if metrics is not None else BrokerMetrics()
        self.pull_max_messages = pull_max_messages
        self.pull_max_bytes = pull_max_bytes
        self.long_poll_max_s = long_poll_max_ms / 1000
        self.inline_read_window = inline_read_window
        self.clock = clock
        self._holds = HeldWaits()

    @property
    def held(self) -> int:
        """Pulls being held now."""
        return self._holds.held

    def stop(self) -> None:
        """Answer every held pull now, and hold no more (the broker is stopping)."""
        self._holds.stop()

    async def pull(self, p: Pull, time_remaining_s: float | None = None) -> RecordsResult:
        """Answer ``p`` (held when nothing is new and ``p.hold_ms`` asks for it);
        ``time_remaining_s``: how long until the call's deadline, None when it has none."""
        validate_group(p.group)
        validate_client_id(p.client_id)
        topic = readable_topic(self.topics, p.topic)
        check_read_queue(self.topics, topic, p.queue_id)
        if p.offset < 0:
            raise InvalidArgumentError(field="offset", rule=f"must not be negative, got {p.offset}")
        sel = parse_selection(p.tag_expression, p.sql_expression)
        max_count = min(p.max_messages or DEFAULT_PULL_MESSAGES, self.pull_max_messages)
        max_bytes = min(p.max_bytes or self.pull_max_bytes, self.pull_max_bytes)
        if p.commit_offset is not None:
            self._commit(p, p.commit_offset)

        hold_s = within_deadline(min(p.hold_ms / 1000, self.long_poll_max_s), time_remaining_s)
        loop = asyncio.get_running_loop()
        began = loop.time()
        result, held = await self._answer(p, began + hold_s, sel, max_count, max_bytes)
        self.metrics.pulled(
            p.topic,
            result.count,
            len(result.records),
            loop.time() - began if held else None,
        )
        return result

    async def _answer(
        self, p: Pull, deadline: float, sel: Selection, max_count: int, max_bytes: int
    ) -> tuple[RecordsResult, bool]:
        """The pull's answer, and whether it was held waiting for a message."""
        loop = asyncio.get_running_loop()
        held = False
        offset = p.offset
        while True:
            result = await read_records(
                self.store,
                self.inline_read_window,
                p.topic,
                p.queue_id,
                offset,
                max_count,
                max_bytes,
                sel,
            )
            if result.status not in (GetStatus.NO_NEW_MESSAGE, GetStatus.NO_MATCHED_MESSAGE):
                return result, held
            if result.next_offset < result.max_offset:
                return result, held  # filtered entries remain to be scanned: the client goes on
            if offset != p.offset and result.status is GetStatus.NO_NEW_MESSAGE:
                # passed over unmatched messages while held: say where the scan got to
                result = _with_status(result, GetStatus.NO_MATCHED_MESSAGE)
            offset = result.next_offset
            remaining = deadline - loop.time()
            if remaining <= 0 or self._holds.stopping:
                return result, held
            held = True
            if not await self._hold(p.topic, p.queue_id, offset, remaining):
                return result, held

    def _commit(self, p: Pull, offset: int) -> None:
        if offset < 0:
            raise InvalidArgumentError(
                field="commit_offset", rule=f"must not be negative, got {offset}"
            )
        high = self.store.max_offset(p.topic, p.queue_id)
        if offset > high:
            # Only after the broker lost its unflushed tail: failing the pull would keep the
            # client from the OFFSET_OVERFLOW answer that puts it right.
            log.warning(
                "pull by %s of group %s: commit_offset %d of %s/%d not committed: beyond the "
                "max offset %d",
                p.client_id,
                p.group,
                offset,
                p.topic,
                p.queue_id,
                high,
            )
            return
        self.offsets.commit(p.group, p.topic, p.queue_id, offset, "commit_offset")

    async def _hold(self, topic: str, queue_id: int, offset: int, timeout: float) -> bool:
        """Wait until the queue has an entry at ``offset`` (True), at most ``timeout`` seconds
        or until the broker stops (False)."""
        return await self._holds.hold(
            timeout,
            lambda wake: partial(
                self.store.cancel_watch, self.store.watch(topic, queue_id, offset, wake)
            ),
        )


def _with_status(r: RecordsResult, status: GetStatus) -> RecordsResult:
    return RecordsResult(status, r.records, r.count, r.next_offset, r.min_offset, r.max_offset)
