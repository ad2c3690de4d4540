"""A consumer's push delivery stream with one broker (``Consumer.Deliver``).

:class:`DeliveryStream` keeps one stream open to a broker for as long as the consumer runs. A
queue is read by subscribing it (:meth:`~DeliveryStream.subscribe`: topic, queue id, start
offset, tag expression, first credits, and what to call with each batch); the broker then
pushes the queue's records as they arrive, while the queue has credit, and the consumer grants
more as it finishes messages (:meth:`~DeliveryStream.grant`). Offsets are committed on the same
stream (:meth:`~DeliveryStream.commit`). Nothing is asked per message: an idle queue costs
nothing, and what arrives while the broker writes goes out together.

What is sent waits in one pending request, written as soon as the previous write completed, so
grants and commits made together travel together. Each :class:`Subscription` keeps where the
queue's next record starts and the credit the broker still holds for it, as the client counts
them (grants added, batches taken off, exactly as the broker counts). When the stream breaks
(a broker restart, say), it is opened again after a pause (0.2 s doubling to 5 s) and every
subscription is sent again from where it got to with the credit it had: records that were on
their way are read again, none is skipped. Batches for a subscription that was ended are
dropped, so a queue taken away (rebalance) or subscribed again from another offset (a reset)
never sees stale records.

A subscription's failure at the broker (its topic deleted, say) arrives as that
subscription's error (``on_error``) and ends only it; the stream goes on.

Commits on the stream never take a queue's offset back. The broker applies a stream's requests
in order, but commits also go by ``CommitOffsets`` and whichever arrives last wins, so a commit
waiting to be written is dropped when its queue is unsubscribed (whoever releases the queue
commits its last offset, on this stream too) and when the stream breaks (the consumer's periodic
commit carries the offsets meanwhile): written later, it could be older than a commit made in
between. :meth:`~DeliveryStream.close` with a timeout writes what is pending, then closes its
side and lets the broker read every request before the stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from typing import Any, Final, cast

import grpc
import grpc.aio

from apogee.client._rpc import IN_PLACE_FROM, ChannelPool, PullAnswer
from apogee.common.errors import ApogeeError, InternalError, UnavailableError
from apogee.rpc.errors import from_rpc_error, from_status
from apogee.rpc.protowire import read_varint, split_field
from apogee.v1 import consumer_pb2

log = logging.getLogger(__name__)

DELIVER_METHOD: Final = "/apogee.v1.Consumer/Deliver"
_MIN_PAUSE: Final = 0.2
_MAX_PAUSE: Final = 5.0
_BATCHES_FIELD: Final = consumer_pb2.DeliverResponse.DESCRIPTOR.fields_by_name["batches"].number
_RESPONSE_FIELD: Final = consumer_pb2.DeliverBatch.DESCRIPTOR.fields_by_name["response"].number
_RECORDS_FIELD: Final = consumer_pb2.PullResponse.DESCRIPTOR.fields_by_name["records"].number

OnBatch = Callable[["Subscription", PullAnswer], None]
OnError = Callable[["Subscription", ApogeeError], None]


class Subscription:
    """One queue subscribed on a :class:`DeliveryStream`."""

    __slots__ = (
        "active",
        "counts_bytes",
        "credit_bytes",
        "credit_messages",
        "exclusive",
        "offset",
        "on_batch",
        "on_error",
        "queue_id",
        "sql_expression",
        "sub",
        "tag_expression",
        "topic",
    )

    def __init__(
        self,
        sub: int,
        topic: str,
        queue_id: int,
        offset: int,
        tag_expression: str,
        credit_messages: int,
        credit_bytes: int,
        on_batch: OnBatch,
        on_error: OnError,
        sql_expression: str = "",
        exclusive: bool = False,
    ) -> None:
        self.sub = sub
        self.topic = topic
        self.queue_id = queue_id
        #: where the queue's next record starts
        self.offset = offset
        self.tag_expression = tag_expression
        self.sql_expression = sql_expression
        #: what the broker may still push before more is granted
        self.credit_messages = credit_messages
        self.counts_bytes = credit_bytes > 0
        self.credit_bytes = credit_bytes
        self.on_batch = on_batch
        self.on_error = on_error
        self.active = True
        #: read by one member of the group at a time (DeliverSubscribe.exclusive)
        self.exclusive = exclusive

    def __repr__(self) -> str:
        return f"<Subscription {self.sub} {self.topic}/{self.queue_id} at {self.offset}>"

    def as_pb(self) -> consumer_pb2.DeliverSubscribe:
        if self.counts_bytes and self.credit_bytes <= 0:
            # sent again after the byte credit went below zero (0 would mean "messages only"):
            # one byte, on both sides, lets one more batch through
            self.credit_bytes = 1
        return consumer_pb2.DeliverSubscribe(
            sub=self.sub,
            topic=self.topic,
            queue_id=self.queue_id,
            offset=self.offset,
            tag_expression=self.tag_expression,
            sql_expression=self.sql_expression,
            credit_messages=max(self.credit_messages, 0),
            credit_bytes=self.credit_bytes if self.counts_bytes else 0,
            exclusive=self.exclusive,
        )


class _Delivered:
    """One batch of an answer: the subscription, its pull-like answer or its error."""

    __slots__ = ("answer", "status", "sub")

    def __init__(self, sub: int, answer: PullAnswer | None, status: Any) -> None:
        self.sub = sub
        self.answer = answer
        self.status = status


def read_deliver_response(raw: bytes) -> list[_Delivered]:
    """The deserializer of ``Deliver`` answers. A large answer's records stay in the bytes
    they arrived in (as :func:`apogee.client._rpc.read_pull_envelope` does for pulls)."""
    if len(raw) < IN_PLACE_FROM:
        resp = consumer_pb2.DeliverResponse.FromString(raw)
        return [
            _Delivered(
                b.sub,
                PullAnswer.of(b.response) if b.HasField("response") else None,
                b.status if b.HasField("status") else None,
            )
            for b in resp.batches
        ]
    out: list[_Delivered] = []
    at, end = 0, len(raw)
    while at < end:
        key, at = read_varint(raw, at, end)
        if key != (_BATCHES_FIELD << 3) | 2:
            raise ValueError(f"unexpected field {key >> 3} in a Deliver answer")
        n, at = read_varint(raw, at, end)
        rest, r_start, r_end = split_field(raw, at, at + n, _RESPONSE_FIELD)
        batch = consumer_pb2.DeliverBatch.FromString(rest)
        answer: PullAnswer | None = None
        if r_start >= 0:
            fields, start, stop = split_field(raw, r_start, r_end, _RECORDS_FIELD)
            response = consumer_pb2.PullResponse.FromString(fields)
            answer = (
                PullAnswer(response, raw, start, stop) if start >= 0 else PullAnswer.of(response)
            )
        out.append(
            _Delivered(batch.sub, answer, batch.status if batch.HasField("status") else None)
        )
        at += n
    return out


Call = grpc.aio.StreamStreamCall[consumer_pb2.DeliverRequest, list[_Delivered]]


class DeliveryStream:
    """The delivery stream of one consumer with the broker at ``address``; see the module
    docstring. Opened on the first subscription, kept open (and opened again after a break)
    while it has subscriptions, until :meth:`close`."""

    def __init__(self, pool: ChannelPool, address: str, group: str, client_id: str) -> None:
        self.address = address
        self.group = group
        self.client_id = client_id
        self.what = f"broker {address}"
        self._pool = pool
        self._subs: dict[int, Subscription] = {}
        self._ids = itertools.count(1)
        # what the next write carries
        self._new: dict[int, Subscription] = {}
        self._gone: list[int] = []
        self._grants: dict[int, list[int]] = {}
        self._commits: dict[tuple[str, int], int] = {}
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        #: closing: write what is pending, then end the stream from this side
        self._ending = False
        #: set while a stream is open; cleared when it breaks
        self.connected = asyncio.Event()
        #: streams opened so far (the first and every reopening)
        self.opened = 0

    @property
    def running(self) -> bool:
        """Whether the stream is kept open (or being opened again)."""
        return self._task is not None

    # -- what the consumer asks ------------------------------------------------------------

    def subscribe(
        self,
        topic: str,
        queue_id: int,
        offset: int,
        tag_expression: str,
        credit_messages: int,
        credit_bytes: int,
        on_batch: OnBatch,
        on_error: OnError,
        sql_expression: str = "",
        exclusive: bool = False,
    ) -> Subscription:
        """Start delivering the queue from ``offset``; ``credit_bytes`` 0 counts messages only;
        ``exclusive``: while no other member of the group reads it (else ``on_error`` gets a
        :class:`~apogee.common.errors.QueueHeldError`)."""
        s = Subscription(
            next(self._ids),
            topic,
            queue_id,
            offset,
            tag_expression,
            credit_messages,
            credit_bytes,
            on_batch,
            on_error,
            sql_expression,
            exclusive,
        )
        self._subs[s.sub] = s
        self._new[s.sub] = s
        self._changed()
        return s

    def unsubscribe(self, s: Subscription, keep_commit: bool = False) -> None:
        """Stop delivering the queue; whatever is still on its way for it is dropped, and so is
        its commit still waiting to be written (see the module docstring), unless
        ``keep_commit`` (the release's own, written before the unsubscription)."""
        s.active = False
        if not keep_commit:
            self._commits.pop((s.topic, s.queue_id), None)
        if self._subs.pop(s.sub, None) is None:
            return
        self._grants.pop(s.sub, None)
        if self._new.pop(s.sub, None) is None:  # the broker has it: tell it
            self._gone.append(s.sub)
            self._changed()

    def grant(self, s: Subscription, messages: int, nbytes: int = 0) -> None:
        """Let the broker push ``messages`` (and ``nbytes``) more for ``s``."""
        if not s.active or (messages <= 0 and nbytes <= 0):
            return
        s.credit_messages += messages
        if s.counts_bytes:
            s.credit_bytes += nbytes
        if s.sub in self._new:  # not sent yet: its subscribe carries the credit
            return
        g = self._grants.setdefault(s.sub, [0, 0])
        g[0] += messages
        g[1] += nbytes if s.counts_bytes else 0
        self._changed()

    def commit(self, topic: str, queue_id: int, offset: int, now: bool = True) -> None:
        """Commit the group's offset of a queue: with a write now, or (``now`` false) with
        whatever is written next (a grant, a subscription)."""
        self._commits[(topic, queue_id)] = offset
        if now:
            self._changed()

    async def close(self, timeout: float = 0.0) -> None:
        """End the stream. With ``timeout`` and the stream up, what is pending (a released
        queue's last commit) is written first, then this side is closed and the broker gets up
        to ``timeout`` seconds to read every request and end the stream; else, or after that,
        the stream is cancelled."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None and timeout > 0 and self.connected.is_set():
            self._ending = True
            self._dirty.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await asyncio.wait((task,))
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for s in self._subs.values():
            s.active = False
        self._subs.clear()

    # -- the stream ---------------------------------------------------------------------------

    def _changed(self) -> None:
        self._dirty.set()
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"apogee-delivery-{self.address}"
            )

    def _pending(self) -> bool:
        return bool(self._new or self._gone or self._grants or self._commits)

    def _take_request(self, first: bool) -> consumer_pb2.DeliverRequest:
        r = consumer_pb2.DeliverRequest()
        if first:
            r.group = self.group
            r.client_id = self.client_id
            self._new = dict(self._subs)  # the new stream knows nothing yet
            self._gone.clear()
            self._grants.clear()
        for s in self._new.values():
            r.subscribe.append(s.as_pb())
        r.unsubscribe.extend(self._gone)
        for sub, (m, b) in self._grants.items():
            r.credit.add(sub=sub, messages=m, bytes=b)
        for (topic, queue_id), offset in self._commits.items():
            r.commit.add(topic=topic, queue_id=queue_id, offset=offset)
        self._new = {}
        self._gone = []
        self._grants = {}
        self._commits = {}
        return r

    async def _run(self) -> None:
        pause = _MIN_PAUSE
        open_stream: grpc.aio.StreamStreamMultiCallable[
            consumer_pb2.DeliverRequest, list[_Delivered]
        ] = self._pool.channel(self.address).stream_stream(
            DELIVER_METHOD,
            request_serializer=consumer_pb2.DeliverRequest.SerializeToString,
            response_deserializer=read_deliver_response,
        )
        while True:
            call: Call = open_stream()
            self.opened += 1
            reader = asyncio.get_running_loop().create_task(self._read(call))
            try:
                was_up = await self._write_loop(call, reader)
            finally:
                self.connected.clear()
                call.cancel()
                reader.cancel()
            if self._closed:
                return
            self._commits.clear()  # not written: see the module docstring
            if reader.cancelled():
                err: ApogeeError | None = UnavailableError(what=self.what, detail="stream broke")
            else:
                err = reader.result()
            if was_up:
                pause = _MIN_PAUSE
            log.log(
                logging.INFO if err is None or err.retriable else logging.WARNING,
                "delivery stream to %s ended: %s; opening it again in %.1fs",
                self.address,
                err or "the broker closed it",
                pause,
            )
            await asyncio.sleep(pause)
            pause = min(pause * 2, _MAX_PAUSE)
            if not self._subs:
                # nothing to deliver (the queues moved away, or the broker is gone for good):
                # the next subscription opens the stream again
                self._task = None
                return

    async def _write_loop(self, call: Call, reader: asyncio.Task[ApogeeError | None]) -> bool:
        """Write what is pending until the stream ends (the reader is done); True when the
        broker took the first request."""
        first = True
        while True:
            if not first:
                if self._ending and not self._pending():
                    await self._end_writing(call, reader)
                    return True
                waiter = asyncio.ensure_future(self._dirty.wait())
                try:
                    await asyncio.wait((waiter, reader), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
            if reader.done():
                return not first
            self._dirty.clear()
            if not first and not self._pending():
                continue  # woken to end the stream
            request = self._take_request(first)
            try:
                await call.write(request)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                await asyncio.wait((reader,))  # the stream broke: the reader says how
                return not first
            if first:
                self.connected.set()
                first = False

    async def _end_writing(self, call: Call, reader: asyncio.Task[ApogeeError | None]) -> None:
        """Close this side; the broker reads what was written, then ends the stream."""
        with contextlib.suppress(
            grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError
        ):
            await call.done_writing()
        await asyncio.wait((reader,))

    async def _read(self, call: Call) -> ApogeeError | None:
        """Hand each batch to its subscription; returns why the stream ended."""
        try:
            while True:
                got = await call.read()
                if got is grpc.aio.EOF:
                    return None
                if got is None:
                    return InternalError(detail=f"{self.what} sent an answer that does not parse")
                for d in cast(list[_Delivered], got):
                    self._deliver(d)
        except grpc.aio.AioRpcError as exc:
            return from_rpc_error(exc, self.what)

    def _deliver(self, d: _Delivered) -> None:
        s = self._subs.get(d.sub)
        if s is None:
            return  # ended meanwhile
        if d.status is not None and d.status.code != 0:
            err = from_status(d.status)
            s.active = False
            del self._subs[d.sub]
            self._new.pop(d.sub, None)
            self._grants.pop(d.sub, None)
            s.on_error(s, err or InternalError(detail=f"{self.what}: subscription failed"))
            return
        answer = d.answer
        if answer is None:
            return
        resp = answer.response
        s.offset = resp.next_offset
        if resp.status == consumer_pb2.PULL_FOUND:
            s.credit_messages -= resp.count
            if s.counts_bytes:
                s.credit_bytes -= answer.end - answer.start
        s.on_batch(s, answer)
