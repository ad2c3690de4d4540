"""The Replication gRPC service and, for a replica that does not lead, the refusal of every
other call with ``NOT_LEADER`` (naming the leader, so a client knows to look again)."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import grpc
import grpc.aio

from apogee.common.errors import NotLeaderError
from apogee.rpc.errors import abort, rpc_errors
from apogee.service.replica_group import GroupRecord
from apogee.v1 import replication_pb2 as pb
from apogee.v1 import replication_pb2_grpc
from apogee_broker.replication.leader import ReplicationLeader


class Node(Protocol):
    """What the service asks of its replica (:class:`~.node.ReplicaNode`)."""

    def leading(self, broker_name: str) -> ReplicationLeader: ...

    def not_leader(self) -> NotLeaderError: ...

    def describe(self) -> pb.DescribeReplicaResponse: ...

    async def hand_off(self, target: str) -> GroupRecord: ...


Context = grpc.aio.ServicerContext[Any, Any]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Replication"].full_name
#: what a replica that does not lead still answers itself (health, Replication)
_OWN_PREFIXES = (f"/{SERVICE_NAME}/", "/grpc.health.v1.Health/")


class ReplicationServicer(replication_pb2_grpc.ReplicationServicer):
    def __init__(self, node: Node) -> None:
        self.node = node

    @rpc_errors
    async def Fetch(self, request: pb.FetchRequest, context: Context) -> pb.FetchResponse:
        leader = self.node.leading(request.broker_name)
        if request.leaving:
            await leader.leaving(request.replica_id, request.epoch, request.session)
            return pb.FetchResponse(log_end=leader.written_end, high_watermark=leader.hw)
        data_epoch, offset, data = await leader.fetch(
            request.replica_id,
            request.epoch,
            request.offset,
            request.max_bytes,
            min(request.wait_ms, 5000),
            request.address,
            request.session,
        )
        return pb.FetchResponse(
            data_epoch=data_epoch,
            offset=offset,
            data=data,
            log_end=leader.written_end,
            high_watermark=leader.hw,
        )

    @rpc_errors
    async def Epochs(self, request: pb.EpochsRequest, context: Context) -> pb.EpochsResponse:
        leader = self.node.leading(request.broker_name)
        entries, end = leader.epoch_entries(request.epoch, request.replica_id)
        # where the log begins, and when asked each queue's next offset there: what a follower
        # whose log ends before it starts over with (one entry per queue, and retention may
        # hold the store's lock a moment: only when asked, and off the loop)
        if request.queue_starts:
            start, starts = await asyncio.to_thread(leader.store.log_start)
        else:
            start, starts = leader.store.commitlog.min_offset, {}
        return pb.EpochsResponse(
            entries=[pb.EpochEntry(epoch=e, start_offset=s) for e, s in entries],
            log_end=end,
            log_start=start,
            queue_starts=[
                pb.QueueStart(topic=t, queue_id=q, offset=o) for (t, q), o in starts.items()
            ],
        )

    @rpc_errors
    async def DescribeReplica(
        self, request: pb.DescribeReplicaRequest, context: Context
    ) -> pb.DescribeReplicaResponse:
        return self.node.describe()

    @rpc_errors
    async def Elect(self, request: pb.ElectRequest, context: Context) -> pb.ElectResponse:
        self.node.leading(request.broker_name)
        record = await self.node.hand_off(request.replica_id)
        return pb.ElectResponse(
            epoch=record.epoch, leader_id=record.leader, leader_address=record.leader_address
        )


class NotLeaderHandler(grpc.GenericRpcHandler):
    """Every call other than health and Replication, answered ``NOT_LEADER`` at once (the
    request is never read, whatever the method's shape)."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = str(handler_call_details.method)
        if method.startswith(_OWN_PREFIXES):
            return None
        node = self.node

        async def refuse(requests: Any, context: Context) -> None:
            await abort(context, node.not_leader())

        return grpc.stream_stream_rpc_method_handler(refuse)


def not_leader(broker: str, replica: str, leader: str, address: str, epoch: int) -> NotLeaderError:
    detail = (
        f"it follows {leader} at {address} (epoch {epoch})"
        if leader
        else "the group has no leader yet"
    )
    return NotLeaderError(broker=broker, replica=replica, detail=detail)
