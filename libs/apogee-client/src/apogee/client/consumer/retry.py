"""Retries of failed messages: send-back to the broker, the retry topic's messages as the
listener sees them, and the property names the brokers put on retried and dead messages.

A clustering consumer whose listener fails on a message sends it back
(``apogee.v1.Consumer.SendBack``) to the broker it was pulled from. The broker stores it again
under ``%RETRY%<group>`` through its delay path (delay level ``first_retry_delay_level`` +
reconsume times, capped at the last level), with its reconsume times counted and its original
topic in the ``RETRY_TOPIC`` property; once ``max_reconsume_times`` retries are used up it goes to
``%DLQ%<group>`` instead. Every clustering member subscribes to ``%RETRY%<group>`` by itself and
:func:`present_retried` shows its messages under their original topic.

:class:`SendBackClient` gathers the send-backs of one broker into one request: the first one
goes out at once, and the ones that arrive while a request is in flight go together in the next
(as the producer batches sends). Each caller gets one :class:`SendBackOutcome` per message; a
failed RPC fails every message of its request, with the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from apogee.client._rpc import ChannelPool, rpc
from apogee.client.consumer.records import ReceivedMessage
from apogee.client.consumer.spans import attempt_traceparent
from apogee.codec import (
    MAX_REASON,
    PROP_ATTEMPTS,
    PROP_DELAY,
    PROP_DLQ_ORIGIN_TOPIC,
    PROP_DLQ_REASON,
    PROP_ORIGIN_MSG_ID,
    PROP_RETRY_TOPIC,
    is_broker_property,
)
from apogee.common.errors import ApogeeError, UnavailableError
from apogee.rpc.errors import from_status
from apogee.v1 import consumer_pb2

log = logging.getLogger(__name__)

__all__ = [
    "PROP_ATTEMPTS",
    "PROP_DELAY",
    "PROP_DLQ_ORIGIN_TOPIC",
    "PROP_DLQ_REASON",
    "PROP_ORIGIN_MSG_ID",
    "PROP_RETRY_TOPIC",
    "SendBackClient",
    "SendBackOutcome",
    "is_internal_property",
    "one_line",
    "present_retried",
]

#: Most messages one SendBack request carries.
MAX_BATCH: Final = 256


def is_internal_property(name: str) -> bool:
    """Whether a property is one the brokers set on retried, delayed or dead messages
    (:func:`apogee.codec.is_broker_property`, and ``ORIGIN_MSG_ID``): a redriven message leaves
    them behind."""
    return name == PROP_ORIGIN_MSG_ID or is_broker_property(name)


def present_retried(msgs: Sequence[ReceivedMessage]) -> None:
    """Messages pulled from ``%RETRY%<group>`` carry their original topic in ``RETRY_TOPIC``:
    show them under it (a message without it keeps the retry topic's name)."""
    for m in msgs:
        original = m.properties.get(PROP_RETRY_TOPIC)
        if original:
            m.topic = original


def one_line(text: str, limit: int = MAX_REASON) -> str:
    """``text`` on one line, cut to ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class SendBackOutcome:
    """What became of one message sent back."""

    #: None: stored again (in ``topic``); else why not (the consumer keeps the message)
    error: ApogeeError | None
    topic: str = ""
    reconsume_times: int = 0
    dead_lettered: bool = False
    #: when the retry is delivered (epoch ms); 0 for a dead letter
    deliver_at_ms: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(slots=True)
class _Pending:
    item: consumer_pb2.SendBackItem
    done: asyncio.Future[SendBackOutcome]


class SendBackClient:
    """Send-backs of one consumer, batched per broker; see the module docstring."""

    def __init__(
        self,
        pool: ChannelPool,
        group: str,
        client_id: str,
        max_reconsume_times: int,
        first_delay_level: int,
        timeout: float,
    ) -> None:
        self._pool = pool
        self._group = group
        self._client_id = client_id
        self._max_reconsume_times = max_reconsume_times
        self._first_delay_level = first_delay_level
        self._timeout = timeout
        self._waiting: dict[str, list[_Pending]] = {}
        self._senders: dict[str, asyncio.Task[None]] = {}
        self._closed = False

    async def send_back(
        self,
        address: str,
        topic: str,
        msgs: Sequence[ReceivedMessage],
        reason: str,
        to_dlq: bool = False,
        attempts: int = 0,
    ) -> list[SendBackOutcome]:
        """Send ``msgs``, pulled from ``topic`` at the broker at ``address``, back to it; one
        outcome per message, in order. A message that has had ``max_reconsume_times`` retries
        goes to the dead-letter topic (also with ``to_dlq``); ``attempts``: the deliveries that
        failed, when counted here (orderly consumers), kept with a dead letter."""
        if self._closed:
            err = UnavailableError(what="send-back", detail="the consumer is closing")
            return [SendBackOutcome(err) for _ in msgs]
        loop = asyncio.get_running_loop()
        text = one_line(reason)
        pending = [
            _Pending(
                consumer_pb2.SendBackItem(
                    topic=topic,
                    queue_id=m.queue_id,
                    queue_offset=m.queue_offset,
                    phys_offset=m.phys_offset,
                    unique_id=m.unique_id,
                    reason=text,
                    # the broker reads 0 as its default (16): a limit of 0 is applied here
                    to_dlq=to_dlq or m.reconsume_times >= self._max_reconsume_times,
                    attempts=attempts,
                    traceparent=attempt_traceparent(m),
                ),
                loop.create_future(),
            )
            for m in msgs
        ]
        self._waiting.setdefault(address, []).extend(pending)
        if address not in self._senders:
            task = loop.create_task(self._drain(address), name=f"apogee-send-back-{address}")
            self._senders[address] = task
        return [await p.done for p in pending]

    async def _drain(self, address: str) -> None:
        try:
            while True:
                waiting = self._waiting.get(address)
                if not waiting:
                    self._waiting.pop(address, None)
                    return
                batch, self._waiting[address] = waiting[:MAX_BATCH], waiting[MAX_BATCH:]
                await self._send(address, batch)
        finally:
            self._senders.pop(address, None)

    async def _send(self, address: str, batch: list[_Pending]) -> None:
        request = consumer_pb2.SendBackRequest(
            group=self._group,
            items=[p.item for p in batch],
            max_reconsume_times=self._max_reconsume_times,
            first_delay_level=self._first_delay_level,
            client_id=self._client_id,
        )
        try:
            resp = await rpc(
                f"broker at {address}",
                self._pool.consumer(address).SendBack(request, timeout=self._timeout),
            )
        except ApogeeError as failed:
            outcomes = [SendBackOutcome(failed) for _ in batch]
        except asyncio.CancelledError:
            closing = UnavailableError(what="send-back", detail="the consumer is closing")
            for p in batch:
                if not p.done.done():
                    p.done.set_result(SendBackOutcome(closing))
            raise
        else:
            outcomes = [_outcome(r) for r in resp.results]
            if len(outcomes) != len(batch):
                short = UnavailableError(
                    what=f"broker at {address}",
                    detail=f"answered {len(outcomes)} send-back results for {len(batch)} messages",
                )
                outcomes = [SendBackOutcome(short) for _ in batch]
        for p, outcome in zip(batch, outcomes, strict=True):
            if not p.done.done():
                p.done.set_result(outcome)

    async def close(self) -> None:
        """Fail what waits, stop the senders (their in-flight requests are abandoned)."""
        self._closed = True
        tasks = list(self._senders.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        err = UnavailableError(what="send-back", detail="the consumer is closing")
        for waiting in self._waiting.values():
            for p in waiting:
                if not p.done.done():
                    p.done.set_result(SendBackOutcome(err))
        self._waiting.clear()


def _outcome(r: consumer_pb2.SendBackResult) -> SendBackOutcome:
    err = from_status(r.status)
    if err is not None:
        return SendBackOutcome(err)
    return SendBackOutcome(None, r.topic, r.reconsume_times, r.dead_lettered, r.deliver_at_ms)
