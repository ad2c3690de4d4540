"""What :class:`~apogee.client.admin.AdminClient` learns of a broker's replica group, and the
controlled switch of its leader.

A broker name may be served by a replica group (docs/replication.md): one leader, registered
with the nameservers, and followers that copy its CommitLog and refuse clients. Each replica
answers ``Replication/DescribeReplica``; the leader's answer lists its followers with their
lag, and :func:`describe_group` asks each of them too, so a :class:`ReplicaGroupStatus` holds
one :class:`ReplicaStatus` per replica, a follower that does not answer included (``reachable``
False, with what the leader knows of it).

The nameservers may still list a leader that has just been replaced: the replica at that
address then names the new leader, and that one is asked instead. A lone broker (not a replica
group) does not serve the Replication service at all (gRPC's ``UNIMPLEMENTED``): it is reported
as a group of one, with ``replicated`` False.

:func:`elect` asks the leader to hand its leadership to an in-sync follower
(``Replication/Elect``); a lone broker cannot, and answers
:class:`~apogee.common.errors.UnsupportedError`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Final, NamedTuple

import grpc
import grpc.aio

from apogee.client._rpc import ChannelPool
from apogee.client.admin_info import BrokerInfo, broker_details
from apogee.common.errors import ApogeeError, InvalidArgumentError, UnsupportedError
from apogee.rpc.errors import from_rpc_error
from apogee.v1 import replication_pb2, replication_pb2_grpc

__all__ = [
    "ELECT_TIMEOUT_S",
    "LEADER",
    "Election",
    "ReplicaGroupStatus",
    "ReplicaStatus",
    "check_replica_id",
    "describe_group",
    "elect",
]

#: The role of the replica that leads (the others are FOLLOWER, or CANDIDATE between roles).
LEADER: Final = "LEADER"
#: The least time an election is given: the chosen follower catches up first.
ELECT_TIMEOUT_S: Final = 15.0


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """One replica of a group, as it says itself and as the leader sees it."""

    #: its identity, kept in its data directory ("" for a lone broker)
    replica_id: str
    address: str
    #: ``LEADER``, ``FOLLOWER`` or ``CANDIDATE`` as it says; "" when it did not answer
    role: str
    #: where its CommitLog ends (for one that did not answer: how far the leader knows it has)
    log_end: int
    #: how far it is behind the leader's log end, in bytes and in seconds (0 for the leader)
    lag_bytes: int
    lag_seconds: float
    #: in the leader's in-sync set (a send with ``acks=all`` waits for it)
    in_sync: bool
    #: whether it may lead (in the in-sync set, and caught up since a crash)
    eligible: bool
    #: why it did not answer; None when it did
    error: ApogeeError | None = None

    @property
    def reachable(self) -> bool:
        return self.error is None


@dataclass(frozen=True, slots=True)
class ReplicaGroupStatus:
    """A broker name's replica group: who leads, at which epoch, and each replica's state."""

    broker_name: str
    cluster: str
    #: False for a lone broker (not a replica group): then ``replicas`` holds it alone
    replicated: bool
    #: the leader's replica id and address ("" when the group has no leader that answers)
    leader_id: str
    leader_address: str
    epoch: int
    #: how many replicas hold a send before it is acknowledged (``all``, ...; "" when lone)
    acks: str
    min_insync_replicas: int
    #: the leader's in-sync set (replica ids)
    in_sync: tuple[str, ...]
    #: the end of what every in-sync replica holds (what a new leader is sure to have)
    high_watermark: int
    #: where the leader's CommitLog ends
    log_end: int
    #: the leader first, then its followers by id
    replicas: tuple[ReplicaStatus, ...]

    @property
    def leader(self) -> ReplicaStatus | None:
        """The replica that leads, if one answered as leader."""
        return next((r for r in self.replicas if r.role == LEADER), None)

    @property
    def in_sync_count(self) -> int:
        """How many of ``replicas`` are in the in-sync set."""
        return sum(r.in_sync for r in self.replicas)


class Election(NamedTuple):
    """The outcome of :func:`elect`: the group's new epoch and who leads it now."""

    epoch: int
    leader_id: str
    leader_address: str


def check_replica_id(replica_id: object) -> str:
    """``replica_id`` if it is a replica id or "" (the most caught-up in-sync follower)."""
    if not isinstance(replica_id, str) or replica_id != replica_id.strip():
        raise InvalidArgumentError(
            field="replica_id",
            rule=f"must be a replica id (text without surrounding spaces) or '', "
            f"got {replica_id!r}",
        )
    return replica_id


def _where(b: BrokerInfo, address: str) -> str:
    return f"broker {b.broker_name} at {address}"


def _stub(pool: ChannelPool, address: str) -> replication_pb2_grpc.ReplicationAsyncStub:
    return replication_pb2_grpc.ReplicationStub(pool.channel(address))


async def _describe(
    pool: ChannelPool, b: BrokerInfo, address: str, timeout: float
) -> replication_pb2.DescribeReplicaResponse | None:
    """What the replica at ``address`` says of itself; None when it does not serve the
    Replication service (a lone broker)."""
    try:
        return await _stub(pool, address).DescribeReplica(
            replication_pb2.DescribeReplicaRequest(), timeout=timeout
        )
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            return None
        raise from_rpc_error(exc, _where(b, address)) from None


async def describe_group(pool: ChannelPool, b: BrokerInfo, timeout: float) -> ReplicaGroupStatus:
    """The replica group of broker ``b`` (as the nameservers list it); see the module
    docstring. Raises when the registered address does not answer."""
    answer = await _describe(pool, b, b.address, timeout)
    if answer is None:
        return await _lone(pool, b, timeout)
    address = b.address
    if answer.role != LEADER and answer.leader_address and answer.leader_address != address:
        try:  # the nameservers still list a replaced leader: ask the one it names
            other = await _describe(pool, b, answer.leader_address, timeout)
        except ApogeeError:
            other = None
        if other is not None and other.role == LEADER:
            answer, address = other, answer.leader_address
    if answer.role != LEADER:
        return _leaderless(b, address, answer)
    in_sync = set(answer.in_sync)
    leader = ReplicaStatus(
        replica_id=answer.replica_id,
        address=address,
        role=LEADER,
        log_end=answer.log_end,
        lag_bytes=0,
        lag_seconds=0.0,
        in_sync=True,
        eligible=answer.eligible,
    )
    followers = sorted(answer.followers, key=lambda f: f.replica_id)
    found = await asyncio.gather(
        *(_follower(pool, b, f, f.replica_id in in_sync, timeout) for f in followers)
    )
    return ReplicaGroupStatus(
        broker_name=answer.broker_name or b.broker_name,
        cluster=b.cluster,
        replicated=True,
        leader_id=answer.replica_id,
        leader_address=address,
        epoch=answer.epoch,
        acks=answer.acks,
        min_insync_replicas=answer.min_insync_replicas,
        in_sync=tuple(answer.in_sync),
        high_watermark=answer.high_watermark,
        log_end=answer.log_end,
        replicas=(leader, *found),
    )


async def _follower(
    pool: ChannelPool,
    b: BrokerInfo,
    f: replication_pb2.FollowerInfo,
    in_sync: bool,
    timeout: float,
) -> ReplicaStatus:
    """A follower the leader lists, as it says itself (or as the leader knows it, with the
    error, when it does not answer)."""
    error: ApogeeError | None = None
    try:
        own = await _describe(pool, b, f.address, timeout)
    except ApogeeError as err:
        own, error = None, err
    if own is None and error is None:
        error = UnsupportedError(
            what=_where(b, f.address), detail="does not serve the Replication service"
        )
    return ReplicaStatus(
        replica_id=f.replica_id,
        address=f.address,
        role=own.role if own is not None else "",
        log_end=own.log_end if own is not None else f.offset,
        lag_bytes=f.lag_bytes,
        lag_seconds=f.lag_seconds,
        in_sync=in_sync,
        eligible=own.eligible if own is not None else False,
        error=error,
    )


def _leaderless(
    b: BrokerInfo, address: str, answer: replication_pb2.DescribeReplicaResponse
) -> ReplicaGroupStatus:
    """A group whose leader does not answer: what the replica at ``address`` knows."""
    return ReplicaGroupStatus(
        broker_name=answer.broker_name or b.broker_name,
        cluster=b.cluster,
        replicated=True,
        leader_id="",
        leader_address="",
        epoch=answer.epoch,
        acks=answer.acks,
        min_insync_replicas=answer.min_insync_replicas,
        in_sync=tuple(answer.in_sync),
        high_watermark=answer.high_watermark,
        log_end=0,
        replicas=(
            ReplicaStatus(
                replica_id=answer.replica_id,
                address=address,
                role=answer.role,
                log_end=answer.log_end,
                lag_bytes=0,
                lag_seconds=0.0,
                in_sync=answer.replica_id in answer.in_sync,
                eligible=answer.eligible,
            ),
        ),
    )


async def _lone(pool: ChannelPool, b: BrokerInfo, timeout: float) -> ReplicaGroupStatus:
    """A lone broker as a group of one: it leads, and everything it stored is committed."""
    details = await broker_details(pool, b, timeout)
    end = details.commitlog_max_offset
    return ReplicaGroupStatus(
        broker_name=b.broker_name,
        cluster=b.cluster,
        replicated=False,
        leader_id="",
        leader_address=b.address,
        epoch=0,
        acks="",
        min_insync_replicas=0,
        in_sync=(),
        high_watermark=end,
        log_end=end,
        replicas=(ReplicaStatus("", b.address, LEADER, end, 0, 0.0, True, True),),
    )


async def elect(pool: ChannelPool, b: BrokerInfo, replica_id: str, timeout: float) -> Election:
    """Ask the leader of ``b``'s group to hand leadership to ``replica_id`` ("": the most
    caught-up in-sync follower). When the nameservers still list a replaced leader, the
    leader it names is asked instead."""
    request = replication_pb2.ElectRequest(broker_name=b.broker_name, replica_id=replica_id)
    wait = max(timeout, ELECT_TIMEOUT_S)
    try:
        resp = await _elect_at(pool, b, b.address, request, wait)
    except ApogeeError as err:
        if err.kind.name != "NOT_LEADER":
            raise
        answer = await _describe(pool, b, b.address, timeout)
        if answer is None or not answer.leader_address or answer.leader_address == b.address:
            raise
        resp = await _elect_at(pool, b, answer.leader_address, request, wait)
    return Election(resp.epoch, resp.leader_id, resp.leader_address)


async def _elect_at(
    pool: ChannelPool,
    b: BrokerInfo,
    address: str,
    request: replication_pb2.ElectRequest,
    timeout: float,
) -> replication_pb2.ElectResponse:
    try:
        return await _stub(pool, address).Elect(request, timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            raise UnsupportedError(
                what=_where(b, address),
                detail="is a lone broker, not a replica group: no other replica can lead",
            ) from None
        raise from_rpc_error(exc, _where(b, address)) from None
