"""``apogee.v1.Consumer`` and ``apogee.v1.ConsumerAdmin``: pulls, push delivery
(:mod:`apogee_broker.servicers.push`), sessions, offsets, locks and group administration,
turned into calls on the core (:mod:`apogee_broker.core`).

Session is a bidirectional stream: a reader task feeds the stream's heartbeats to the core's
:class:`~apogee_broker.core.clients.sessions.Session` while the handler sends the session's events.
The stream ends when the session does: the client closed its side or went away (the handler is
cancelled), a bad heartbeat (the stream ends with that error's status, INVALID_ARGUMENT naming the
field), the member expired, or the broker is stopping (UNAVAILABLE). Whatever ends it, the reader
task is cancelled and awaited and the member leaves its group at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc.aio

from apogee.common.errors import (
    ApogeeError,
    DeadlineExceededError,
    InvalidArgumentError,
    UnsupportedError,
)
from apogee.rpc.errors import OK, abort, rpc_errors, to_status
from apogee.rpc.mux import MuxServer
from apogee.store import GetStatus
from apogee.v1 import common_pb2, consumer_pb2, consumer_pb2_grpc
from apogee_broker.core.checks import validate_group
from apogee_broker.core.clients.groups import (
    ConsumeMode,
    ConsumerGroups,
    Heartbeat,
    Member,
    Subscription,
)
from apogee_broker.core.clients.sessions import MembersChanged, SessionEvent, SessionHub
from apogee_broker.core.clients.sessions import Session as ConsumerSession
from apogee_broker.core.consume.group_admin import GroupAdmin
from apogee_broker.core.consume.locks import QueueLocks
from apogee_broker.core.consume.offsets import ConsumerOffsets, ResetTo
from apogee_broker.core.consume.pulling import Pull, PullService
from apogee_broker.core.consume.push import DeliveryHub
from apogee_broker.core.consume.queues import queue_offsets
from apogee_broker.core.consume.send_back import BackItem, SendBackService
from apogee_broker.servicers.broker import peer_host
from apogee_broker.servicers.push import serve_delivery

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]
pb = consumer_pb2

_PULL_STATUS = {
    GetStatus.FOUND: pb.PULL_FOUND,
    GetStatus.NO_NEW_MESSAGE: pb.PULL_NO_NEW_MESSAGE,
    GetStatus.NO_MATCHED_MESSAGE: pb.PULL_NO_MATCHED_MESSAGE,
    GetStatus.OFFSET_TOO_SMALL: pb.PULL_OFFSET_TOO_SMALL,
    GetStatus.OFFSET_OVERFLOW: pb.PULL_OFFSET_OVERFLOW,
}
_MODE_FROM_PB = {pb.CLUSTERING: ConsumeMode.CLUSTERING, pb.BROADCASTING: ConsumeMode.BROADCASTING}
_MODE_TO_PB = {v: k for k, v in _MODE_FROM_PB.items()}
#: How long a Session handler waits for its reader task to finish once the stream ends.
_READER_STOP_S = 2.0


def _pull_answer(
    request_id: int, response: pb.PullResponse | None, status: common_pb2.Status | None
) -> pb.PullStreamResponse:
    return pb.PullStreamResponse(id=request_id, response=response, status=status)


class ConsumerServicer(consumer_pb2_grpc.ConsumerServicer):
    def __init__(
        self,
        pulling: PullService,
        sessions: SessionHub,
        groups: ConsumerGroups,
        offsets: ConsumerOffsets,
        locks: QueueLocks,
        broker_name: str,
        send_back: SendBackService | None = None,
        streams: MuxServer | None = None,
        delivery: DeliveryHub | None = None,
    ) -> None:
        self.streams = streams if streams is not None else MuxServer(f"broker {broker_name}")
        self.delivery = delivery
        self.send_back = send_back
        self.pulling = pulling
        self.sessions = sessions
        self.groups = groups
        self.offsets = offsets
        self.locks = locks
        self.broker_name = broker_name

    async def PullStream(  # type: ignore[override]  # answers with context.write
        self, request_iterator: AsyncIterator[pb.PullStreamRequest], context: Context
    ) -> None:
        await self.streams.serve(request_iterator, context, self._pull, _pull_answer)

    async def Deliver(  # type: ignore[override]  # answers with context.write
        self, request_iterator: AsyncIterator[pb.DeliverRequest], context: Context
    ) -> None:
        if self.delivery is None:
            await abort(context, UnsupportedError(what="Deliver", detail="is not served here"))
        await serve_delivery(self.delivery, request_iterator, context)

    async def _pull(self, r: pb.PullRequest, time_remaining: float | None) -> pb.PullResponse:
        result = await self.pulling.pull(
            Pull(
                r.group,
                r.client_id,
                r.topic,
                r.queue_id,
                r.offset,
                r.max_messages,
                r.max_bytes,
                r.tag_expression,
                r.hold_ms,
                r.commit_offset if r.HasField("commit_offset") else None,
                r.sql_expression,
            ),
            time_remaining,
        )
        return pb.PullResponse(
            status=_PULL_STATUS[result.status],
            records=result.records,
            count=result.count,
            next_offset=result.next_offset,
            min_offset=result.min_offset,
            max_offset=result.max_offset,
            broker_name=self.broker_name,
        )

    async def Session(
        self, request_iterator: AsyncIterator[pb.SessionRequest], context: Context
    ) -> AsyncIterator[pb.SessionEvent]:
        try:
            session = self.sessions.open(peer_host(context.peer()))
        except ApogeeError as err:
            await abort(context, err)
        reader = asyncio.create_task(
            self._read_heartbeats(request_iterator, session), name="apogee-broker-session-reader"
        )
        try:
            async for event in session.events():
                yield _event_to_pb(event)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(reader, _READER_STOP_S)
            self.sessions.close(session)
        if session.error is not None:
            await abort(context, session.error)

    async def _read_heartbeats(
        self, requests: AsyncIterator[pb.SessionRequest], session: ConsumerSession
    ) -> None:
        """Feed the stream's heartbeats to ``session``; end it when the client is done or a
        heartbeat is bad."""
        error: ApogeeError | None = None
        try:
            timeout = self.sessions.first_heartbeat_timeout_s
            it = aiter(requests)
            try:
                first = await asyncio.wait_for(anext(it), timeout)
            except TimeoutError:
                raise DeadlineExceededError(
                    what="the first heartbeat of this session", timeout_s=timeout
                ) from None
            self.sessions.heartbeat(session, _heartbeat(first))
            async for request in it:
                self.sessions.heartbeat(session, _heartbeat(request))
        except StopAsyncIteration:
            pass  # the client closed its side before any heartbeat
        except ApogeeError as err:
            error = err
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the stream broke under us: the session ends with it
            log.debug("%r: reading requests failed: %s", session, exc)
        session.end(error)

    @rpc_errors
    async def GetMembers(
        self, request: pb.GetMembersRequest, context: Context
    ) -> pb.GetMembersResponse:
        validate_group(request.group)
        return pb.GetMembersResponse(
            members=[member_to_pb(m) for m in self.groups.members(request.group)]
        )

    @rpc_errors
    async def CommitOffsets(
        self, request: pb.CommitOffsetsRequest, context: Context
    ) -> pb.CommitOffsetsResponse:
        self.offsets.commit_many(
            request.group, [(o.topic, o.queue_id, o.offset) for o in request.offsets]
        )
        return pb.CommitOffsetsResponse()

    @rpc_errors
    async def QueryOffsets(
        self, request: pb.QueryOffsetsRequest, context: Context
    ) -> pb.QueryOffsetsResponse:
        queues = self.offsets.query(request.group, request.topic, list(request.queue_ids))
        return pb.QueryOffsetsResponse(
            topic=request.topic,
            queues=[
                pb.QueueOffsets(
                    queue_id=q.queue_id,
                    committed=q.committed,
                    min_offset=q.min_offset,
                    max_offset=q.max_offset,
                )
                for q in queues
            ],
        )

    @rpc_errors
    async def GetQueueOffsets(
        self, request: pb.GetQueueOffsetsRequest, context: Context
    ) -> pb.GetQueueOffsetsResponse:
        found = await queue_offsets(
            self.pulling.store,
            self.pulling.topics,
            request.topic,
            request.queue_id,
            request.timestamp_ms if request.HasField("timestamp_ms") else None,
        )
        return pb.GetQueueOffsetsResponse(
            min_offset=found.min_offset,
            max_offset=found.max_offset,
            timestamp_offset=-1 if found.timestamp_offset is None else found.timestamp_offset,
            broker_name=self.broker_name,
        )

    @rpc_errors
    async def LockQueues(
        self, request: pb.LockQueuesRequest, context: Context
    ) -> pb.LockQueuesResponse:
        granted = self.locks.lock(
            request.group, request.client_id, [(q.topic, q.queue_id) for q in request.queues]
        )
        return pb.LockQueuesResponse(locked=[pb.QueueRef(topic=t, queue_id=q) for t, q in granted])

    @rpc_errors
    async def UnlockQueues(
        self, request: pb.UnlockQueuesRequest, context: Context
    ) -> pb.UnlockQueuesResponse:
        self.locks.unlock(
            request.group, request.client_id, [(q.topic, q.queue_id) for q in request.queues]
        )
        return pb.UnlockQueuesResponse()

    @rpc_errors
    async def SendBack(self, request: pb.SendBackRequest, context: Context) -> pb.SendBackResponse:
        if self.send_back is None:
            raise UnsupportedError(what="SendBack", detail="is not served by this broker")
        outcomes = await self.send_back.send_back(
            request.group,
            [
                BackItem(
                    i.topic,
                    i.queue_id,
                    i.queue_offset,
                    i.phys_offset,
                    i.unique_id,
                    i.reason,
                    i.to_dlq,
                    i.attempts,
                    i.traceparent,
                )
                for i in request.items
            ],
            request.max_reconsume_times,
            request.first_delay_level,
        )
        resp = pb.SendBackResponse()
        for o in outcomes:
            resp.results.add(
                status=OK if o.error is None else to_status(o.error),
                topic=o.topic,
                reconsume_times=o.reconsume_times,
                dead_lettered=o.dead_lettered,
                deliver_at_ms=o.deliver_at_ms,
            )
        return resp


class ConsumerAdminServicer(consumer_pb2_grpc.ConsumerAdminServicer):
    def __init__(self, admin: GroupAdmin, broker_name: str) -> None:
        self.admin = admin
        self.broker_name = broker_name

    @rpc_errors
    async def ListGroups(
        self, request: pb.ListGroupsRequest, context: Context
    ) -> pb.ListGroupsResponse:
        return pb.ListGroupsResponse(
            groups=[
                pb.GroupSummary(
                    group=g.group,
                    members=g.members,
                    mode=_MODE_TO_PB[g.mode] if g.mode else pb.CONSUME_MODE_UNSPECIFIED,
                    topics=g.topics,
                )
                for g in self.admin.list_groups()
            ]
        )

    @rpc_errors
    async def DescribeGroup(
        self, request: pb.DescribeGroupRequest, context: Context
    ) -> pb.DescribeGroupResponse:
        d = await self.admin.describe(request.group)
        return pb.DescribeGroupResponse(
            group=d.group,
            broker_name=self.broker_name,
            members=[member_to_pb(m) for m in d.members],
            queues=[
                pb.QueueLag(
                    topic=q.topic,
                    queue_id=q.queue_id,
                    broker_offset=q.broker_offset,
                    consumer_offset=q.consumer_offset,
                    lag_messages=q.lag_messages,
                    lag_ms=q.lag_ms,
                    locked_by=q.locked_by,
                    in_flight=q.in_flight,
                    invisible=q.invisible,
                )
                for q in d.queues
            ],
            warnings=d.warnings,
            consumption=d.consumption,
            clients=[
                pb.OfficialClient(
                    client_id=c.client_id,
                    language=c.language,
                    version=c.version,
                    client_type=c.client_type,
                    host=c.host,
                )
                for c in d.clients
            ],
        )

    @rpc_errors
    async def ResetOffsets(
        self, request: pb.ResetOffsetsRequest, context: Context
    ) -> pb.ResetOffsetsResponse:
        which = request.WhichOneof("to")
        if which is None:
            raise InvalidArgumentError(
                field="to", rule="choose one of earliest, latest or timestamp_ms"
            )
        if which in ("earliest", "latest") and not getattr(request, which):
            raise InvalidArgumentError(field=which, rule="must be true when chosen")
        to = {"earliest": ResetTo.EARLIEST, "latest": ResetTo.LATEST}.get(which, ResetTo.TIMESTAMP)
        moved = await self.admin.reset(request.group, request.topic, to, request.timestamp_ms)
        return pb.ResetOffsetsResponse(
            offsets=[
                pb.QueueOffset(topic=request.topic, queue_id=q, offset=off) for q, off in moved
            ]
        )


def _heartbeat(request: pb.SessionRequest) -> Heartbeat:
    if request.WhichOneof("kind") != "heartbeat":
        raise InvalidArgumentError(
            field="kind", rule="each request of a session must be a heartbeat, got none"
        )
    hb = request.heartbeat
    return Heartbeat(
        hb.client_id,
        hb.group,
        _MODE_FROM_PB.get(hb.mode),
        tuple(Subscription(s.topic, s.tag_expression, s.sql_expression) for s in hb.subscriptions),
        hb.heartbeat_interval_ms,
    )


def _event_to_pb(event: SessionEvent) -> pb.SessionEvent:
    if isinstance(event, MembersChanged):
        return pb.SessionEvent(
            members_changed=pb.MembersChanged(group=event.group, client_ids=event.client_ids)
        )
    return pb.SessionEvent(
        offsets_reset=pb.OffsetsReset(
            group=event.group,
            topic=event.topic,
            offsets=[
                pb.QueueOffset(topic=event.topic, queue_id=q, offset=off)
                for q, off in event.offsets
            ],
        )
    )


def member_to_pb(m: Member) -> pb.GroupMember:
    return pb.GroupMember(
        client_id=m.client_id,
        host=m.host,
        mode=_MODE_TO_PB[m.mode],
        subscriptions=[
            pb.Subscription(
                topic=s.topic, tag_expression=s.tag_expression, sql_expression=s.sql_expression
            )
            for s in m.subscriptions
        ],
        last_heartbeat_ms=m.last_heartbeat_ms,
    )
