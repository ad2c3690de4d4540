"""Two axes of the scale benchmark that grow the clients rather than the data: the members of one
consumer group, and the clients connected to a broker. Each step runs against a fresh one-broker
cluster (:class:`scale_common.Step`); the clients run in this process, on one event loop.

Axis ``consumers`` (1, 50, 200 by default): ``n`` ``PushConsumer`` of one group (clustering,
default client ids, the ``--allocate`` strategy) on one topic of ``--queues`` queues (256 by
default: more queues than members, so that every member owns one or two and a member that joins
takes queues from others; with fewer queues than members a joining member would get nothing and
the step would measure nothing). Once the group has settled, a producer of this process sends
``--rate`` messages per second (each awaited by its own task) and ONE more consumer joins:

- ``start_s``: starting the ``n`` consumers (``--start-batch`` at a time) until the group has
  settled (``start_loop_lag_ms``: the event loop's worst lag meanwhile); ``settle_s``: from the
  new consumer's ``start()`` until the group has settled again, ``join_start_s``: until its
  ``start()`` returned, ``new_member_queues``: its share.
  *Settled*: the members' assignments (``assignment()`` of each consumer) are exactly what the
  strategy gives for the member list (every queue owned by one member, the new one owning its
  share) and stay so for ``--quiet-s``;
- ``max_overlap``, ``max_unowned``: the most queues owned by two members at once, and owned by
  none, seen while it settled (the assignments are read every 50 ms: a shorter overlap can be
  missed, the deliveries below are not), ``assignment_changes``: the changes seen;
  ``rebalances``: the rebalances the members ran meanwhile (one woken by the join reads the
  member list its session was sent and the routes it read last: no call);
- ``double_deliveries``: messages (by message id) delivered to two different members, of all
  the run, and ``double_while_settling``: those whose second delivery came between the join
  and the end of the quiet window; ``redelivered_same``: messages delivered twice to the same
  member; ``sent``, ``send_errors``, ``delivered``; ``lost``: sent and never delivered (within
  30 s of the last send);
- ``e2e_p50_ms``, ``e2e_p99_ms``: from send to the listener, over the step, and ``loop_lag_ms``:
  the longest late wake-up of a 50 ms ticker on this process's event loop (this process keeps up
  while it stays small); ``client_cpu_s`` (the join to the end), ``client_cpu_pct`` (this
  process's CPU from the join until settled, as a share of one core);
- ``broker_rss_mb``, ``broker_cpu_s``, ``broker_cpu_pct``: the broker's resident memory at the
  end and its CPU seconds from the join until the group settled (and as a share of one core).

Axis ``connections`` (10, 500, 2,000): ``n`` clients connected and idle, half ``Producer``
(each has sent one message, to a topic no consumer reads, so that it holds its channels to the
nameserver and the broker; a plain producer has no session and sends no heartbeat) and half
``PushConsumer``, each of a group of its own, on a topic nothing is sent to (a ``Session``
stream with heartbeats, a delivery stream, a rebalance every ``rebalance_interval``, offsets
committed every ``offset_persist_interval``); every client has channels of its own (the SDK's
channels keep their own connections, ``grpc.use_local_subchannel_pool``):

- ``connect_s``: starting them all (``--start-batch`` at a time);
- ``broker_rss_mb``, ``broker_fds``, ``broker_maps``, ``broker_threads`` with the clients idle,
  ``broker_fd_limit`` and ``fds_per_client``: the broker's open files above those of the step
  without clients, per client; ``fd_wall_clients``: how many clients the limit allows at that
  rate; ``client_fds``: this process's open files;
- ``idle_cpu_s_per_min``: the broker's CPU seconds per minute over ``--idle-s`` with the clients
  idle (heartbeats, periodic rebalances); ``client_idle_cpu_s_per_min``: this process's;
- ``send_p50_ms``, ``send_p99_ms``, ``send_per_s``: ``--conn-messages`` small messages through
  one more producer (at most 100 unsettled) with the ``n`` clients connected, to the producers'
  topic (no consumer reads it: the consumers stay idle).

Prints one JSON object per step (with ``axis`` and ``step``) and, at the end, a table per axis;
with ``--timeline``, also (to stderr) the processes' ids as each measured phase begins, and the
assignments' changes while a group settles: (seconds, queues owned twice, queues owned by none).

    python bench/scale_bench.py --axis consumers --steps 1,50
    python bench/scale_bench.py --axis connections --steps 10,500
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import struct
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from figures import ProcessMeter, paced, percentile
from load import create_topics, windowed_sends
from scale_common import Step, fd_limit, proc_facts, run

from apogee.client import AdminClient, Message, MessageQueue, Producer
from apogee.client.consumer.allocate import strategy_by_name
from apogee.client.consumer.push import PushConsumer
from apogee.client.consumer.records import ReceivedMessage
from apogee.testkit.waiting import eventually

DEFAULT_STEPS = {"consumers": [1, 50, 200], "connections": [10, 500, 2_000]}
STAMP = struct.Struct("<d")
#: how often the consumers' assignments are read
WATCH_S = 0.05

Assignment = tuple[frozenset[MessageQueue], ...]


def threads(pid: int) -> int:
    """Process ``pid``'s threads."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


class LoopLag:
    """The longest late wake-up of a ticker on this event loop, since the last :meth:`reset`."""

    def __init__(self, every: float = 0.05) -> None:
        self.every = every
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(self.every)  # a ticker: its lateness is the measurement
            self.worst = max(self.worst, time.perf_counter() - t - self.every)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._tick())

    def reset(self) -> None:
        self.worst = 0.0

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


async def start_batched(starts: Sequence[Callable[[], Awaitable[Any]]], batch: int) -> None:
    """Run ``starts`` ``batch`` at a time (each batch to its end before the next)."""
    for i in range(0, len(starts), batch):
        await asyncio.gather(*(s() for s in starts[i : i + batch]))


# -- axis: consumers ----------------------------------------------------------------------------


class Group:
    """The consumers of one group in this process, what each was handed, and when."""

    def __init__(self, namesrv: str, group: str, topic: str, args: argparse.Namespace) -> None:
        self.namesrv = namesrv
        self.group = group
        self.topic = topic
        self.args = args
        self.members: list[PushConsumer] = []
        #: message id -> (member index, perf_counter) of each delivery
        self.deliveries: dict[str, list[tuple[int, float]]] = {}
        self.latencies: list[float] = []
        self.strategy = strategy_by_name(args.allocate)
        self._expected: tuple[tuple[tuple[str, ...], tuple[MessageQueue, ...]], Assignment] | None
        self._expected = None

    def listener(self, index: int) -> Callable[[list[ReceivedMessage]], Awaitable[None]]:
        async def listen(msgs: list[ReceivedMessage]) -> None:
            now = time.perf_counter()
            for m in msgs:
                self.deliveries.setdefault(m.message_id, []).append((index, now))
                self.latencies.append(now - STAMP.unpack_from(m.body)[0])

        return listen

    def add(self) -> PushConsumer:
        index = len(self.members)
        consumer = PushConsumer(
            self.namesrv,
            self.group,
            self.listener(index),
            consume_from="earliest",
            consume_batch_size=32,
            allocate=strategy_by_name(self.args.allocate),
        )
        consumer.subscribe(self.topic)
        self.members.append(consumer)
        return consumer

    def assignment(self) -> Assignment:
        """Each member's queues of the topic: ``assignment()``, read without its sorting (the
        assignments of every member are read every :data:`WATCH_S`)."""
        return tuple(
            frozenset(mq for mq in c._runtime.queues if mq.topic == self.topic)
            if c._runtime is not None
            else frozenset()
            for c in self.members
        )

    def expected(self, queues: Sequence[MessageQueue]) -> Assignment:
        """What the strategy gives each member, for the member list as it is (computed with a
        strategy object of its own: the members' objects cache what they computed last)."""
        ids = sorted(c.client_id for c in self.members)
        if self._expected is None or self._expected[0] != (tuple(ids), tuple(queues)):
            mine = tuple(
                frozenset(self.strategy.allocate(self.group, c.client_id, queues, ids))
                for c in self.members
            )
            self._expected = ((tuple(ids), tuple(queues)), mine)
        return self._expected[1]

    def rebalances(self) -> int:
        return sum(c._runtime.rebalances for c in self.members if c._runtime is not None)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.members), return_exceptions=True)


class Watch:
    """Reads the assignments every :data:`WATCH_S` until they are what is expected and stay so
    for ``quiet`` seconds; the most queues owned twice and by none meanwhile."""

    def __init__(self, group: Group, queues: Sequence[MessageQueue]) -> None:
        self.group = group
        self.queues = queues
        self.max_overlap = 0
        self.max_unowned = 0
        self.changes = 0
        #: (seconds since the start, queues owned twice, queues owned by none) at each change
        self.timeline: list[tuple[float, int, int]] = []

    async def settled(self, since: float, quiet: float, timeout: float) -> float:
        """Seconds from ``since`` (perf_counter) until the assignments were as expected, for
        good (``quiet`` s unchanged after)."""
        deadline = time.perf_counter() + timeout
        good_since: float | None = None
        last: Assignment | None = None
        want = set(self.queues)
        while True:
            now = time.perf_counter()
            snap = self.group.assignment()
            if snap != last:
                self.changes += last is not None
                last = snap
                owners: dict[MessageQueue, int] = {}
                for mine in snap:
                    for mq in mine:
                        owners[mq] = owners.get(mq, 0) + 1
                overlap = sum(v > 1 for v in owners.values())
                unowned = len(want - owners.keys())
                self.max_overlap = max(self.max_overlap, overlap)
                self.max_unowned = max(self.max_unowned, unowned)
                self.timeline.append((round(now - since, 3), overlap, unowned))
                good_since = now if snap == self.group.expected(self.queues) else None
            if good_since is not None and now - good_since >= quiet:
                return good_since - since
            if now > deadline:
                raise TimeoutError(
                    f"group of {len(snap)} not settled within {timeout} s "
                    f"({sum(len(s) for s in snap)} queues owned)"
                )
            await asyncio.sleep(WATCH_S)  # polling the assignments, with a deadline


class Load:
    """``rate`` sends per second, each awaited by its own task, until :meth:`stop`; the ids
    sent."""

    def __init__(self, producer: Producer, topic: str, rate: int) -> None:
        self.producer = producer
        self.topic = topic
        self.rate = rate
        self.sent: set[str] = set()
        self.errors = 0
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._runner: asyncio.Task[None] | None = None
        self._pad = os.urandom(100)

    async def _one(self) -> None:
        body = STAMP.pack(time.perf_counter()) + self._pad
        try:
            result = await self.producer.send(Message(self.topic, body))
        except Exception:
            self.errors += 1
            return
        self.sent.add(result.message_id)

    async def _run(self) -> None:
        async for _ in paced(self.rate, 10**9):
            if self._stop.is_set():
                break
            task = asyncio.get_running_loop().create_task(self._one())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if self._tasks:
            await asyncio.gather(*self._tasks)

    def start(self) -> None:
        self._runner = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._stop.set()
        if self._runner is not None:
            await asyncio.wait_for(self._runner, 60)


async def queues_of(namesrv: str, topic: str, count: int) -> list[MessageQueue]:
    """The topic's queues, sorted as the consumers sort them (one broker)."""
    async with AdminClient(namesrv) as admin:
        info = await admin.cluster_info()
    return [MessageQueue(topic, info[0].broker_name, q) for q in range(count)]


async def consumers_step(step: Step, n: int, args: argparse.Namespace) -> dict[str, Any]:
    topic, group_name = "ScaleConsumers", "scale-consumers"
    await create_topics(step.namesrv, [topic], args.queues)
    queues = await queues_of(step.namesrv, topic, args.queues)
    group = Group(step.namesrv, group_name, topic, args)
    broker = ProcessMeter(step.pid)
    lag = LoopLag()
    lag.start()
    row: dict[str, Any] = {}
    try:
        for _ in range(n):
            group.add()
        t0 = time.perf_counter()
        await start_batched([c.start for c in group.members], args.start_batch)
        await Watch(group, queues).settled(t0, args.quiet_s, args.settle_timeout)
        row["start_s"] = round(time.perf_counter() - t0 - args.quiet_s, 2)
        row["start_loop_lag_ms"] = round(lag.worst * 1000, 1)
        async with Producer(step.namesrv, group="scale-consumers-load") as producer:
            load = Load(producer, topic, args.rate)
            load.start()
            # a second of the load first, so that every member is delivering when one joins
            await eventually(
                lambda: len(group.deliveries) >= args.rate, 30, "a second of the load delivered"
            )
            lag.reset()
            if args.timeline:
                print(
                    f"# joining: broker pid {step.pid}, client pid {os.getpid()}", file=sys.stderr
                )
            watch = Watch(group, queues)
            rebalances0 = group.rebalances()
            cpu0, client0 = broker.cpu_s(), time.process_time()
            t_join = time.perf_counter()
            joined = group.add()
            # watched from the start: the new member takes its share inside start()
            settling = asyncio.ensure_future(
                watch.settled(t_join, args.quiet_s, args.settle_timeout)
            )
            await joined.start()
            row["join_start_s"] = round(time.perf_counter() - t_join, 3)
            settle = await settling
            t_quiet = time.perf_counter()
            window = t_quiet - t_join
            broker_cpu = broker.cpu_s() - cpu0
            row["client_cpu_pct"] = round(100 * (time.process_time() - client0) / window, 1)
            row["settle_s"] = round(settle, 3)
            row["assignment_changes"] = watch.changes
            row["max_overlap"] = watch.max_overlap
            row["max_unowned"] = watch.max_unowned
            row["rebalances"] = group.rebalances() - rebalances0
            row["new_member_queues"] = len(joined.assignment())
            if args.timeline:
                print(f"# settling: {watch.timeline}", file=sys.stderr)
            await load.stop()
        sent = load.sent
        got = group.deliveries

        def all_delivered() -> bool:
            return sent <= got.keys()

        with contextlib.suppress(AssertionError):  # what is missing is counted as lost
            await eventually(all_delivered, 30, "every message sent delivered", every=0.1)
        client_cpu = time.process_time() - client0
        two = {k: v for k, v in got.items() if len({i for i, _ in v}) > 1}
        lat = sorted(group.latencies)
        row |= {
            "sent": len(sent),
            "send_errors": load.errors,
            "delivered": len(sent & got.keys()),
            "lost": len(sent - got.keys()),
            "double_deliveries": len(two),
            "double_while_settling": sum(
                1 for v in two.values() if any(t_join <= t <= t_quiet for _, t in v[1:])
            ),
            "redelivered_same": sum(
                1 for v in got.values() if len(v) > len({i for i, _ in v}) and len(v) > 1
            ),
            "e2e_p50_ms": round(percentile(lat, 0.5) * 1000, 1),
            "e2e_p99_ms": round(percentile(lat, 0.99) * 1000, 1),
            "loop_lag_ms": round(lag.worst * 1000, 1),
            "client_cpu_s": round(client_cpu, 2),
            "broker_rss_mb": proc_facts(step.pid)["rss_mb"],
            "broker_cpu_s": round(broker_cpu, 2),
            "broker_cpu_pct": round(100 * broker_cpu / window, 1),
        }
    finally:
        lag.stop()
        await group.close()
    return row


def axis_consumers(base: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    args = options(args)
    row: dict[str, Any] = {"axis": "consumers", "step": n, "queues": args.queues}
    with Step(base, f"consumers-{n}") as step:
        row |= run(consumers_step(step, n, args))
    return row


# -- axis: connections --------------------------------------------------------------------------


async def connections_step(step: Step, n: int, args: argparse.Namespace) -> dict[str, Any]:
    # the consumers' topic, which nothing is sent to (each consumer, of a group of its own,
    # would be delivered every message), and the topic of the producers' sends
    topic, load_topic = "ScaleConnections", "ScaleConnectionsLoad"
    await create_topics(step.namesrv, [topic, load_topic], 8)
    bare = proc_facts(step.pid)["fds"]
    producers = [Producer(step.namesrv, group=f"scale-conn-p{i:05d}") for i in range(n // 2)]

    async def nothing(msgs: list[ReceivedMessage]) -> None:
        return None

    consumers = [
        PushConsumer(step.namesrv, f"scale-conn-g{i:05d}", nothing) for i in range(n - n // 2)
    ]
    for c in consumers:
        c.subscribe(topic)
    row: dict[str, Any] = {}
    meter = ProcessMeter(step.pid)
    try:

        async def connect(p: Producer) -> None:
            await p.send(Message(load_topic, b"c"))

        if args.timeline:
            print(f"# connecting: broker pid {step.pid}, client pid {os.getpid()}", file=sys.stderr)
        t0 = time.perf_counter()
        starts: list[Callable[[], Awaitable[Any]]] = [
            functools.partial(connect, p) for p in producers
        ]
        starts += [c.start for c in consumers]
        await start_batched(starts, args.start_batch)
        row["connect_s"] = round(time.perf_counter() - t0, 2)
        if args.timeline:
            print(f"# idle: broker pid {step.pid}, client pid {os.getpid()}", file=sys.stderr)
        cpu0, client0 = meter.cpu_s(), time.process_time()
        await asyncio.sleep(args.idle_s)  # the idle window over which the CPU is measured
        cpu = meter.cpu_s() - cpu0
        client_cpu = time.process_time() - client0
        facts = proc_facts(step.pid)
        limit = fd_limit(step.pid)
        per = (facts["fds"] - bare) / n
        row |= {f"broker_{k}": v for k, v in facts.items()}
        row |= {
            "broker_threads": threads(step.pid),
            "broker_fd_limit": limit,
            "fds_per_client": round(per, 2),
            "fd_wall_clients": int((limit - bare) / per) if per > 0 else None,
            "client_fds": len(os.listdir("/proc/self/fd")),
            "idle_cpu_s_per_min": round(cpu * 60 / args.idle_s, 2),
            "client_idle_cpu_s_per_min": round(client_cpu * 60 / args.idle_s, 2),
        }
        async with Producer(step.namesrv, group="scale-conn-load") as producer:
            await producer.send(Message(load_topic, b"w"))  # its route and channels
            sent = await windowed_sends(
                producer, Message(load_topic, b"x" * 100), args.conn_messages, 100, sample=1
            )
        lat = sorted(sent.latencies)
        row |= {
            "send_per_s": round(args.conn_messages / sent.seconds),
            "send_p50_ms": round(percentile(lat, 0.5) * 1000, 2),
            "send_p99_ms": round(percentile(lat, 0.99) * 1000, 2),
            "send_errors": sent.errors,
        }
    finally:
        await asyncio.gather(
            *(c.close() for c in consumers),
            *(p.close() for p in producers),
            return_exceptions=True,
        )
    return row


def axis_connections(base: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    args = options(args)
    row: dict[str, Any] = {"axis": "connections", "step": n}
    with Step(base, f"connections-{n}") as step:
        row |= run(connections_step(step, n, args))
    return row


# -- running ------------------------------------------------------------------------------------


#: the options these axes read, their defaults and help (a runner that has not added them, as
#: scale_bench's, gets the defaults: see :func:`options`)
OPTIONS: dict[str, tuple[type, Any, str]] = {
    "queues": (int, 256, "queues of the consumers' topic"),
    "allocate": (str, "average", "the consumers' allocation strategy"),
    "rate": (int, 200, "sends per second while one consumer joins"),
    "quiet_s": (float, 2.0, "assignments unchanged this long: settled"),
    "settle_timeout": (float, 120.0, "the longest a group may take to settle"),
    "start_batch": (int, 50, "clients started at a time"),
    "idle_s": (float, 30.0, "the idle window of the connections axis"),
    "conn_messages": (int, 5_000, "the connections axis's fixed load"),
    "timeline": (bool, False, "print the assignments' changes while settling, and the pids"),
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options these axes read, on ``ap``."""
    for name, (kind, default, text) in OPTIONS.items():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            ap.add_argument(flag, action="store_true", help=text)
        else:
            ap.add_argument(flag, type=kind, default=default, help=text)


def options(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the defaults of the options it lacks."""
    out = argparse.Namespace(**vars(args))
    for name, (_, default, _) in OPTIONS.items():
        if not hasattr(out, name):
            setattr(out, name, default)
    return out
