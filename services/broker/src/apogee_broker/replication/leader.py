"""The leader's side of replication: what followers copy, who is in sync, what is committed.

- **Replicate.** A follower opens a stream at the offset where its log ends; the leader pushes
  its CommitLog bytes from there as they are written (:class:`Push`), at most a window past
  what the follower acknowledged, and the follower acknowledges each answer it applied with its
  new log end. An answer never crosses an epoch boundary (the follower records each epoch's
  start as it crosses one); with nothing new, an empty answer every ``idle_ms`` says the leader
  is there and where the high watermark is, and its acknowledgement that the follower is.
  (``Fetch``, one call per answer, is the same from an offset; a follower sends its goodbye
  with it.)
- **In-sync set.** The group record's ``in_sync`` is written in the coordination engine
  *before* the leader acts on a change: a follower that has everything acknowledged so far
  joins, and one that has not caught up for ``replica_lag_max_s`` leaves. So the record always
  holds at least every replica the leader counts, and an election (which picks from the
  record) never picks one that lacks an acknowledged message. An elected leader starts with
  itself alone; the others join as they catch up.
- **High watermark.** The smallest log end of the in-sync set (the leader's included).
  Appends are dispatched to the ConsumeQueues only up to it (:class:`DispatchGate`), so
  consumers read only what the set has, and with ``acks = all`` a send is answered once the
  high watermark passes it.
- **Refusals.** With ``acks = all`` a write is refused (``NOT_ENOUGH_REPLICAS``, nothing stored)
  while the set is smaller than ``min_insync_replicas``. A leader cut off from its followers
  therefore acknowledges nothing: they stop copying, it cannot shrink the set without the
  engine, and what it stores waits until ``replication_timeout_s`` (``NOT_REPLICATED``).
- **Losing leadership.** A fetch or stream at a higher epoch, a record naming another leader,
  or a claim found lost in the engine ends the term: waiting sends are answered
  ``NOT_REPLICATED``, new ones ``NOT_LEADER``, and the node steps down (:mod:`.node`).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

from apogee.common.errors import (
    ApogeeError,
    InvalidArgumentError,
    NotEnoughReplicasError,
    NotLeaderError,
    NotReplicatedError,
    StaleEpochError,
    UnavailableError,
)
from apogee.service.replica_group import GroupRecord, ReplicaCoordination, Versioned
from apogee.store import AppendResult, MessageStore
from apogee.store.epochs import EpochFile

log = logging.getLogger(__name__)

Submit = Callable[[list[AppendResult], int], None]

#: Reads of the log up to this size are served on the event loop (slices of the map).
INLINE_BYTES = 256 << 10
#: Longest a write is held while leadership is handed over (then NOT_LEADER, retried there).
HANDOFF_HOLD_S = 5.0
#: A successor must have been heard from within this many seconds (every 0.5 s at least).
HANDOFF_ALIVE_S = 1.5


class DispatchGate:
    """Sits between the CommitLog and the dispatcher: a batch reaches the ConsumeQueues only
    once the high watermark has passed it. ``on_written(end)`` is told (from the appending
    thread) of every batch written."""

    def __init__(self, submit: Submit, on_written: Callable[[int], None]) -> None:
        self._submit = submit
        self._on_written = on_written
        self._lock = threading.Lock()
        self._held: deque[tuple[list[AppendResult], int]] = deque()
        self._hw = 0
        self._open = False

    def sink(self, batch: list[AppendResult], end: int) -> None:
        with self._lock:
            if not self._held and (self._open or end <= self._hw):
                self._submit(batch, end)
            else:
                self._held.append((batch, end))
        self._on_written(end)

    def advance(self, hw: int) -> None:
        with self._lock:
            self._hw = max(self._hw, hw)
            held = self._held
            while held and held[0][1] <= self._hw:
                self._submit(*held.popleft())

    def open(self) -> None:
        """Dispatch everything held and, from now on, every batch at once (the term ended: a
        follower's log is dispatched as it arrives, and truncation cuts what is not kept)."""
        with self._lock:
            self._open = True
            while self._held:
                self._submit(*self._held.popleft())


@dataclass(slots=True)
class FollowerState:
    replica_id: str
    address: str = ""
    #: the follower's log end as of its last fetch or acknowledgement (it has every byte below)
    offset: int = 0
    last_heard: float = 0.0
    #: when it last had everything the leader had (monotonic seconds)
    caught_up_at: float = 0.0
    #: the leader's log end when it answered this follower's last fetch (Fetch only)
    sent_end: int = 0


@dataclass(frozen=True, slots=True)
class PushLimits:
    """What a follower asked of its stream (0: the leader's own bounds)."""

    max_bytes: int = 0
    window_bytes: int = 0
    idle_ms: int = 0


class Push:
    """One follower's copying stream (see the module docstring): :meth:`next` is the next
    answer to push, :meth:`ack` takes the follower's acknowledgement. Both on the event loop."""

    def __init__(
        self,
        leader: ReplicationLeader,
        follower: FollowerState,
        session: str,
        offset: int,
        limits: PushLimits,
    ) -> None:
        cfg = leader.cfg
        self._leader = leader
        self.follower = follower
        self.session = session
        #: where the next answer starts, and the follower's last acknowledgement
        self.pos = self.acked = offset
        self.max_bytes = min(limits.max_bytes or cfg.max_fetch_bytes, cfg.max_fetch_bytes)
        self.window = max(
            self.max_bytes, min(limits.window_bytes or cfg.push_window_bytes, 256 << 20)
        )
        self.idle_s = min(limits.idle_ms or 500, 5000) / 1000
        #: (end of an answer pushed, the leader's log end then), not yet acknowledged
        self.unacked: deque[tuple[int, int]] = deque()
        #: set when there may be something to do: a write, an acknowledgement, the term's end
        self.wake = asyncio.Event()
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.wake.set()

    def ack(self, offset: int) -> None:
        """The follower's log ends at ``offset`` now."""
        self._leader._acknowledged(self, offset)

    async def next(self) -> tuple[int, int, bytes] | None:
        """``(data epoch, offset, data)`` to push (data empty: nothing new for ``idle_ms``);
        None once the stream is to end (closed, or its session said goodbye). Raises when
        the term ended."""
        leader = self._leader
        while True:
            leader._check_term()
            if self.closed or self.session in leader._left:
                return None
            if self.pos < leader.written_end and self.pos - self.acked < self.window:
                return await leader._push(self)
            self.wake.clear()
            try:
                async with asyncio.timeout(self.idle_s):
                    await self.wake.wait()
            except TimeoutError:
                return leader._epoch_at(self.pos)[0], self.pos, b""


@dataclass(frozen=True, slots=True)
class LeaderConfig:
    broker_name: str
    replica_id: str
    address: str
    acks: str = "all"
    min_insync: int = 2
    lag_max_s: float = 10.0
    timeout_s: float = 15.0
    max_fetch_bytes: int = 4 << 20
    #: bytes pushed to a follower past its last acknowledgement, at most
    push_window_bytes: int = 16 << 20


@dataclass(order=True, slots=True)
class _Waiter:
    end: int
    seq: int
    future: asyncio.Future[ApogeeError | None] = field(compare=False)


class ReplicationLeader:
    """One term of leadership; made by the node when it wins an election, ended by
    :meth:`step_down`. Everything runs on the event loop except :meth:`DispatchGate.sink`."""

    def __init__(
        self,
        config: LeaderConfig,
        store: MessageStore,
        epochs: EpochFile,
        coordination: ReplicaCoordination,
        won: Versioned,
        known_hw: int = 0,
    ) -> None:
        """``known_hw``: the high watermark this replica last heard of as a follower: every
        member of the in-sync set holds the log below it, so a follower joins the set only
        once it has that much (a replica back from a wiped disk does not join at offset 0)."""
        self.cfg = config
        self.store = store
        self.epochs = epochs
        self.coordination = coordination
        self.epoch = won.record.epoch
        self._versioned = won
        self.in_sync: set[str] = set(won.record.in_sync) | {config.replica_id}
        #: followers being added to the in-sync set (counted for the high watermark already)
        self._joining: set[str] = set()
        #: set (and replaced) each time the in-sync set grows
        self._in_sync_grew = asyncio.Event()
        self.followers: dict[str, FollowerState] = {}
        #: the sessions of followers that said goodbye (the latest few)
        self._left: deque[str] = deque(maxlen=64)
        self.written_end = store.commitlog.max_offset
        self.hw = (
            self.written_end
            if self.in_sync == {config.replica_id}
            else min(known_hw, self.written_end)
        )
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()
        self._data = asyncio.Event()
        #: the followers' copying streams
        self._pushes: set[Push] = set()
        self._isr_lock = asyncio.Lock()
        self.lost: asyncio.Future[str] = self._loop.create_future()
        self.ended = False
        self.gate = DispatchGate(store.dispatcher.submit, self._written_from_thread)
        self._tasks: set[asyncio.Task[None]] = set()
        #: set while leadership is handed over: done once the successor serves (or it failed)
        self.handing_off: asyncio.Future[None] | None = None
        #: writes refused (not_enough_replicas) or answered not_replicated, for the metrics
        self.refusals: dict[str, int] = {"not_enough_replicas": 0, "not_replicated": 0}
        self._born = time.monotonic()
        #: whether the broker of this term serves (announced); lag counts from then
        self.serving = False

    # -- installing ---------------------------------------------------------------------------

    def install(self) -> None:
        """Route the CommitLog's appends through the gate (held until replicated)."""
        with self.store.commitlog.lock:
            self.store.commitlog.sink = self.gate.sink
        self.gate.advance(self.hw)

    def uninstall(self) -> None:
        """Dispatch what is held and route appends straight to the dispatcher again."""
        self.gate.open()
        with self.store.commitlog.lock:
            self.store.commitlog.sink = self.store.dispatcher.submit

    def start(self) -> None:
        self._spawn(self._upkeep())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the write path -----------------------------------------------------------------------

    async def admit(self) -> None:
        """Let a write through, or raise when it must not be stored at all (see the module
        docstring). While leadership is being handed off a write waits (at most
        ``HANDOFF_HOLD_S``) for the successor to serve, then is refused ``NOT_LEADER``: the
        client asks the nameserver again and finds the successor there."""
        if self.handing_off is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.handing_off), HANDOFF_HOLD_S)
            raise NotLeaderError(
                broker=self.cfg.broker_name,
                replica=self.cfg.replica_id,
                detail=f"it handed leadership over at epoch {self.epoch}",
            )
        if self.cfg.acks == "all" and len(self.in_sync) < self.cfg.min_insync:
            # A term starts with the followers that were in sync with the last leader; one
            # that is still reconciling joins within moments: hold writes for it, at most
            # replica_lag_max_s into the term (later, a short set means followers are gone).
            left = self._born + self.cfg.lag_max_s - time.monotonic()
            while left > 0 and len(self.in_sync) < self.cfg.min_insync and not self.ended:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._in_sync_grew.wait(), left)
                left = self._born + self.cfg.lag_max_s - time.monotonic()
        self.check_writable()

    def check_writable(self) -> None:
        """Raise when a write must not be stored at all (see the module docstring)."""
        if self.ended:
            raise NotLeaderError(
                broker=self.cfg.broker_name,
                replica=self.cfg.replica_id,
                detail=f"its term at epoch {self.epoch} ended",
            )
        if self.cfg.acks == "all" and len(self.in_sync) < self.cfg.min_insync:
            self.refusals["not_enough_replicas"] += 1
            raise NotEnoughReplicasError(
                broker=self.cfg.broker_name,
                detail=f"the in-sync set is {sorted(self.in_sync)}: {len(self.in_sync)} of the "
                f"{self.cfg.min_insync} replicas needed",
                min_insync=self.cfg.min_insync,
            )

    async def replicated(self, end: int) -> ApogeeError | None:
        """Wait until the in-sync set has the log below ``end`` (acks = all); None when it
        does, else the error to answer (the message is stored on this leader)."""
        if self.cfg.acks != "all" or self.hw >= end:
            return None
        if self.ended:
            return self._lost_error()
        fut: asyncio.Future[ApogeeError | None] = self._loop.create_future()
        heapq.heappush(self._waiters, _Waiter(end, next(self._seq), fut))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.cfg.timeout_s)
        except TimeoutError:
            self.refusals["not_replicated"] += 1
            return NotReplicatedError(
                broker=self.cfg.broker_name,
                detail=f"the in-sync set {sorted(self.in_sync)} did not confirm it within "
                f"{self.cfg.timeout_s}s (replication_timeout_s)",
            )

    def _lost_error(self) -> NotReplicatedError:
        return NotReplicatedError(
            broker=self.cfg.broker_name,
            detail=f"leadership at epoch {self.epoch} was lost before the in-sync set confirmed it",
        )

    def _written_from_thread(self, end: int) -> None:
        if threading.get_ident() == self._loop_thread:
            self._written(end)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed: nothing waits any more
                self._loop.call_soon_threadsafe(self._written, end)

    def _written(self, end: int) -> None:
        self.written_end = max(self.written_end, end)
        self._advance()
        self._wake_all()

    def _wake_all(self) -> None:
        self._data.set()
        for push in self._pushes:
            push.wake.set()

    def _advance(self) -> None:
        """Recompute the high watermark over the in-sync set and the followers joining it;
        release the gate and, while the set is at least ``min_insync_replicas`` strong, the
        waiting sends (a send that waited while the set shrank below it is not acknowledged:
        it times out NOT_REPLICATED, as Kafka's NotEnoughReplicasAfterAppend)."""
        hw = self.written_end
        for rid in self.in_sync | self._joining:
            if rid != self.cfg.replica_id:
                f = self.followers.get(rid)
                hw = min(hw, f.offset if f is not None else 0)
        if hw > self.hw:
            self.hw = hw
            self.gate.advance(hw)
        if self.cfg.acks == "all" and len(self.in_sync) < self.cfg.min_insync:
            return
        waiters = self._waiters
        while waiters and waiters[0].end <= self.hw:
            w = heapq.heappop(waiters)
            if not w.future.done():
                w.future.set_result(None)

    # -- what followers ask -------------------------------------------------------------------

    async def fetch(
        self,
        replica_id: str,
        epoch: int,
        offset: int,
        max_bytes: int,
        wait_ms: int,
        address: str,
        session: str = "",
    ) -> tuple[int, int, bytes]:
        """``(data epoch, offset, data)`` for a follower (see the module docstring)."""
        self._check_epoch(epoch, f"a fetch from replica {replica_id}")
        if not replica_id:
            raise InvalidArgumentError(field="replica_id", rule="must be set")
        if session and session in self._left:  # in flight when its follower said goodbye
            return self._epoch_at(offset)[0], offset, b""
        f = self._follower_at(replica_id, offset, address)
        self._heard(f, offset >= f.sent_end, session)
        if offset >= self.written_end and wait_ms > 0:
            self._data.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._data.wait(), wait_ms / 1000)
            self._check_epoch(epoch, f"a fetch from replica {replica_id}")
        data_epoch, limit = self._epoch_at(offset)
        f.sent_end = self.written_end
        if offset >= self.written_end:
            return data_epoch, offset, b""
        want = min(max_bytes or self.cfg.max_fetch_bytes, self.cfg.max_fetch_bytes)
        if limit is not None:
            want = min(want, limit - offset)
        return data_epoch, offset, await self._read(offset, want)

    async def _read(self, offset: int, want: int) -> bytes:
        if min(want, self.written_end - offset) <= INLINE_BYTES:  # a slice of the map
            return self.store.read_log(offset, want, self.written_end)
        return await asyncio.to_thread(self.store.read_log, offset, want, self.written_end)

    def _follower_at(self, replica_id: str, offset: int, address: str = "") -> FollowerState:
        """Note that ``replica_id``'s log ends at ``offset`` (it has every byte below)."""
        if offset > self.written_end:
            raise InvalidArgumentError(
                field="offset",
                rule=f"{offset} is past the leader's log end {self.written_end}: find the "
                "common point with Epochs and truncate first",
            )
        now = time.monotonic()
        f = self.followers.get(replica_id)
        if f is None:
            f = self.followers[replica_id] = FollowerState(replica_id, caught_up_at=now)
        f.address = address or f.address
        f.offset = offset
        f.last_heard = now
        return f

    def _heard(self, f: FollowerState, caught_up: bool, session: str) -> None:
        """After a follower said where its log ends: whether it has everything (or everything
        the leader had when it last answered it: ``caught_up``), the high watermark, and its
        joining the in-sync set once it has all that the set has."""
        if caught_up or f.offset >= self.written_end:
            f.caught_up_at = f.last_heard
        self._advance()
        rid = f.replica_id
        if rid not in self.in_sync and f.offset >= self.hw and not self._isr_lock.locked():
            self._spawn(self._join(rid, session))

    def open_push(
        self,
        replica_id: str,
        epoch: int,
        offset: int,
        address: str,
        session: str,
        limits: PushLimits,
    ) -> Push:
        """A follower's copying stream from ``offset`` (see the module docstring)."""
        self._check_epoch(epoch, f"the stream of replica {replica_id}")
        if not replica_id:
            raise InvalidArgumentError(field="replica_id", rule="must be set")
        f = self._follower_at(replica_id, offset, address)
        push = Push(self, f, session, offset, limits)
        self._pushes.add(push)
        self._heard(f, False, session)
        return push

    def streaming(self) -> list[str]:
        """The replicas with a copying stream open (sorted)."""
        return sorted({p.follower.replica_id for p in self._pushes if not p.closed})

    def close_push(self, push: Push) -> None:
        push.close()
        self._pushes.discard(push)

    def _acknowledged(self, push: Push, offset: int) -> None:
        unacked = push.unacked
        if offset != push.acked and not any(end == offset for end, _ in unacked):
            raise InvalidArgumentError(
                field="offset",
                rule=f"an acknowledgement must be the last one ({push.acked}) or where an "
                f"answer pushed since ends (up to {push.pos}), got {offset}",
            )
        if push.closed or push.session in self._left:
            return  # its follower said goodbye: what it says counts no more
        push.acked = offset
        f = self._follower_at(push.follower.replica_id, offset)
        caught_up = False
        while unacked and unacked[0][0] <= offset:
            end, leader_end = unacked.popleft()
            caught_up = end >= leader_end
        self._heard(f, caught_up, push.session)
        push.wake.set()

    async def _push(self, push: Push) -> tuple[int, int, bytes]:
        pos = push.pos
        data_epoch, limit = self._epoch_at(pos)
        want = min(push.max_bytes, push.acked + push.window - pos)
        if limit is not None:
            want = min(want, limit - pos)
        end = self.written_end
        data = await self._read(pos, want)
        push.pos = pos + len(data)
        push.unacked.append((push.pos, end))
        return data_epoch, pos, data

    async def leaving(self, replica_id: str, epoch: int, session: str = "") -> None:
        """A follower stops: out of the in-sync set now (the record first, as always), and
        its session's stream ends and its fetches still in flight count no more."""
        self._check_epoch(epoch, f"the goodbye of replica {replica_id}")
        if session:
            self._left.append(session)
            self._wake_all()  # its stream ends
        if replica_id in self.in_sync and replica_id != self.cfg.replica_id:
            await self._shrink([replica_id], "it stops")

    def _epoch_at(self, offset: int) -> tuple[int, int | None]:
        """The epoch that wrote the log at ``offset`` and where the next one starts."""
        current, limit = 0, None
        for entry_epoch, start in self.epochs.entries:
            if start <= offset:
                current = entry_epoch
            else:
                limit = start
                break
        return current, limit

    def epoch_entries(self, epoch: int, replica_id: str) -> tuple[list[tuple[int, int]], int]:
        self._check_epoch(epoch, f"an epoch query from replica {replica_id}")
        return list(self.epochs.entries), self.written_end

    def _check_term(self) -> None:
        if self.ended:
            raise NotLeaderError(
                broker=self.cfg.broker_name,
                replica=self.cfg.replica_id,
                detail=f"its term at epoch {self.epoch} ended",
            )

    def _check_epoch(self, epoch: int, what: str) -> None:
        self._check_term()
        if epoch > self.epoch:
            self.step_down(f"{what} carries epoch {epoch}, above this leader's {self.epoch}")
            raise NotLeaderError(
                broker=self.cfg.broker_name,
                replica=self.cfg.replica_id,
                detail=f"epoch {epoch} replaced its epoch {self.epoch}",
            )
        if epoch < self.epoch:
            raise StaleEpochError(
                what=what, epoch=epoch, broker=self.cfg.broker_name, current=self.epoch
            )

    # -- the in-sync set ----------------------------------------------------------------------

    async def _join(self, replica_id: str, session: str = "") -> None:
        """Add a caught-up follower to the in-sync set. From the moment it is chosen it counts
        for the high watermark (nothing is acknowledged that it lacks), and it counts for
        ``min_insync_replicas`` and elections once the record says so."""
        async with self._isr_lock:
            f = self.followers.get(replica_id)
            if self.ended or f is None or replica_id in self.in_sync or f.offset < self.hw:
                return
            if session and session in self._left:  # it said goodbye meanwhile
                return
            self._joining.add(replica_id)
            try:
                new = self.in_sync | {replica_id}
                if await self._write_in_sync(new, f"{replica_id} caught up (offset {f.offset})"):
                    self.in_sync = new
                    grew, self._in_sync_grew = self._in_sync_grew, asyncio.Event()
                    grew.set()
            finally:
                self._joining.discard(replica_id)
            self._advance()

    async def _shrink(self, lagging: list[str], why: str = "") -> None:
        async with self._isr_lock:
            new = self.in_sync - set(lagging)
            if new == self.in_sync or self.ended:
                return
            if await self._write_in_sync(
                new, f"{', '.join(lagging)} {why or f'lagged more than {self.cfg.lag_max_s}s'}"
            ):
                self.in_sync = new
                self._advance()

    async def _write_in_sync(self, in_sync: set[str], why: str) -> bool:
        """Write the record with ``in_sync``; False when it could not (engine unreachable, or
        the record moved: then this term may be over)."""
        current = self._versioned
        members = tuple(dict.fromkeys(current.record.members + tuple(sorted(in_sync))))
        record = replace(
            current.record, in_sync=tuple(sorted(in_sync, key=self._order)), members=members
        )
        try:
            done = await self.coordination.update(record, current.version)
        except UnavailableError as exc:
            log.warning("in-sync set change (%s) not written: %s", why, exc)
            return False
        if done is None:
            await self._recheck()
            return False
        self._versioned = done
        log.info(
            "broker %s epoch %d: in-sync set %s (%s)",
            self.cfg.broker_name,
            self.epoch,
            list(record.in_sync),
            why,
        )
        return True

    def _order(self, rid: str) -> tuple[int, str]:
        return (0 if rid == self.cfg.replica_id else 1, rid)

    async def _recheck(self) -> None:
        """The record moved under this leader: is it still the leader of this epoch?"""
        try:
            now = await self.coordination.read()
        except UnavailableError:
            return
        rec = now.record
        if rec.epoch != self.epoch or rec.leader != self.cfg.replica_id:
            self.step_down(f"the group record names {rec.leader or 'nobody'} at epoch {rec.epoch}")
        else:
            self._versioned = now

    @property
    def record(self) -> GroupRecord:
        return self._versioned.record

    async def _upkeep(self) -> None:
        """Renew the claim, and take lagging followers out of the in-sync set."""
        tick = max(0.05, min(self.cfg.lag_max_s / 4, self.coordination.lease_s / 3 or 0.5))
        while not self.ended:
            await asyncio.sleep(tick)  # a period: renewals and lag checks run on a clock
            if self.handing_off is not None:
                continue  # the claim was given up on purpose: the node ends the term
            try:
                held = await self.coordination.renew()
            except UnavailableError as exc:
                # The engine is away and the claim may have lapsed. With acks = all nothing is
                # acknowledged without the in-sync followers, and they copy at this epoch only
                # while no other leader exists: go on while one of them still does.
                if not self._followed_lately():
                    self.step_down(
                        f"the coordination engine is unreachable ({exc}) and no "
                        "in-sync follower was heard from lately"
                    )
                    return
                held = True
            if not held:
                self.step_down("its claim in the coordination engine lapsed or was taken")
                return
            if not self.serving:
                continue  # followers cannot copy yet: none lags
            now = time.monotonic()
            lagging = [
                rid
                for rid in self.in_sync
                if rid != self.cfg.replica_id and now - self._caught_up_at(rid) > self.cfg.lag_max_s
            ]
            if lagging:
                await self._shrink(lagging)

    def _followed_lately(self) -> bool:
        """Whether, with acks = all, an in-sync follower was heard from at this epoch within the
        claim's lease (a lone leader, or acks = leader, cannot tell it still leads)."""
        if self.cfg.acks != "all":
            return False
        horizon = time.monotonic() - max(1.0, self.coordination.lease_s)
        return any(
            f.last_heard >= horizon
            for rid, f in self.followers.items()
            if rid in self.in_sync and rid != self.cfg.replica_id
        )

    def _caught_up_at(self, rid: str) -> float:
        f = self.followers.get(rid)
        return f.caught_up_at if f is not None else self._born

    async def announce(self, client_address: str) -> None:
        """Write into the record that this leader serves clients (at ``client_address``, and
        registered with the nameservers): a leader handing over waits for that. The term's
        clocks start here: followers cannot copy before, so none lags before."""
        self._born = time.monotonic()
        self.serving = True
        async with self._isr_lock:
            current = self._versioned
            record = replace(current.record, client_address=client_address, successor="")
            try:
                done = await self.coordination.update(record, current.version)
            except UnavailableError as exc:
                log.warning("the record could not say this leader serves: %s", exc)
                return
            if done is None:
                await self._recheck()
            else:
                self._versioned = done

    # -- handing over -------------------------------------------------------------------------

    def successor_for(self, target: str) -> FollowerState:
        """The follower a handoff would go to: ``target`` if it is an in-sync follower heard
        from lately, else ("") the live in-sync follower with the most of the log; raises when
        there is none (nothing to wait for: the caller stops at once)."""
        lately = time.monotonic() - HANDOFF_ALIVE_S  # a live follower acknowledges every 0.5 s
        followers = [
            f
            for rid, f in self.followers.items()
            if rid in self.in_sync and rid != self.cfg.replica_id and f.last_heard >= lately
        ]
        if target:
            chosen = [f for f in followers if f.replica_id == target]
            if not chosen:
                raise InvalidArgumentError(
                    field="replica_id",
                    rule=f"{target!r} is not an in-sync follower of broker "
                    f"{self.cfg.broker_name!r} (in sync: {sorted(self.in_sync)})",
                )
        else:
            chosen = sorted(followers, key=lambda f: (-f.offset, f.replica_id))[:1]
            if not chosen:
                raise NotEnoughReplicasError(
                    broker=self.cfg.broker_name,
                    detail="no in-sync follower to hand leadership to",
                    min_insync=self.cfg.min_insync,
                )
        return chosen[0]

    async def hand_off(self, target: str, timeout_s: float) -> GroupRecord:
        """Hand leadership to ``target`` (an in-sync follower; "": the one with the most of the
        log): new writes are held, the ones in flight finish, the successor catches up to the
        log end, the record names it as successor and the claim is given up, so that it
        campaigns at once while the others wait. Returns the record written; the node ends
        the term when the successor leads (:meth:`successor_serves`)."""
        if self.ended or self.handing_off is not None:
            raise NotLeaderError(
                broker=self.cfg.broker_name,
                replica=self.cfg.replica_id,
                detail="its term is ending already",
            )
        successor = self.successor_for(target)
        self.handing_off = self._loop.create_future()
        deadline = self._loop.time() + timeout_s
        try:
            while (
                successor.offset < self.written_end
                and self._loop.time() < deadline
                and time.monotonic() - successor.last_heard < 1.0  # it still copies
            ):
                self._wake_all()
                await asyncio.sleep(
                    0.01
                )  # a poll with a deadline: the follower's next acknowledgement
            if successor.offset < self.written_end:
                raise NotReplicatedError(
                    broker=self.cfg.broker_name,
                    detail=f"replica {successor.replica_id} did not catch up (within "
                    f"{timeout_s}s, copying), so leadership stays",
                )
            record = replace(self.record, successor=successor.replica_id)
            done = await self.coordination.update(record, self._versioned.version)
            if done is None:
                await self._recheck()
                raise NotLeaderError(
                    broker=self.cfg.broker_name,
                    replica=self.cfg.replica_id,
                    detail="the group record moved during the handoff",
                )
            self._versioned = done
            await self.coordination.resign()
        except BaseException:
            fut, self.handing_off = self.handing_off, None
            if not fut.done():
                fut.set_result(None)
            raise
        log.info(
            "broker %s epoch %d: handing leadership to %s at offset %d",
            self.cfg.broker_name,
            self.epoch,
            successor.replica_id,
            self.written_end,
        )
        return record

    def successor_serves(self) -> None:
        """The successor leads: held writes are answered NOT_LEADER (they retry there)."""
        fut = self.handing_off
        if fut is not None and not fut.done():
            fut.set_result(None)

    # -- ending -------------------------------------------------------------------------------

    def step_down(self, why: str) -> None:
        """End the term: waiting sends fail (outcome unknown), new ones are refused."""
        if self.ended:
            return
        self.ended = True
        log.warning(
            "broker %s replica %s steps down from epoch %d: %s",
            self.cfg.broker_name,
            self.cfg.replica_id,
            self.epoch,
            why,
        )
        for w in self._waiters:
            if not w.future.done():
                w.future.set_result(self._lost_error())
        self._waiters.clear()
        self._wake_all()
        self._in_sync_grew.set()
        if not self.lost.done():
            self.lost.set_result(why)

    async def close(self) -> None:
        self.step_down("the broker stops")
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
