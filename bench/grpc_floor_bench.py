"""The floor under the send and pull figures: what gRPC alone costs on this machine.

No Apogee code runs on either side. A server in a child process (grpc.aio, on uvloop when it is
installed, as the services run) answers raw bytes; this process is the client (grpc.aio on the
same loop, as the SDK runs). A request carries ``count`` messages of ``--size`` bytes behind an
8-byte id and a 4-byte count; the answer is the id and 24 bytes per message (about what a
send's result takes). The cases are the shapes of Apogee's own exchanges, so each of
``cluster_bench.py`` and ``consumer_bench.py``'s figures can be set against what the transport
leaves:

- ``unary_1``: one unary call at a time.
- ``stream_1``: one message at a time on an open bidirectional stream (how the producer and
  the consumer talk to a broker).
- ``stream_gap_1ms``, ``stream_gap_10ms``, ``stream_gap_100ms``: the same, each message after
  that much silence: what waking idle threads costs.
- ``stream_paced_2000``: messages started on a schedule of 2,000 per second, each awaited in
  its own task, on one stream (calls multiplexed by id, as ``apogee.rpc.mux`` does); latency
  of one exchange.
- ``stream_64``: 64 tasks, each awaiting its own exchange in a loop, on one stream; one
  message per exchange (no batching).
- ``unary_batch_100``: 4 callers, each awaiting calls of 100 messages: the issue's "100 in one
  call" figure.

Printed as one JSON object per line (see ``figures.py``), with ``client_cpu_us`` and
``server_cpu_us``, the CPU each process used per exchange.

    python bench/grpc_floor_bench.py            # about 40 s
    python bench/grpc_floor_bench.py --quick    # about 15 s
    python bench/grpc_floor_bench.py --case stream
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import select
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from functools import partial
from typing import Any

import grpc
import grpc.aio
from figures import ProcessMeter, emit, loop_name, paced, run_async

SERVICE = "floor.Echo"
UNARY = f"/{SERVICE}/Unary"
STREAM = f"/{SERVICE}/Stream"
HEAD = struct.Struct("<QI")  # id, messages in the request
ANSWER_PER_MESSAGE = bytes(24)


def answer(request: bytes) -> bytes:
    count: int = HEAD.unpack_from(request)[1]
    return request[:8] + ANSWER_PER_MESSAGE * count


# -- the server (child process) -----------------------------------------------------------------


async def unary_echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return answer(request)


async def stream_echo(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
) -> AsyncIterator[bytes]:
    async for request in requests:
        yield answer(request)


async def serve() -> None:
    """Serve on a free port, print it, and stop when this process's stdin closes."""
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary_echo),
            "Stream": grpc.stream_stream_rpc_method_handler(stream_echo),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # EOF: the bench is done or gone
    await server.stop(1.0)


# -- the client ---------------------------------------------------------------------------------


class Mux:
    """Exchanges multiplexed by id on one stream: one write at a time, answers matched by id."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call: grpc.aio.StreamStreamCall[bytes, bytes] = channel.stream_stream(STREAM)()
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[bytes]] = {}
        self._write = asyncio.Lock()
        self._reader = asyncio.create_task(self._read())

    async def exchange(self, payload: bytes, count: int = 1) -> bytes:
        request_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = fut
        async with self._write:
            await self.call.write(HEAD.pack(request_id, count) + payload)
        return await asyncio.wait_for(fut, 10.0)

    async def _read(self) -> None:
        while True:
            reply = await self.call.read()
            if reply is grpc.aio.EOF:
                break
            assert isinstance(reply, bytes)
            (request_id,) = struct.unpack_from("<Q", reply)
            fut = self._waiting.pop(request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.call.done_writing()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError, grpc.aio.AioRpcError):
            await asyncio.wait_for(self._reader, 5.0)
        self._reader.cancel()


class Bench:
    """The server's address and meter, the payload, and the CPU marks of the case running."""

    def __init__(self, address: str, server: ProcessMeter, size: int, loop: str) -> None:
        self.address = address
        self.server = server
        self.size = size
        self.payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
        self.loop = loop
        self._cpu0 = (0.0, 0.0)
        self._cpu = (0.0, 0.0)

    def emit(
        self,
        case: str,
        messages: int,
        exchanges: int,
        seconds: float,
        lat: list[float],
        **kw: object,
    ) -> None:
        emit(
            case,
            messages,
            self.size,
            seconds,
            lat,
            exchanges=exchanges,
            client_cpu_us=round(self._cpu[0] / exchanges * 1e6, 1),
            server_cpu_us=round(self._cpu[1] / exchanges * 1e6, 1),
            server_rss_mb=round(self.server.rss_mb(), 1),
            loop=self.loop,
            **kw,
        )

    def start(self) -> float:
        self._cpu0 = (time.process_time(), self.server.cpu_s())
        return time.perf_counter()

    def stop(self, t0: float) -> float:
        elapsed = time.perf_counter() - t0
        self._cpu = (time.process_time() - self._cpu0[0], self.server.cpu_s() - self._cpu0[1])
        return elapsed


@contextlib.asynccontextmanager
async def open_mux(b: Bench) -> AsyncIterator[Mux]:
    """A channel and a warmed-up stream to the server, both closed on the way out."""
    async with grpc.aio.insecure_channel(b.address) as channel:
        mux = Mux(channel)
        try:
            for _ in range(200):
                await mux.exchange(b.payload)
            yield mux
        finally:
            await mux.close()


async def timed(exchange: Awaitable[object], lat: list[float]) -> None:
    """Await ``exchange`` and add how long it took to ``lat``."""
    t = time.perf_counter()
    await exchange
    lat.append(time.perf_counter() - t)


async def case_unary_1(b: Bench, count: int) -> None:
    async with grpc.aio.insecure_channel(b.address) as channel:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(UNARY)
        request = HEAD.pack(1, 1) + b.payload
        for _ in range(200):
            await call(request, timeout=10.0)
        lat: list[float] = []
        t0 = b.start()
        for _ in range(count):
            await timed(call(request, timeout=10.0), lat)
        b.emit("unary_1", count, count, b.stop(t0), lat, latency_of="one call")


async def case_stream_gap(b: Bench, count: int, gap_s: float) -> None:
    lat: list[float] = []
    async with open_mux(b) as mux:
        t0 = b.start()
        for _ in range(count):
            if gap_s:
                await asyncio.sleep(gap_s)
            await timed(mux.exchange(b.payload), lat)
        elapsed = b.stop(t0)
    name = f"stream_gap_{round(gap_s * 1000)}ms" if gap_s else "stream_1"
    b.emit(name, count, count, elapsed, lat, latency_of="one exchange on an open stream")


async def case_stream_paced(b: Bench, seconds: float, rate: int) -> None:
    count = int(seconds * rate)
    lat: list[float] = []
    late = 0
    async with open_mux(b) as mux:
        tasks: set[asyncio.Task[None]] = set()
        t0 = b.start()
        async for behind in paced(rate, count):
            late += behind
            task = asyncio.create_task(timed(mux.exchange(b.payload), lat))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait_for(asyncio.gather(*tasks), 30.0)
        elapsed = b.stop(t0)
    b.emit(
        f"stream_paced_{rate}",
        count,
        count,
        elapsed,
        lat,
        target_rate=rate,
        started_late=late,
        latency_of="one exchange, each started on schedule in its own task",
    )


async def case_stream_concurrent(b: Bench, count: int, senders: int) -> None:
    lat: list[float] = []
    async with open_mux(b) as mux:

        async def sender() -> None:
            for _ in range(count // senders):
                await timed(mux.exchange(b.payload), lat)

        t0 = b.start()
        await asyncio.gather(*(sender() for _ in range(senders)))
        elapsed = b.stop(t0)
    done = len(lat)
    b.emit(f"stream_{senders}", done, done, elapsed, lat, latency_of="one exchange")


async def case_unary_batch(b: Bench, calls: int, per_call: int, callers: int) -> None:
    async with grpc.aio.insecure_channel(b.address) as channel:
        call: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(UNARY)
        request = HEAD.pack(1, per_call) + b.payload * per_call
        for _ in range(20):
            await call(request, timeout=10.0)
        lat: list[float] = []

        async def caller() -> None:
            for _ in range(calls // callers):
                await timed(call(request, timeout=10.0), lat)

        t0 = b.start()
        await asyncio.gather(*(caller() for _ in range(callers)))
        elapsed = b.stop(t0)
    done = len(lat)
    b.emit(
        f"unary_batch_{per_call}",
        done * per_call,
        done,
        elapsed,
        lat,
        messages_per_call=per_call,
        callers=callers,
        latency_of=f"one call of {per_call} messages",
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smaller runs, about 15 s in all")
    ap.add_argument("--case", help="run only cases whose name starts with this")
    ap.add_argument("--size", type=int, default=1024, help="bytes per message (default 1024)")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default=None)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    loop = loop_name(args.loop)
    if args.serve:
        run_async(serve(), loop)
        return
    k = 1 if args.quick else 3
    cases: list[tuple[str, Callable[[Bench], Coroutine[Any, Any, None]]]] = [
        ("unary_1", partial(case_unary_1, count=1_000 * k)),
        ("stream_1", partial(case_stream_gap, count=2_000 * k, gap_s=0.0)),
        ("stream_gap_1ms", partial(case_stream_gap, count=300 * k, gap_s=0.001)),
        ("stream_gap_10ms", partial(case_stream_gap, count=100 * k, gap_s=0.01)),
        ("stream_gap_100ms", partial(case_stream_gap, count=20 * k, gap_s=0.1)),
        ("stream_paced_2000", partial(case_stream_paced, seconds=2.0 * k, rate=2000)),
        ("stream_64", partial(case_stream_concurrent, count=12_800 * k, senders=64)),
        ("unary_batch_100", partial(case_unary_batch, calls=400 * k, per_call=100, callers=4)),
    ]
    selected = [(n, c) for n, c in cases if args.case is None or n.startswith(args.case)]
    if not selected:
        sys.exit(f"no case starts with {args.case!r}")
    cmd = [sys.executable, __file__, "--serve", "--loop", loop]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            ready, _, _ = select.select([child.stdout], [], [], 30.0)
            port = int(child.stdout.readline() or "0") if ready else 0
            if not port:
                sys.exit("the echo server did not start")
            bench = Bench(f"127.0.0.1:{port}", ProcessMeter(child.pid), args.size, loop)
            for _, case in selected:
                run_async(case(bench), loop)
        finally:
            assert child.stdin is not None
            child.stdin.close()
            try:
                child.wait(10.0)
            except subprocess.TimeoutExpired:
                child.kill()


if __name__ == "__main__":
    main()
