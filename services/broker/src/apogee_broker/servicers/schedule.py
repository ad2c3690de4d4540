"""``apogee.v1.Schedule``: what the schedule service calls on this broker
(:mod:`apogee_broker.core.schedule.service`)."""

from __future__ import annotations

from typing import Any

import grpc.aio

from apogee.common.errors import InvalidArgumentError
from apogee.rpc.errors import rpc_errors
from apogee.v1 import schedule_pb2, schedule_pb2_grpc
from apogee_broker.core.schedule.layout import FIRST_SLOT_QUEUE
from apogee_broker.core.schedule.service import Entry, ScanQueue, ScheduleService

Context = grpc.aio.ServicerContext[Any, Any]
pb = schedule_pb2
_OUTCOMES = {"RESOLVED": pb.RESOLVED, "DROPPED": pb.DROPPED, "FAILED": pb.FAILED}


class ScheduleServicer(schedule_pb2_grpc.ScheduleServicer):
    def __init__(self, service: ScheduleService, broker_name: str) -> None:
        self.service = service
        self.broker_name = broker_name

    @rpc_errors
    async def GetScheduleState(
        self, request: pb.GetScheduleStateRequest, context: Context
    ) -> pb.GetScheduleStateResponse:
        st = self.service.state()
        return pb.GetScheduleStateResponse(
            broker_name=self.broker_name,
            delay_ms=st.layout.delay_ms,
            first_slot_queue=FIRST_SLOT_QUEUE,
            slots=st.layout.slots,
            slot_ms=st.layout.slot_ms,
            queues=[
                pb.ScheduleQueueState(
                    queue_id=q.queue_id,
                    min_offset=q.min_offset,
                    max_offset=q.max_offset,
                    progress=q.progress,
                )
                for q in st.queues
            ],
            progress_updated_ms=st.progress_updated_ms,
            now_ms=st.now_ms,
        )

    @rpc_errors
    async def Scan(self, request: pb.ScanRequest, context: Context) -> pb.ScanResponse:
        got = await self.service.scan(
            [ScanQueue(q.queue_id, q.offset, q.due_before_ms) for q in request.queues],
            request.max_entries,
            request.hold_ms,
            context.time_remaining(),
        )
        resp = pb.ScanResponse(now_ms=got.now_ms)
        add = resp.entries.add
        for e in got.entries:
            add(
                queue_id=e.queue_id,
                queue_offset=e.queue_offset,
                phys_offset=e.phys_offset,
                size=e.size,
                deliver_at_ms=e.deliver_at_ms,
            )
        for q in got.queues:
            resp.queues.add(queue_id=q.queue_id, next_offset=q.next_offset, skipped=q.skipped)
        return resp

    @rpc_errors
    async def Resolve(self, request: pb.ResolveRequest, context: Context) -> pb.ResolveResponse:
        items: list[tuple[Entry, bool]] = []
        for i, item in enumerate(request.items):
            if item.action not in (pb.DELIVER, pb.PARK):
                raise InvalidArgumentError(
                    field=f"items[{i}].action", rule="must be DELIVER or PARK"
                )
            e = item.entry
            items.append(
                (
                    Entry(e.queue_id, e.queue_offset, e.phys_offset, e.size, e.deliver_at_ms),
                    item.action == pb.DELIVER,
                )
            )
        outcomes = await self.service.resolve(items, request.trace_context)
        resp = pb.ResolveResponse()
        for o in outcomes:
            r = resp.results.add(
                outcome=_OUTCOMES[o.outcome],
                reason=o.reason,
                topic=o.topic,
                queue_id=o.queue_id,
                queue_offset=o.queue_offset,
            )
            if o.trace is not None:
                r.traceparent = o.trace.traceparent
                r.tracestate = o.trace.tracestate
                r.store_timestamp_ms = o.trace.store_timestamp_ms
                r.unique_id = o.trace.unique_id
                r.real_topic = o.trace.real_topic
        return resp

    @rpc_errors
    async def CommitProgress(
        self, request: pb.CommitProgressRequest, context: Context
    ) -> pb.CommitProgressResponse:
        await self.service.commit_progress(dict(request.offsets))
        return pb.CommitProgressResponse()

    @rpc_errors
    async def Recall(self, request: pb.RecallRequest, context: Context) -> pb.RecallResponse:
        await self.service.recall(request.topic, request.unique_id, request.deliver_at_ms)
        return pb.RecallResponse(unique_id=request.unique_id)
