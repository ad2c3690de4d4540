"""``apogee.v1.Transaction`` and ``apogee.v1.TransactionCheck``: transactional messages, turned
into calls on the core (:mod:`apogee_broker.core.txn`: :mod:`~apogee_broker.core.txn.halves`,
:mod:`~apogee_broker.core.txn.ends`, :mod:`~apogee_broker.core.txn.checks`,
:mod:`~apogee_broker.core.txn.scans`; producers' sessions in
:mod:`apogee_broker.core.clients.producers`).

ProducerSession is a bidirectional stream: a reader task feeds the stream's hello and heartbeats
to the core's :class:`~apogee_broker.core.clients.producers.ProducerSession` while the handler
sends its checks. The stream ends when the session does: the client closed its side or went
away, a bad first message (not a hello) or a later one (a second hello, an empty one) ends it with
INVALID_ARGUMENT naming the field, no hello within ``producer_expiry_s`` with
DEADLINE_EXCEEDED, the producer expired, a newer session of the same client took over, or the
broker is stopping (UNAVAILABLE). Whatever ends it, the reader task is cancelled and awaited and
the producer is forgotten at once.

EndTransaction takes an unspecified ``source`` as PRODUCER; only an OPERATOR may leave
``producer_group`` empty (any group's transaction is then ended).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, Final

import grpc.aio

from apogee.common.errors import ApogeeError, DeadlineExceededError, InvalidArgumentError
from apogee.rpc.errors import abort, rpc_errors, to_status
from apogee.store import Message
from apogee.v1 import common_pb2, transaction_pb2, transaction_pb2_grpc
from apogee_broker.core.clients.producers import CheckEvent, Hello, ProducerRegistry
from apogee_broker.core.clients.producers import ProducerSession as Session
from apogee_broker.core.send.service import Outgoing
from apogee_broker.core.txn.checks import CheckOutcome, HalfChecks
from apogee_broker.core.txn.ends import End, Ended, EndOutcome, EndSource, TransactionEnds
from apogee_broker.core.txn.halves import HalfIntake, HalfSent
from apogee_broker.core.txn.ledger import TransactionLedger
from apogee_broker.core.txn.records import Decision
from apogee_broker.core.txn.scans import TransactionScans
from apogee_broker.metrics import BrokerMetrics
from apogee_broker.servicers.broker import peer_host, stored_to_pb

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]
pb = transaction_pb2

_DECISIONS: Final = {
    pb.COMMIT: Decision.COMMIT,
    pb.ROLLBACK: Decision.ROLLBACK,
    pb.UNKNOWN: Decision.UNKNOWN,
}
_DECISIONS_TO_PB: Final = {Decision.COMMIT: pb.COMMIT, Decision.ROLLBACK: pb.ROLLBACK}
_SOURCES: Final = {
    pb.END_SOURCE_UNSPECIFIED: EndSource.UNSPECIFIED,
    pb.PRODUCER: EndSource.PRODUCER,
    pb.CHECK: EndSource.CHECK,
    pb.OPERATOR: EndSource.OPERATOR,
}
_END_OUTCOMES: Final = {
    EndOutcome.COMMITTED: pb.COMMITTED,
    EndOutcome.ROLLED_BACK: pb.ROLLED_BACK,
    EndOutcome.ALREADY_DONE: pb.ALREADY_DONE,
    EndOutcome.STILL_PENDING: pb.STILL_PENDING,
}
_CHECK_OUTCOMES: Final = {
    CheckOutcome.CHECK_SENT: pb.CHECK_SENT,
    CheckOutcome.NO_PRODUCER: pb.NO_PRODUCER,
    CheckOutcome.DECIDED: pb.DECIDED,
    CheckOutcome.GAVE_UP: pb.GAVE_UP,
    CheckOutcome.GONE: pb.GONE,
    CheckOutcome.CLOSED: pb.CLOSED,
}
#: How long a ProducerSession handler waits for its reader task to finish once the stream ends.
_READER_STOP_S: Final = 2.0


class TransactionServicer(transaction_pb2_grpc.TransactionServicer):
    def __init__(
        self,
        halves: HalfIntake,
        ends: TransactionEnds,
        producers: ProducerRegistry,
        metrics: BrokerMetrics,
        broker_name: str,
    ) -> None:
        self.halves = halves
        self.ends = ends
        self.producers = producers
        self.metrics = metrics
        self.broker_name = broker_name

    @rpc_errors
    async def SendHalf(self, request: pb.SendHalfRequest, context: Context) -> pb.SendHalfResponse:
        host = peer_host(context.peer())
        m = request.message
        sent = await self.halves.send_half(
            request.producer_group, _message(m, host), m.delay_level, m.deliver_at_ms, host
        )
        return self._half_to_pb(sent)

    @rpc_errors
    async def SendHalves(
        self, request: pb.SendHalvesRequest, context: Context
    ) -> pb.SendHalvesResponse:
        host = peer_host(context.peer())
        items = [
            Outgoing(_message(m, host), m.delay_level, m.deliver_at_ms) for m in request.messages
        ]
        outcomes = await self.halves.send_halves(request.producer_group, items, host)
        resp = pb.SendHalvesResponse(broker_name=self.broker_name)
        add = resp.results.add
        for o in outcomes:
            if isinstance(o, ApogeeError):
                add(status=to_status(o))
            else:
                add(half=self._half_to_pb(o))
        return resp

    def _half_to_pb(self, sent: HalfSent) -> pb.SendHalfResponse:
        return pb.SendHalfResponse(
            unique_id=sent.unique_id,
            half_offset=sent.half_offset,
            store_timestamp_ms=sent.store_timestamp,
            broker_name=self.broker_name,
            queue_id=sent.queue_id,
        )

    @rpc_errors
    async def EndTransaction(
        self, request: pb.EndTransactionRequest, context: Context
    ) -> pb.EndTransactionResponse:
        req = _end(request)
        ended = await self.ends.end(req)
        self.metrics.txn_ends.labels(ended.outcome.value, req.source.value).inc()
        return _ended_to_pb(ended)

    @rpc_errors
    async def EndTransactions(
        self, request: pb.EndTransactionsRequest, context: Context
    ) -> pb.EndTransactionsResponse:
        self.ends.check_count(len(request.ends))
        reqs: list[End] = []
        refused: dict[int, ApogeeError] = {}
        for i, r in enumerate(request.ends):
            try:
                reqs.append(_end(r))
            except ApogeeError as bad:
                refused[i] = bad
        outcomes = await self.ends.end_many(reqs) if reqs else []
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        resp = pb.EndTransactionsResponse()
        add = resp.results.add
        got = iter(zip(reqs, outcomes, strict=True))
        for i in range(len(request.ends)):
            why = refused.get(i)
            if why is not None:
                add(status=to_status(why))
                continue
            req, o = next(got)
            if isinstance(o, ApogeeError):
                add(status=to_status(o))
            else:
                counts[o.outcome.value, req.source.value] += 1
                add(end=_ended_to_pb(o))
        ends = self.metrics.txn_ends
        for (outcome, source), n in counts.items():
            ends.labels(outcome, source).inc(n)
        return resp

    async def ProducerSession(
        self, request_iterator: AsyncIterator[pb.ProducerSessionRequest], context: Context
    ) -> AsyncIterator[pb.ProducerSessionEvent]:
        try:
            session = self.producers.open(peer_host(context.peer()))
        except ApogeeError as err:
            await abort(context, err)
        reader = asyncio.create_task(
            self._read(request_iterator, session), name="apogee-broker-producer-reader"
        )
        try:
            async for event in session.events():
                yield pb.ProducerSessionEvent(check=self._check_to_pb(event))
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(reader, _READER_STOP_S)
            self.producers.close(session)
        if session.error is not None:
            await abort(context, session.error)

    async def _read(
        self, requests: AsyncIterator[pb.ProducerSessionRequest], session: Session
    ) -> None:
        """Feed the stream's hello and heartbeats to ``session``; end it when the client is
        done or a message is bad."""
        error: ApogeeError | None = None
        try:
            timeout = self.producers.expiry_s
            it = aiter(requests)
            try:
                first = await asyncio.wait_for(anext(it), timeout)
            except TimeoutError:
                raise DeadlineExceededError(
                    what="the hello of this producer session", timeout_s=timeout
                ) from None
            if first.WhichOneof("kind") != "hello":
                raise InvalidArgumentError(
                    field="hello",
                    rule="the first message of a producer session must be a hello (its "
                    f"producer_group and client_id), got {first.WhichOneof('kind') or 'nothing'}",
                )
            h = first.hello
            self.producers.hello(
                session, Hello(h.producer_group, h.client_id, h.heartbeat_interval_ms)
            )
            async for request in it:
                kind = request.WhichOneof("kind")
                if kind == "heartbeat_ms":
                    self.producers.heartbeat(session)
                elif kind == "hello":
                    raise InvalidArgumentError(
                        field="hello",
                        rule="is sent once, as the first message of a session; later messages "
                        "are heartbeats (heartbeat_ms)",
                    )
                else:
                    raise InvalidArgumentError(
                        field="kind",
                        rule="each later message of a producer session must be a heartbeat "
                        "(heartbeat_ms), got nothing",
                    )
        except StopAsyncIteration:
            pass  # the client closed its side before its hello
        except ApogeeError as err:
            error = err
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the stream broke under us: the session ends with it
            log.debug("%r: reading requests failed: %s", session, exc)
        session.end(error)

    def _check_to_pb(self, event: CheckEvent) -> pb.TransactionCheckRequest:
        return pb.TransactionCheckRequest(
            half=stored_to_pb(event.half, self.broker_name),
            unique_id=event.unique_id,
            half_offset=event.half_offset,
            check_times=event.check_times,
            topic=event.topic,
        )


class TransactionCheckServicer(transaction_pb2_grpc.TransactionCheckServicer):
    def __init__(
        self,
        ledger: TransactionLedger,
        checks: HalfChecks,
        scans: TransactionScans,
        metrics: BrokerMetrics,
    ) -> None:
        self.ledger = ledger
        self.checks = checks
        self.scans = scans
        self.metrics = metrics

    @rpc_errors
    async def GetTransactionState(
        self, request: pb.GetTransactionStateRequest, context: Context
    ) -> pb.GetTransactionStateResponse:
        st = self.scans.state()
        return pb.GetTransactionStateResponse(
            broker_name=st.broker_name,
            half_min_offset=st.half_min_offset,
            half_max_offset=st.half_max_offset,
            op_min_offset=st.op_min_offset,
            op_max_offset=st.op_max_offset,
            half_progress=st.half_progress,
            op_progress=st.op_progress,
            progress_updated_ms=st.progress_updated_ms,
            producers=[
                pb.ProducerGroupState(producer_group=g, client_ids=ids)
                for g, ids in st.producers.items()
            ],
            now_ms=st.now_ms,
        )

    @rpc_errors
    async def ScanHalf(self, request: pb.ScanHalfRequest, context: Context) -> pb.ScanHalfResponse:
        got = await self.scans.scan_half(request.offset, request.max_entries)
        resp = pb.ScanHalfResponse(next_offset=got.next_offset, max_offset=got.max_offset)
        add = resp.entries.add
        for info, decided in got.entries:
            add(
                queue_offset=info.queue_offset,
                unique_id=info.unique_id,
                producer_group=info.producer_group,
                topic=info.real_topic,
                store_timestamp_ms=info.store_timestamp,
                check_times=info.check_times,
                immunity_ms=info.immunity_ms,
                decided=_decision_pb(decided),
                first_stored_ms=info.first_stored_ms,
            )
        return resp

    @rpc_errors
    async def ScanOps(self, request: pb.ScanOpsRequest, context: Context) -> pb.ScanOpsResponse:
        got = await self.scans.scan_ops(request.offset, request.max_entries)
        resp = pb.ScanOpsResponse(next_offset=got.next_offset, max_offset=got.max_offset)
        add = resp.entries.add
        for op in got.entries:
            add(
                queue_offset=op.queue_offset,
                half_offset=op.half_offset,
                unique_id=op.unique_id,
                decision=_decision_pb(op.kind.decision if op.kind is not None else None),
            )
        return resp

    @rpc_errors
    async def CheckHalf(
        self, request: pb.CheckHalfRequest, context: Context
    ) -> pb.CheckHalfResponse:
        got = await self.checks.check_half(request.half_offset, request.max_check_times)
        self.metrics.txn_checks.labels(got.outcome.value).inc()
        return pb.CheckHalfResponse(
            outcome=_CHECK_OUTCOMES[got.outcome],
            new_half_offset=got.new_half_offset,
            producer_client_id=got.producer_client_id,
            check_times=got.check_times,
        )

    @rpc_errors
    async def CommitTransactionProgress(
        self, request: pb.CommitTransactionProgressRequest, context: Context
    ) -> pb.CommitTransactionProgressResponse:
        await self.ledger.commit_progress(request.half_progress, request.op_progress)
        return pb.CommitTransactionProgressResponse()

    @rpc_errors
    async def ListPending(
        self, request: pb.ListPendingRequest, context: Context
    ) -> pb.ListPendingResponse:
        got = await self.scans.list_pending(
            request.producer_group, request.topic, request.max_entries
        )
        return pb.ListPendingResponse(
            pending=[
                pb.PendingTransaction(
                    unique_id=p.unique_id,
                    producer_group=p.producer_group,
                    topic=p.topic,
                    first_stored_ms=p.first_stored_ms,
                    check_times=p.check_times,
                    checking=p.checking,
                    offset=p.offset,
                    keys=p.keys,
                )
                for p in got.pending
            ],
            more=got.more,
            broker_name=self.ledger.broker_name,
        )


def _message(m: common_pb2.Message, host: str) -> Message:
    """The store's message of a half as the client sent it (``host``: the caller's, for a
    message without a born host)."""
    keys = m.keys
    props = m.properties
    return Message(
        m.topic,
        m.body,
        m.queue_id,
        m.tags or None,
        tuple(keys) if keys else (),
        dict(props) if props else None,
        m.unique_id or None,
        m.flag,
        m.sys_flag,
        m.born_timestamp_ms,
        m.born_host or host,
    )


def _end(request: pb.EndTransactionRequest) -> End:
    """The core's End of an EndTransaction request; its decision and source checked."""
    decision = _DECISIONS.get(request.decision)
    if decision is None:
        raise InvalidArgumentError(
            field="decision",
            rule="must be COMMIT, ROLLBACK or UNKNOWN (what the producer knows of its local "
            f"transaction), got {_name(pb.TransactionDecision, request.decision)}",
        )
    source = _SOURCES.get(request.source)
    if source is None:
        raise InvalidArgumentError(
            field="source",
            rule="must be PRODUCER, CHECK or OPERATOR (or unspecified, taken as "
            f"PRODUCER), got {request.source}",
        )
    return End(
        request.producer_group,
        request.unique_id,
        request.half_offset,
        decision,
        source,
        request.client_id,
    )


def _ended_to_pb(ended: Ended) -> pb.EndTransactionResponse:
    return pb.EndTransactionResponse(
        outcome=_END_OUTCOMES[ended.outcome],
        topic=ended.topic,
        queue_id=ended.queue_id,
        queue_offset=ended.queue_offset,
    )


def _decision_pb(decision: Decision | None) -> pb.TransactionDecision.ValueType:
    if decision is None:
        return pb.TRANSACTION_DECISION_UNSPECIFIED
    return _DECISIONS_TO_PB.get(decision, pb.TRANSACTION_DECISION_UNSPECIFIED)


def _name(enum_type: Any, number: int) -> str:
    """An enum value's name, or its number when it has none."""
    try:
        return str(enum_type.Name(number))
    except ValueError:
        return str(number)
