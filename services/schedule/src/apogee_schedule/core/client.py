"""The seam between the scheduler and gRPC: one client per broker.

:class:`BrokerScheduleClient` wraps a broker's ``apogee.v1.Schedule`` service and speaks
:mod:`apogee_schedule.core.model` (the brokers are found with
:class:`apogee.service.directory.NameServerDirectory`). Its channel, deadlines and errors are
:class:`apogee.service.broker_client.BrokerClient`'s: failed calls raise
:class:`~apogee.common.errors.ApogeeError`; nothing else of gRPC leaks out.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

from apogee.common.errors import UnavailableError
from apogee.rpc.errors import call
from apogee.rpc.security import PLAIN, ClientSecurity
from apogee.service.broker_client import BrokerClient
from apogee.v1 import schedule_pb2, schedule_pb2_grpc
from apogee_schedule.core.layout import Layout
from apogee_schedule.core.model import (
    BrokerScheduleState,
    Outcome,
    ResolveAction,
    ResolveResult,
    ScanQueue,
    ScanQueueResult,
    ScanResult,
    ScheduleEntry,
    TraceInfo,
)
from apogee_schedule.core.progress import QueueState

log = logging.getLogger(__name__)

_ACTIONS = {ResolveAction.DELIVER: schedule_pb2.DELIVER, ResolveAction.PARK: schedule_pb2.PARK}
_OUTCOMES = {
    schedule_pb2.RESOLVED: Outcome.RESOLVED,
    schedule_pb2.DROPPED: Outcome.DROPPED,
    schedule_pb2.FAILED: Outcome.FAILED,
}


class ScheduleClient(Protocol):
    """What the scheduler needs of one broker."""

    address: str

    async def get_state(self) -> BrokerScheduleState: ...

    async def scan(
        self, queues: Sequence[ScanQueue], max_entries: int, hold_ms: int
    ) -> ScanResult: ...

    async def resolve(
        self, items: Sequence[tuple[ScheduleEntry, ResolveAction]], trace_context: bool = False
    ) -> list[ResolveResult]:
        """``trace_context``: each result carries its message's trace context (if any)."""
        ...

    async def commit(self, offsets: Mapping[int, int]) -> None: ...

    async def close(self) -> None: ...


class BrokerScheduleClient(BrokerClient):
    """The Schedule service of the broker at ``address``, each call with ``timeout_s`` (over
    TLS and signed as ``security`` says)."""

    def __init__(self, address: str, timeout_s: float, security: ClientSecurity = PLAIN) -> None:
        super().__init__(address, timeout_s, security)
        self._stub = schedule_pb2_grpc.ScheduleStub(self.channel)

    async def get_state(self) -> BrokerScheduleState:
        resp = await call(
            self.what,
            self._stub.GetScheduleState(
                schedule_pb2.GetScheduleStateRequest(), timeout=self.timeout_s
            ),
        )
        layout = Layout(
            delay_ms=tuple(resp.delay_ms),
            first_slot_queue=resp.first_slot_queue,
            slots=resp.slots,
            slot_ms=resp.slot_ms,
        )
        queues = tuple(
            QueueState(q.queue_id, q.min_offset, q.max_offset, q.progress) for q in resp.queues
        )
        return BrokerScheduleState(
            resp.broker_name, layout, queues, resp.progress_updated_ms, resp.now_ms
        )

    async def scan(self, queues: Sequence[ScanQueue], max_entries: int, hold_ms: int) -> ScanResult:
        request = schedule_pb2.ScanRequest(
            queues=[
                schedule_pb2.ScanQueue(
                    queue_id=q.queue_id, offset=q.offset, due_before_ms=q.due_before_ms
                )
                for q in queues
            ],
            max_entries=max_entries,
            hold_ms=hold_ms,
        )
        resp = await call(
            self.what, self._stub.Scan(request, timeout=self.timeout_s + hold_ms / 1000)
        )
        return ScanResult(
            entries=[
                ScheduleEntry(e.queue_id, e.queue_offset, e.phys_offset, e.size, e.deliver_at_ms)
                for e in resp.entries
            ],
            queues=[ScanQueueResult(q.queue_id, q.next_offset, q.skipped) for q in resp.queues],
            now_ms=resp.now_ms,
        )

    async def resolve(
        self, items: Sequence[tuple[ScheduleEntry, ResolveAction]], trace_context: bool = False
    ) -> list[ResolveResult]:
        request = schedule_pb2.ResolveRequest(
            trace_context=trace_context,
            items=[
                schedule_pb2.ResolveItem(
                    entry=schedule_pb2.ScheduleEntry(
                        queue_id=e.queue_id,
                        queue_offset=e.queue_offset,
                        phys_offset=e.phys_offset,
                        size=e.size,
                        deliver_at_ms=e.deliver_at_ms,
                    ),
                    action=_ACTIONS[action],
                )
                for e, action in items
            ],
        )
        resp = await call(self.what, self._stub.Resolve(request, timeout=self.timeout_s))
        if len(resp.results) != len(items):
            raise UnavailableError(
                what=self.what,
                detail=f"Resolve answered {len(resp.results)} results for {len(items)} items",
            )
        return [
            ResolveResult(
                _OUTCOMES.get(r.outcome, Outcome.FAILED),
                r.reason,
                r.topic,
                TraceInfo(
                    r.traceparent, r.tracestate, r.store_timestamp_ms, r.unique_id, r.real_topic
                )
                if r.traceparent
                else None,
            )
            for r in resp.results
        ]

    async def commit(self, offsets: Mapping[int, int]) -> None:
        await call(
            self.what,
            self._stub.CommitProgress(
                schedule_pb2.CommitProgressRequest(offsets=dict(offsets)), timeout=self.timeout_s
            ),
        )
