"""The one place where Apogee errors become gRPC statuses, and statuses become errors again.

A server raises :class:`~apogee.common.errors.ApogeeError` from its core; :func:`rpc_errors`
turns it into a status with the kind's gRPC code, the error's sentence as details, and the kind's
name in the trailing metadata key ``apogee-error-kind``. A client turns an ``AioRpcError`` back
into the same error class with :func:`from_rpc_error`, so ``retriable`` means the same on both
sides. A status without that key comes from gRPC itself: ``UNAVAILABLE``, ``INTERNAL`` and
``UNKNOWN`` then mean the transport broke (a peer killed mid-call), and are retriable.
Per-message outcomes inside a response use :func:`to_status` / :func:`from_status`.

A status's details travel percent-encoded in the ``grpc-message`` trailer, and a peer refuses
trailers over 8 KiB (it reports RESOURCE_EXHAUSTED, and the sentence is lost): a sentence that
quotes a long bad value is cut in the middle to :data:`MAX_DETAILS_WIRE` bytes by
:func:`bounded`, keeping the field it starts with and the rule it ends with.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
import grpc.aio

from apogee.common.errors import (
    ApogeeError,
    DeadlineExceededError,
    InternalError,
    UnavailableError,
)
from apogee.v1 import common_pb2

log = logging.getLogger(__name__)

KIND_KEY = "apogee-error-kind"
OK = common_pb2.Status()

_CODE_KIND = {
    grpc.StatusCode.INVALID_ARGUMENT: "INVALID_ARGUMENT",
    grpc.StatusCode.NOT_FOUND: "NOT_FOUND",
    grpc.StatusCode.PERMISSION_DENIED: "PERMISSION_DENIED",
    grpc.StatusCode.UNAUTHENTICATED: "UNAUTHENTICATED",
    grpc.StatusCode.FAILED_PRECONDITION: "UNSUPPORTED",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "DISK_FULL",
    grpc.StatusCode.DATA_LOSS: "CORRUPT_RECORD",
}


def status_code(err: ApogeeError) -> grpc.StatusCode:
    return grpc.StatusCode[err.kind.code]


def to_status(err: ApogeeError) -> common_pb2.Status:
    return common_pb2.Status(
        code=status_code(err).value[0],
        reason=err.kind.name,
        message=str(err),
        retriable=err.retriable,
    )


def from_status(status: common_pb2.Status) -> ApogeeError | None:
    if status.code == 0:
        return None
    return ApogeeError.from_wire(status.reason or "INTERNAL", status.message)


#: Most bytes of a status's details as sent (percent-encoded: 3 bytes for each byte outside
#: printable ASCII, and for ``%``).
MAX_DETAILS_WIRE = 4096
_CUT = "[... {} characters cut ...]"


def _wire_size(c: str) -> int:
    return 1 if " " <= c <= "~" and c != "%" else 3 * len(c.encode("utf-8", "surrogatepass"))


def bounded(details: str, limit: int = MAX_DETAILS_WIRE) -> str:
    """``details`` if it takes at most ``limit`` bytes as sent, else its start and its end
    with what is between them replaced by a note of how many characters were cut."""
    if len(details) * 12 <= limit:  # 12: the most a character can take (4 UTF-8 bytes, each %XX)
        return details
    sizes = [_wire_size(c) for c in details]
    if sum(sizes) <= limit:
        return details
    half = (limit - len(_CUT) - 8) // 2
    head = used = 0
    while used + sizes[head] <= half:
        used += sizes[head]
        head += 1
    tail, used = len(details), 0
    while used + sizes[tail - 1] <= half:
        tail -= 1
        used += sizes[tail]
    return details[:head] + _CUT.format(tail - head) + details[tail:]


async def abort(context: grpc.aio.ServicerContext[Any, Any], err: ApogeeError) -> NoReturn:
    await context.abort(
        status_code(err), bounded(str(err)), trailing_metadata=((KIND_KEY, err.kind.name),)
    )
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


Req = TypeVar("Req")
Resp = TypeVar("Resp")


async def first_request(
    requests: AsyncIterator[Req],
    context: grpc.aio.ServicerContext[Any, Any],
    what: str,
    timeout_s: float,
) -> Req | None:
    """The first request of a stream a server is answering (None: the client closed its
    side without one); the stream ends ``DEADLINE_EXCEEDED`` when none comes within
    ``timeout_s``, naming ``what`` was waited for."""
    try:
        async with asyncio.timeout(timeout_s):
            return await anext(requests)
    except StopAsyncIteration:
        return None
    except TimeoutError:
        await abort(context, DeadlineExceededError(what=what, timeout_s=timeout_s))


Self = TypeVar("Self")
Handler = Callable[[Self, Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp]]


def rpc_errors(fn: Handler[Self, Req, Resp]) -> Handler[Self, Req, Resp]:
    """Decorate an async servicer method: Apogee errors become their status; anything else is
    logged with its traceback and becomes INTERNAL, and the server keeps serving."""

    @functools.wraps(fn)
    async def wrapper(
        self: Self, request: Req, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Resp:
        try:
            return await fn(self, request, context)
        except ApogeeError as err:
            await abort(context, err)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            log.exception("%s failed", fn.__qualname__)
            await abort(context, InternalError(detail=f"{type(exc).__name__}: {exc}"))

    return wrapper


#: Codes gRPC itself fails a call with when the transport breaks under it. CANCELLED is among
#: them: a caller that gives up gets asyncio.CancelledError, never the status, so a CANCELLED
#: status is the peer's gRPC ending the stream under the call (seen from a broker whose server
#: was stopping as it stepped down).
_TRANSPORT_CODES = frozenset(
    {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}
)


def from_rpc_error(exc: grpc.aio.AioRpcError, what: str) -> ApogeeError:
    """The Apogee error a failed call stands for (``what`` names the peer, for messages)."""
    kind = None
    for key, value in exc.trailing_metadata() or ():
        if key == KIND_KEY:
            kind = value if isinstance(value, str) else value.decode()
    code = exc.code()
    details = exc.details() or code.name
    if kind:
        return ApogeeError.from_wire(kind, details)
    if code == grpc.StatusCode.UNAVAILABLE:
        return UnavailableError(what=what, detail=details)
    if code in _TRANSPORT_CODES:
        # no kind: not an answer of Apogee's (whose every error carries one) but gRPC's own,
        # e.g. "Internal error from Core" when the peer died mid-call. What was asked may or
        # may not have been done; sends are at-least-once, so trying again elsewhere is right.
        return UnavailableError(what=what, detail=f"the call broke ({code.name}: {details})")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApogeeError.from_wire(
            "DEADLINE_EXCEEDED", f"{what} did not answer within the call's deadline"
        )
    if code in _CODE_KIND:
        return ApogeeError.from_wire(_CODE_KIND[code], f"{what}: {details}")
    return InternalError(detail=f"{what} answered {code.name}: {details}")


async def call(what: str, coro: Awaitable[Resp]) -> Resp:
    """Await a client call, turning gRPC failures into Apogee errors."""
    try:
        return await coro
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc, what) from None
