"""A pull answer whose bytes do not parse fails its pull with an error that says so, on a real
gRPC stream, whichever way the answer is read (in place or by protobuf)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest

from apogee.client._rpc import ChannelPool
from apogee.common.errors import ApogeeError
from apogee.v1 import consumer_pb2

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("size", [10, 100_000])  # both ways of reading a pull answer
async def test_an_answer_that_does_not_parse_fails_its_pull_with_a_clear_error(size: int) -> None:
    async def garbage(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for _ in requests:
            yield b"\x12" + b"\xff" * size  # a length that runs past the end

    server = grpc.aio.server()
    handler: Any = grpc.stream_stream_rpc_method_handler(garbage)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("apogee.v1.Consumer", {"PullStream": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    pool = ChannelPool()
    try:
        request = consumer_pb2.PullRequest(group="g", topic="T", client_id="c")
        for _ in range(2):  # on a new stream the second time, failing the same way
            with pytest.raises(ApogeeError, match="broker g sent a stream answer") as caught:
                await pool.pull(f"127.0.0.1:{port}", request, 5.0, "broker g")
            assert caught.value.kind.name == "INTERNAL"
    finally:
        await pool.close()
        await server.stop(None)
