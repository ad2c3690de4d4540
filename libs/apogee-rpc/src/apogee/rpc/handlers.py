"""A method handler rebuilt around its behaviour: what the server interceptors
(:mod:`apogee.rpc.malformed`, :mod:`apogee.service.access`) do to every method they wrap."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:  # generic only in the type stubs
    Handler = grpc.RpcMethodHandler[Any, Any]

#: a behaviour (``(request or request iterator, context) -> ...``) wrapped in another
Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


def rewrap(
    h: Handler,
    single: Wrap,
    streaming: Wrap,
    deserializer: Callable[[bytes], Any] | None = None,
) -> Handler:
    """``h`` with its behaviour wrapped by ``single`` (a method taking one request) or
    ``streaming`` (one taking a request stream), and its request deserializer replaced by
    ``deserializer`` when given."""
    parse = deserializer or h.request_deserializer
    out = h.response_serializer
    if h.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(single(h.unary_unary), parse, out)
    if h.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(single(h.unary_stream), parse, out)
    if h.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(streaming(h.stream_unary), parse, out)
    assert h.stream_stream is not None
    return grpc.stream_stream_rpc_method_handler(streaming(h.stream_stream), parse, out)
