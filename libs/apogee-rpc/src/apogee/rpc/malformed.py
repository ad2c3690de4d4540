"""Requests whose bytes do not parse: refused as INVALID_ARGUMENT, logged once in a while.

Left to grpc.aio, a request that its protobuf type cannot parse fails in the deserializer,
before any handler runs: the caller gets ``UNKNOWN`` with no error kind, and the server logs an
ERROR with a traceback per request (a fuzzer makes hundreds). :class:`MalformedRequests`, a
server interceptor that every Apogee server installs (:class:`~apogee.rpc.server.GrpcServer`),
wraps each method's deserializer instead: bytes that do not parse become a marker, and the
method's wrapper answers ``INVALID_ARGUMENT`` (kind ``INVALID_ARGUMENT``, trailer included)
naming the message type and protobuf's reason, for unary requests and for any message of a
request stream alike. Each method logs one WARNING per :data:`LOG_EVERY_S` at most, with the
number of refusals since the last line.

On a request stream the refusal is not sent from inside the stream's iterator: the handler may
be writing an answer at that moment (from another task, as :class:`~apogee.rpc.mux.MuxServer`
does), and a status sent over a write in flight fails in gRPC's core (``TOO_MANY_OPERATIONS``)
and leaves the call hanging. The iterator raises :class:`MalformedRequestError` instead; the
handler stops reading and finishes what it is writing, and the call ends with that error, by
the handler (which may end it with the error as its own status) or else by the wrapper.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

import grpc
import grpc.aio

from apogee.common.errors import InvalidArgumentError
from apogee.rpc.errors import abort
from apogee.rpc.handlers import rewrap

log = logging.getLogger(__name__)

#: Seconds between two WARNING lines about one method's malformed requests.
LOG_EVERY_S: Final = 60.0

if TYPE_CHECKING:  # generic only in the type stubs
    Context = grpc.aio.ServicerContext[Any, Any]
    Handler = grpc.RpcMethodHandler[Any, Any]
    Refuse = Callable[[Context, "_Malformed"], Awaitable[None]]
    Refusal = Callable[["_Malformed"], "MalformedRequestError"]


class MalformedRequestError(InvalidArgumentError):
    """A message of a request stream that does not parse (kind ``INVALID_ARGUMENT``); raised
    by the stream's iterator, so that the handler stops reading."""


class _Malformed:
    """What the wrapped deserializer returns for bytes that do not parse."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


class MalformedRequests(grpc.aio.ServerInterceptor):
    """See the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        #: method -> (when its last line was logged, refusals not logged since)
        self._logged: dict[str, tuple[float, int]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method: str = handler_call_details.method
        return self._wrap(handler, method)

    def _wrap(self, h: Handler, method: str) -> Handler:
        parse = h.request_deserializer
        assert parse is not None

        def deserialize(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as exc:  # protobuf's DecodeError, or anything a parser raises
                return _Malformed(f"{exc}")

        refuse = self._refuser(method)
        refusal = self._refusal(method)
        return rewrap(
            h,
            lambda behavior: _unary(behavior, refuse),
            lambda behavior: _streaming(behavior, refusal),
            deserialize,
        )

    def _refusal(self, method: str) -> Refusal:
        """The error refusing a malformed request of ``method``, logged as the module says."""

        def refusal(bad: _Malformed) -> MalformedRequestError:
            now = self._clock()
            last, quiet = self._logged.get(method, (None, 0))
            if last is None or now - last >= LOG_EVERY_S:
                more = f" ({quiet} more since the last line)" if quiet else ""
                log.warning(
                    "%s: refused a request that does not parse%s: %s", method, more, bad.reason
                )
                self._logged[method] = (now, 0)
            else:
                self._logged[method] = (last, quiet + 1)
            return MalformedRequestError(
                field="request", rule=f"does not parse as the method's message: {bad.reason}"
            )

        return refusal

    def _refuser(self, method: str) -> Refuse:
        refusal = self._refusal(method)

        async def refuse(context: Context, bad: _Malformed) -> None:
            await abort(context, refusal(bad))

        return refuse


def _unary(behavior: Callable[..., Any], refuse: Refuse) -> Callable[..., Any]:
    """A handler of one request (answering once or streaming) that refuses a malformed one."""
    if inspect.isasyncgenfunction(behavior):

        async def gen(request: Any, context: Context) -> AsyncIterator[Any]:
            if isinstance(request, _Malformed):
                await refuse(context, request)
            async for item in behavior(request, context):
                yield item

        return gen

    async def call(request: Any, context: Context) -> Any:
        if isinstance(request, _Malformed):
            await refuse(context, request)
        return await behavior(request, context)

    return call


def _streaming(behavior: Callable[..., Any], refusal: Refusal) -> Callable[..., Any]:
    """A handler of a request stream whose first malformed message ends the call: the stream's
    iterator raises :class:`MalformedRequestError` (never a status from inside the iterator, see
    the module docstring); unless the handler ends the call with a status of its own, the call
    ends with that error once the handler is done."""

    async def checked(
        requests: AsyncIterator[Any], refused: list[MalformedRequestError]
    ) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, _Malformed):
                err = refusal(request)
                refused.append(err)
                raise err
            yield request

    if inspect.isasyncgenfunction(behavior):

        async def gen(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            refused: list[MalformedRequestError] = []
            try:
                async for item in behavior(checked(requests, refused), context):
                    yield item
            except MalformedRequestError as err:
                await abort(context, err)
            if refused:  # the handler caught the error and ended as if the stream had
                await abort(context, refused[0])

        return gen

    async def call(requests: AsyncIterator[Any], context: Context) -> Any:
        refused: list[MalformedRequestError] = []
        try:
            out = await behavior(checked(requests, refused), context)
        except MalformedRequestError as err:
            await abort(context, err)
        if refused:
            await abort(context, refused[0])
        return out

    return call
