"""Natural batching: messages for one broker travel together when the broker is busy.

Each destination (a broker) has a FIFO of pending messages and at most ``max_in_flight``
requests on the wire. A message appended while a request slot is free leaves at the next turn
of the event loop, together with whatever else was appended in the same turn; while every slot
is busy, messages wait, and when a request completes the ones that waited leave together in the
next request. A request carries at most ``batch_max_messages`` messages and
``batch_max_bytes`` bytes (a single larger message or group still goes, alone). With
``linger_ms`` > 0 a request that is not full waits up to that long for more messages first.
With ``coalesce_ms`` > 0 (and no linger), a message appended while a request to its broker is
in flight, behind fewer than :data:`SPLIT_MIN` others, waits for that request's answer, or
``coalesce_ms`` at most, instead of taking a free slot at once: at moderate rates messages then
share requests (each request costs both sides far more than a message does), while a send to
an idle broker still leaves at the next turn of the loop.

So a lone send costs one round trip and no added delay, and a thousand concurrent sends cost a
handful of requests: the batch size follows the load without tuning.

The accumulator knows nothing of gRPC: it is given ``send(destination, payloads)``, a coroutine
that returns one outcome per payload, in order: a result, or the exception for that payload
alone. An exception raised by ``send`` itself fails every message of that request and no other.
Payloads whose future is already done (the caller gave up) are dropped before they are sent.
An entry's ``sent`` turns true as its request is handed to ``send`` (its messages may reach the
destination from then on: an entry that gives up later cannot know whether they did), and a
request cancelled in flight (the accumulator closing) fails with an error that says so.

Instead of a payload and a future, a caller may queue its own :class:`Entry`
(:meth:`Accumulator.append_entry`) that takes its outcome itself: :meth:`Entry.settle` is given
whatever ``send`` returned and where its messages' outcomes start in it, :meth:`Entry.fail` the
error of a request that failed as a whole. The producer's sends are such entries; they read
their outcomes from the request's answer, so a request settles with no future or outcome
object per message unless the sender asked for one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Sequence, Sized
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from apogee.common.errors import InternalError, InvalidArgumentError, UnavailableError

log = logging.getLogger(__name__)

P = TypeVar("P")
R = TypeVar("R")
R_contra = TypeVar("R_contra", contravariant=True)

#: ``send(destination, payloads)``: one outcome per payload, in order: a sequence of results
#: and exceptions (what :meth:`append` and :meth:`append_group` read), or any other answer of
#: that length that the queued :class:`Entry` objects know how to read
SendFn = Callable[[str, list[P]], Awaitable[Sized]]
Outcomes = list[Any]

#: A backlog that fits in one request is shared out among free request slots in parts of at
#: least this many messages (64 concurrent sends: two requests of 32).
SPLIT_MIN = 32


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    max_in_flight: int = 4
    batch_max_messages: int = 256
    batch_max_bytes: int = 4 * 1024 * 1024
    linger_ms: float = 0.0
    coalesce_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_in_flight", "batch_max_messages", "batch_max_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(
                    field=name, rule=f"must be an integer of at least 1, got {value!r}"
                )
        for name in ("linger_ms", "coalesce_ms"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
                raise InvalidArgumentError(
                    field=name, rule=f"must be a number of at least 0, got {value!r}"
                )


class Sink(Protocol[R_contra]):
    """What gets one message's outcome: an ``asyncio.Future`` is one. ``set_result`` or
    ``set_exception`` is called once, unless ``done()`` says the outcome is no longer wanted
    (then the message is not sent, or its outcome is dropped)."""

    def done(self) -> bool: ...

    def set_result(self, result: R_contra, /) -> None: ...

    def set_exception(self, exception: BaseException, /) -> None: ...


class Entry:
    """One message (``group`` False: ``payload`` is one P, the future gets its outcome) or a
    group that must travel in one request (``payload`` is a list, the future gets the list of
    outcomes). ``future`` is an ``asyncio.Future`` or another :class:`Sink`. An entry is in
    at most one queue at a time; once its outcome is delivered it may be queued again.

    A subclass may take its outcome otherwise by overriding :meth:`given_up`, :meth:`settle`
    and :meth:`fail` (then ``future`` is not used)."""

    __slots__ = ("count", "future", "group", "nbytes", "payload", "sent")

    def __init__(
        self, payload: Any, count: int, nbytes: int, future: Sink[Any], group: bool
    ) -> None:
        self.payload = payload
        self.count = count
        self.nbytes = nbytes
        self.future = future
        self.group = group
        #: the request carrying the entry was handed to ``send`` (set by the accumulator)
        self.sent = False

    def given_up(self) -> bool:
        """Whether the outcome is no longer wanted (the entry is then dropped unsent)."""
        return self.future.done()

    def settle(self, outcomes: Any, start: int) -> None:
        """The request's answer: this entry's outcomes are ``outcomes[start:start + count]``."""
        fut = self.future
        if fut.done():
            return
        if self.group:
            fut.set_result(list(outcomes[start : start + self.count]))
            return
        outcome = outcomes[start]
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)

    def fail(self, exc: BaseException) -> None:
        """The request failed as a whole with ``exc``."""
        if not self.future.done():
            self.future.set_exception(exc)


class _Destination:
    __slots__ = ("count", "in_flight", "name", "nbytes", "pending", "scheduled", "timer")

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending: collections.deque[Entry] = collections.deque()
        self.count = 0
        self.nbytes = 0
        self.in_flight = 0
        self.scheduled = False
        self.timer: asyncio.TimerHandle | None = None


@dataclass(frozen=True, slots=True)
class AccumulatorStats:
    requests: int
    messages: int
    largest_request: int


def _closed_error() -> UnavailableError:
    return UnavailableError(what="the producer", detail="it closed before the message was sent")


def _closed_in_flight() -> UnavailableError:
    return UnavailableError(
        what="the producer", detail="it closed while the request was in flight, unanswered"
    )


class Accumulator(Generic[P, R]):
    def __init__(self, send: SendFn[P], config: BatchingConfig | None = None) -> None:
        self._send = send
        self.config = config or BatchingConfig()
        self._max_in_flight = self.config.max_in_flight
        self._max_messages = self.config.batch_max_messages
        self._max_bytes = self.config.batch_max_bytes
        self._linger = self.config.linger_ms / 1000.0
        self._coalesce = self.config.coalesce_ms / 1000.0
        self._dests: dict[str, _Destination] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = False
        self._requests = 0
        self._messages = 0
        self._largest = 0

    # -- appending ---------------------------------------------------------------------------

    def append(self, dest: str, payload: P, nbytes: int) -> asyncio.Future[R]:
        """Queue one payload for ``dest``; the future gets its outcome."""
        fut: asyncio.Future[R] = self._add(dest, payload, 1, nbytes, False)
        return fut

    def append_entry(self, dest: str, entry: Entry) -> None:
        """Queue ``entry`` (its payload, count and size set) for ``dest``; its ``future`` gets
        the outcome."""
        if self._closed:
            raise _closed_error()
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self._queue(dest, entry)

    def append_group(
        self, dest: str, payloads: Sequence[P], nbytes: int
    ) -> asyncio.Future[list[R | BaseException]]:
        """Queue payloads that must travel in one request; the future gets one outcome per
        payload (a result or an exception), or the exception that failed the request."""
        fut: asyncio.Future[list[R | BaseException]] = self._add(
            dest, list(payloads), len(payloads), nbytes, True
        )
        return fut

    def _add(self, dest: str, payload: Any, count: int, nbytes: int, group: bool) -> Any:
        if self._closed:
            raise _closed_error()
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue(dest, Entry(payload, count, nbytes, fut, group))
        return fut

    def _queue(self, dest: str, entry: Entry) -> None:
        d = self._dests.get(dest)
        if d is None:
            d = self._dests[dest] = _Destination(dest)
        d.pending.append(entry)
        d.count += entry.count
        d.nbytes += entry.nbytes
        self._idle.clear()
        if not d.scheduled:
            self._schedule(d, linger=True)

    def _schedule(self, d: _Destination, linger: bool) -> None:
        if d.scheduled or d.in_flight >= self._max_in_flight or not d.pending:
            return
        assert self._loop is not None
        if linger and d.count < self._max_messages and d.nbytes < self._max_bytes:
            if self._linger > 0:
                if d.timer is None:
                    d.timer = self._loop.call_later(self._linger, self._drain, d)
                return
            if d.in_flight and self._coalesce > 0 and d.count < SPLIT_MIN:
                # busy: a few messages wait for the request in flight to be answered (which
                # drains them at once), or coalesce_ms at most, and leave together
                if d.timer is None:
                    d.timer = self._loop.call_later(self._coalesce, self._drain, d)
                return
        d.scheduled = True
        self._loop.call_soon(self._drain, d)

    # -- sending -----------------------------------------------------------------------------

    def _drain(self, d: _Destination) -> None:
        d.scheduled = False
        if d.timer is not None:
            d.timer.cancel()
            d.timer = None
        assert self._loop is not None
        limit = self._max_messages
        free = self._max_in_flight - d.in_flight
        if free > 1 and 2 * SPLIT_MIN <= d.count <= limit:
            # Everything would fit in one request, and other slots are free: share it out, so
            # that the broker works on the first part while the rest is on its way, and the
            # senders of the first part can send again while the rest is being stored.
            parts = min(free, d.count // SPLIT_MIN)
            limit = -(-d.count // parts)
        while d.in_flight < self._max_in_flight and d.pending:
            entries, payloads = self._take(d, limit)
            if not entries:
                break
            d.in_flight += 1
            task = self._loop.create_task(self._run(d, entries, payloads))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._check_idle()

    def _take(self, d: _Destination, limit: int) -> tuple[list[Entry], list[P]]:
        entries: list[Entry] = []
        payloads: list[P] = []
        count = nbytes = 0
        pending = d.pending
        while pending:
            e = pending[0]
            given_up = e.given_up()  # the caller stopped waiting before it was sent
            if (
                not given_up
                and entries
                and (count + e.count > limit or nbytes + e.nbytes > self._max_bytes)
            ):
                break
            pending.popleft()
            d.count -= e.count
            d.nbytes -= e.nbytes
            if given_up:
                continue
            entries.append(e)
            if e.group:
                payloads.extend(e.payload)
            else:
                payloads.append(e.payload)
            count += e.count
            nbytes += e.nbytes
        return entries, payloads

    async def _run(self, d: _Destination, entries: list[Entry], payloads: list[P]) -> None:
        n = len(payloads)
        self._requests += 1
        self._messages += n
        self._largest = max(self._largest, n)
        for e in entries:
            e.sent = True
        try:
            outcomes = await self._send(d.name, payloads)
            if len(outcomes) != n:
                raise InternalError(
                    detail=f"{d.name} answered {len(outcomes)} outcomes for {n} messages"
                )
        except asyncio.CancelledError:
            _fail(entries, _closed_in_flight())
            raise
        except Exception as exc:
            _fail(entries, exc)
        else:
            i = 0
            for e in entries:
                e.settle(outcomes, i)
                i += e.count
        finally:
            d.in_flight -= 1
            self._schedule(d, linger=False)
            self._check_idle()

    def _check_idle(self) -> None:
        for d in self._dests.values():
            if d.pending or d.in_flight:
                return
        self._idle.set()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> AccumulatorStats:
        return AccumulatorStats(self._requests, self._messages, self._largest)

    def pending_count(self) -> int:
        return sum(d.count for d in self._dests.values())

    async def flush(self, timeout: float) -> bool:
        """Send whatever is pending now (no lingering) and wait until nothing is pending or in
        flight, for at most ``timeout`` seconds. Returns whether that happened."""
        self._linger = 0.0
        for d in self._dests.values():
            self._schedule(d, linger=False)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self, timeout: float = 5.0) -> None:
        """Refuse new messages, flush for at most ``timeout`` seconds, then fail what is left
        with :class:`UnavailableError` and cancel requests still in flight."""
        if self._closed:
            return
        self._closed = True
        flushed = await self.flush(timeout) if self._loop is not None else True
        if flushed:
            return
        left = 0
        for d in self._dests.values():
            if d.timer is not None:
                d.timer.cancel()
                d.timer = None
            left += d.count
            _fail(list(d.pending), _closed_error())
            d.pending.clear()
            d.count = d.nbytes = 0
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        log.warning(
            "closed with %d messages unsent and %d requests cancelled after %.1fs",
            left,
            len(tasks),
            timeout,
        )


def _fail(entries: list[Entry], exc: BaseException) -> None:
    for e in entries:
        e.fail(exc)
