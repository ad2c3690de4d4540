"""The seam between the checker and gRPC: one client per broker.

:class:`TransactionCheckClient` is what a check round needs of one broker;
:class:`BrokerTransactionClient` implements it over the broker's ``apogee.v1.TransactionCheck``
service and speaks :mod:`apogee_txn_checker.core.model` (the brokers are found with
:class:`apogee.service.directory.NameServerDirectory`). Its channel, deadlines and errors are
:class:`apogee.service.broker_client.BrokerClient`'s: every call has a deadline, failed calls
raise :class:`~apogee.common.errors.ApogeeError`; nothing else of gRPC leaks out.
"""

from __future__ import annotations

from typing import Protocol

from apogee.common.errors import InternalError
from apogee.common.tracing import TRACEPARENT, TRACESTATE
from apogee.rpc.errors import call
from apogee.rpc.security import PLAIN, ClientSecurity
from apogee.service.broker_client import BrokerClient
from apogee.v1 import broker_pb2, broker_pb2_grpc, transaction_pb2, transaction_pb2_grpc
from apogee_txn_checker.core.model import (
    CheckOutcome,
    CheckResult,
    Decision,
    HalfEntry,
    HalfScan,
    OpEntry,
    OpScan,
    TransactionState,
)

_DECISIONS = {
    transaction_pb2.COMMIT: Decision.COMMIT,
    transaction_pb2.ROLLBACK: Decision.ROLLBACK,
    transaction_pb2.UNKNOWN: Decision.UNKNOWN,
}
_OUTCOMES = {
    transaction_pb2.CHECK_SENT: CheckOutcome.CHECK_SENT,
    transaction_pb2.NO_PRODUCER: CheckOutcome.NO_PRODUCER,
    transaction_pb2.DECIDED: CheckOutcome.DECIDED,
    transaction_pb2.GAVE_UP: CheckOutcome.GAVE_UP,
    transaction_pb2.GONE: CheckOutcome.GONE,
    transaction_pb2.CLOSED: CheckOutcome.CLOSED,
}


class TransactionCheckClient(Protocol):
    """What a check round needs of one broker."""

    address: str

    async def get_state(self) -> TransactionState: ...

    async def scan_half(self, offset: int, max_entries: int) -> HalfScan: ...

    async def scan_ops(self, offset: int, max_entries: int) -> OpScan: ...

    async def check_half(self, half_offset: int, max_check_times: int) -> CheckResult: ...

    async def commit_progress(self, half_progress: int, op_progress: int) -> None: ...

    async def close(self) -> None: ...


class BrokerTransactionClient(BrokerClient):
    """The TransactionCheck service of the broker at ``address``, each call with
    ``timeout_s`` (over TLS and signed as ``security`` says)."""

    def __init__(self, address: str, timeout_s: float, security: ClientSecurity = PLAIN) -> None:
        super().__init__(address, timeout_s, security)
        self._stub = transaction_pb2_grpc.TransactionCheckStub(self.channel)
        self._broker = broker_pb2_grpc.BrokerStub(self.channel)

    async def get_state(self) -> TransactionState:
        resp = await call(
            self.what,
            self._stub.GetTransactionState(
                transaction_pb2.GetTransactionStateRequest(), timeout=self.timeout_s
            ),
        )
        return TransactionState(
            broker_name=resp.broker_name,
            half_min_offset=resp.half_min_offset,
            half_max_offset=resp.half_max_offset,
            op_min_offset=resp.op_min_offset,
            op_max_offset=resp.op_max_offset,
            half_progress=resp.half_progress,
            op_progress=resp.op_progress,
            now_ms=resp.now_ms,
            producers={p.producer_group: tuple(p.client_ids) for p in resp.producers},
        )

    async def scan_half(self, offset: int, max_entries: int) -> HalfScan:
        resp = await call(
            self.what,
            self._stub.ScanHalf(
                transaction_pb2.ScanHalfRequest(offset=offset, max_entries=max_entries),
                timeout=self.timeout_s,
            ),
        )
        return HalfScan(
            entries=[
                HalfEntry(
                    queue_offset=e.queue_offset,
                    unique_id=e.unique_id,
                    producer_group=e.producer_group,
                    topic=e.topic,
                    store_timestamp_ms=e.store_timestamp_ms,
                    check_times=e.check_times,
                    immunity_ms=e.immunity_ms,
                    decided=_DECISIONS.get(e.decided, Decision.NONE),
                    first_stored_ms=e.first_stored_ms,
                )
                for e in resp.entries
            ],
            next_offset=resp.next_offset,
            max_offset=resp.max_offset,
        )

    async def scan_ops(self, offset: int, max_entries: int) -> OpScan:
        resp = await call(
            self.what,
            self._stub.ScanOps(
                transaction_pb2.ScanOpsRequest(offset=offset, max_entries=max_entries),
                timeout=self.timeout_s,
            ),
        )
        return OpScan(
            entries=[
                OpEntry(
                    queue_offset=e.queue_offset,
                    half_offset=e.half_offset,
                    unique_id=e.unique_id,
                    decision=_DECISIONS.get(e.decision, Decision.NONE),
                )
                for e in resp.entries
            ],
            next_offset=resp.next_offset,
            max_offset=resp.max_offset,
        )

    async def check_half(self, half_offset: int, max_check_times: int) -> CheckResult:
        resp = await call(
            self.what,
            self._stub.CheckHalf(
                transaction_pb2.CheckHalfRequest(
                    half_offset=half_offset, max_check_times=max_check_times
                ),
                timeout=self.timeout_s,
            ),
        )
        outcome = _OUTCOMES.get(resp.outcome)
        if outcome is None:
            raise InternalError(
                detail=f"{self.what} answered CheckHalf of half offset {half_offset} with "
                f"outcome {resp.outcome}, which is not one of {sorted(_OUTCOMES)}"
            )
        return CheckResult(
            outcome=outcome,
            new_half_offset=resp.new_half_offset,
            producer_client_id=resp.producer_client_id,
            check_times=resp.check_times,
        )

    async def commit_progress(self, half_progress: int, op_progress: int) -> None:
        await call(
            self.what,
            self._stub.CommitTransactionProgress(
                transaction_pb2.CommitTransactionProgressRequest(
                    half_progress=half_progress, op_progress=op_progress
                ),
                timeout=self.timeout_s,
            ),
        )

    async def trace_context(self, unique_id: str) -> tuple[str, str]:
        """The trace context of the message with ``unique_id`` (a tracing checker's lookup:
        :class:`apogee_txn_checker.core.spans.TraceLookup`)."""
        resp = await call(
            self.what,
            self._broker.GetMessage(
                broker_pb2.GetMessageRequest(unique_id=unique_id), timeout=self.timeout_s
            ),
        )
        props = resp.message.properties
        return props.get(TRACEPARENT, ""), props.get(TRACESTATE, "")
