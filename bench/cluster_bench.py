"""Benchmark of the send path: a producer in this process, one broker and one nameserver as
separate processes (``apogee.local.cluster``, async flush), talking gRPC on 127.0.0.1.

Prints one JSON object per line:
``case, messages, msg_bytes, seconds, msgs_per_s, mb_per_s, p50_us, p99_us, rss_mb`` (this
process), plus ``broker_rss_mb``, ``client_cpu_s`` and ``broker_cpu_s`` (CPU time each process
used during the case: with two cores, whichever is near ``seconds`` is the bottleneck),
``msgs_per_request`` (the batching the producer achieved), ``loop`` (this process's event
loop) and, for async sends, ``errors``. Throughput counts until every send has its result.
Messages carry a tag and no keys.

Cases, each for 1 KiB and 128 B bodies:

- ``sync_1``: one sender awaiting each ``send``; latency of one send.
- ``sync_64_tasks``: 64 asyncio tasks, each awaiting ``send`` in a loop.
- ``sync_64_threads``: 64 threads sharing one ``SyncProducer``, each calling ``send``.
- ``async``: ``send_nowait`` in a loop with at most ``--window`` sends unsettled; latency
  from ``send_nowait`` to the result (mostly time spent waiting behind the window).
- ``batch64``: one sender awaiting ``send_batch`` of 64 in a loop; latency of one batch.
- ``batch64_x4``: the same with 4 concurrent senders.
- ``paced_2000``: sends started on a schedule of 2,000 per second, each awaited by its own
  task (an open loop); latency of one send and the rate achieved.
- ``paced_2000_1sender``: one sender awaiting each ``send`` before the next, on the same
  schedule; it falls behind when a send takes more than 0.5 ms (``started_late`` counts the
  sends that started over 1 ms behind schedule).

    python bench/cluster_bench.py            # full run (about two minutes)
    python bench/cluster_bench.py --quick    # under 40 s
    python bench/cluster_bench.py --case async   # cases whose name starts with "async"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

from figures import ProcessMeter, emit, loop_name, paced, run_async
from load import create_topics, windowed_sends

from apogee.client import Message, Producer, SyncProducer
from apogee.local import cluster as local_cluster

MiB = 1 << 20
SAMPLE = 16  # async sends: the latency of one in SAMPLE is measured
SIZES = {"1k": 1024, "128b": 128}


class Run:
    """What every case needs: the cluster's address, the broker's meter, and how to print."""

    def __init__(self, namesrv: str, broker: ProcessMeter, loop_name: str) -> None:
        self.namesrv = namesrv
        self.broker = broker
        self.loop_name = loop_name

    def emit(
        self,
        case: str,
        messages: int,
        msg_bytes: int,
        seconds: float,
        lat_s: list[float],
        cpu: tuple[float, float],
        requests: int = 0,
        **extra: Any,
    ) -> None:
        client_cpu = time.process_time() - cpu[0]
        broker_cpu = self.broker.cpu_s() - cpu[1]
        emit(
            case,
            messages,
            msg_bytes,
            seconds,
            lat_s,
            broker_rss_mb=round(self.broker.rss_mb(), 1),
            client_cpu_s=round(client_cpu, 2),
            broker_cpu_s=round(broker_cpu, 2),
            msgs_per_request=round(messages / requests, 1) if requests else None,
            loop=self.loop_name,
            **extra,
        )

    def cpu_mark(self) -> tuple[float, float]:
        return time.process_time(), self.broker.cpu_s()


def topic_of(size_name: str) -> str:
    return f"BenchCluster{size_name}"


def message(size_name: str) -> Message:
    return Message(topic_of(size_name), os.urandom(SIZES[size_name]), tags="TagA")


async def warm_up(producer: Producer, msg: Message) -> None:
    """Routes cached, channel connected, code paths warm; not timed."""
    await asyncio.gather(*(producer.send(msg) for _ in range(200)))
    await producer.send_batch([msg] * 64)


def stats_requests(producer: Producer, before: int) -> int:
    return producer.stats().requests - before


# -- cases -------------------------------------------------------------------------------------


async def case_sync_1(run: Run, size_name: str, count: int) -> None:
    msg = message(size_name)
    async with Producer(run.namesrv) as producer:
        await warm_up(producer, msg)
        req0 = producer.stats().requests
        lat: list[float] = []
        cpu = run.cpu_mark()
        t0 = time.perf_counter()
        for _ in range(count):
            t = time.perf_counter()
            await producer.send(msg)
            lat.append(time.perf_counter() - t)
        seconds = time.perf_counter() - t0
        run.emit(
            f"sync_1_{size_name}",
            count,
            len(msg.body),
            seconds,
            lat,
            cpu,
            stats_requests(producer, req0),
            senders=1,
            latency_of="one send",
        )


async def case_sync_tasks(run: Run, size_name: str, count: int, senders: int) -> None:
    msg = message(size_name)
    per = count // senders
    async with Producer(run.namesrv) as producer:
        await warm_up(producer, msg)
        req0 = producer.stats().requests
        lat: list[float] = []

        async def sender() -> None:
            for _ in range(per):
                t = time.perf_counter()
                await producer.send(msg)
                lat.append(time.perf_counter() - t)

        cpu = run.cpu_mark()
        t0 = time.perf_counter()
        await asyncio.gather(*(sender() for _ in range(senders)))
        seconds = time.perf_counter() - t0
        run.emit(
            f"sync_{senders}_tasks_{size_name}",
            per * senders,
            len(msg.body),
            seconds,
            lat,
            cpu,
            stats_requests(producer, req0),
            senders=senders,
            latency_of="one send",
        )


def case_sync_threads(run: Run, size_name: str, count: int, senders: int) -> None:
    msg = message(size_name)
    per = count // senders
    with SyncProducer(run.namesrv) as producer:
        for _ in range(200):
            producer.send(msg)
        req0 = producer.stats().requests
        lats: list[list[float]] = [[] for _ in range(senders)]
        start = threading.Barrier(senders + 1)
        failures: list[BaseException] = []

        def sender(i: int) -> None:
            out = lats[i]
            start.wait(30)
            try:
                for _ in range(per):
                    t = time.perf_counter()
                    producer.send(msg)
                    out.append(time.perf_counter() - t)
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=sender, args=(i,)) for i in range(senders)]
        for th in threads:
            th.start()
        start.wait(30)
        cpu = run.cpu_mark()
        t0 = time.perf_counter()
        for th in threads:
            th.join(300)
        seconds = time.perf_counter() - t0
        if failures:
            raise RuntimeError(f"{len(failures)} senders failed; first: {failures[0]!r}")
        run.emit(
            f"sync_{senders}_threads_{size_name}",
            per * senders,
            len(msg.body),
            seconds,
            [x for lst in lats for x in lst],
            cpu,
            producer.stats().requests - req0,
            senders=senders,
            latency_of="one send",
        )


async def case_async(run: Run, size_name: str, count: int, window: int) -> None:
    msg = message(size_name)
    async with Producer(run.namesrv) as producer:
        await warm_up(producer, msg)
        req0 = producer.stats().requests
        cpu = run.cpu_mark()
        sent = await windowed_sends(producer, msg, count, window, SAMPLE, settle_timeout_s=60)
        run.emit(
            f"async_{size_name}",
            count,
            len(msg.body),
            sent.seconds,
            sent.latencies,
            cpu,
            stats_requests(producer, req0),
            window=window,
            errors=sent.errors,
            latency_of=f"send_nowait to its result (one send in {SAMPLE})",
        )


async def case_batch(run: Run, size_name: str, count: int, batch: int, senders: int) -> None:
    msg = message(size_name)
    msgs = [msg] * batch
    rounds = count // (batch * senders)
    async with Producer(run.namesrv) as producer:
        await warm_up(producer, msg)
        req0 = producer.stats().requests
        lat: list[float] = []

        async def sender() -> None:
            for _ in range(rounds):
                t = time.perf_counter()
                await producer.send_batch(msgs)
                lat.append(time.perf_counter() - t)

        cpu = run.cpu_mark()
        t0 = time.perf_counter()
        await asyncio.gather(*(sender() for _ in range(senders)))
        seconds = time.perf_counter() - t0
        suffix = "" if senders == 1 else f"_x{senders}"
        run.emit(
            f"batch{batch}{suffix}_{size_name}",
            rounds * batch * senders,
            len(msg.body),
            seconds,
            lat,
            cpu,
            stats_requests(producer, req0),
            batch=batch,
            senders=senders,
            latency_of=f"one send_batch of {batch}",
        )


async def case_paced(run: Run, size_name: str, seconds: float, rate: int, one_sender: bool) -> None:
    """Sends started on a schedule of ``rate`` per second, each awaited (``await send``).

    ``one_sender``: one sender awaits each send before it starts the next, so it falls behind
    the schedule whenever a send takes longer than ``1 / rate``; it stops after ``seconds``,
    however many it sent. Otherwise each send starts on time in its own task (an open loop: a
    slow send does not delay the next one, and its latency is not hidden by a delayed start)."""
    msg = message(size_name)
    count = int(seconds * rate)
    async with Producer(run.namesrv) as producer:
        await warm_up(producer, msg)
        req0 = producer.stats().requests
        lat: list[float] = []
        late = 0
        perf = time.perf_counter

        async def one() -> None:
            t = perf()
            await producer.send(msg)
            lat.append(perf() - t)

        tasks: set[asyncio.Task[None]] = set()
        cpu = run.cpu_mark()
        t0 = perf()
        async for behind in paced(rate, count):
            late += behind
            if one_sender:
                if perf() - t0 >= seconds:
                    break
                await one()
            else:
                task = asyncio.create_task(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait_for(asyncio.gather(*tasks), 30)
        elapsed = perf() - t0
        run.emit(
            f"paced_{rate}{'_1sender' if one_sender else ''}_{size_name}",
            len(lat),
            len(msg.body),
            elapsed,
            lat,
            cpu,
            stats_requests(producer, req0),
            target_rate=rate,
            started_late=late,
            latency_of="one send, by one sender awaiting each"
            if one_sender
            else "one send, each started on schedule in its own task",
        )


# -- the run -----------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smaller runs, under 40 s in all")
    ap.add_argument("--case", help="run only cases whose name starts with this")
    ap.add_argument("--window", type=int, default=4096, help="unsettled sends in the async case")
    ap.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default=None,
        help="this process's event loop (default: uvloop when installed)",
    )
    ap.add_argument("--dir", default=None, help="where to put the cluster (default: a temp dir)")
    args = ap.parse_args()
    loop = loop_name(args.loop)
    k = 1 if args.quick else 4
    paced_s = 2.0 if args.quick else 5.0

    cases: list[tuple[str, Callable[[Run], Awaitable[None] | None]]] = []
    for s in SIZES:
        cases += [
            (f"sync_1_{s}", partial(case_sync_1, size_name=s, count=1_500 * k)),
            (
                f"sync_64_tasks_{s}",
                partial(case_sync_tasks, size_name=s, count=12_800 * k, senders=64),
            ),
            (
                f"sync_64_threads_{s}",
                partial(case_sync_threads, size_name=s, count=6_400 * k, senders=64),
            ),
            (f"async_{s}", partial(case_async, size_name=s, count=50_000 * k, window=args.window)),
            (
                f"batch64_{s}",
                partial(case_batch, size_name=s, count=12_800 * k, batch=64, senders=1),
            ),
            (
                f"batch64_x4_{s}",
                partial(case_batch, size_name=s, count=25_600 * k, batch=64, senders=4),
            ),
            (
                f"paced_2000_{s}",
                partial(case_paced, size_name=s, seconds=paced_s, rate=2000, one_sender=False),
            ),
            (
                f"paced_2000_1sender_{s}",
                partial(case_paced, size_name=s, seconds=paced_s, rate=2000, one_sender=True),
            ),
        ]
    selected = [(n, c) for n, c in cases if args.case is None or n.startswith(args.case)]
    if not selected:
        sys.exit(f"no case starts with {args.case!r}")

    base = Path(args.dir or tempfile.gettempdir())
    data = Path(tempfile.mkdtemp(prefix="cluster-bench-", dir=base))
    try:
        state = local_cluster.up(data, brokers=1, nameservers=1, flush_mode="async", console=False)
        run = Run(state.namesrv, ProcessMeter(state.brokers[0].pid), loop)
        run_async(create_topics(state.namesrv, [topic_of(s) for s in SIZES]), loop)
        for _, case in selected:
            out = case(run)
            if out is not None:

                async def wrap(aw: Awaitable[None] = out) -> None:
                    await aw

                run_async(wrap(), loop)
    finally:
        with contextlib.suppress(Exception):
            local_cluster.down(data)
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
