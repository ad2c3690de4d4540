"""The one place where Apogee errors become gRPC statuses, and statuses become errors again.

A server raises :class:`~apogee.common.errors.ApogeeError` from its core; :func:`rpc_errors`
turns it into a status with the kind's gRPC code, the error's sentence as details, and the kind's
name in the trailing metadata key ``apogee-error-kind``. A client turns an ``AioRpcError`` back
into the same error class with :func:`from_rpc_error`, so ``retriable`` means the same on both
sides. A status without that key comes from gRPC itself: ``UNAVAILABLE``, ``INTERNAL`` and
``UNKNOWN`` then mean the transport broke (a peer killed mid-call), and are retriable.
Per-message outcomes inside a response use :func:`to_status` / :func:`from_status`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
import grpc.aio

from apogee.common.errors import (
    ApogeeError,
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


async def abort(context: grpc.aio.ServicerContext[Any, Any], err: ApogeeError) -> NoReturn:
    await context.abort(status_code(err), str(err), trailing_metadata=((KIND_KEY, err.kind.name),))
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises


Req = TypeVar("Req")
Resp = TypeVar("Resp")
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


#: Codes gRPC itself fails a call with when the transport breaks under it.
_TRANSPORT_CODES = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


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
