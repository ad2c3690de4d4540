"""A transactional producer's calls to the brokers' ``apogee.v1.Transaction`` service.

The halves and the ends of concurrent transactions bound for one broker share requests, as
plain sends do (:mod:`~apogee.client.producer.accumulator`): a half or an end queued while a
request slot to its broker is free leaves at the next turn of the event loop with whatever else
was queued in that turn (``SendHalves``, ``EndTransactions``); while every slot is busy they
wait and leave together when one frees. A lone transaction costs two round trips and no added
delay; a thousand concurrent ones cost a handful of requests. Each half and each end is
answered on its own in the shared request: a refused one fails alone, with the broker's error.

The broker and the channel are named by the broker's address (the destination of the
accumulator); the broker's name is kept for error sentences.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import grpc.aio

from apogee.client._rpc import ChannelPool
from apogee.client.producer.accumulator import Accumulator, BatchingConfig
from apogee.common.errors import (
    ApogeeError,
    DeadlineExceededError,
    InternalError,
    UnsupportedError,
)
from apogee.rpc.errors import from_rpc_error, from_status
from apogee.v1 import common_pb2, transaction_pb2, transaction_pb2_grpc

if TYPE_CHECKING:
    _TxnStub = transaction_pb2_grpc.TransactionAsyncStub

T = TypeVar("T")
pb = transaction_pb2
_Outcome = Any  # a response message, or the ApogeeError of that item


@dataclass(frozen=True, slots=True)
class TransactionCallStats:
    """What a transactional producer has sent so far: ``halves / half_requests`` (and
    ``ends / end_requests``) is how many concurrent transactions shared a request."""

    #: SendHalves requests made (failed ones included)
    half_requests: int
    #: halves those carried (a retried half counts once per attempt)
    halves: int
    #: EndTransactions requests made (the check listener's answers included)
    end_requests: int
    #: ends those carried
    ends: int


class TransactionCalls:
    """Halves and ends of ``group``'s transactions, shared out into requests per broker
    (``batching``: slots in flight and request sizes, as the producer's sends); each request
    may take ``timeout`` seconds."""

    def __init__(
        self, pool: ChannelPool, group: str, batching: BatchingConfig, timeout: float
    ) -> None:
        self._pool = pool
        self._group = group
        self._timeout = timeout
        self._stubs: dict[str, _TxnStub] = {}
        self._names: dict[str, str] = {}
        self._halves: Accumulator[common_pb2.Message, pb.SendHalfResponse] = Accumulator(
            self._send_halves, batching
        )
        self._ends: Accumulator[pb.EndTransactionRequest, pb.EndTransactionResponse] = Accumulator(
            self._send_ends, batching
        )

    async def send_half(
        self, broker: str, address: str, message: common_pb2.Message, timeout: float
    ) -> pb.SendHalfResponse:
        """Store ``message`` as a half at the broker; raises its refusal or the failure of the
        request that carried it, :class:`DeadlineExceededError` after ``timeout`` seconds."""
        self._names[address] = broker
        fut = self._halves.append(address, message, message.ByteSize())
        return await self._outcome(fut, timeout, f"storing a half message at broker {broker}")

    async def end(
        self, broker: str, address: str, request: pb.EndTransactionRequest, timeout: float
    ) -> pb.EndTransactionResponse:
        """End a transaction at the broker (as :meth:`send_half` fails)."""
        self._names[address] = broker
        fut = self._ends.append(address, request, 64)
        return await self._outcome(
            fut, timeout, f"ending transaction {request.unique_id!r} at broker {broker}"
        )

    async def call(self, broker: str, address: str, fn: Callable[[_TxnStub], Awaitable[T]]) -> T:
        """``fn(stub)`` on the broker's Transaction service, alone; failures as Apogee
        errors."""
        what = f"broker {broker} at {address}"
        try:
            return await fn(self._stub(address))
        except grpc.aio.AioRpcError as exc:
            raise _rpc_error(exc, what) from None

    def stats(self) -> TransactionCallStats:
        halves, ends = self._halves.stats(), self._ends.stats()
        return TransactionCallStats(halves.requests, halves.messages, ends.requests, ends.messages)

    async def close(self, timeout: float) -> None:
        """Let what is queued leave (``timeout`` seconds at most), then fail the rest."""
        await asyncio.gather(self._halves.close(timeout), self._ends.close(timeout))
        self._stubs.clear()

    # -- requests ------------------------------------------------------------------------------

    async def _outcome(self, fut: asyncio.Future[T], timeout: float, what: str) -> T:
        """``fut``'s outcome, or :class:`DeadlineExceededError` after ``timeout`` seconds (the
        future is then cancelled: its item is dropped if it has not left yet). One timer, no
        task: this runs twice per transaction."""
        expired: list[bool] = []
        timer = fut.get_loop().call_later(timeout, _expire, fut, expired)
        try:
            return await fut
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not expired or (current is not None and current.cancelling()):
                raise  # the caller was cancelled
            raise DeadlineExceededError(what=what, timeout_s=timeout) from None
        finally:
            timer.cancel()

    def _stub(self, address: str) -> _TxnStub:
        stub = self._stubs.get(address)
        if stub is None:
            stub = self._stubs[address] = transaction_pb2_grpc.TransactionStub(
                self._pool.channel(address)
            )
        return stub

    async def _send_halves(
        self, address: str, messages: list[common_pb2.Message]
    ) -> list[_Outcome]:
        request = pb.SendHalvesRequest(producer_group=self._group, messages=messages)
        resp = await self._request(
            address, lambda stub: stub.SendHalves(request, timeout=self._timeout)
        )
        return [_item(r.status, r.half) for r in resp.results]

    async def _send_ends(
        self, address: str, ends: list[pb.EndTransactionRequest]
    ) -> list[_Outcome]:
        request = pb.EndTransactionsRequest(ends=ends)
        resp = await self._request(
            address, lambda stub: stub.EndTransactions(request, timeout=self._timeout)
        )
        return [_item(r.status, r.end) for r in resp.results]

    async def _request(self, address: str, fn: Callable[[_TxnStub], Awaitable[T]]) -> T:
        broker = self._names.get(address, "?")
        return await self.call(broker, address, fn)


def _expire(fut: asyncio.Future[Any], expired: list[bool]) -> None:
    if not fut.done():
        expired.append(True)
        fut.cancel()


def _item(status: common_pb2.Status, answer: Any) -> _Outcome:
    """One item's outcome in a shared request: its answer, or its error."""
    if status.code == 0:
        return answer
    return from_status(status) or InternalError(detail=f"item failed: {status.message}")


def _rpc_error(exc: grpc.aio.AioRpcError, what: str) -> ApogeeError:
    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
        return UnsupportedError(
            what=what,
            detail="does not serve transactional messages (apogee.v1.Transaction)",
        )
    return from_rpc_error(exc, what)
