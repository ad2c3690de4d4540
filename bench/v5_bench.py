"""Benchmark of the public RocketMQ 5 protocol (``apache.rocketmq.v2``) next to Apogee's own SDK,
in one run against one local cluster: one nameserver and one broker as separate processes
(``apogee.local.cluster``, async flush, no schedule service, transaction checker or console;
on free ports, not the defaults), a topic of 8 queues per side, 1 KiB bodies with a tag,
gRPC on 127.0.0.1.

The official Python client (``rocketmq-python-client``) runs in child processes of its own
(this script again, with ``--child``), each with a ``HOME`` of its own under the cluster's
temporary directory (the client writes its log under ``$HOME/logs`` from the moment it is
imported), so that its CPU is counted apart from the broker's and from this process's. Apogee's
SDK runs in this process.

Prints one JSON object per line (see ``figures.emit``), plus ``client_cpu_s``,
``broker_cpu_s`` and the same per message (``client_cpu_us_per_msg``,
``broker_cpu_us_per_msg``: CPU microseconds of the client's process and of the broker's per
message counted). ``rss_mb`` is the peak memory of the process that ran the client (the child
for the ``v5_`` cases). Throughput counts until every send has its result, or every message is
acked (``v5_receive_ack``) or handed over (``sdk_consume``).

Cases:

- ``v5_send``: one official ``Producer``, ``send`` (synchronous) in ``--threads`` threads (8),
  one new ``Message`` per send; latency of one ``send``.
- ``v5_send_async``: the same producer, ``send_async`` from one thread with at most
  ``--window`` (64) futures unsettled; latency from ``send_async`` to the future's callback.
  Neither way of sending beats the other beyond run-to-run noise (both keep the broker's core
  busy; more threads or a larger window only add latency), so ``v5_send`` is the figure to
  quote: it has the same rate and a send's own latency.
- ``v5_receive_ack``: one official ``SimpleConsumer`` (started before the sends, so that its
  group starts at the topic's first message) shared by ``--receivers`` threads (4), each looping
  ``receive(32, 30)`` then ``ack`` of each message, drains what the two cases above sent
  (the warm-up sends included); latency of one ``receive`` call, ``ack_p50_us``/``ack_p99_us``
  of one ``ack``.
- ``sdk_send``: Apogee's ``Producer``, ``send_nowait`` with at most ``--sdk-window`` (4,096)
  sends unsettled (``load.windowed_sends``; the SDK batches them: ``msgs_per_request``); the
  latency of one send in 16.
- ``sdk_send_sync_8``: Apogee's ``SyncProducer`` shared by 8 threads, each calling ``send``
  (nearer to the official client's one message per request); latency of one ``send``.
- ``sdk_consume``: one Apogee ``PullConsumer`` (``poll`` of up to 1,024, auto commit of
  offsets, no per-message ack) drains what the two SDK cases sent.

The official client sends one message per ``SendMessage`` request and acks one message per
``AckMessage`` request, so every message costs the broker a whole unary call (set the
``broker_cpu_us_per_msg`` figures against ``grpc_floor_bench.py``'s ``unary_1``). On two cores
the client and the broker each keep about one busy, and the rates are what that allows.

    python bench/v5_bench.py            # full run (a few minutes)
    python bench/v5_bench.py --quick    # under a minute
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from figures import ProcessMeter, emit, percentile
from load import create_topics, windowed_sends

from apogee.client import AdminClient, Message, Producer, SyncProducer
from apogee.client.consumer.pull import PullConsumer
from apogee.common.errors import ApogeeError
from apogee.local import cluster as local_cluster
from apogee.local.ports import PORTS_FILE
from apogee.testkit.ports import free_port
from apogee.testkit.waiting import eventually

BODY = 1024
TAG = "TagA"
V5_TOPIC = "BenchV5"
SDK_TOPIC = "BenchV5Sdk"
V5_GROUP = "bench-v5-simple"
SDK_GROUP = "bench-v5-pull"
WARM_UP = 200
#: the SDK's async sends: the latency of one in SAMPLE is measured
SAMPLE = 16
#: how long a child may take to start, and a drain to finish
START_TIMEOUT_S = 30.0
DRAIN_TIMEOUT_S = 600.0


@dataclass
class Outcome:
    """What one measured loop did."""

    messages: int
    seconds: float
    latencies: list[float]
    errors: int
    client_cpu_s: float
    broker_cpu_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def emit_outcome(case: str, out: Outcome, **extra: Any) -> None:
    per = 1e6 / out.messages if out.messages else 0.0
    emit(
        case,
        out.messages,
        BODY,
        out.seconds,
        out.latencies,
        errors=out.errors,
        client_cpu_s=round(out.client_cpu_s, 2),
        broker_cpu_s=round(out.broker_cpu_s, 2),
        client_cpu_us_per_msg=round(out.client_cpu_s * per, 1),
        broker_cpu_us_per_msg=round(out.broker_cpu_s * per, 1),
        **out.extra,
        **extra,
    )


class Marks:
    """This process's CPU, the broker's CPU and the clock, from a starting point."""

    def __init__(self, broker: ProcessMeter) -> None:
        self.broker = broker
        self.cpu0, self.broker0 = time.process_time(), broker.cpu_s()
        self.t0 = time.perf_counter()

    def outcome(self, messages: int, lat: list[float], errors: int, **extra: Any) -> Outcome:
        seconds = time.perf_counter() - self.t0
        client, broker = time.process_time() - self.cpu0, self.broker.cpu_s() - self.broker0
        return Outcome(messages, seconds, lat, errors, client, broker, dict(extra))


def run_threads(count: int, target: Callable[[int], None]) -> None:
    """``count`` threads running ``target(i)``; returns once they have all ended."""
    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(DRAIN_TIMEOUT_S)


# -- the official client, in a child process -----------------------------------------------------


def say(event: dict[str, Any]) -> None:
    """One event line for the parent on stdout (result lines come from ``figures.emit``)."""
    print(json.dumps(event), flush=True)


def official_config(endpoints: str) -> Any:
    from rocketmq import ClientConfiguration, Credentials  # type: ignore[import-untyped]  # noqa: PLC0415

    return ClientConfiguration(endpoints, Credentials(), request_timeout=10)


def v5_sync_sends(
    producer: Any, make: Callable[[], Any], count: int, threads: int, broker: ProcessMeter
) -> Outcome:
    per = count // threads
    lats: list[list[float]] = [[] for _ in range(threads)]
    errors = [0] * threads
    perf = time.perf_counter

    def sender(i: int) -> None:
        out = lats[i]
        for _ in range(per):
            msg = make()
            t = perf()
            try:
                producer.send(msg)
            except Exception:  # counted: the figure says how many failed
                errors[i] += 1
                continue
            out.append(perf() - t)

    marks = Marks(broker)
    run_threads(threads, sender)
    lat = [x for lst in lats for x in lst]
    return marks.outcome(len(lat), lat, sum(errors), threads=threads, mode="send")


def v5_async_sends(
    producer: Any, make: Callable[[], Any], count: int, window: int, broker: ProcessMeter
) -> Outcome:
    room = threading.BoundedSemaphore(window)
    all_settled = threading.Event()
    lock = threading.Lock()
    lat: list[float] = []
    state = {"settled": 0, "errors": 0}
    perf = time.perf_counter

    def settle(failed: bool) -> None:
        with lock:
            state["settled"] += 1
            state["errors"] += failed
            if state["settled"] == count:
                all_settled.set()
        room.release()

    def on_done(t: float, fut: Any) -> None:
        failed = fut.exception() is not None
        if not failed:
            lat.append(perf() - t)
        settle(failed)

    marks = Marks(broker)
    for _ in range(count):
        room.acquire()
        msg = make()
        t = perf()
        try:
            fut = producer.send_async(msg)
        except Exception:  # counted as a failed send
            settle(True)
            continue
        fut.add_done_callback(lambda f, t=t: on_done(t, f))
    if not all_settled.wait(DRAIN_TIMEOUT_S):
        raise TimeoutError(f"send_async: {count - state['settled']} sends never settled")
    return marks.outcome(len(lat), lat, state["errors"], window=window, mode="send_async")


def child_send(args: argparse.Namespace) -> None:
    from rocketmq import Message as V5Message  # noqa: PLC0415
    from rocketmq import Producer as V5Producer  # noqa: PLC0415

    body = os.urandom(BODY)

    def make() -> Any:
        msg = V5Message()
        msg.topic = args.topic
        msg.body = body
        msg.tag = TAG
        return msg

    broker = ProcessMeter(args.broker_pid)
    producer = V5Producer(official_config(args.endpoints), (args.topic,))
    producer.startup()
    sent = 0
    try:
        # routes cached, channels connected, code paths warm; not timed (but consumed later)
        warm = v5_sync_sends(producer, make, WARM_UP, args.threads, broker)
        sent += warm.messages
        out = v5_sync_sends(producer, make, args.count, args.threads, broker)
        sent += out.messages
        emit_outcome("v5_send", out, latency_of="one send")
        out = v5_async_sends(producer, make, args.count, args.window, broker)
        sent += out.messages
        emit_outcome("v5_send_async", out, latency_of="send_async to its callback")
    finally:
        say({"event": "sent", "total": sent})
        producer.shutdown()


def child_receive(args: argparse.Namespace) -> None:
    from rocketmq import FilterExpression, SimpleConsumer  # noqa: PLC0415

    broker = ProcessMeter(args.broker_pid)
    consumer = SimpleConsumer(
        official_config(args.endpoints),
        args.group,
        {args.topic: FilterExpression(TAG)},
        await_duration=5,  # the broker's shortest hold: the receivers left over stop soon
    )
    consumer.startup()
    try:
        say({"event": "ready"})
        line = sys.stdin.readline().split()
        if not line or line[0] != "go":
            return
        out = v5_drain(consumer, int(line[1]), args.receivers, broker)
        emit_outcome("v5_receive_ack", out, latency_of="one receive(32, 30) call")
    finally:
        consumer.shutdown()


def v5_drain(consumer: Any, target: int, receivers: int, broker: ProcessMeter) -> Outcome:
    lock = threading.Lock()
    done = threading.Event()
    state = {"acked": 0, "received": 0, "receives": 0, "empty": 0, "errors": 0}
    lat: list[float] = []
    ack_lat: list[float] = []
    finished: list[Outcome] = []
    perf = time.perf_counter

    def receiver(_: int) -> None:
        while not done.is_set():
            t = perf()
            try:
                msgs = consumer.receive(32, 30)
            except Exception:  # counted; more than 100 end the case
                with lock:
                    state["errors"] += 1
                    if state["errors"] > 100:
                        done.set()
                continue
            lat.append(perf() - t)
            acked = 0
            for msg in msgs:
                t = perf()
                try:
                    consumer.ack(msg)
                except Exception:  # counted
                    with lock:
                        state["errors"] += 1
                    continue
                ack_lat.append(perf() - t)
                acked += 1
            with lock:
                state["receives"] += 1
                state["empty"] += not msgs
                state["received"] += len(msgs)
                state["acked"] += acked
                if state["acked"] >= target and not done.is_set():
                    finished.append(outcome())
                    done.set()

    def outcome() -> Outcome:
        acks = sorted(ack_lat)
        return marks.outcome(
            state["acked"],
            list(lat),
            state["errors"],
            receivers=receivers,
            receives=state["receives"],
            empty_receives=state["empty"],
            msgs_per_receive=round(state["received"] / max(1, state["receives"]), 1),
            ack_p50_us=round(percentile(acks, 0.5) * 1e6, 1),
            ack_p99_us=round(percentile(acks, 0.99) * 1e6, 1),
        )

    watchdog = threading.Timer(DRAIN_TIMEOUT_S, done.set)
    watchdog.start()
    marks = Marks(broker)
    run_threads(receivers, receiver)
    watchdog.cancel()
    if finished:
        return finished[0]
    with lock:
        out = outcome()
    out.extra["incomplete"] = f"{state['acked']} of {target} acked"
    return out


def child_main(args: argparse.Namespace) -> None:
    try:
        if args.child == "send":
            child_send(args)
        else:
            child_receive(args)
    except Exception as exc:  # reported to the parent, which says what failed
        traceback.print_exc()
        say({"event": "failed", "error": f"{type(exc).__name__}: {exc}"})
        sys.exit(1)


class ChildEnded(RuntimeError):
    """A child's output ended."""


class Child:
    """This script in a child process (``--child ROLE``), its ``HOME`` of its own; its result
    lines are printed here as they come, its events handed to :meth:`event`."""

    def __init__(self, role: str, args: list[str], home: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, str(Path(__file__).resolve()), "--child", role, *args]
        self.role = role
        self.proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def event(self, timeout: float) -> dict[str, Any]:
        """The child's next event, printing the result lines met on the way."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"{self.role} child: no event in {timeout:.0f}s") from None
            if line is None:
                raise ChildEnded(f"{self.role} child ended (exit {self.proc.wait()})")
            try:
                obj: dict[str, Any] = json.loads(line)
            except ValueError:
                print(f"# {self.role}: {line.rstrip()}", file=sys.stderr)
                continue
            if "case" in obj:
                print(line.rstrip(), flush=True)
                continue
            if obj.get("event") == "failed":
                raise RuntimeError(f"{self.role} child failed: {obj.get('error')}")
            return obj

    def tell(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float) -> None:
        """Wait for the child's end (its result lines printed); kill it when it overstays."""
        with contextlib.suppress(ChildEnded, TimeoutError):
            self.event(timeout)  # nothing more is expected but the end of its output
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# -- Apogee's SDK, in this process ----------------------------------------------------------------


async def sdk_async(namesrv: str, count: int, window: int, broker: ProcessMeter) -> int:
    msg = Message(SDK_TOPIC, os.urandom(BODY), tags=TAG)
    async with Producer(namesrv, group="bench-v5-sdk") as producer:
        await asyncio.gather(*(producer.send(msg) for _ in range(WARM_UP)))
        req0 = producer.stats().requests
        marks = Marks(broker)
        sent = await windowed_sends(producer, msg, count, window, SAMPLE, settle_timeout_s=120)
        out = marks.outcome(count - sent.errors, sent.latencies, sent.errors)
        requests = producer.stats().requests - req0
    out.seconds, out.client_cpu_s = sent.seconds, sent.cpu_s
    emit_outcome(
        "sdk_send",
        out,
        window=window,
        msgs_per_request=round(count / requests, 1) if requests else None,
        latency_of=f"send_nowait to its result (one send in {SAMPLE})",
    )
    return WARM_UP + out.messages


def sdk_sync_threads(namesrv: str, count: int, threads: int, broker: ProcessMeter) -> int:
    msg = Message(SDK_TOPIC, os.urandom(BODY), tags=TAG)
    per = count // threads
    with SyncProducer(namesrv, group="bench-v5-sdk-sync") as producer:
        for _ in range(WARM_UP):
            producer.send(msg)
        req0 = producer.stats().requests
        lats: list[list[float]] = [[] for _ in range(threads)]
        errors = [0] * threads

        def sender(i: int) -> None:
            for _ in range(per):
                t = time.perf_counter()
                try:
                    producer.send(msg)
                except ApogeeError:
                    errors[i] += 1
                    continue
                lats[i].append(time.perf_counter() - t)

        marks = Marks(broker)
        run_threads(threads, sender)
        lat = [x for lst in lats for x in lst]
        out = marks.outcome(len(lat), lat, sum(errors))
        requests = producer.stats().requests - req0
    emit_outcome(
        f"sdk_send_sync_{threads}",
        out,
        threads=threads,
        msgs_per_request=round(out.messages / requests, 1) if requests else None,
        latency_of="one send",
    )
    return WARM_UP + out.messages


async def sdk_consume(namesrv: str, count: int, broker: ProcessMeter) -> None:
    consumer = PullConsumer(namesrv, SDK_GROUP, consume_from="earliest", pull_batch_size=1024)
    consumer.subscribe(SDK_TOPIC)
    got = polls = 0
    lat: list[float] = []
    marks = Marks(broker)
    deadline = time.perf_counter() + DRAIN_TIMEOUT_S
    async with consumer:
        await consumer.start()
        while got < count and time.perf_counter() < deadline:
            t = time.perf_counter()
            got += len(await consumer.poll(timeout=5.0, max_messages=1024))
            lat.append(time.perf_counter() - t)
            polls += 1
        out = marks.outcome(got, lat, 0, polls=polls, latency_of="one poll(1024)")
    if got < count:
        out.extra["incomplete"] = f"{got} of {count} consumed"
    emit_outcome("sdk_consume", out)


async def group_known(namesrv: str, group: str) -> None:
    """Return once a broker knows ``group`` (the consumer's Settings reached it)."""
    async with AdminClient(namesrv) as admin:

        async def known() -> bool:
            try:
                await admin.describe_group(group)
            except ApogeeError:
                return False
            return True

        await eventually(known, START_TIMEOUT_S, f"a broker knows group {group}", every=0.05)


# -- the run ------------------------------------------------------------------------------------


def seed_ports(data: Path) -> None:
    """Free ports for the cluster's members (``ports.json``, which ``up`` reads), not the
    services' defaults: a local cluster or a test run may hold those."""
    names = ["nameserver-0", *local_cluster.broker_names(1)]
    record = {
        name: {"address": f"127.0.0.1:{free_port()}", "metrics": f"127.0.0.1:{free_port()}"}
        for name in names
    }
    (data / PORTS_FILE).write_text(json.dumps(record, indent=2))


def run(args: argparse.Namespace, data: Path) -> None:
    seed_ports(data)
    state = local_cluster.up(
        data,
        brokers=1,
        nameservers=1,
        flush_mode="async",
        schedule=False,
        txn_checker=False,
        console=False,
    )
    namesrv, broker_proc = state.namesrv, state.brokers[0]
    broker = ProcessMeter(broker_proc.pid)
    asyncio.run(create_topics(namesrv, [V5_TOPIC, SDK_TOPIC], 8))
    common = ["--endpoints", broker_proc.address, "--topic", V5_TOPIC]
    common += ["--broker-pid", str(broker_proc.pid)]
    children: list[Child] = []
    try:
        receiver = Child(
            "receive",
            [*common, "--group", V5_GROUP, "--receivers", str(args.receivers)],
            data / "home-receive",
        )
        children.append(receiver)
        receiver.event(START_TIMEOUT_S)  # ready
        asyncio.run(group_known(namesrv, V5_GROUP))
        counts = ["--count", str(args.v5_messages), "--threads", str(args.threads)]
        sender = Child("send", [*common, *counts, "--window", str(args.window)], data / "home-send")
        children.append(sender)
        total = int(sender.event(DRAIN_TIMEOUT_S)["total"])
        sender.finish(START_TIMEOUT_S)
        receiver.tell(f"go {total}")
        receiver.finish(DRAIN_TIMEOUT_S)
    finally:
        for child in children:
            child.kill()
    sdk_total = asyncio.run(sdk_async(namesrv, args.sdk_messages, args.sdk_window, broker))
    sdk_total += sdk_sync_threads(namesrv, args.v5_messages, args.threads, broker)
    asyncio.run(sdk_consume(namesrv, sdk_total, broker))
    print(f"# broker peak rss {broker.rss_mb():.0f} MiB", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smaller runs, under a minute in all")
    ap.add_argument("--v5-messages", type=int, default=None, help="sends per official case")
    ap.add_argument("--sdk-messages", type=int, default=None, help="sends in sdk_send")
    ap.add_argument("--threads", type=int, default=8, help="threads sending with send")
    ap.add_argument("--window", type=int, default=64, help="unsettled send_async futures")
    ap.add_argument("--receivers", type=int, default=4, help="threads receiving and acking")
    ap.add_argument("--sdk-window", type=int, default=4096, help="unsettled SDK sends")
    ap.add_argument("--dir", default=None, help="where to put the cluster (default: a temp dir)")
    # the official client's side, in a child process (see Child)
    ap.add_argument("--child", choices=("send", "receive"), help=argparse.SUPPRESS)
    ap.add_argument("--endpoints", help=argparse.SUPPRESS)
    ap.add_argument("--topic", help=argparse.SUPPRESS)
    ap.add_argument("--group", help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--broker-pid", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_main(args)
        return
    args.v5_messages = args.v5_messages or (3_000 if args.quick else 20_000)
    args.sdk_messages = args.sdk_messages or (20_000 if args.quick else 200_000)
    base = Path(args.dir or tempfile.gettempdir())
    data = Path(tempfile.mkdtemp(prefix="v5-bench-", dir=base))
    try:
        run(args, data)
    finally:
        with contextlib.suppress(Exception):
            local_cluster.down(data)
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
