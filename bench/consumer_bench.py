"""Benchmark of consumption: two brokers and a nameserver as separate processes
(``apogee.local.cluster``, async flush), a topic of 8 queues (4 per broker), consumers
in this process or in processes of their own, gRPC on 127.0.0.1.

Prints one JSON object per line (see ``figures.emit``), plus ``client_cpu_s`` and
``brokers_cpu_s`` where they apply.

Cases (1 KiB bodies):

- ``backlog_pull_1``: one ``PullConsumer`` drains a backlog of ``--backlog`` messages
  (``poll`` of up to 1,024, auto commit).
- ``backlog_push_1``: one ``PushConsumer`` drains the backlog (async listener, batches of 64).
- ``backlog_group_4``: four ``PullConsumer`` processes of one group drain the backlog; the
  time is from their start until the last message is counted (rebalance included).
- ``e2e_2000``: a ``PushConsumer`` (async listener, one message per call) while a producer in
  the same process sends 2,000 messages per second, each send awaited by its own task;
  latency from just before ``send`` to the listener (after one uncounted second at the same
  rate, so that the producer's route lookup and connections are not counted).
- ``idle_to_delivery``: the consumer is idle (subscribed on its delivery streams); one message is
  sent every 100 ms; latency from just before ``send`` to the listener (after one uncounted
  message per queue, so that the producer's route lookup and connections are not counted).

    python bench/consumer_bench.py            # full run (a few minutes)
    python bench/consumer_bench.py --quick    # smaller backlog and shorter runs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import multiprocessing.synchronize
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from figures import ProcessMeter, emit, loop_name, paced, run_async
from load import create_topics

from apogee.client import Message, Producer
from apogee.client.consumer.pull import PullConsumer
from apogee.client.consumer.push import PushConsumer
from apogee.client.consumer.records import ReceivedMessage
from apogee.local import cluster as local_cluster

TOPIC = "BenchConsume"
BODY = 1024
STAMP = struct.Struct("<d")


class Brokers:
    def __init__(self, pids: list[int]) -> None:
        self.meters = [ProcessMeter(p) for p in pids]

    def cpu(self) -> float:
        return sum(m.cpu_s() for m in self.meters)


async def fill(namesrv: str, count: int) -> None:
    """``count`` messages of 1 KiB into the topic (not timed)."""
    body = os.urandom(BODY)
    async with Producer(namesrv, group="bench-fill") as producer:
        window = 4096
        pending: set[asyncio.Future[Any]] = set()
        for _ in range(count):
            pending.add(producer.send_nowait(Message(TOPIC, body, tags="TagA")))
            if len(pending) >= window:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for f in done:
                    f.result()
        if pending:
            for f in await asyncio.gather(*pending):
                assert f is not None


async def case_backlog_pull(namesrv: str, brokers: Brokers, count: int) -> None:
    consumer = PullConsumer(namesrv, "bench-pull-1", consume_from="earliest", pull_batch_size=1024)
    consumer.subscribe(TOPIC)
    got = 0
    cpu0, b0 = time.process_time(), brokers.cpu()
    start = time.perf_counter()
    async with consumer:
        await consumer.start()
        while got < count:
            got += len(await consumer.poll(timeout=5.0, max_messages=1024))
        seconds = time.perf_counter() - start
    emit(
        "backlog_pull_1",
        got,
        BODY,
        seconds,
        [],
        client_cpu_s=round(time.process_time() - cpu0, 2),
        brokers_cpu_s=round(brokers.cpu() - b0, 2),
    )


async def case_backlog_push(namesrv: str, brokers: Brokers, count: int) -> None:
    got = 0
    done = asyncio.Event()

    async def listen(msgs: list[ReceivedMessage]) -> None:
        nonlocal got
        got += len(msgs)
        if got >= count:
            done.set()

    consumer = PushConsumer(
        namesrv,
        "bench-push-1",
        listen,
        consume_from="earliest",
        consume_batch_size=64,
        pull_batch_size=1024,
        max_cached_messages_per_queue=4096,
    )
    consumer.subscribe(TOPIC)
    cpu0, b0 = time.process_time(), brokers.cpu()
    start = time.perf_counter()
    async with consumer:
        await consumer.start()
        await asyncio.wait_for(done.wait(), 600)
        seconds = time.perf_counter() - start
    emit(
        "backlog_push_1",
        got,
        BODY,
        seconds,
        [],
        client_cpu_s=round(time.process_time() - cpu0, 2),
        brokers_cpu_s=round(brokers.cpu() - b0, 2),
    )


def _group_member(
    namesrv: str, total: Any, target: int, stop: multiprocessing.synchronize.Event
) -> None:
    async def run() -> None:
        consumer = PullConsumer(
            namesrv, "bench-group-4", consume_from="earliest", pull_batch_size=1024
        )
        consumer.subscribe(TOPIC)
        async with consumer:
            await consumer.start()
            while not stop.is_set():
                n = len(await consumer.poll(timeout=0.2, max_messages=1024))
                if n:
                    with total.get_lock():
                        total.value += n
                        if total.value >= target:
                            stop.set()

    asyncio.run(run())


def case_backlog_group(namesrv: str, brokers: Brokers, count: int) -> None:
    ctx = multiprocessing.get_context("spawn")
    total = ctx.Value("q", 0)
    stop = ctx.Event()
    b0 = brokers.cpu()
    start = time.perf_counter()
    procs = [
        ctx.Process(target=_group_member, args=(namesrv, total, count, stop)) for _ in range(4)
    ]
    for p in procs:
        p.start()
    stop.wait(600)
    seconds = time.perf_counter() - start
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    emit(
        "backlog_group_4",
        int(total.value),
        BODY,
        seconds,
        [],
        brokers_cpu_s=round(brokers.cpu() - b0, 2),
        note="time includes starting 4 processes and the group's first rebalance",
    )


async def case_e2e(namesrv: str, brokers: Brokers, seconds: float, rate: int) -> None:
    lat: list[float] = []

    async def listen(msgs: list[ReceivedMessage]) -> None:
        now = time.perf_counter()
        for m in msgs:
            lat.append(now - STAMP.unpack_from(m.body)[0])

    consumer = PushConsumer(namesrv, "bench-e2e", listen)
    consumer.subscribe(TOPIC)
    pad = os.urandom(BODY - STAMP.size)
    tasks: set[asyncio.Future[Any]] = set()  # only those still running, as an app would

    async def send_paced(producer: Producer, count: int) -> None:
        """``count`` sends at ``rate``, each awaited by its own task; returns once the listener
        has them all (or after 10 s more)."""
        async for _ in paced(rate, count):
            body = STAMP.pack(time.perf_counter()) + pad
            task = asyncio.ensure_future(producer.send(Message(TOPIC, body)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        deadline = time.perf_counter() + 10
        while len(lat) < count and time.perf_counter() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # the last messages in flight: poll with a deadline

    async with consumer, Producer(namesrv, group="bench-e2e") as producer:
        await consumer.start()
        await asyncio.sleep(1.0)  # the consumer has subscribed its queues at the brokers
        # a second of the same rate first, not counted: the producer's route lookup, its
        # connections and the first requests on each stream are not what this case measures
        await send_paced(producer, rate)
        lat.clear()
        total = int(seconds * rate)
        cpu0, b0 = time.process_time(), brokers.cpu()
        start = time.perf_counter()
        await send_paced(producer, total)
        elapsed = time.perf_counter() - start
        client_cpu, brokers_cpu = time.process_time() - cpu0, brokers.cpu() - b0
    emit(
        f"e2e_{rate}",
        len(lat),
        BODY,
        elapsed,
        lat,
        sent=total,
        client_cpu_s=round(client_cpu, 2),
        brokers_cpu_s=round(brokers_cpu, 2),
    )


async def case_idle(namesrv: str, samples: int) -> None:
    lat: list[float] = []
    arrived = asyncio.Event()

    async def listen(msgs: list[ReceivedMessage]) -> None:
        now = time.perf_counter()
        for m in msgs:
            lat.append(now - STAMP.unpack_from(m.body)[0])
        arrived.set()

    consumer = PushConsumer(namesrv, "bench-idle", listen)
    consumer.subscribe(TOPIC)
    pad = os.urandom(BODY - STAMP.size)
    async with consumer, Producer(namesrv, group="bench-idle") as producer:
        await consumer.start()
        await asyncio.sleep(1.0)
        # one message per queue first, not counted: the producer's route lookup and its
        # connection to each broker are not what this case measures
        for _ in range(8):
            arrived.clear()
            await producer.send(Message(TOPIC, STAMP.pack(time.perf_counter()) + pad))
            await asyncio.wait_for(arrived.wait(), 10)
        lat.clear()
        start = time.perf_counter()
        for _ in range(samples):
            arrived.clear()
            await asyncio.sleep(0.1)  # idle: nothing moves on the delivery streams
            await producer.send(Message(TOPIC, STAMP.pack(time.perf_counter()) + pad))
            await asyncio.wait_for(arrived.wait(), 10)
        elapsed = time.perf_counter() - start
    emit("idle_to_delivery", len(lat), BODY, elapsed, lat)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backlog", type=int, default=None)
    ap.add_argument("--case", help="run only cases whose name starts with this")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    backlog = args.backlog or (50_000 if args.quick else 200_000)
    e2e_s = 3.0 if args.quick else 10.0
    idle_n = 50 if args.quick else 200

    def wanted(name: str) -> bool:
        return args.case is None or name.startswith(args.case)

    loop = loop_name()

    base = Path(args.dir or tempfile.gettempdir())
    data = Path(tempfile.mkdtemp(prefix="consumer-bench-", dir=base))
    try:
        state = local_cluster.up(data, brokers=2, nameservers=1, flush_mode="async", console=False)
        brokers = Brokers([b.pid for b in state.brokers])
        namesrv = state.namesrv

        async def setup() -> None:
            await create_topics(namesrv, [TOPIC], 4)
            if any(wanted(n) for n in ("backlog_pull", "backlog_push", "backlog_group")):
                t = time.perf_counter()
                await fill(namesrv, backlog)
                print(
                    f"# backlog of {backlog} filled in {time.perf_counter() - t:.1f}s",
                    file=sys.stderr,
                )

        run_async(setup(), loop)
        if wanted("backlog_pull"):
            run_async(case_backlog_pull(namesrv, brokers, backlog), loop)
        if wanted("backlog_push"):
            run_async(case_backlog_push(namesrv, brokers, backlog), loop)
        if wanted("backlog_group"):
            case_backlog_group(namesrv, brokers, backlog)
        if wanted("e2e"):
            run_async(case_e2e(namesrv, brokers, e2e_s, 2000), loop)
        if wanted("idle"):
            run_async(case_idle(namesrv, idle_n), loop)
    finally:
        with contextlib.suppress(Exception):
            local_cluster.down(data)
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
