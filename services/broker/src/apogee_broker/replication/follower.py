"""The follower's side of replication: agree with the leader on a common point, then copy.

1. **Reconcile.** Ask the leader for its epoch checkpoint and find the last offset both logs
   are known to hold alike (:func:`~apogee.store.epochs.consistent_point`, as RocketMQ's
   consistent point and Kafka's KIP-279). Whatever this replica holds past it was never
   acknowledged by the group: it is cut (crash-safely, :meth:`MessageStore.truncate`), and the
   epoch checkpoint with it.
2. **Copy.** Fetch from the log end, append the bytes unchanged at the same offsets (the store
   checks every record's CRC and builds its own ConsumeQueues and index), record in the epoch
   checkpoint where each new epoch starts. Each fetch's offset tells the leader what this
   replica has.

The follower ends when the leader says its epoch moved on (``STALE_EPOCH`` or ``NOT_LEADER``),
when the leader cannot be reached for ``lost_after_s``, or when told to stop; the node then
looks at the group's record again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from apogee.common.errors import ApogeeError, StaleEpochError
from apogee.rpc.errors import call
from apogee.rpc.security import ClientSecurity
from apogee.rpc.server import CLIENT_OPTIONS
from apogee.store import FlushMode, MessageStore
from apogee.store.epochs import EpochFile, consistent_point
from apogee.v1 import replication_pb2, replication_pb2_grpc

log = logging.getLogger(__name__)

#: Copies up to this size are appended on the event loop (async flush: a memory copy).
INLINE_BYTES = 256 << 10


@dataclass(frozen=True, slots=True)
class FollowerConfig:
    broker_name: str
    replica_id: str
    address: str
    max_fetch_bytes: int = 4 << 20
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
        self._channel = security.channel(leader_address, CLIENT_OPTIONS)
        self._stub = replication_pb2_grpc.ReplicationStub(self._channel)
        self._stopping = asyncio.Event()
        #: run on a worker thread after a copy when ``behind()`` says so (the node brings the
        #: state files up to date)
        self.after_append: Callable[[], object] | None = None
        self.behind: Callable[[], bool] | None = None
        self._sync = store.cfg.flush_mode is FlushMode.SYNC

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> str:
        """Reconcile, then copy until the term ends; returns why it ended."""
        try:
            return await self._run()
        finally:
            await self._channel.close()

    async def _run(self) -> str:
        last_contact = time.monotonic()
        reconciled = False
        while not self._stopping.is_set():
            try:
                if not reconciled:
                    await self._reconcile()
                    reconciled = True
                await self._fetch_once()
                last_contact = time.monotonic()
            except StaleEpochError as exc:
                return f"the leader answered: {exc}"
            except ApogeeError as exc:
                # NOT_LEADER from the replica the record names: it is starting its term (or
                # ending it: then the record moves on and the node stops this follower)
                if not exc.retriable:
                    log.error("replication from %s failed: %s", self.leader_address, exc)
                    return f"replication failed: {exc}"
                if time.monotonic() - last_contact > self.cfg.lost_after_s:
                    return f"the leader {self.leader_address} is unreachable: {exc}"
                with contextlib.suppress(TimeoutError):  # back off a little, then try again
                    await asyncio.wait_for(self._stopping.wait(), 0.1)
        return "stopped"

    def _request(self, leaving: bool = False) -> replication_pb2.FetchRequest:
        """A fetch from where this replica's log ends (its acknowledgement of what is below)."""
        return replication_pb2.FetchRequest(
            broker_name=self.cfg.broker_name,
            replica_id=self.cfg.replica_id,
            epoch=self.epoch,
            offset=self.store.commitlog.max_offset,
            max_bytes=0 if leaving else self.cfg.max_fetch_bytes,
            wait_ms=0 if leaving else self.cfg.wait_ms,
            address=self.cfg.address,
            unclean=self.unclean,
            leaving=leaving,
        )

    async def leave(self) -> None:
        """Tell the leader this replica stops (best effort, within a second): it leaves the
        in-sync set now instead of after ``replica_lag_max_s`` of silence."""
        try:
            await call(
                f"replication leader {self.leader_address}",
                self._stub.Fetch(self._request(leaving=True), timeout=1.0),
            )
        except ApogeeError as exc:
            log.info("the leader was not told that this replica stops: %s", exc)

    async def _reconcile(self) -> None:
        response: replication_pb2.EpochsResponse = await call(
            f"replication leader {self.leader_address}",
            self._stub.Epochs(
                replication_pb2.EpochsRequest(
                    broker_name=self.cfg.broker_name,
                    replica_id=self.cfg.replica_id,
                    epoch=self.epoch,
                ),
                timeout=5.0,
            ),
        )
        theirs = [(e.epoch, e.start_offset) for e in response.entries]
        mine = [(e.epoch, e.start_offset) for e in self.epochs.entries]
        end = self.store.commitlog.max_offset
        point = consistent_point(theirs, response.log_end, mine, end)
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

    async def _fetch_once(self) -> None:
        offset = self.store.commitlog.max_offset
        response: replication_pb2.FetchResponse = await call(
            f"replication leader {self.leader_address}",
            self._stub.Fetch(self._request(), timeout=self.cfg.wait_ms / 1000 + 5.0),
        )
        self.high_watermark = response.high_watermark
        self.leader_end = response.log_end
        if response.data:
            if response.offset != offset:
                return  # an answer to an older question: ask again
            last = self.epochs.last
            if last is None or response.data_epoch > last[0]:
                await asyncio.to_thread(self.epochs.begin, response.data_epoch, offset)
            if len(response.data) <= INLINE_BYTES and not self._sync:
                # a small copy with async flush is a memory copy: no hand-off to a thread
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
