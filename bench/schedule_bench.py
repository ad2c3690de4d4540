"""Benchmark of timer-message lateness: a nameserver, one broker and the schedule service as
separate processes (``python -m apogee_nameserver``, ``python -m apogee_broker``,
``python -m apogee_schedule``, the broker with its default timer wheel and async flush),
timer messages sent with ``Broker.SendMessages`` (up to 256 per call), and every queue of the
topic read back by long-polling pulls.

Lateness of a message = the store timestamp of its delivered copy (stamped by the broker when
the schedule service had it stored in the real topic) minus the ``deliver_at_ms`` it asked for.
It counts the service's reaction and the broker's append, not the consumer's pull. ``early``
counts copies stored before their time (must be 0); ``duplicates`` copies beyond the first.

Prints one JSON object per line: ``case, messages, delivered, duplicates, missing, early,
lateness_p50_ms, lateness_p99_ms, lateness_max_ms, lateness_mean_ms, send_s, seconds,
schedule_cpu_s, broker_cpu_s, schedule_rss_mb, loop``.

Cases:

- ``burst_10000_in_2s``: 10,000 timer messages, all sent first, due within the same 2 s
  (evenly spread), 3 s after the sending began.
- ``steady_1000_per_s``: 1,000 timer messages per second (a call of 50 every 50 ms) for
  60 s (15 s with ``--quick``), each due a random 5 to 10 s after it was sent.

    python bench/schedule_bench.py            # about two minutes
    python bench/schedule_bench.py --quick    # about 40 s
    python bench/schedule_bench.py --case burst
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpc.aio
from figures import ProcessMeter, loop_name, percentile, run_async

from apogee.client.consumer.records import decode_records
from apogee.rpc.mux import MuxClient
from apogee.rpc.server import CLIENT_OPTIONS, check_health
from apogee.testkit.ports import free_port
from apogee.testkit.processes import service_env
from apogee.testkit.waiting import eventually
from apogee.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    consumer_pb2,
    nameserver_pb2,
    nameserver_pb2_grpc,
)

TOPIC = "BenchTimers"
QUEUES = 4
BATCH = 256
BODY_PAD = 120
#: the body starts with the requested time, so each delivered copy says when it was due
DUE = struct.Struct(">q")
START_TIMEOUT = 30.0


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Processes:
    """The three services, each its own process with its log under ``data``."""

    def __init__(self, data: Path) -> None:
        self.data = data
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.nameserver = f"127.0.0.1:{free_port()}"
        self.broker = f"127.0.0.1:{free_port()}"
        self.schedule = f"127.0.0.1:{free_port()}"

    def spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        """``python -m <args>``: this environment without its ``APOGEE_*`` variables, metrics
        on free ports, then ``env``."""
        with (self.data / f"{name}.log").open("wb") as out:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=service_env(env),
            )

    def tail(self, name: str) -> str:
        lines = (self.data / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(lines[-20:])

    async def wait_healthy(self, name: str, address: str) -> None:
        async def healthy() -> bool:
            if await check_health(address, 1.0):
                return True
            proc = self.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.tail(name)}")
            return False

        await eventually(healthy, START_TIMEOUT, f"{name} healthy", every=0.1)

    async def start(self) -> None:
        self.spawn("nameserver", ["apogee_nameserver", "--listen", self.nameserver], {})
        await self.wait_healthy("nameserver", self.nameserver)
        self.spawn(
            "broker",
            [
                "apogee_broker",
                "--listen",
                self.broker,
                "--name",
                "broker-a",
                "--data-dir",
                str(self.data / "broker-a"),
                "--namesrv",
                self.nameserver,
            ],
            {"APOGEE_BROKER_FLUSH_MODE": "async"},
        )
        await self.wait_healthy("broker", self.broker)
        await self.wait_registered()
        self.spawn(
            "schedule",
            [
                "apogee_schedule",
                "--namesrv",
                self.nameserver,
                "--listen",
                self.schedule,
                "--lock-file",
                str(self.data / "schedule.lock"),
            ],
            {},
        )
        await self.wait_healthy("schedule", self.schedule)  # SERVING: it is the active one

    async def wait_registered(self) -> None:
        async with grpc.aio.insecure_channel(self.nameserver) as ch:
            stub = nameserver_pb2_grpc.NameServerStub(ch)

            async def registered() -> bool:
                info = await stub.GetClusterInfo(nameserver_pb2.GetClusterInfoRequest(), timeout=2)
                return bool(info.brokers)

            await eventually(registered, START_TIMEOUT, "the broker registered", every=0.1)

    def stop(self) -> None:
        for name in ("schedule", "broker", "nameserver"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


async def no_unary() -> consumer_pb2.PullResponse:
    raise RuntimeError("the broker serves Consumer.PullStream")


class Bench:
    def __init__(self, procs: Processes, loop_name: str) -> None:
        self.procs = procs
        self.loop_name = loop_name
        self.channel = grpc.aio.insecure_channel(procs.broker, options=CLIENT_OPTIONS)
        self.broker = broker_pb2_grpc.BrokerStub(self.channel)
        self.pulls: MuxClient[consumer_pb2.PullResponse] = MuxClient(
            self.channel,
            "/apogee.v1.Consumer/PullStream",
            consumer_pb2.PullStreamResponse.FromString,
            "broker",
        )
        self.offsets = [0] * QUEUES
        #: copies seen again by the last consume
        self.dups = 0
        self.schedule_meter = ProcessMeter(procs.procs["schedule"].pid)
        self.broker_meter = ProcessMeter(procs.procs["broker"].pid)

    async def create_topic(self) -> None:
        await broker_pb2_grpc.BrokerAdminStub(self.channel).PutTopic(
            broker_pb2.PutTopicRequest(
                topic=common_pb2.TopicConfig(
                    name=TOPIC, read_queues=QUEUES, write_queues=QUEUES, perm=6
                )
            ),
            timeout=10,
        )

    async def send(self, due: list[int]) -> None:
        """One call per ``BATCH`` messages, round robin over the queues."""
        pad = b"x" * BODY_PAD
        for start in range(0, len(due), BATCH):
            msgs = [
                common_pb2.Message(
                    topic=TOPIC,
                    body=DUE.pack(t) + pad,
                    queue_id=(start + i) % QUEUES,
                    deliver_at_ms=t,
                )
                for i, t in enumerate(due[start : start + BATCH])
            ]
            reply = await self.broker.SendMessages(
                broker_pb2.SendMessagesRequest(messages=msgs), timeout=10
            )
            bad = [r.status.message for r in reply.results if r.status.code]
            if bad:
                raise RuntimeError(f"{len(bad)} sends failed; first: {bad[0]}")

    async def consume(self, expected: int, deadline_ms: int) -> dict[str, tuple[int, int]]:
        """Pull every queue until ``expected`` distinct messages came (or the deadline): unique
        id -> (due, store timestamp) of its first copy; duplicates counted in ``self.dups``."""
        seen: dict[str, tuple[int, int]] = {}
        self.dups = 0

        async def one(q: int) -> None:
            while len(seen) < expected and now_ms() < deadline_ms:
                hold = max(0, min(1000, deadline_ms - now_ms()))
                request = consumer_pb2.PullRequest(
                    group="bench",
                    client_id="bench",
                    topic=TOPIC,
                    queue_id=q,
                    offset=self.offsets[q],
                    max_messages=1024,
                    hold_ms=hold,
                )
                reply = await self.pulls.call(
                    request.SerializeToString(), hold / 1000 + 10, no_unary
                )
                if reply.records:
                    for m in decode_records(reply.records, "broker-a", TOPIC, q, self.offsets[q]):
                        uid = m.unique_id
                        if uid in seen:
                            self.dups += 1
                        else:
                            seen[uid] = (DUE.unpack_from(m.body)[0], m.store_timestamp_ms)
                self.offsets[q] = reply.next_offset

        await asyncio.gather(*(one(q) for q in range(QUEUES)))
        return seen

    def report(
        self,
        case: str,
        messages: int,
        seen: dict[str, tuple[int, int]],
        send_s: float,
        seconds: float,
        cpu: tuple[float, float],
    ) -> None:
        lateness = sorted(float(stored - due) for due, stored in seen.values())
        row: dict[str, Any] = {
            "case": case,
            "messages": messages,
            "delivered": len(seen),
            "duplicates": self.dups,
            "missing": messages - len(seen),
            "early": sum(1 for x in lateness if x < 0),
            "lateness_p50_ms": percentile(lateness, 0.50),
            "lateness_p99_ms": percentile(lateness, 0.99),
            "lateness_max_ms": lateness[-1] if lateness else 0.0,
            "lateness_mean_ms": round(sum(lateness) / len(lateness), 1) if lateness else 0.0,
            "send_s": round(send_s, 2),
            "seconds": round(seconds, 2),
            "schedule_cpu_s": round(self.schedule_meter.cpu_s() - cpu[0], 2),
            "broker_cpu_s": round(self.broker_meter.cpu_s() - cpu[1], 2),
            "schedule_rss_mb": round(self.schedule_meter.rss_mb(), 1),
            "loop": self.loop_name,
        }
        print(json.dumps(row), flush=True)

    def cpu_mark(self) -> tuple[float, float]:
        return self.schedule_meter.cpu_s(), self.broker_meter.cpu_s()

    async def close(self) -> None:
        await self.pulls.close()
        await self.channel.close(grace=None)


async def case_burst(bench: Bench, count: int, spread_ms: int, ahead_ms: int) -> None:
    cpu = bench.cpu_mark()
    t0 = now_ms()
    start = t0 + ahead_ms
    due = [start + (i * spread_ms) // count for i in range(count)]
    random.Random(1).shuffle(due)  # arrival order is not due order
    sent = time.perf_counter()
    await bench.send(due)
    send_s = time.perf_counter() - sent
    seen = await bench.consume(count, start + spread_ms + 30_000)
    bench.report(
        f"burst_{count}_in_{spread_ms // 1000}s",
        count,
        seen,
        send_s,
        (now_ms() - t0) / 1000,
        cpu,
    )


async def case_steady(bench: Bench, rate: int, seconds: float) -> None:
    cpu = bench.cpu_mark()
    rng = random.Random(2)
    tick_s = 0.05
    per_tick = int(rate * tick_s)
    ticks = int(seconds / tick_s)
    count = ticks * per_tick
    t0 = now_ms()

    async def producer() -> None:
        began = time.monotonic()
        for i in range(ticks):
            wait = began + i * tick_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)  # pacing the sender
            now = now_ms()
            await bench.send([now + rng.randint(5_000, 10_000) for _ in range(per_tick)])

    sending = asyncio.create_task(producer())
    deadline = t0 + int(seconds * 1000) + 10_000 + 30_000
    seen = await bench.consume(count, deadline)
    await sending
    bench.report(f"steady_{rate}_per_s", count, seen, seconds, (now_ms() - t0) / 1000, cpu)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="the steady case for 15 s, not 60 s")
    ap.add_argument("--case", help="run only cases whose name starts with this")
    ap.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default=None,
        help="this process's event loop (default: uvloop when installed)",
    )
    ap.add_argument("--dir", default=None, help="where to put the data (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the data and the services' logs")
    args = ap.parse_args()
    loop = loop_name(args.loop)
    steady_s = 15.0 if args.quick else 60.0
    cases: list[tuple[str, Callable[[Bench], Coroutine[Any, Any, None]]]] = [
        ("burst", lambda b: case_burst(b, 10_000, 2_000, 3_000)),
        ("steady", lambda b: case_steady(b, 1_000, steady_s)),
    ]
    selected = [(n, c) for n, c in cases if args.case is None or n.startswith(args.case)]
    if not selected:
        sys.exit(f"no case starts with {args.case!r}")

    base = Path(args.dir or tempfile.gettempdir())
    data = Path(tempfile.mkdtemp(prefix="schedule-bench-", dir=base))
    procs = Processes(data)

    async def run() -> None:
        await procs.start()
        bench = Bench(procs, loop)
        try:
            await bench.create_topic()
            for _, case in selected:
                await case(bench)
        finally:
            await bench.close()

    try:
        run_async(run(), loop)
    finally:
        with contextlib.suppress(Exception):
            procs.stop()
        if args.keep:
            print(f"data and logs kept in {data}", file=sys.stderr)
        else:
            shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
