"""Benchmark of the console's API: latency of ``GET /api/v1/groups/{name}`` (a group's
members and per-queue lag, gathered from every broker) on a cluster of a realistic size.

A nameserver and two brokers as separate processes (``apogee.local.cluster``), 100 topics
of 8 queues on each broker, one message in every queue, 20 groups each with committed offsets
on 5 topics (80 queue rows per description, some lag), and the console as a real process
(``python -m apogee_console``, uvicorn, its sampler running every 5 s as in production).
Requests come from httpx in this process: ``--requests`` one at a time (``c1``: the latency a
user sees), then the same with ``--concurrency`` in flight (``c8``: the throughput).

Prints one JSON line per case (see ``figures.emit``: ``messages`` = requests, ``msg_bytes`` =
mean answer size) with ``p50_ms``, ``p99_ms``, ``requests_per_s``, ``console_cpu_s`` and
``target_p99_ms`` (200) / ``ok``; and one line for ``GET /api/v1/topics`` (100 topics described).

    python bench/console_bench.py             # about a minute
    python bench/console_bench.py --quick     # fewer requests
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from figures import ProcessMeter, emit, loop_name, run_async

from apogee.client import AdminClient, Message, Producer
from apogee.local import cluster as local_cluster
from apogee.testkit.ports import free_port

TOPICS = 100
QUEUES = 8
GROUPS = 20
TOPICS_PER_GROUP = 5
TARGET_P99_MS = 200.0


async def populate(namesrv: str) -> None:
    """Topics, a message in every queue, and groups with committed offsets."""
    names = [f"BenchTopic{i:03d}" for i in range(TOPICS)]
    gate = asyncio.Semaphore(16)
    async with AdminClient(namesrv, timeout=10) as admin:

        async def create(name: str) -> None:
            async with gate:
                await admin.create_or_update_topic(name, queues=QUEUES)

        await asyncio.gather(*map(create, names))
        deadline = time.monotonic() + 60
        while len(set(names) & set(await admin.list_topics())) < TOPICS:
            if time.monotonic() > deadline:
                raise RuntimeError("the topics were not routed within 60 s")
            await asyncio.sleep(0.2)  # waiting for registration, with a deadline
        async with Producer(namesrv, "console-bench") as producer:
            sends = [
                producer.send(Message(name, b"x" * 100, keys=f"k{i}"))
                for name in names
                for i in range(2 * QUEUES * 2)
            ]
            await asyncio.gather(*sends)

        async def commit(g: int) -> None:
            for t in range(TOPICS_PER_GROUP):
                async with gate:
                    topic = names[(g * TOPICS_PER_GROUP + t) % TOPICS]
                    # half-way: earliest on some topics, latest on others (lag on some queues)
                    await admin.reset_offsets(
                        f"bench-group-{g:02d}", topic, earliest=t % 2 == 0, latest=t % 2 == 1
                    )

        await asyncio.gather(*(commit(g) for g in range(GROUPS)))


def start_console(namesrv: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("APOGEE_")}
    env["APOGEE_CONSOLE_METRICS_LISTEN"] = ""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "apogee_console", "--listen", f"127.0.0.1:{port}",
             "--namesrv", namesrv, "--log-level", "WARNING"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the console did not start:\n{log.read_text()}")
        time.sleep(0.1)  # waiting for the process to serve, with a deadline


async def measure(
    client: httpx.AsyncClient, paths: list[str], requests: int, concurrency: int
) -> tuple[float, list[float], int]:
    """(seconds, latencies, bytes) of ``requests`` GETs cycling over ``paths``."""
    lat: list[float] = []
    size = 0
    it = iter(range(requests))

    async def worker() -> None:
        nonlocal size
        for i in it:
            t = time.perf_counter()
            resp = await client.get(paths[i % len(paths)])
            lat.append(time.perf_counter() - t)
            if resp.status_code != 200:
                raise RuntimeError(f"{paths[i % len(paths)]}: {resp.status_code} {resp.text}")
            size += len(resp.content)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0, lat, size


async def bench(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="apogee-console-bench-"))
    data = root / "cluster"
    state = await asyncio.to_thread(
        local_cluster.up,
        data,
        brokers=2,
        nameservers=1,
        timeout=90.0,
        broker_env={"APOGEE_BROKER_AUTO_CREATE_TOPICS": "false"},
        schedule=False,
        txn_checker=False,
        console=False,  # the console measured is started below
    )
    proc: subprocess.Popen[bytes] | None = None
    try:
        await populate(state.namesrv)
        proc, base = await asyncio.to_thread(start_console, state.namesrv, root / "console.log")
        assert proc is not None
        meter = ProcessMeter(proc.pid)
        brokers = [ProcessMeter(b.pid) for b in state.brokers]
        groups = [f"/api/v1/groups/bench-group-{g:02d}" for g in range(GROUPS)]
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            first = (await client.get(groups[0])).json()
            rows = len(first["queues"])
            await measure(client, groups, 50, 4)  # warm up
            for case, concurrency in (("c1", 1), (f"c{args.concurrency}", args.concurrency)):
                cpu0, bcpu0, own0 = meter.cpu_s(), _cpu(brokers), time.process_time()
                seconds, lat, size = await measure(client, groups, args.requests, concurrency)
                cpu = meter.cpu_s() - cpu0
                _emit(
                    f"console_group_describe_{case}",
                    seconds,
                    lat,
                    size,
                    cpu,
                    queue_rows=rows,
                    concurrency=concurrency,
                    brokers_cpu_s=round(_cpu(brokers) - bcpu0, 2),
                    client_cpu_s=round(time.process_time() - own0, 2),
                    load_average=round(os.getloadavg()[0], 2),
                )
            seconds, lat, size = await measure(client, ["/api/v1/topics"], args.requests // 50, 1)
            _emit("console_topic_list_c1", seconds, lat, size, 0.0, topics=TOPICS)
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        await asyncio.to_thread(local_cluster.down, data)
        shutil.rmtree(root, ignore_errors=True)


def _cpu(meters: list[ProcessMeter]) -> float:
    return sum(m.cpu_s() for m in meters)


def _emit(case: str, seconds: float, lat: list[float], size: int, cpu: float, **extra: Any) -> None:
    lat.sort()
    n = len(lat)
    p50 = lat[n // 2] * 1000
    p99 = lat[min(n - 1, int(0.99 * n))] * 1000
    emit(
        case,
        n,
        size // max(1, n),
        seconds,
        lat,
        p50_ms=round(p50, 2),
        p99_ms=round(p99, 2),
        requests_per_s=round(n / seconds, 1),
        console_cpu_s=round(cpu, 2),
        target_p99_ms=TARGET_P99_MS,
        ok=p99 <= TARGET_P99_MS,
        **extra,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--quick", action="store_true", help="400 requests per case")
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default=None)
    args = p.parse_args()
    if args.quick:
        args.requests = 400
    run_async(bench(args), loop_name(args.loop))


if __name__ == "__main__":
    main()
