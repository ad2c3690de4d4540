"""Push delivery: a consumer's subscriptions on one stream, fed as records arrive, within the
credits the consumer grants.

A :class:`DeliverySession` is one ``Consumer.Deliver`` stream. The consumer subscribes queues
(:meth:`~DeliverySession.subscribe`: topic, queue id, start offset, tag expression, first
credits), grants more credit as it finishes messages (:meth:`~DeliverySession.grant`), ends
subscriptions (:meth:`~DeliverySession.unsubscribe`: a queue taken away, or one to start again
from another offset after a reset) and commits offsets (:meth:`~DeliverySession.commit`). The
stream's writer takes :meth:`~DeliverySession.next_batches` in a loop: each call returns the
batches of every queue that has both credit and something new, one read per queue (so one
answer carries several queues' messages when they arrive together), and waits when none has.

When to read a queue (no polling interval): a subscription is *ready* after it subscribes,
after a read that left more behind (credit or the batch size ran out, the tag filter stopped
mid-way), and when the store's dispatcher indexes an entry at its offset
(:meth:`MessageStore.watch`, registered after a read that reached the end of the queue and
called from the indexing thread; the callback hands over to the event loop). Only queues that
are ready and have credit are visited, in turn; a ready queue without credit is visited once it
gets some. Reads of records near the end of the CommitLog run on the event loop, older ones on a
worker thread, as pulls do (:mod:`.reads`).

What a read finds, per subscription:

- records: a batch (``FOUND``) of at most the credit left and the broker's ``pull_max_messages``
  and ``pull_max_bytes``; the credit shrinks by the batch's messages and bytes;
- nothing matching the tag filter up to the end of the queue: one ``NO_MATCHED_MESSAGE`` with
  where the scan got to (so the consumer's committed offset passes filtered messages), only
  when that moved since it was last told;
- an offset below what the queue keeps (retention moved its start) or beyond its end:
  ``OFFSET_TOO_SMALL`` / ``OFFSET_OVERFLOW`` with the offset it continues from;
- an error (the topic deleted or no longer readable, say, noticed at the next read or at once
  when the topic table changes): the subscription ends with that error as a status; the
  stream and the other subscriptions go on.

A stream may also be granted credit of its own (subscription 0), shared by its
subscriptions: from its first such grant on, nothing is read while the stream's messages (or
bytes, once granted) are used up, whatever the queues have.

Exclusive subscriptions (a clustering consumer's): one session of a group at a time reads a
queue. :meth:`DeliveryHub.hold` refuses another session of the group with
:class:`~apogee.common.errors.QueueHeldError` (retriable) while the holder's subscription lives;
it lives until it is unsubscribed or ends, or its session ends (the stream closed: the client
exited or was killed). An exclusive subscription starts no earlier than the group's committed
offset (its first answer is ``NO_MATCHED_MESSAGE`` up to there when it asked from before), and
while a session holds a queue, another session's commits of it on its stream are not taken:
so when rebalance moves a queue, its new owner reads it only after the old one let it go, from
where that one committed.

Coalescing: a session that answered less than ``coalesce_s`` ago (the broker's
``delivery_coalesce_ms``) waits out the rest before it reads, so that at a steady rate one answer
carries what arrived meanwhile on all of its queues, one gRPC write instead of one per arrival;
an idle session answers at once. The wait is one sleep rounded up to whole milliseconds (what
uvloop's timers count), never a loop that looks at the clock until the window has passed.

Flow control: nothing is read for a subscription without credit, and the writer takes the next
answer only after the previous one was written (gRPC's write completes when the transport has
room), so a slow consumer holds the broker to one answer of at most about ``pull_max_bytes``
(plus one batch) per stream. :meth:`DeliveryHub.stop` (the broker stopping) ends every session
at once; its watches are cancelled as it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from apogee.common.errors import (
    ApogeeError,
    InvalidArgumentError,
    QueueHeldError,
    UnavailableError,
)
from apogee.common.filtering import Selection, parse_selection
from apogee.store import GetStatus, MessageStore, RecordsResult, Watch
from apogee_broker.core.checks import (
    check_read_queue,
    readable_topic,
    validate_client_id,
    validate_group,
)
from apogee_broker.core.consume.offsets import ConsumerOffsets
from apogee_broker.core.consume.reads import INLINE_READ_WINDOW, read_records
from apogee_broker.core.topics import TopicManager
from apogee_broker.metrics import BrokerMetrics

log = logging.getLogger(__name__)

#: Subscriptions one stream may hold at once.
MAX_SUBSCRIPTIONS: Final = 4096


@dataclass(frozen=True, slots=True)
class Subscribe:
    """A subscription as the servicer hands it over."""

    sub: int
    topic: str
    queue_id: int
    offset: int
    tag_expression: str = ""
    credit_messages: int = 0
    credit_bytes: int = 0
    sql_expression: str = ""
    #: one member of the group at a time (see DeliveryHub.hold)
    exclusive: bool = False


@dataclass(frozen=True, slots=True)
class Batch:
    """What one subscription gets in an answer: a read's result, or the error that ended it."""

    sub: int
    result: RecordsResult | None
    error: ApogeeError | None = None


class _Sub:
    """One subscribed queue."""

    __slots__ = (
        "bytes",
        "counts_bytes",
        "exclusive",
        "messages",
        "offset",
        "queue_id",
        "ready",
        "reported",
        "sel",
        "sub",
        "topic",
        "watch",
    )

    def __init__(self, s: Subscribe, sel: Selection) -> None:
        self.sub = s.sub
        self.topic = s.topic
        self.queue_id = s.queue_id
        self.offset = s.offset
        self.sel = sel
        self.exclusive = s.exclusive
        self.messages = s.credit_messages
        self.counts_bytes = s.credit_bytes > 0
        self.bytes = s.credit_bytes
        #: may have something to read (else it waits on its watch)
        self.ready = True
        #: the offset the consumer was last told of (records or a status)
        self.reported = s.offset
        self.watch: Watch | None = None

    def has_credit(self) -> bool:
        return self.messages > 0 and (not self.counts_bytes or self.bytes > 0)


class DeliverySession:
    """One ``Deliver`` stream's subscriptions; see the module docstring."""

    def __init__(self, hub: DeliveryHub, group: str, client_id: str) -> None:
        self.hub = hub
        self.group = group
        self.client_id = client_id
        self._subs: dict[int, _Sub] = {}
        #: subscriptions to read at the next answer (ready, with credit), in turn
        self._ready: dict[int, _Sub] = {}
        self._pending: list[Batch] = []  # errors of subscribe calls, sent with the next answer
        #: (topic, queue id) this session reads alone for its group (DeliveryHub.hold), with
        #: how many of its exclusive subscriptions read it
        self.held: dict[tuple[str, int], int] = {}
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.ended = False
        #: ended by the broker stopping (not by the client)
        self.stopped = False
        #: when the last answer was taken (time.monotonic())
        self._answered = 0.0
        #: the stream's own credit, shared by its subscriptions (None: not counted)
        self._stream_messages: int | None = None
        self._stream_bytes: int | None = None

    def __repr__(self) -> str:
        return f"<DeliverySession {self.group}/{self.client_id}: {len(self._subs)} queue(s)>"

    @property
    def subscriptions(self) -> int:
        return len(self._subs)

    # -- what the consumer asks ------------------------------------------------------------

    def subscribe(self, s: Subscribe) -> None:
        """Start delivering a queue; a bad subscription is answered with its error as the
        subscription's status (it never ends the stream)."""
        try:
            if s.sub <= 0:
                raise InvalidArgumentError(field="sub", rule=f"must be positive, got {s.sub}")
            if s.sub in self._subs:
                raise InvalidArgumentError(
                    field="sub", rule=f"{s.sub} is already subscribed on this stream"
                )
            if len(self._subs) >= MAX_SUBSCRIPTIONS:
                raise InvalidArgumentError(
                    field="subscribe",
                    rule=f"a stream holds at most {MAX_SUBSCRIPTIONS} subscriptions",
                )
            topic = readable_topic(self.hub.topics, s.topic)
            check_read_queue(self.hub.topics, topic, s.queue_id)
            if s.offset < 0:
                raise InvalidArgumentError(
                    field="offset", rule=f"must not be negative, got {s.offset}"
                )
            sel = parse_selection(s.tag_expression, s.sql_expression)
            if s.exclusive:
                self.hub.hold(self, s.topic, s.queue_id)
        except ApogeeError as err:
            if s.sub > 0 and s.sub not in self._subs:
                self._pending.append(Batch(s.sub, None, err))
                self._wake.set()
            return
        sub = self._subs[s.sub] = _Sub(s, sel)
        if s.exclusive:
            self._start_at_committed(sub)
        self._make_ready(sub)

    def _start_at_committed(self, sub: _Sub) -> None:
        """An exclusive subscription starts no earlier than the group's committed offset: a
        member that was held back (QUEUE_HELD) asked from where the queue stood when it
        decided to take it, and the member that let it go has committed since. The first
        answer says so (NO_MATCHED_MESSAGE up to there), as a filter passing over messages
        does."""
        committed = self.hub.offsets.committed(self.group, sub.topic, sub.queue_id)
        if committed is None or committed <= sub.offset:
            return
        store = self.hub.store
        sub.offset = committed
        self._pending.append(
            Batch(
                sub.sub,
                RecordsResult(
                    GetStatus.NO_MATCHED_MESSAGE,
                    b"",
                    0,
                    committed,
                    store.min_offset(sub.topic, sub.queue_id),
                    store.max_offset(sub.topic, sub.queue_id),
                ),
            )
        )
        self._wake.set()

    def unsubscribe(self, subs: Iterable[int]) -> None:
        for n in subs:
            sub = self._subs.pop(n, None)
            if sub is not None:
                self._ready.pop(n, None)
                self._cancel_watch(sub)
                self._let_go(sub)

    def _let_go(self, sub: _Sub) -> None:
        """``sub`` ended: its queue is free for the group's others when no other
        subscription of this stream reads it exclusively."""
        if not sub.exclusive:
            return
        key = (sub.topic, sub.queue_id)
        left = self.held.get(key, 0) - 1
        if left > 0:
            self.held[key] = left
        else:
            self.hub.let_go(self, sub.topic, sub.queue_id)

    def grant(self, sub_id: int, messages: int, nbytes: int) -> None:
        """More credit for a subscription (unknown ones are ignored: it may have just ended),
        or for the whole stream (``sub_id`` 0: from the first such grant on, the stream counts
        messages, bytes or both, and its subscriptions share what it has)."""
        if sub_id == 0:
            if messages > 0:
                self._stream_messages = (self._stream_messages or 0) + messages
            if nbytes > 0:
                self._stream_bytes = (self._stream_bytes or 0) + nbytes
            self._wake.set()
            return
        sub = self._subs.get(sub_id)
        if sub is None:
            return
        had = sub.has_credit()
        sub.messages += messages
        if sub.counts_bytes:
            sub.bytes += nbytes
        if not had and sub.has_credit() and sub.ready:
            self._make_ready(sub)  # (one waiting for messages is woken by their arrival)

    def commit(self, offsets: Sequence[tuple[str, int, int]]) -> None:
        """Commit the group's offsets. A negative offset is a bad request (raised: it ends the
        stream); an offset that cannot be committed for its queue's sake (the topic deleted
        meanwhile, or beyond the queue's max offset, possible only after the broker lost the
        unflushed end of its log) is logged and skipped, as a queue's trouble never ends the
        stream."""
        store = self.hub.store
        for i, (topic, queue_id, offset) in enumerate(offsets):
            if offset < 0:
                raise InvalidArgumentError(
                    field=f"commit[{i}]", rule=f"must not be negative, got {offset}"
                )
            if not self.hub.may_commit(self, topic, queue_id):
                # another member of the group reads it now: what this one sends is where it
                # stood, behind that member (a late commit of the old owner, or the start of
                # one still waiting for it); taken, it would hand messages out again
                log.debug(
                    "delivery to %s of group %s: offset %d of %s/%d not committed: held by "
                    "another member",
                    self.client_id,
                    self.group,
                    offset,
                    topic,
                    queue_id,
                )
                continue
            try:
                high = store.max_offset(topic, queue_id)
                if offset > high:
                    raise InvalidArgumentError(
                        field=f"commit[{i}]",
                        rule=f"{offset} is beyond the max offset {high} of queue "
                        f"{topic}/{queue_id}",
                    )
                self.hub.offsets.commit(self.group, topic, queue_id, offset, f"commit[{i}]")
            except ApogeeError as err:
                log.warning(
                    "delivery to %s of group %s: offset %d of %s/%d not committed: %s",
                    self.client_id,
                    self.group,
                    offset,
                    topic,
                    queue_id,
                    err,
                )

    def topic_changed(self, name: str) -> None:
        """Topic ``name`` was changed or deleted: a subscription whose queue can no longer be
        read ends now with the reason, even while it waits for messages or credit."""
        for sub in list(self._subs.values()):
            if sub.topic != name:
                continue
            try:
                check_read_queue(
                    self.hub.topics, readable_topic(self.hub.topics, sub.topic), sub.queue_id
                )
            except ApogeeError as err:
                self._end_sub(sub)
                self._pending.append(Batch(sub.sub, None, err))
                self._wake.set()

    # -- what the stream's writer takes -------------------------------------------------------

    async def next_batches(self) -> list[Batch]:
        """The next answer: at least one batch; [] once the session has ended."""
        waited = False
        while not self.ended:
            if self._ready and not waited:
                # a busy stream answers at most once per coalesce_s: what arrives meanwhile,
                # on any of its queues, goes in the same answer (an idle one answers at once).
                # One sleep, rounded up to whole milliseconds, and no second look at the clock:
                # uvloop's timers count milliseconds and run a shorter one at once, so waiting
                # out a remainder in a loop would spin the event loop until it passed.
                wait = self._answered + self.hub.coalesce_s - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(math.ceil(wait * 1000) / 1000)
                    waited = True
                    continue  # (ended meanwhile? the loop's test says)
            waited = False
            out = self._pending
            self._pending = []
            size = 0
            for sub in list(self._ready.values()):
                if not self._stream_has_credit():
                    break  # the queues ready now are read after the next grant
                if size >= self.hub.pull_max_bytes:
                    self._wake.set()  # the rest go in the next answer
                    break
                if self._ready.pop(sub.sub, None) is not sub or not sub.has_credit():
                    continue  # ended meanwhile
                batch = await self._read(sub)  # None once the session ended meanwhile
                if batch is not None:
                    out.append(batch)
                    if batch.result is not None:
                        size += len(batch.result.records)
            if out:
                self._answered = time.monotonic()
                return out
            if not self._wake.is_set():
                await self._wake.wait()
            self._wake.clear()
        return []

    def _stream_has_credit(self) -> bool:
        m, b = self._stream_messages, self._stream_bytes
        return (m is None or m > 0) and (b is None or b > 0)

    def end(self, stopping: bool = False) -> None:
        """Stop delivering (the stream ended, or the broker stops); cancels every watch."""
        if self.ended:
            return
        self.ended = True
        self.stopped = stopping
        self._ready.clear()
        for sub in self._subs.values():
            self._cancel_watch(sub)
        self._subs.clear()
        self.hub.let_go_all(self)
        self._wake.set()

    # -- reading ------------------------------------------------------------------------------

    async def _read(self, sub: _Sub) -> Batch | None:
        hub = self.hub
        sub.ready = False
        count = min(sub.messages, hub.pull_max_messages)
        nbytes = min(sub.bytes, hub.pull_max_bytes) if sub.counts_bytes else hub.pull_max_bytes
        if self._stream_messages is not None:
            count = min(count, self._stream_messages)
        if self._stream_bytes is not None:
            nbytes = min(nbytes, self._stream_bytes)
        try:
            readable_topic(hub.topics, sub.topic)  # deleted, or no longer readable?
            got = await read_records(
                hub.store,
                hub.inline_read_window,
                sub.topic,
                sub.queue_id,
                sub.offset,
                count,
                nbytes,
                sub.sel,
            )
        except ApogeeError as err:
            self._end_sub(sub)
            return Batch(sub.sub, None, err)
        except Exception as exc:
            log.exception("delivery of %s/%d failed", sub.topic, sub.queue_id)
            self._end_sub(sub)
            return Batch(sub.sub, None, UnavailableError(what="the broker", detail=str(exc)))
        if self._subs.get(sub.sub) is not sub:
            return None  # unsubscribed while the read ran on a thread
        status = got.status
        if status is GetStatus.FOUND:
            hub.metrics.sent_out(sub.topic, got.count, len(got.records))
            sub.offset = sub.reported = got.next_offset
            sub.messages -= got.count
            if sub.counts_bytes:
                sub.bytes -= len(got.records)
            if self._stream_messages is not None:
                self._stream_messages -= got.count
            if self._stream_bytes is not None:
                self._stream_bytes -= len(got.records)
            if got.next_offset < got.max_offset:
                self._make_ready(sub)  # more is there; the next answer reads again
            else:
                self._watch(sub)  # caught up: the next arrival wakes it (no empty read)
            return Batch(sub.sub, got)
        if status in (GetStatus.OFFSET_TOO_SMALL, GetStatus.OFFSET_OVERFLOW):
            sub.offset = sub.reported = got.next_offset
            self._make_ready(sub)
            return Batch(sub.sub, got)
        # NO_NEW_MESSAGE or NO_MATCHED_MESSAGE
        sub.offset = got.next_offset
        if got.next_offset < got.max_offset:
            self._make_ready(sub)  # the tag filter stopped mid-way: scan on
            return None
        self._watch(sub)
        if sub.offset != sub.reported:
            sub.reported = sub.offset
            return Batch(
                sub.sub,
                RecordsResult(
                    GetStatus.NO_MATCHED_MESSAGE,
                    b"",
                    0,
                    got.next_offset,
                    got.min_offset,
                    got.max_offset,
                ),
            )
        return None

    def _watch(self, sub: _Sub) -> None:
        self._cancel_watch(sub)
        loop, own = self._loop, self._loop_thread

        def arrived() -> None:  # any thread: the dispatcher's, an appender's, or this one
            if threading.get_ident() == own:
                self._arrived(sub)
                return
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(self._arrived, sub)

        sub.watch = self.hub.store.watch(sub.topic, sub.queue_id, sub.offset, arrived)

    def _arrived(self, sub: _Sub) -> None:
        sub.watch = None
        if self._subs.get(sub.sub) is sub:
            self._make_ready(sub)

    def _make_ready(self, sub: _Sub) -> None:
        """``sub`` may have something to read: read it at the next answer if it has credit
        (else once it gets some)."""
        sub.ready = True
        if sub.has_credit():
            self._ready[sub.sub] = sub
            self._wake.set()

    def _cancel_watch(self, sub: _Sub) -> None:
        w, sub.watch = sub.watch, None
        if w is not None:
            self.hub.store.cancel_watch(w)

    def _end_sub(self, sub: _Sub) -> None:
        if self._subs.get(sub.sub) is sub:
            del self._subs[sub.sub]
            self._ready.pop(sub.sub, None)
            self._let_go(sub)
        self._cancel_watch(sub)


class DeliveryHub:
    """Every delivery session of one broker."""

    def __init__(
        self,
        store: MessageStore,
        topics: TopicManager,
        offsets: ConsumerOffsets,
        *,
        pull_max_messages: int = 1024,
        pull_max_bytes: int = 4 << 20,
        inline_read_window: int = INLINE_READ_WINDOW,
        coalesce_s: float = 0.0,
        metrics: BrokerMetrics | None = None,
    ) -> None:
        self.store = store
        self.topics = topics
        self.offsets = offsets
        self.metrics = metrics if metrics is not None else BrokerMetrics()
        self.pull_max_messages = pull_max_messages
        self.pull_max_bytes = pull_max_bytes
        self.inline_read_window = inline_read_window
        self.coalesce_s = coalesce_s
        self._sessions: set[DeliverySession] = set()
        self._stopping = False
        #: (group, topic, queue id) -> the session reading it exclusively
        self._holders: dict[tuple[str, str, int], DeliverySession] = {}
        topics.add_listener(self._topic_changed)

    @property
    def sessions(self) -> int:
        return len(self._sessions)

    def open(self, group: str, client_id: str) -> DeliverySession:
        """A new session; raises when the broker is stopping or a name is bad."""
        if self._stopping:
            raise UnavailableError(what="the broker", detail="is stopping")
        validate_group(group)
        validate_client_id(client_id)
        session = DeliverySession(self, group, client_id)
        self._sessions.add(session)
        return session

    def close(self, session: DeliverySession) -> None:
        session.end()
        self._sessions.discard(session)

    # -- exclusive reading: one member of a group per queue ----------------------------------

    def hold(self, session: DeliverySession, topic: str, queue_id: int) -> None:
        """``session`` reads the queue for its group alone from now on; raises
        :class:`QueueHeldError` while another live session of the group holds it."""
        key = (session.group, topic, queue_id)
        holder = self._holders.get(key)
        if holder is not None and holder is not session and not holder.ended:
            raise QueueHeldError(
                topic=topic, queue_id=queue_id, group=session.group, holder=holder.client_id
            )
        self._holders[key] = session
        session.held[(topic, queue_id)] = session.held.get((topic, queue_id), 0) + 1

    def may_commit(self, session: DeliverySession, topic: str, queue_id: int) -> bool:
        """Whether ``session`` may commit the queue's offset for its group on its stream: not
        while another live session of the group reads it exclusively."""
        holder = self._holders.get((session.group, topic, queue_id))
        return holder is None or holder is session or holder.ended

    def let_go(self, session: DeliverySession, topic: str, queue_id: int) -> None:
        key = (session.group, topic, queue_id)
        if self._holders.get(key) is session:
            del self._holders[key]
        session.held.pop((topic, queue_id), None)

    def let_go_all(self, session: DeliverySession) -> None:
        """Every queue ``session`` holds is free (its stream ended)."""
        for topic, queue_id in list(session.held):
            self.let_go(session, topic, queue_id)

    def _topic_changed(self, name: str) -> None:
        # each session looks at its subscriptions of that topic only: every session checking
        # every subscription at each change made a thousand groups connecting (each creating
        # its retry topic) cost a thousand times a thousand checks
        for session in list(self._sessions):
            session.topic_changed(name)

    def stop(self) -> None:
        """End every session now, and open no more (the broker is stopping)."""
        self._stopping = True
        for session in list(self._sessions):
            session.end(stopping=True)
