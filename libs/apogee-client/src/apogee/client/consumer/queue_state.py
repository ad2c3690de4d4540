"""One owned queue's state, shared by its fetcher, the sink that consumes it, the offset
committer and the lock keeper, and the :class:`Sink` protocol that fetched messages go to.

A :class:`QueueState` lives from the moment a queue is taken (rebalance, offset reset) until
it is released; ``gone`` is set then, and ``pq.dropped`` is true from that moment on.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from apogee.client.consumer.process_queue import ProcessQueue
from apogee.client.consumer.records import ReceivedMessage
from apogee.client.producer.routes import MessageQueue

__all__ = ["QueueState", "Sink"]


@dataclass(eq=False)
class QueueState:
    """One owned queue."""

    mq: MessageQueue
    address: str
    pq: ProcessQueue
    next_offset: int = -1
    #: set whenever the sink finishes messages (fetching may go on)
    space: asyncio.Event = field(default_factory=asyncio.Event)
    #: listener calls running for this queue, and set when there are none
    running: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    #: orderly: time on the consumer's clock (``monotonic``) until which the broker lock is
    #: trusted
    locked_until: float = 0.0
    #: orderly: set while the lock is trusted
    lock_granted: asyncio.Event = field(default_factory=asyncio.Event)
    #: consume_from=timestamp on a queue without a committed offset: skip older messages
    #: the sink's own per-queue state (the orderly worker task)
    worker: asyncio.Task[None] | None = None
    #: set when the queue is released
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    #: set once the fetcher knows where the queue starts (``next_offset``)
    placed: asyncio.Event = field(default_factory=asyncio.Event)
    #: the release committed the queue's offset: listener calls that end later move it no
    #: more (those that end while the release waits for them still do)
    let_go: bool = False
    #: the queue's offset is this member's to commit: false from a QUEUE_HELD refusal (another
    #: member still reads it: what this one holds is only where it would start) until the
    #: broker answers a fetch of it
    reading: bool = True

    def __post_init__(self) -> None:
        self.idle.set()

    def locked(self, now: float) -> bool:
        return now < self.locked_until

    def call_started(self) -> None:
        self.running += 1
        self.idle.clear()

    def call_ended(self) -> None:
        self.running -= 1
        if self.running <= 0:
            self.running = 0
            self.idle.set()


class Sink(Protocol):
    """Where fetched messages go."""

    def deliver(self, qs: QueueState, msgs: list[ReceivedMessage]) -> None: ...

    def released(self, qs: QueueState) -> None:
        """The queue is no longer owned; forget anything kept for it."""
        ...
