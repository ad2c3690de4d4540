"""The Replication gRPC service and, for a replica that does not lead, the refusal of every
other call with ``NOT_LEADER`` (naming the leader, so a client knows to look again)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, Final, Protocol

import grpc
import grpc.aio

from apogee.common.errors import (
    ApogeeError,
    InternalError,
    InvalidArgumentError,
    NotLeaderError,
)
from apogee.rpc.errors import abort, first_request, rpc_errors
from apogee.service.replica_group import GroupRecord
from apogee.v1 import replication_pb2 as pb
from apogee.v1 import replication_pb2_grpc
from apogee_broker.replication.leader import Push, PushLimits, ReplicationLeader

log = logging.getLogger(__name__)

#: The first request of a Replicate stream must come within this long.
FIRST_REQUEST_TIMEOUT_S: Final = 10.0


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

    async def Replicate(  # type: ignore[override]  # answers with context.write
        self, request_iterator: AsyncIterator[pb.ReplicateRequest], context: Context
    ) -> None:
        """A follower's copying stream (:class:`~.leader.Push`): one task takes its
        acknowledgements, this one pushes."""
        it = aiter(request_iterator)
        first = await first_request(
            it, context, "the first request of this Replicate stream", FIRST_REQUEST_TIMEOUT_S
        )
        if first is None:
            return
        try:
            leader = self.node.leading(first.broker_name)
            push = leader.open_push(
                first.replica_id,
                first.epoch,
                first.offset,
                first.address,
                first.session,
                PushLimits(first.max_bytes, first.window_bytes, first.idle_ms),
            )
        except ApogeeError as err:
            await abort(context, err)
        failed: list[ApogeeError] = []
        reader = asyncio.create_task(
            _acknowledgements(push, first, it, failed), name="apogee-replicate-reader"
        )
        try:
            while (item := await push.next()) is not None:
                data_epoch, offset, data = item
                answer = pb.FetchResponse(
                    data_epoch=data_epoch,
                    offset=offset,
                    data=data,
                    log_end=leader.written_end,
                    high_watermark=leader.hw,
                )
                try:
                    await context.write(answer)
                except Exception as exc:  # the follower went away: nobody to tell
                    log.debug("the Replicate stream of %s broke: %s", first.replica_id, exc)
                    return
        except ApogeeError as err:
            failed.append(err)
        except Exception as exc:
            log.exception("the Replicate stream of replica %s failed", first.replica_id)
            failed.append(InternalError(detail=f"{type(exc).__name__}: {exc}"))
        finally:
            leader.close_push(push)
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        if failed:
            await abort(context, failed[0])

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


async def _acknowledgements(
    push: Push,
    first: pb.ReplicateRequest,
    it: AsyncIterator[pb.ReplicateRequest],
    failed: list[ApogeeError],
) -> None:
    """Take a stream's acknowledgements until the follower closes its side, the stream breaks
    or one is wrong (its error goes to ``failed``); then end the stream."""
    try:
        async for request in it:
            if request.epoch and request.epoch != first.epoch:
                raise InvalidArgumentError(
                    field="epoch", rule=f"must stay {first.epoch} on one stream"
                )
            push.ack(request.offset)
    except ApogeeError as err:
        failed.append(err)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the stream broke under us: it ends
        log.debug("the Replicate stream of %s: reading failed: %s", first.replica_id, exc)
    push.close()


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
