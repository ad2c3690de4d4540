"""Records pushed on delivery streams, as a fetcher's
:class:`~apogee.client.consumer.fetcher.RecordSource` (what consumers use by default).

:class:`StreamSource` keeps one :class:`~apogee.client.consumer.delivery.DeliveryStream` per
broker. A queue's first fetch subscribes it there from the fetch's offset; from then on the
broker pushes the queue's records as they arrive and the source keeps them, in order, until the
fetcher asks (a fetch that finds nothing kept waits up to ``long_poll_timeout`` and answers
``PULL_NO_NEW_MESSAGE``, as a held pull would). A fetch asking for another offset than where
the kept records continue (the fetcher goes back after a record failed its check) subscribes
the queue again from there.

Credits: a fetch says the queue has room for ``max_messages`` more (the fetcher stops asking
while its queue is full). The source keeps a queue's credit at two batches: it tops it up to
``2 * max_messages`` once it has fallen to one batch, so the broker reads the next batch while
the consumer takes in the last one, and is told once per batch, not per message; a queue that
stops fetching gets at most two batches more. The offset to commit that rides on a fetch goes
out with the next write on the stream (a grant or a subscription); the committer's periodic
commits do the rest.

A released queue's commit that is still waiting is not written (it was asked for with the
fetch, before the last messages were finished, so it is older than the offset the release
commits); the release's own offset goes out on the stream as well
(:meth:`StreamSource.commit_released`), after every commit that rode on it before: the broker
applies a stream's requests in order, so none of those can land after it. Closing writes what
the streams still hold and lets the brokers read it before the streams end.

A clustering consumer subscribes its queues *exclusively*: the broker refuses the subscription
(:class:`~apogee.common.errors.QueueHeldError`) while another member of the group holds the
queue, which that member does until it unsubscribes (after its release commit, on the same
stream) or its stream ends. So when a rebalance moves a queue, the new owner reads it only
once the old one has let it go, from the offset the old one committed; the fetcher asks again
every :data:`~apogee.client.consumer.fetcher.HELD_RETRY_S`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

from apogee.client._rpc import ChannelPool, PullAnswer
from apogee.client.consumer.config import ConsumeMode, ConsumerConfig
from apogee.client.consumer.delivery import DeliveryStream, Subscription
from apogee.client.consumer.fetcher import FetchRequest
from apogee.client.producer.routes import MessageQueue
from apogee.common.errors import ApogeeError
from apogee.v1 import consumer_pb2

__all__ = ["StreamSource"]


class _Feed:
    """One subscribed queue: what was pushed and not yet fetched."""

    __slots__ = ("address", "answers", "arrived", "committed", "error", "expected", "sub")

    def __init__(self, address: str, offset: int) -> None:
        self.address = address
        self.sub: Subscription | None = None
        self.answers: collections.deque[PullAnswer] = collections.deque()
        self.arrived = asyncio.Event()
        self.error: ApogeeError | None = None
        #: where the records after those fetched so far start
        self.expected = offset
        #: the offset last sent for commit
        self.committed = -1

    def batch(self, sub: Subscription, answer: PullAnswer) -> None:
        self.answers.append(answer)
        self.arrived.set()

    def failed(self, sub: Subscription, err: ApogeeError) -> None:
        self.error = err
        self.arrived.set()


class StreamSource:
    """See the module docstring."""

    def __init__(self, cfg: ConsumerConfig, pool: ChannelPool) -> None:
        self._cfg = cfg
        self._pool = pool
        self._streams: dict[str, DeliveryStream] = {}
        self._feeds: dict[MessageQueue, _Feed] = {}
        self._wait = cfg.long_poll_timeout

    def stream(self, address: str) -> DeliveryStream:
        s = self._streams.get(address)
        if s is None:
            s = self._streams[address] = DeliveryStream(
                self._pool, address, self._cfg.group, self._cfg.client_id
            )
        return s

    async def fetch(self, request: FetchRequest) -> PullAnswer:
        mq = request.mq
        feed = self._feeds.get(mq)
        if feed is not None and (
            feed.address != request.address or feed.expected != request.offset
        ):
            self.released(mq)  # another broker, or back to an earlier offset: start again
            feed = None
        stream = self.stream(request.address)
        if feed is None:
            feed = self._feeds[mq] = _Feed(request.address, request.offset)
        if request.commit_offset is not None and request.commit_offset != feed.committed:
            feed.committed = request.commit_offset
            stream.commit(mq.topic, mq.queue_id, request.commit_offset, now=False)
        sub = feed.sub
        want = 2 * max(request.max_messages, 1)  # two batches: one read while one is used
        if sub is None:
            feed.sub = stream.subscribe(
                mq.topic,
                mq.queue_id,
                request.offset,
                request.tag_expression,
                want,
                0,
                feed.batch,
                feed.failed,
                request.sql_expression,
                exclusive=self._cfg.mode is ConsumeMode.CLUSTERING,
            )
        elif sub.credit_messages <= want // 2:
            stream.grant(sub, want - sub.credit_messages)
        if not feed.answers and feed.error is None:
            feed.arrived.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._wait):
                    await feed.arrived.wait()
        if feed.error is not None:
            err = feed.error
            self.released(mq)
            raise err
        if not feed.answers:
            return PullAnswer.of(
                consumer_pb2.PullResponse(
                    status=consumer_pb2.PULL_NO_NEW_MESSAGE, next_offset=request.offset
                )
            )
        answer = feed.answers.popleft()
        feed.expected = answer.response.next_offset
        return answer

    def released(self, mq: MessageQueue, keep_commit: bool = False) -> None:
        feed = self._feeds.pop(mq, None)
        if feed is not None and feed.sub is not None:
            # and its waiting commit, but the release's own (commit_released)
            self.stream(feed.address).unsubscribe(feed.sub, keep_commit)
            feed.arrived.set()  # a fetch waiting on it answers at once

    def commit_released(self, mq: MessageQueue, address: str, offset: int) -> None:
        """``mq`` (read from the broker at ``address``) was released with ``offset`` as its
        offset: commit it on that broker's stream too, when the stream is up."""
        stream = self._streams.get(address)
        if stream is not None and stream.connected.is_set():
            stream.commit(mq.topic, mq.queue_id, offset)

    async def close(self) -> None:
        """End every stream (the consumer is closing, its queues released): what they still
        hold is written first, within ``request_timeout``."""
        for mq in list(self._feeds):  # a release cut short: its waiting commit is dropped
            self.released(mq)
        streams = list(self._streams.values())
        self._streams.clear()
        await asyncio.gather(*(s.close(self._cfg.request_timeout) for s in streams))
