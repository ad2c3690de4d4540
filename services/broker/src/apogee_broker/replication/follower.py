"""The follower's side of replication: agree with the leader on a common point, then copy.

1. **Reconcile.** Ask the leader for its epoch checkpoint and find the last offset both logs
   are known to hold alike (:func:`~apogee.store.epochs.consistent_point`, as RocketMQ's
   consistent point and Kafka's KIP-279). Whatever this replica holds past it was never
   acknowledged by the group: it is cut (crash-safely, :meth:`MessageStore.truncate`), and the
   epoch checkpoint with it.
2. **Copy.** Open a ``Replicate`` stream at the log end; append what the leader pushes
   unchanged at the same offsets (the store checks every record's CRC and builds its own
   ConsumeQueues and index), record in the epoch checkpoint where each new epoch starts, and
   after each answer tell the leader where the log ends now: its acknowledgement. The leader
   pushes the next bytes as they are written, without waiting to be asked, so copying runs
   ahead of the acknowledgements by up to the stream's window.
3. **Start over.** When the leader's log begins past the end of this replica's (its retention
   deleted the files: a new replica, a wiped disk, one down for long; the leader's ``Epochs``
   answer says where it begins, and a stream that raced its retention ends ``OFFSET_DELETED``
   and the follower reconciles again), nothing this replica holds is of use: it discards
   everything and continues its log at the leader's first offset
   (:meth:`MessageStore.start_over`, as a Kafka follower does at the leader's log start
   offset), with the leader's table of queue offsets there, keeps of its epoch checkpoint only
   the leader's epoch in force there, and copies from there. The leader counts it in sync only
   once its acknowledgements reach the high watermark. A reconciliation whose common point
   lies below this log's first offset (nothing it holds is known to be the leader's, and it
   cannot be cut there) starts over the same way, at this log's first offset.

The follower ends when the leader says its epoch moved on (``STALE_EPOCH`` or ``NOT_LEADER``),
when the leader cannot be reached (or its stream says nothing) for ``lost_after_s``, or when
told to stop; the node then looks at the group's record again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import grpc
import grpc.aio

from apogee.common.errors import (
    ApogeeError,
    InternalError,
    OffsetDeletedError,
    StaleEpochError,
    UnavailableError,
)
from apogee.rpc.errors import call, from_rpc_error
from apogee.rpc.security import ClientSecurity
from apogee.rpc.server import CLIENT_OPTIONS
from apogee.store import FlushMode, MessageStore
from apogee.store.epochs import EpochFile, consistent_point
from apogee.v1 import replication_pb2, replication_pb2_grpc

log = logging.getLogger(__name__)

#: The largest answer a follower asks for. With async flush each is appended, and its
#: ConsumeQueue and index entries made, on the event loop, in one go (about 15 ms for 1 MiB of
#: 1 KiB messages on a slow core): a follower's loop serves only replication, health and the
#: access point, and a hand-off to the writing and dispatching threads per answer cost more
#: CPU than the work itself (``bench/RESULTS.md``).
MAX_ANSWER_BYTES = 1 << 20
#: The store dispatcher's ``inline_max`` while following: every batch.
DISPATCH_ALL_INLINE = 1 << 30


@dataclass(frozen=True, slots=True)
class FollowerConfig:
    broker_name: str
    replica_id: str
    address: str
    max_fetch_bytes: int = MAX_ANSWER_BYTES
    #: how far the leader may push past this replica's last acknowledgement
    window_bytes: int = 16 << 20
    #: with nothing new, the leader answers empty this often
    wait_ms: int = 500
    #: the leader unreachable (or not serving yet) for this long: look at the record again
    lost_after_s: float = 3.0


class Follower:
    """Follows ``leader_address`` at ``epoch`` until the term ends (:meth:`run`)."""

    def __init__(
        self,
        config: FollowerConfig,
        store: MessageStore,
        epochs: EpochFile,
        security: ClientSecurity,
        leader_id: str,
        leader_address: str,
        epoch: int,
        unclean: bool,
    ) -> None:
        self.cfg = config
        self.store = store
        self.epochs = epochs
        self.leader_id = leader_id
        self.leader_address = leader_address
        self.epoch = epoch
        #: restarted after a crash and not yet caught up with the leader
        self.unclean = unclean
        self.high_watermark = 0
        self.leader_end = 0
        self.caught_up = False
        self._security = security
        self._channel = security.channel(leader_address, CLIENT_OPTIONS)
        self._stub = replication_pb2_grpc.ReplicationStub(self._channel)
        self._stopping = asyncio.Event()
        #: when the leader last answered (monotonic seconds)
        self._last_contact = time.monotonic()
        #: the copying stream, while one is open
        self._call: grpc.aio.StreamStreamCall[Any, Any] | None = None
        self._what = f"replication leader {leader_address}"
        #: this run's session: when it says goodbye, its stream ends at the leader and what
        #: it still acknowledges counts no more
        self.session = uuid.uuid4().hex[:12]
        #: run on a worker thread after a copy when ``behind()`` says so (the node brings the
        #: state files up to date)
        self.after_append: Callable[[], object] | None = None
        self.behind: Callable[[], bool] | None = None
        self._sync = store.cfg.flush_mode is FlushMode.SYNC

    def stop(self) -> None:
        self._stopping.set()
        if self._call is not None:
            self._call.cancel()  # its read ends at once, even across a cut network

    async def run(self) -> str:
        """Reconcile, then copy until the term ends; returns why it ended. While it copies, an
        append's ConsumeQueue and index entries are made by the appending thread, whatever
        the batch's size (see ``MAX_ANSWER_BYTES``)."""
        dispatcher = self.store.dispatcher
        inline_max, dispatcher.inline_max = dispatcher.inline_max, DISPATCH_ALL_INLINE
        try:
            return await self._run()
        finally:
            dispatcher.inline_max = inline_max
            await self._channel.close()

    async def _run(self) -> str:
        self._last_contact = time.monotonic()
        reconciled = False
        while not self._stopping.is_set():
            try:
                if not reconciled:
                    await self._reconcile()
                    reconciled = True
                    self._last_contact = time.monotonic()
                await self._copy()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._stopping.is_set() and not (task is not None and task.cancelling()):
                    break  # stop() cancelled the stream
                raise
            except StaleEpochError as exc:
                return f"the leader answered: {exc}"
            except OffsetDeletedError:
                # the leader's retention passed this log's end since the reconciliation: the
                # next one sees where the leader's log begins now, and starts over there
                self._last_contact = time.monotonic()  # an answer: the leader is there
                reconciled = False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), 0.1)
            except ApogeeError as exc:
                # NOT_LEADER from the replica the record names: it is starting its term (or
                # ending it: then the record moves on and the node stops this follower)
                if not exc.retriable:
                    log.error("replication from %s failed: %s", self.leader_address, exc)
                    return f"replication failed: {exc}"
                if time.monotonic() - self._last_contact > self.cfg.lost_after_s:
                    return f"the leader {self.leader_address} is unreachable: {exc}"
                with contextlib.suppress(TimeoutError):  # back off a little, then try again
                    await asyncio.wait_for(self._stopping.wait(), 0.1)
        return "stopped"

    def _goodbye(self) -> replication_pb2.FetchRequest:
        """This replica stops: a fetch that says so (and asks for nothing)."""
        return replication_pb2.FetchRequest(
            broker_name=self.cfg.broker_name,
            replica_id=self.cfg.replica_id,
            epoch=self.epoch,
            offset=self.store.commitlog.max_offset,
            address=self.cfg.address,
            unclean=self.unclean,
            leaving=True,
            session=self.session,
        )

    async def leave(self) -> None:
        """Tell the leader this replica stops (best effort, within a second): it leaves the
        in-sync set now instead of after ``replica_lag_max_s`` of silence. No stream opens
        after it, and the open one ends at the leader, where what it still says counts no
        more (the session said goodbye)."""
        self._stopping.set()
        try:  # a channel of its own: the copying one closes as the copying ends
            async with self._security.channel(self.leader_address, CLIENT_OPTIONS) as ch:
                await call(
                    f"replication leader {self.leader_address}",
                    replication_pb2_grpc.ReplicationStub(ch).Fetch(self._goodbye(), timeout=1.0),
                )
        except ApogeeError as exc:
            log.info("the leader was not told that this replica stops: %s", exc)

    async def _leader_epochs(self, queue_starts: bool = False) -> replication_pb2.EpochsResponse:
        """The leader's epoch checkpoint, where its log begins and ends, and (``queue_starts``)
        its queues' offsets where it begins."""
        response: replication_pb2.EpochsResponse = await call(
            f"replication leader {self.leader_address}",
            self._stub.Epochs(
                replication_pb2.EpochsRequest(
                    broker_name=self.cfg.broker_name,
                    replica_id=self.cfg.replica_id,
                    epoch=self.epoch,
                    queue_starts=queue_starts,
                ),
                timeout=5.0,
            ),
        )
        return response

    async def _reconcile(self) -> None:
        response = await self._leader_epochs()
        theirs = [(e.epoch, e.start_offset) for e in response.entries]
        mine = [(e.epoch, e.start_offset) for e in self.epochs.entries]
        end = self.store.commitlog.max_offset
        if end < response.log_start:
            await self._start_over(
                response.log_start,
                response,
                f"the leader deleted its log below offset {response.log_start}",
            )
            return
        point = consistent_point(theirs, response.log_end, mine, end)
        first = self.store.commitlog.min_offset
        if point < first:  # nothing this log holds is known to be the leader's: all of it goes
            await self._start_over(
                first, response, f"its log parts from the leader's at offset {point}, below its own"
            )
            return
        if end > point:
            cut = await asyncio.to_thread(self.store.truncate, point)
            await asyncio.to_thread(self.epochs.truncate_from, point)
            log.warning(
                "broker %s replica %s: cut %d bytes past offset %d, which the leader %s "
                "(epoch %d) does not have",
                self.cfg.broker_name,
                self.cfg.replica_id,
                cut,
                point,
                self.leader_id,
                self.epoch,
            )
        else:
            await asyncio.to_thread(self.epochs.truncate_from, end)
        log.info(
            "broker %s replica %s follows %s at %s (epoch %d) from offset %d",
            self.cfg.broker_name,
            self.cfg.replica_id,
            self.leader_id,
            self.leader_address,
            self.epoch,
            min(end, point),
        )

    async def _start_over(
        self, offset: int, leader: replication_pb2.EpochsResponse, why: str
    ) -> None:
        """Discard this replica's log and go on at ``offset`` (see the module docstring), with
        the leader's ``Epochs`` answer.

        The epoch checkpoint then holds the leader's epoch in force at ``offset`` only, with
        the leader's start for it although the records before ``offset`` are gone on both
        sides: the next reconciliation, with this leader or another, finds that entry in the
        other's checkpoint and the point where the logs agree. When the leader's log begins at
        ``offset``, its table of queue offsets there seeds this store's
        (:meth:`MessageStore.start_over`): a queue none of whose records is left goes on at
        its offset should this replica lead."""
        theirs = [(e.epoch, e.start_offset) for e in leader.entries]
        in_force = [entry for entry in theirs if entry[1] <= offset][-1:]
        starts: dict[tuple[str, int], int] | None = None
        if leader.log_start == offset:
            leader = await self._leader_epochs(queue_starts=True)
        if leader.log_start == offset:
            starts = {(q.topic, q.queue_id): q.offset for q in leader.queue_starts}
        elif offset > 0:
            log.warning(
                "broker %s replica %s: the leader %s does not say where its queues are at "
                "offset %d (its log begins at %d): should this replica lead, a queue none of "
                "whose records it holds begins again at 0",
                self.cfg.broker_name,
                self.cfg.replica_id,
                self.leader_id,
                offset,
                leader.log_start,
            )
        end = self.store.commitlog.max_offset
        log.warning(
            "broker %s replica %s: %s, and this replica's log is [%d, %d): starting over at "
            "offset %d from the leader %s (epoch %d), discarding %d bytes",
            self.cfg.broker_name,
            self.cfg.replica_id,
            why,
            self.store.commitlog.min_offset,
            end,
            offset,
            self.leader_id,
            self.epoch,
            end - self.store.commitlog.min_offset,
        )
        await asyncio.to_thread(self.store.start_over, offset, starts)
        await asyncio.to_thread(self.epochs.truncate_from, 0)
        for epoch, start in in_force:
            await asyncio.to_thread(self.epochs.begin, epoch, start)
        self.caught_up = False

    def _open_request(self) -> replication_pb2.ReplicateRequest:
        return replication_pb2.ReplicateRequest(
            broker_name=self.cfg.broker_name,
            replica_id=self.cfg.replica_id,
            epoch=self.epoch,
            offset=self.store.commitlog.max_offset,
            max_bytes=self.cfg.max_fetch_bytes,
            window_bytes=self.cfg.window_bytes,
            idle_ms=self.cfg.wait_ms,
            address=self.cfg.address,
            unclean=self.unclean,
            session=self.session,
        )

    async def _copy(self) -> None:
        """One ``Replicate`` stream: apply each answer and acknowledge it, until the stream
        ends (raises why) or :meth:`stop` cancels it. The leader answers at least every
        ``wait_ms``: silence for ``lost_after_s`` ends the stream."""
        if self._stopping.is_set():
            return
        stream = self._stub.Replicate()
        self._call = stream
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(loop.time() + self.cfg.lost_after_s) as silence:
                await stream.write(self._open_request())
                while True:
                    got = await stream.read()
                    if got is grpc.aio.EOF:
                        raise UnavailableError(what=self._what, detail="ended the stream")
                    silence.reschedule(loop.time() + self.cfg.lost_after_s)
                    self._last_contact = time.monotonic()
                    await self._apply(cast(replication_pb2.FetchResponse, got))
                    ack = replication_pb2.ReplicateRequest(offset=self.store.commitlog.max_offset)
                    # a stream that ended refuses the write: the next read says how it ended
                    with contextlib.suppress(grpc.aio.UsageError, asyncio.InvalidStateError):
                        await stream.write(ack)
        except TimeoutError:
            raise UnavailableError(
                what=self._what, detail=f"sent nothing for {self.cfg.lost_after_s}s"
            ) from None
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, self._what) from None
        finally:
            self._call = None
            stream.cancel()

    async def _apply(self, response: replication_pb2.FetchResponse) -> None:
        """Append what the leader pushed (nothing, in an empty answer)."""
        self.high_watermark = response.high_watermark
        self.leader_end = response.log_end
        offset = self.store.commitlog.max_offset
        if response.data:
            if response.offset != offset:
                raise InternalError(
                    detail=f"the leader pushed bytes from offset {response.offset} where this "
                    f"replica's log ends at {offset}"
                )
            last = self.epochs.last
            if last is None or response.data_epoch > last[0]:
                await asyncio.to_thread(self.epochs.begin, response.data_epoch, offset)
            if not self._sync:  # a memory copy (see MAX_ANSWER_BYTES)
                self.store.append_replica(offset, response.data)
            else:
                await asyncio.to_thread(self.store.append_replica, offset, response.data)
            if self.after_append is not None and (self.behind is None or self.behind()):
                await asyncio.to_thread(self.after_append)
        end = self.store.commitlog.max_offset
        self.caught_up = end >= response.log_end
        if self.unclean and end >= response.high_watermark and self.caught_up:
            log.info(
                "broker %s replica %s caught up after its crash: it may lead again",
                self.cfg.broker_name,
                self.cfg.replica_id,
            )
            self.unclean = False
