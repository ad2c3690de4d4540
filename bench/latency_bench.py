"""End-to-end latency at a moderate, paced rate, and where each message's time and CPU go.

Three processes per case: this one publishes, a server in the middle, a consumer in a child
process of its own (this file run with ``--role consumer``). Each body is 1 KiB and starts with
the 8-byte little-endian wall-clock time (``time.time_ns()``) of its send; the consumer takes
``now - stamp`` for each message (the processes share the host's clock). Before the measured
phase the consumer has its queues (``READY``) and has received a few hundred warm-up messages
(``WARMED``), so connections, routes and code paths are warm; the measured phase runs from just
before the first paced send to the consumer's report. The publisher paces itself: each turn
sends every message that is due by then, so several may leave in one turn.

Cases (``<rate>`` is ``--rate``, 2,000 per second unless told):

- ``e2e_paced_<rate>``: Apogee. One broker and one nameserver as separate processes
  (``apogee.local.cluster``, async flush, free ports), a topic of 8 queues; the publisher is a
  ``Producer`` calling ``send_nowait``; the consumer a ``PushConsumer`` (async listener, pulls
  and listener calls of up to 1,000 messages, as the peers' harness runs it) of a new group,
  from the earliest offset.
- ``relay_paced_<rate>``: the floor under it, with no Apogee code: a bare ``grpc.aio`` server
  in a child process (on uvloop when installed, as the services run) answers each message of
  a bidirectional stream with a small ack and forwards it to every subscriber of a
  server-streaming method, whatever is queued for a subscriber going as one message per write;
  the publisher writes each message on one stream (awaiting each write), the consumer
  subscribes. The ``broker_*`` fields are this server's.

Printed as one JSON object per line (see ``figures.emit``; ``p50_us`` and ``p99_us`` there are
the acknowledgement latencies), plus:

- ``server``: what sat in the middle; ``target_rate``, ``sent``, ``received``,
  ``achieved_rate`` (sends per second of the paced phase), ``errors`` (failed sends);
- ``e2e_p50_ms``, ``e2e_p90_ms``, ``e2e_p99_ms``, ``e2e_p999_ms``, ``e2e_max_ms``: send to the
  consumer's listener;
- ``ack_p50_ms``, ``ack_p99_ms``: ``send_nowait`` (or the write) to its acknowledgement;
- ``broker_cpu_us_per_msg``, ``publisher_cpu_us_per_msg``, ``consumer_cpu_us_per_msg``: CPU
  of each process per message (the consumer's own count, from its last warm-up message to its
  last measured one);
- ``msgs_per_request`` (the producer's batching), ``msgs_per_delivery`` (messages per
  listener call, or per forwarded write);
- ``broker_threads``: for each group of the server's threads (by name, numeric suffixes
  folded: ``uvloop_3`` is ``uvloop_N``; the process's first thread is ``main (event loop)``):
  ``threads``, ``wakeups_per_msg`` (voluntary context switches: the thread slept and was
  woken), ``preempted_per_msg`` (involuntary ones) and ``cpu_us_per_msg``; a thread that
  starts during the phase counts from zero, one that ends counts nothing;
- ``publisher_wakeups_per_msg``, ``consumer_wakeups_per_msg``: the same, all threads together;
- ``sys_busy_cores``, ``steal_cores``: the machine's busy cores during the phase (``/proc/stat``);
- ``loop``: the publisher's event loop (asyncio unless ``--loop uvloop``; the consumer runs on the
  same kind; the servers run on uvloop when it is installed, as the services do).

    python bench/latency_bench.py                  # both cases, 8 s each
    python bench/latency_bench.py --quick          # 3 s each
    python bench/latency_bench.py --case relay --rate 5000 --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from figures import ProcessMeter, emit, loop_name, percentile, run_async
from load import create_topics

from apogee.client import Message, Producer, PushConsumer, ReceivedMessage, SendResult
from apogee.local import cluster as local_cluster

BODY = 1024
QUEUES = 8
WARM = 400  # warm-up messages, not measured
CONSUME_BATCH = 1000
STAMP = struct.Struct("<Q")  # send time, ns since the epoch; 0 marks a warm-up message
FRAME = struct.Struct("<I")  # relay: the length of each body in a forwarded write
ACK = struct.Struct("<Q")  # relay: the number of the message acknowledged
PAD = bytes(BODY - STAMP.size)
WARM_BODY = STAMP.pack(0) + PAD
RELAY = "relay.Relay"
PUBLISH = f"/{RELAY}/Publish"
SUBSCRIBE = f"/{RELAY}/Subscribe"
TICK = os.sysconf("SC_CLK_TCK")
START_TIMEOUT_S = 30.0
ACK_TIMEOUT_S = 30.0


# -- where the time goes: threads and cores, from /proc ------------------------------------------


@dataclass(frozen=True)
class ThreadStat:
    group: str
    voluntary: int
    involuntary: int
    cpu_ticks: int


def thread_group(pid: int, tid: int, comm: str) -> str:
    if tid == pid:
        return "main (event loop)"
    return re.sub(r"([_-])\d+$", r"\1N", comm)


def threads_of(pid: int) -> dict[int, ThreadStat]:
    """Every thread of ``pid`` now, by thread id (those that end while read are left out)."""
    out: dict[int, ThreadStat] = {}
    task = Path(f"/proc/{pid}/task")
    try:
        tids = [int(t) for t in os.listdir(task)]
    except OSError:
        return out
    for tid in tids:
        try:
            comm = (task / str(tid) / "comm").read_text().strip()
            status = (task / str(tid) / "status").read_text()
            stat = (task / str(tid) / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        switches = dict(
            line.split(":", 1) for line in status.splitlines() if "ctxt_switches" in line
        )
        out[tid] = ThreadStat(
            thread_group(pid, tid, comm),
            int(switches.get("voluntary_ctxt_switches", "0")),
            int(switches.get("nonvoluntary_ctxt_switches", "0")),
            int(stat[11]) + int(stat[12]),  # utime, stime
        )
    return out


def thread_groups(
    before: dict[int, ThreadStat], after: dict[int, ThreadStat], messages: int
) -> dict[str, dict[str, float]]:
    """Per group of threads: how many, and their wake-ups, preemptions and CPU per message."""
    sums: dict[str, list[float]] = {}
    zero = ThreadStat("", 0, 0, 0)
    for tid in before.keys() | after.keys():
        end = after.get(tid) or before[tid]  # ended: its last reading
        start = before.get(tid, zero)  # started: from zero
        s = sums.setdefault(end.group, [0, 0, 0, 0])
        s[0] += 1
        s[1] += end.voluntary - start.voluntary
        s[2] += end.involuntary - start.involuntary
        s[3] += end.cpu_ticks - start.cpu_ticks
    n = max(messages, 1)
    rows = {
        group: {
            "threads": int(s[0]),
            "wakeups_per_msg": round(s[1] / n, 2),
            "preempted_per_msg": round(s[2] / n, 2),
            "cpu_us_per_msg": round(s[3] / TICK / n * 1e6),
        }
        for group, s in sums.items()
    }
    return dict(sorted(rows.items(), key=lambda kv: (-kv[1]["cpu_us_per_msg"], kv[0])))


def wakeups(before: dict[int, ThreadStat], after: dict[int, ThreadStat], messages: int) -> float:
    groups = thread_groups(before, after, messages)
    return round(sum(g["wakeups_per_msg"] for g in groups.values()), 2)


def sys_cpu() -> tuple[float, float]:
    """Busy and stolen CPU seconds of the whole machine so far (``/proc/stat``)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = v[0] + v[1] + v[2] + v[5] + v[6]  # user nice system (idle iowait) irq softirq
    return busy / TICK, (v[7] if len(v) > 7 else 0) / TICK


@dataclass
class Snapshot:
    """Everything read at one end of the measured phase."""

    t: float
    machine: tuple[float, float]
    cpu: float
    broker_cpu: float
    broker: dict[int, ThreadStat]
    publisher: dict[int, ThreadStat]
    consumer: dict[int, ThreadStat]

    @classmethod
    def take(cls, broker: ProcessMeter, consumer_pid: int) -> Snapshot:
        return cls(
            time.perf_counter(),
            sys_cpu(),
            time.process_time(),
            broker.cpu_s(),
            threads_of(broker.pid),
            threads_of(os.getpid()),
            threads_of(consumer_pid),
        )


def where_it_went(a: Snapshot, b: Snapshot, messages: int, consumer_cpu_s: float) -> dict[str, Any]:
    n = max(messages, 1)
    dt = max(b.t - a.t, 1e-9)
    return {
        "broker_cpu_us_per_msg": round((b.broker_cpu - a.broker_cpu) / n * 1e6),
        "publisher_cpu_us_per_msg": round((b.cpu - a.cpu) / n * 1e6),
        "consumer_cpu_us_per_msg": round(consumer_cpu_s / n * 1e6),
        "broker_threads": thread_groups(a.broker, b.broker, messages),
        "publisher_wakeups_per_msg": wakeups(a.publisher, b.publisher, messages),
        "consumer_wakeups_per_msg": wakeups(a.consumer, b.consumer, messages),
        "sys_busy_cores": round((b.machine[0] - a.machine[0]) / dt, 2),
        "steal_cores": round((b.machine[1] - a.machine[1]) / dt, 2),
    }


# -- the consumer (child process) ----------------------------------------------------------------


class Tally:
    """The consumer's count: warm-up messages until ``warm`` (then ``WARMED``), then the
    latency of each measured message until ``expected``."""

    def __init__(self, warm: int, expected: int) -> None:
        self.warm = warm
        self.expected = expected
        self.warm_seen = 0
        self.deliveries = 0
        self.lat_ns: list[int] = []
        self.warmed = asyncio.Event()
        self.done = asyncio.Event()
        self.cpu = [0.0, 0.0]

    def take(self, bodies: Iterable[bytes]) -> None:
        now = time.time_ns()
        measured = False
        for body in bodies:
            (stamp,) = STAMP.unpack_from(body)
            if stamp:
                self.lat_ns.append(now - stamp)
                measured = True
            else:
                self.warm_seen += 1
                if self.warm_seen == self.warm:
                    self.cpu[0] = time.process_time()
                    print("WARMED", flush=True)
                    self.warmed.set()
        if measured:
            self.deliveries += 1
            if len(self.lat_ns) >= self.expected and not self.done.is_set():
                self.cpu[1] = time.process_time()
                self.done.set()

    async def wait(self, seconds: float) -> dict[str, Any]:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.warmed.wait(), START_TIMEOUT_S + 30)
            await asyncio.wait_for(self.done.wait(), seconds + 30)
        if not self.done.is_set():
            self.cpu[1] = time.process_time()
        ms = sorted(x / 1e6 for x in self.lat_ns)
        return {
            "count": len(ms),
            "deliveries": self.deliveries,
            **{f"p{q}_ms": round(percentile(ms, f), 3) for q, f in QUANTILES.items()},
            "max_ms": round(ms[-1], 3) if ms else 0.0,
            "cpu_s": round(self.cpu[1] - self.cpu[0], 4) if self.warmed.is_set() else 0.0,
        }


QUANTILES = {"50": 0.50, "90": 0.90, "99": 0.99, "999": 0.999}


async def stdin_closed(timeout: float) -> None:
    """Return when this process's stdin reaches its end (the publisher is done), or after
    ``timeout`` seconds."""
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(reader.read(), timeout)


async def consume_apogee(args: argparse.Namespace, tally: Tally) -> None:
    async def listen(msgs: list[ReceivedMessage]) -> None:
        tally.take(m.body for m in msgs)

    consumer = PushConsumer(
        args.target,
        args.group,
        listen,
        consume_from="earliest",
        consume_batch_size=CONSUME_BATCH,
        pull_batch_size=CONSUME_BATCH,
    )
    consumer.subscribe(args.topic)
    async with consumer:
        await consumer.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(consumer.assignment()) < QUEUES:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the consumer was not given {QUEUES} queues")
            await asyncio.sleep(0.05)  # polling with a deadline
        print("READY", flush=True)
        print(json.dumps(await tally.wait(args.seconds)), flush=True)
        await stdin_closed(30.0)


async def consume_relay(args: argparse.Namespace, tally: Tally) -> None:
    async with grpc.aio.insecure_channel(args.target) as channel:
        subscribe: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(SUBSCRIBE)
        call = subscribe(b"")
        await asyncio.wait_for(call.read(), START_TIMEOUT_S)  # the server's hello
        print("READY", flush=True)

        async def read() -> None:
            while True:  # read() as for the hello: the two reading styles do not mix
                chunk = await call.read()
                if chunk is grpc.aio.EOF:
                    break
                assert isinstance(chunk, bytes)
                bodies: list[bytes] = []
                at = 0
                while at < len(chunk):
                    (size,) = FRAME.unpack_from(chunk, at)
                    bodies.append(chunk[at + FRAME.size : at + FRAME.size + size])
                    at += FRAME.size + size
                tally.take(bodies)

        reader = asyncio.create_task(read())
        try:
            print(json.dumps(await tally.wait(args.seconds)), flush=True)
            await stdin_closed(30.0)
        finally:
            call.cancel()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await reader


async def consumer_main(args: argparse.Namespace) -> None:
    tally = Tally(args.warm, args.expected)
    if args.kind == "apogee":
        await consume_apogee(args, tally)
    else:
        await consume_relay(args, tally)


# -- the relay server (child process) ------------------------------------------------------------


class Subscriber:
    def __init__(self) -> None:
        self.queued: list[bytes] = []
        self.ready = asyncio.Event()

    def push(self, framed: bytes) -> None:
        self.queued.append(framed)
        self.ready.set()


async def relay_serve() -> None:
    """Serve on a free port, print it, and stop when this process's stdin closes."""
    subscribers: set[Subscriber] = set()

    async def publish(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        n = 0
        async for body in requests:
            n += 1
            framed = FRAME.pack(len(body)) + body
            for sub in subscribers:
                sub.push(framed)
            yield ACK.pack(n)

    async def subscribe(
        request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]
    ) -> AsyncIterator[bytes]:
        sub = Subscriber()
        subscribers.add(sub)
        try:
            yield b""  # hello: subscribed
            while True:
                await sub.ready.wait()
                sub.ready.clear()
                chunk = b"".join(sub.queued)
                sub.queued.clear()
                yield chunk
        finally:
            subscribers.discard(sub)

    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        RELAY,
        {
            "Publish": grpc.stream_stream_rpc_method_handler(publish),
            "Subscribe": grpc.unary_stream_rpc_method_handler(subscribe),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await stdin_closed(24 * 3600.0)
    await server.stop(1.0)


# -- the publisher (this process) ----------------------------------------------------------------


class Child:
    """A child process of this file: lines read with a timeout; stdin closed, waited for and,
    if it lingers, killed (by its pid) on the way out."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pid = proc.pid

    @classmethod
    @contextlib.asynccontextmanager
    async def run(cls, *argv: str) -> AsyncIterator[Child]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            yield cls(proc)
        finally:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 15.0)
            except TimeoutError:
                proc.kill()
                await asyncio.wait_for(proc.wait(), 15.0)

    async def line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not raw:
            raise RuntimeError(f"child {self.pid} ended (exit code {self.proc.returncode})")
        return raw.decode().strip()

    async def expect(self, word: str, timeout: float) -> None:
        got = await self.line(timeout)
        if got != word:
            raise RuntimeError(f"child {self.pid} said {got!r}, not {word}")


async def pace(rate: int, seconds: float, send: Callable[[list[bytes]], Any]) -> tuple[int, float]:
    """Send ``rate * seconds`` stamped bodies on schedule: each turn, every body that is due
    goes to ``send`` (awaited if it returns an awaitable). Returns how many and how long."""
    total = int(rate * seconds)
    t0 = time.monotonic()
    hard = t0 + seconds + 10
    i = 0
    while i < total and time.monotonic() < hard:
        due = min(total, int((time.monotonic() - t0) * rate) + 1)
        if due > i:
            out = send([STAMP.pack(time.time_ns()) + PAD for _ in range(due - i)])
            if out is not None:
                await out
            i = due
        wait = t0 + i / rate - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)  # pacing an open loop, not synchronisation
    return i, time.monotonic() - t0


@dataclass
class Acks:
    """Acknowledgement latencies, and an event once ``expected`` have come."""

    lat_s: list[float] = field(default_factory=list)
    errors: int = 0
    expected: int = -1
    all_in: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, seconds: float, ok: bool = True) -> None:
        self.lat_s.append(seconds)
        self.errors += not ok
        if len(self.lat_s) == self.expected:
            self.all_in.set()

    async def wait(self, expected: int) -> None:
        self.expected = expected
        if len(self.lat_s) >= expected:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.all_in.wait(), ACK_TIMEOUT_S)


def report(
    case: str,
    rate: int,
    sent: int,
    pub_s: float,
    acks: Acks,
    got: dict[str, Any],
    spent: dict[str, Any],
    seconds: float,
    **extra: Any,
) -> None:
    ack = sorted(acks.lat_s)
    emit(
        case,
        sent,
        BODY,
        seconds,
        acks.lat_s,
        **extra,
        target_rate=rate,
        sent=sent,
        received=got["count"],
        achieved_rate=round(sent / pub_s) if pub_s else 0,
        errors=acks.errors + (sent - len(ack)),
        **{f"e2e_p{q}_ms": got[f"p{q}_ms"] for q in QUANTILES},
        e2e_max_ms=got["max_ms"],
        ack_p50_ms=round(percentile(ack, 0.50) * 1e3, 3),
        ack_p99_ms=round(percentile(ack, 0.99) * 1e3, 3),
        msgs_per_delivery=round(got["count"] / got["deliveries"], 1) if got["deliveries"] else 0,
        **spent,
    )


_runs = itertools.count(1)


async def case_e2e(
    namesrv: str, broker: ProcessMeter, rate: int, seconds: float, loop: str
) -> None:
    run = f"{os.getpid()}_{next(_runs)}"
    topic = f"BenchLatency_{run}"
    await create_topics(namesrv, [topic], QUEUES)
    count = int(rate * seconds)
    argv = ["--role", "consumer", "--kind", "apogee", "--target", namesrv, "--topic", topic]
    argv += ["--group", f"bench-latency-{run}", "--expected", str(count)]
    argv += ["--seconds", str(seconds), "--loop", loop]
    async with Child.run(*argv) as consumer, Producer(namesrv, group="bench-latency") as producer:
        await consumer.expect("READY", START_TIMEOUT_S + 15)
        warm = Message(topic, WARM_BODY)
        await asyncio.gather(*(producer.send(warm) for _ in range(WARM)))
        await consumer.expect("WARMED", START_TIMEOUT_S)
        acks = Acks()
        perf = time.perf_counter

        def acked(t: float) -> Callable[[SendResult | None, BaseException | None], None]:
            def callback(result: SendResult | None, error: BaseException | None) -> None:
                acks.add(perf() - t, error is None)

            return callback

        def send(bodies: list[bytes]) -> None:
            for body in bodies:
                producer.send_nowait(Message(topic, body), acked(perf()))

        stats0 = producer.stats()
        before = Snapshot.take(broker, consumer.pid)
        sent, pub_s = await pace(rate, seconds, send)
        await acks.wait(sent)
        got = json.loads(await consumer.line(seconds + 60))
        after = Snapshot.take(broker, consumer.pid)
        stats1 = producer.stats()
    requests = stats1.requests - stats0.requests
    report(
        f"e2e_paced_{rate}",
        rate,
        sent,
        pub_s,
        acks,
        got,
        where_it_went(before, after, sent, got["cpu_s"]),
        after.t - before.t,
        server="apogee broker",
        msgs_per_request=round((stats1.messages - stats0.messages) / requests, 1)
        if requests
        else None,
        loop=loop,
    )


async def case_relay(rate: int, seconds: float, loop: str) -> None:
    count = int(rate * seconds)
    async with Child.run("--role", "relay-server") as server:
        port = int(await server.line(START_TIMEOUT_S))
        address = f"127.0.0.1:{port}"
        argv = ["--role", "consumer", "--kind", "relay", "--target", address]
        argv += ["--expected", str(count), "--seconds", str(seconds), "--loop", loop]
        async with Child.run(*argv) as consumer, grpc.aio.insecure_channel(address) as channel:
            await consumer.expect("READY", START_TIMEOUT_S)
            call: grpc.aio.StreamStreamCall[bytes, bytes] = channel.stream_stream(PUBLISH)()
            acks = Acks()
            started: collections.deque[float] = collections.deque()
            perf = time.perf_counter

            async def read_acks() -> None:
                async for _ in call:
                    acks.add(perf() - started.popleft())

            reader = asyncio.create_task(read_acks())
            try:
                for _ in range(WARM):
                    started.append(perf())
                    await call.write(WARM_BODY)
                await acks.wait(WARM)
                await consumer.expect("WARMED", START_TIMEOUT_S)
                acks = Acks()

                async def send(bodies: list[bytes]) -> None:
                    for body in bodies:
                        started.append(perf())
                        await call.write(body)

                meter = ProcessMeter(server.pid)
                before = Snapshot.take(meter, consumer.pid)
                sent, pub_s = await pace(rate, seconds, send)
                await acks.wait(sent)
                got = json.loads(await consumer.line(seconds + 60))
                after = Snapshot.take(meter, consumer.pid)
            finally:
                with contextlib.suppress(Exception):
                    await call.done_writing()
                call.cancel()
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await reader
    report(
        f"relay_paced_{rate}",
        rate,
        sent,
        pub_s,
        acks,
        got,
        where_it_went(before, after, sent, got["cpu_s"]),
        after.t - before.t,
        server="grpc relay",
        msgs_per_request=1.0,
        loop=loop,
    )


# -- the run ------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rate", type=int, default=2000, help="messages per second (default 2000)")
    ap.add_argument("--seconds", type=float, default=8.0, help="paced phase (default 8 s)")
    ap.add_argument("--quick", action="store_true", help="3 s paced phases")
    ap.add_argument("--case", help="run only cases whose name starts with this")
    ap.add_argument("--repeat", type=int, default=1, help="run each case this many times")
    ap.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="asyncio",
        help="the publisher's and the consumer's event loop (default asyncio, as the peers' "
        "harness runs its clients: uvloop's timers count whole milliseconds, so pacing at "
        "sub-millisecond steps spins and the publisher's own CPU would crowd the machine)",
    )
    ap.add_argument("--dir", default=None, help="where to put the cluster (default: a temp dir)")
    hidden = argparse.SUPPRESS
    ap.add_argument("--role", choices=("consumer", "relay-server"), help=hidden)
    ap.add_argument("--kind", choices=("apogee", "relay"), help=hidden)
    ap.add_argument("--target", help=hidden)
    ap.add_argument("--topic", help=hidden)
    ap.add_argument("--group", help=hidden)
    ap.add_argument("--expected", type=int, default=0, help=hidden)
    ap.add_argument("--warm", type=int, default=WARM, help=hidden)
    args = ap.parse_args()
    loop = loop_name(args.loop)
    if args.role == "relay-server":
        run_async(relay_serve(), loop_name())
        return
    if args.role == "consumer":
        run_async(consumer_main(args), loop)
        return
    seconds = 3.0 if args.quick else args.seconds
    rate: int = args.rate
    cases: list[tuple[str, Callable[..., Coroutine[Any, Any, None]]]] = [
        (f"e2e_paced_{rate}", partial(case_e2e, rate=rate, seconds=seconds, loop=loop)),
        (f"relay_paced_{rate}", partial(case_relay, rate=rate, seconds=seconds, loop=loop)),
    ]
    selected = [(n, c) for n, c in cases if args.case is None or n.startswith(args.case)]
    if not selected:
        sys.exit(f"no case starts with {args.case!r}")
    data: Path | None = None
    try:
        namesrv, broker = "", ProcessMeter(0)
        if any(n.startswith("e2e") for n, _ in selected):
            base = Path(args.dir or tempfile.gettempdir())
            data = Path(tempfile.mkdtemp(prefix="latency-bench-", dir=base))
            state = local_cluster.up(
                data, brokers=1, nameservers=1, flush_mode="async", console=False
            )
            namesrv, broker = state.namesrv, ProcessMeter(state.brokers[0].pid)
        for _ in range(args.repeat):
            for name, case in selected:
                if name.startswith("e2e"):
                    run_async(case(namesrv, broker), loop)
                else:
                    run_async(case(), loop)
    finally:
        if data is not None:
            with contextlib.suppress(Exception):
                local_cluster.down(data)
            shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
