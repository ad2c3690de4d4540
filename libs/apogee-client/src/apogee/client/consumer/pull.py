"""The pull consumer: the application asks for messages and says when it is done with them.

::

    async with PullConsumer("127.0.0.1:9876", "reports", consume_from="earliest") as consumer:
        consumer.subscribe("Orders")
        await consumer.start()
        while True:
            batch = await consumer.poll(timeout=1.0)
            handle(batch)
            await consumer.commit()

or ``async for message in consumer: ...``. Queues are shared in the group by rebalance as for the
push consumer, and pulled ahead in the background (with long polling) into a bounded buffer.

Offsets: with ``auto_commit=True`` (the default) a message counts as done once the next
``poll`` (or the next step of ``async for``) asks for more, and offsets are committed every
``offset_persist_interval`` and at close. With ``auto_commit=False`` only :meth:`commit` marks
what was polled as done (and commits at once); messages polled and never committed are
delivered again after a restart or a rebalance. Pulling pauses while a queue holds
``max_cached_messages_per_queue`` unfinished messages.

Failures: a pull consumer decides by itself what a message it could not handle becomes (as in
RocketMQ, whose pull consumers have no send-back of their own). In clustering mode it may hand
it to :meth:`PullConsumer.send_back`: the broker delivers it again through ``%RETRY%<group>``
after a growing delay, or moves it to ``%DLQ%<group>`` once ``max_reconsume_times`` retries are
used up, and the message counts as done at once. Clustering pull consumers read
``%RETRY%<group>`` like the push consumers do, so retried messages come back from :meth:`poll`
under their original topic, with ``reconsume_times`` counted. A message neither sent back nor
committed is simply delivered again after a restart or a rebalance.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Unpack

from apogee.client.consumer.base import ConsumerBase
from apogee.client.consumer.config import ConsumerConfig, ConsumerOptions
from apogee.client.consumer.queue_state import QueueState
from apogee.client.consumer.records import ReceivedMessage
from apogee.client.consumer.retry import SendBackOutcome
from apogee.client.consumer.spans import handed_over
from apogee.common.errors import InvalidArgumentError, UnsupportedError

_Batch = tuple[QueueState, list[ReceivedMessage]]


class PullConsumer(ConsumerBase):
    """See the module docstring."""

    def __init__(
        self,
        namesrv: str | Sequence[str],
        group: str,
        *,
        auto_commit: bool = True,
        **options: Unpack[ConsumerOptions],
    ) -> None:
        super().__init__(ConsumerConfig.create(namesrv, group, options))
        if self.config.orderly:
            raise InvalidArgumentError(
                field="orderly", rule="is for PushConsumer; a PullConsumer decides its own order"
            )
        self.auto_commit = auto_commit
        self._buffer: collections.deque[_Batch] = collections.deque()
        self._ready = asyncio.Event()
        self._outstanding: list[_Batch] = []

    async def start(self) -> None:
        """Join the group, take a share of the queues and start pulling them."""
        if self._startable():
            await self._start_runtime(self)

    # -- the runtime's sink -------------------------------------------------------------------

    def deliver(self, qs: QueueState, msgs: list[ReceivedMessage]) -> None:
        self._buffer.append((qs, msgs))
        self._ready.set()

    def released(self, qs: QueueState) -> None:
        self._outstanding = [b for b in self._outstanding if b[0] is not qs]

    # -- the application's side ---------------------------------------------------------------

    async def poll(self, timeout: float = 1.0, max_messages: int = 1024) -> list[ReceivedMessage]:
        """Up to ``max_messages`` messages, waiting at most ``timeout`` seconds for the first;
        [] when none arrived. With ``auto_commit`` the previous poll's messages count as done."""
        if self._runtime is None:
            raise RuntimeError("start() the consumer before polling")
        if max_messages < 1:
            raise InvalidArgumentError(
                field="max_messages", rule=f"must be at least 1, got {max_messages}"
            )
        if self.auto_commit:
            self._mark_done()
        if not self._buffer:
            self._ready.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._ready.wait()
        out: list[ReceivedMessage] = []
        while self._buffer and len(out) < max_messages:
            qs, msgs = self._buffer[0]
            if qs.pq.dropped:  # the queue went to another consumer; it delivers these
                self._buffer.popleft()
                continue
            room = max_messages - len(out)
            if len(msgs) > room:
                self._buffer[0] = (qs, msgs[room:])
                msgs = msgs[:room]
            else:
                self._buffer.popleft()
            out += msgs
            self._outstanding.append((qs, msgs))
        if self._tracer is not None:
            handed_over(out)
        return out

    def _mark_done(self) -> None:
        runtime = self._runtime
        if runtime is None:
            return
        for qs, msgs in self._outstanding:
            runtime.finished(qs, msgs)
        self._outstanding = []

    async def send_back(self, message: ReceivedMessage, reason: str = "") -> SendBackOutcome:
        """Give up on ``message`` for now: its broker stores it again, to be delivered again
        through ``%RETRY%<group>`` after a delay (or, once it has had ``max_reconsume_times``
        retries, moved to ``%DLQ%<group>`` with ``reason``), and it counts as done here.
        ``message`` must come from a poll and not be committed yet. Raises the broker's error
        when it was not stored again (the message is then still outstanding)."""
        runtime = self._runtime
        if runtime is None:
            raise RuntimeError("start() the consumer before sending messages back")
        if runtime.send_back is None:
            raise UnsupportedError(
                what="send_back",
                detail="needs clustering mode: a broadcasting group has no retry topic",
            )
        found = next(
            (qs for qs, msgs in self._outstanding if any(m is message for m in msgs)), None
        )
        if found is None:
            raise InvalidArgumentError(
                field="message",
                rule="must be a message returned by poll() and not committed yet",
            )
        if not isinstance(reason, str):
            raise InvalidArgumentError(
                field="reason", rule=f"must be a str, got {type(reason).__name__}"
            )
        (outcome,) = await runtime.send_back.send_back(
            found.address, found.mq.topic, [message], reason or "sent back by the application"
        )
        if outcome.error is not None:
            raise outcome.error
        runtime.finished(found, [message])
        if not outcome.dead_lettered:
            runtime.retry_stored()
        self._outstanding = [
            (qs, [m for m in msgs if m is not message]) for qs, msgs in self._outstanding
        ]
        return outcome

    async def commit(self) -> None:
        """Everything polled so far is done: commit the offsets now."""
        self._mark_done()
        if self._runtime is not None:
            await self._runtime.persist_offsets()

    def __aiter__(self) -> AsyncIterator[ReceivedMessage]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[ReceivedMessage]:
        while not self._closed:
            for m in await self.poll(timeout=1.0):
                yield m

    async def close(self) -> None:
        """Commit (what was polled counts as done with ``auto_commit``), leave the group."""
        if self._closed:
            return
        self._closed = True
        if self.auto_commit:
            self._mark_done()
        if self._runtime is not None:
            await self._runtime.close()
        self._buffer.clear()

    async def __aenter__(self) -> PullConsumer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
