"""How a broker's and a nameserver's costs grow with the work they hold: topics, touched
queues, consumer groups, group members, connections, pending timers and transactions, each at a
series of steps, against a real cluster (``apogee.local.cluster``: one nameserver and one broker
as processes, async flush, free ports; a fresh data directory at each step).

Axis ``topics`` (100, 1,000, 10,000, 50,000 by default; 8 queues each). At each step:

- ``create_s``, ``creates_per_s``: creating the topics, ``--concurrency`` ``PutTopic`` calls at
  a time straight to the broker (what ``AdminClient.create_or_update_topic`` sends to each
  broker), and ``known_s``: until the nameserver lists them all;
- ``broker_rss_mb``, ``broker_fds``, ``broker_maps``: the broker's resident memory, open files
  and memory maps with the topics created and idle (nothing sent); ``broker_fd_limit``: its
  limit on open files;
- ``register_bytes``, ``register_ms``: the size of the broker's registration with every topic
  (what it sends after a change) and the nameserver's time to answer it (median of 5);
  ``heartbeat_bytes``, ``heartbeat_ms``: the same for a heartbeat with nothing changed (the
  short form, which carries no topics);
- ``route_p50_ms``, ``route_p99_ms``: ``GetRoute`` of random topics, one at a time;
- ``send_per_s``, ``send_p99_ms``, ``read_per_s``: a fixed load on one topic
  (``--messages`` of 1 KiB through a ``Producer``, at most 1,000 unsettled; then read back
  with a ``QueueReader``);
- ``touched_rss_mb``, ``touched_fds``, ``touched_maps``, ``per_touched_queue_kib``: the same
  once every queue of every topic has had one message (and is idle again), and the memory one
  such queue costs; ``touch_errors``: sends that failed (a wall: files or maps run out);
- ``recovery_s``, ``recovery_known_s``: after ``kill -9`` of the broker, until it answers
  again, and until the nameserver lists every topic again.

Axis ``groups`` (10, 1,000, 10,000): each group commits an offset on every queue of one topic
(``AdminClient.commit_offsets``); ``commit_s``, ``offsets_file_kib`` (what the broker keeps on
disk for them), ``broker_rss_mb``, and ``persist_bytes``: what the broker writes to its data
directory to persist one group's changed offset (the files' growth and rewrites between two
persistences, with the broker otherwise idle).

Axes ``consumers`` (1, 50, 200 members of one group; the time for the group to settle after
one more joins, and messages delivered to two members meanwhile) and ``connections`` (10, 500,
2,000 clients connected, idle): ``scale_clients.py``. Axis ``timers`` (10,000, 1,000,000,
5,000,000 pending timer messages; ``scale_timers.py``): the schedule service's memory with them
pending and the lateness of probe timers at their due time. Axis ``txns`` (10,000 and 1,000,000
pending transactions; ``scale_txns.py``): the broker's and the checker's costs with them
pending, a scrape of ``/metrics``, fresh transactions beside them. Axis ``replicated-groups``
(10, 1,000, 10,000 groups on a replica group of three; ``scale_replicas.py``): the time of one
offset persistence on the leader, replicated, after one group's change. Each module's
docstring lists its figures.

Prints one JSON object per step (the figures above, with ``axis`` and ``step``) and, at the end,
one table per axis: the curve of each figure against the axis.

    python bench/scale_bench.py                       # every axis, default steps
    python bench/scale_bench.py --axis topics --steps 100,1000
    python bench/scale_bench.py --quick               # the first two steps of each axis
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import scale_clients
import scale_replicas
import scale_timers
import scale_txns
from figures import percentile
from load import windowed_sends
from scale_common import (
    PERSIST_INTERVAL_S,
    Step,
    bounded,
    dir_bytes,
    fd_limit,
    proc_facts,
    run,
)

from apogee.client import AdminClient, Message, MessageQueue, Producer, QueueReader
from apogee.common.topics import READ_WRITE
from apogee.testkit.waiting import eventually
from apogee.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    nameserver_pb2,
    nameserver_pb2_grpc,
)

QUEUES = 8
BODY = b"x" * 1024
DEFAULT_STEPS = {
    "topics": [100, 1_000, 10_000, 50_000],
    "groups": [10, 1_000, 10_000],
    "consumers": scale_clients.DEFAULT_STEPS["consumers"],
    "connections": scale_clients.DEFAULT_STEPS["connections"],
    "timers": list(scale_timers.DEFAULT_STEPS),
    "txns": list(scale_txns.DEFAULT_STEPS),
    "replicated-groups": list(scale_replicas.DEFAULT_STEPS),
}
QUICK_STEPS = {
    "topics": [100, 1_000],
    "groups": [10, 1_000],
    "consumers": [1, 50],
    "connections": [10, 500],
    "timers": [10_000, 100_000],
    "txns": [10_000, 100_000],
    "replicated-groups": [10, 1_000],
}
#: the gRPC answer size limit of the benchmark's own calls (a 50,000-topic listing is large)
MAX_MESSAGE = 256 << 20
OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]


async def nameserver_lists(namesrv: str, wanted: set[str], timeout: float) -> float:
    """Seconds until the nameserver lists every topic of ``wanted``."""
    t0 = time.perf_counter()
    async with grpc.aio.insecure_channel(namesrv, options=OPTIONS) as ch:
        stub = nameserver_pb2_grpc.NameServerStub(ch)

        async def known() -> bool:
            got = await stub.ListTopics(nameserver_pb2.ListTopicsRequest(), timeout=60)
            return wanted <= set(got.topics)

        await eventually(known, timeout, f"the nameserver lists {len(wanted)} topics", every=0.2)
    return time.perf_counter() - t0


# -- axis: topics -------------------------------------------------------------------------------


def topic_names(n: int) -> list[str]:
    return [f"ScaleTopic{i:05d}" for i in range(n)]


async def create(broker: str, names: list[str], concurrency: int) -> float:
    t0 = time.perf_counter()
    async with grpc.aio.insecure_channel(broker, options=OPTIONS) as ch:
        stub = broker_pb2_grpc.BrokerAdminStub(ch)

        def put(name: str) -> Callable[[], Awaitable[Any]]:
            config = common_pb2.TopicConfig(
                name=name, read_queues=QUEUES, write_queues=QUEUES, perm=int(READ_WRITE)
            )
            return lambda: stub.PutTopic(broker_pb2.PutTopicRequest(topic=config), timeout=600)

        await bounded(concurrency, (put(n) for n in names))
    return time.perf_counter() - t0


async def registration(step: Step) -> dict[str, Any]:
    """The broker's registration with every topic, sent to the nameserver as a heartbeat sends
    it: its size, and the nameserver's time to answer it."""
    async with (
        grpc.aio.insecure_channel(step.broker.address, options=OPTIONS) as bch,
        grpc.aio.insecure_channel(step.namesrv, options=OPTIONS) as nch,
    ):
        listed = await broker_pb2_grpc.BrokerAdminStub(bch).ListTopics(
            broker_pb2.BrokerListTopicsRequest(include_system=True), timeout=60
        )
        ns = nameserver_pb2_grpc.NameServerStub(nch)
        info = await ns.GetClusterInfo(nameserver_pb2.GetClusterInfoRequest(), timeout=60)
        me = next(b for b in info.brokers if b.address == step.broker.address)
        request = nameserver_pb2.RegisterBrokerRequest(
            cluster=me.cluster,
            broker_name=me.broker_name,
            address=me.address,
            topics=list(listed.topics),
            heartbeat_interval_ms=30_000,
            auto_create_topics=me.auto_create_topics,
            epoch=me.epoch,
        )
        full = await median_s(lambda: ns.RegisterBroker(request, timeout=60))
        # a heartbeat with nothing changed: the short form, at the version just registered
        short = nameserver_pb2.RegisterBrokerRequest(
            cluster=me.cluster,
            broker_name=me.broker_name,
            address=me.address,
            heartbeat_interval_ms=30_000,
            auto_create_topics=me.auto_create_topics,
            epoch=me.epoch,
            topics_unchanged=True,
            topics_version=request.topics_version,
        )
        answer = await ns.RegisterBroker(short, timeout=60)
        assert not answer.topics_needed, "the nameserver refused a short heartbeat"
        quick = await median_s(lambda: ns.RegisterBroker(short, timeout=60))
    # (the broker's own next heartbeat, at its version, is refused and followed by its topics)
    return {
        "register_topics": len(listed.topics),
        "register_bytes": request.ByteSize(),
        "register_ms": round(full * 1000, 2),
        "heartbeat_bytes": short.ByteSize(),
        "heartbeat_ms": round(quick * 1000, 2),
    }


async def median_s(call: Callable[[], Awaitable[Any]], times: int = 5) -> float:
    """The median seconds ``call()`` takes, of ``times``."""
    took = []
    for _ in range(times):
        t0 = time.perf_counter()
        await call()
        took.append(time.perf_counter() - t0)
    return statistics.median(took)


async def routes(namesrv: str, names: list[str], lookups: int) -> dict[str, Any]:
    rng = random.Random(7)
    lat = []
    async with grpc.aio.insecure_channel(namesrv, options=OPTIONS) as ch:
        stub = nameserver_pb2_grpc.NameServerStub(ch)
        for _ in range(lookups):
            topic = rng.choice(names)
            t0 = time.perf_counter()
            await stub.GetRoute(nameserver_pb2.GetRouteRequest(topic=topic), timeout=10)
            lat.append(time.perf_counter() - t0)
    lat.sort()
    return {
        "route_p50_ms": round(percentile(lat, 0.5) * 1000, 3),
        "route_p99_ms": round(percentile(lat, 0.99) * 1000, 3),
    }


async def fixed_load(namesrv: str, topic: str, messages: int) -> dict[str, Any]:
    async with Producer(namesrv) as producer:
        sent = await windowed_sends(producer, Message(topic, BODY), messages, 1_000, sample=16)
    lat = sorted(sent.latencies)
    t0 = time.perf_counter()
    read = 0
    async with QueueReader(namesrv) as reader:
        for q in await reader.queues(topic):
            bounds = await reader.offsets(q)
            async for _ in reader.read(q, bounds.min_offset, bounds.max_offset):
                read += 1
    read_s = time.perf_counter() - t0
    return {
        "send_per_s": round(messages / sent.seconds),
        "send_p99_ms": round(percentile(lat, 0.99) * 1000, 2),
        "send_errors": sent.errors,
        "read_per_s": round(read / read_s) if read_s else 0,
        "read": read,
    }


async def touch_every_queue(namesrv: str, names: list[str]) -> int:
    """One message to each queue of every topic (the producer takes a topic's queues in turn);
    the sends that failed."""
    errors = 0
    pending: list[Awaitable[Any]] = []
    async with Producer(namesrv, send_timeout=30) as producer:
        for i, name in enumerate(names):
            msg = Message(name, b"t")
            pending += (producer.send(msg) for _ in range(QUEUES))
            if len(pending) >= 4_000 or i == len(names) - 1:
                outcomes = await asyncio.gather(*pending, return_exceptions=True)
                errors += sum(isinstance(o, BaseException) for o in outcomes)
                pending = []
    if errors:
        return errors  # a wall was met: what it left is measured as it is
    # the store indexes a large backlog on its dispatch thread: wait until the last topic's
    # queues show their message (indexing goes in CommitLog order, so every queue then has)
    async with QueueReader(namesrv) as reader:
        last = await reader.queues(names[-1])

        async def indexed() -> bool:
            return all([(await reader.offsets(q)).max_offset >= 1 for q in last])

        await eventually(indexed, 300, f"{names[-1]}'s queues indexed", every=0.1)
    return errors


def axis_topics(base: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    names = topic_names(n)
    row: dict[str, Any] = {"axis": "topics", "step": n, "queues": n * QUEUES}
    with Step(base, f"topics-{n}") as step:
        idle_before = proc_facts(step.pid)
        row["broker_fd_limit"] = fd_limit(step.pid)
        row["create_s"] = round(run(create(step.broker.address, names, args.concurrency)), 2)
        row["creates_per_s"] = round(n / row["create_s"])
        row["known_s"] = round(run(nameserver_lists(step.namesrv, set(names), 600)), 2)
        idle = proc_facts(step.pid)
        row |= {f"broker_{k}": v for k, v in idle.items()}
        row["per_idle_topic_kib"] = round((idle["rss_mb"] - idle_before["rss_mb"]) * 1024 / n, 2)
        row |= run(registration(step))
        row |= run(routes(step.namesrv, names, args.lookups))
        row |= run(fixed_load(step.namesrv, names[0], args.messages))
        loaded = proc_facts(step.pid)
        if not args.no_touch:
            t0 = time.perf_counter()
            row["touch_errors"] = run(touch_every_queue(step.namesrv, names))
            row["touch_s"] = round(time.perf_counter() - t0, 2)
            if step.broker_alive():
                touched = proc_facts(step.pid)
                row |= {f"touched_{k}": v for k, v in touched.items()}
                row["per_touched_queue_kib"] = round(
                    (touched["rss_mb"] - loaded["rss_mb"]) * 1024 / (n * QUEUES), 2
                )
            else:
                row["touched_broker"] = "exited"
        try:
            row["recovery_s"] = round(step.restart_broker_after_kill(), 2)
        except Exception as exc:  # a wall: the broker does not come back
            row["recovery_failed"] = f"{type(exc).__name__}: {str(exc)[-300:]}"
            return row
        row["recovery_known_s"] = round(run(nameserver_lists(step.namesrv, set(names), 600)), 2)
        recovered = proc_facts(step.pid)
        row |= {f"recovered_{k}": v for k, v in recovered.items()}
    return row


# -- axis: groups -------------------------------------------------------------------------------


async def fill(namesrv: str, topic: str, per_queue: int) -> None:
    """``per_queue`` messages in each queue of ``topic`` (offsets can be committed up to it)."""
    async with Producer(namesrv) as producer:
        for _ in range(per_queue * QUEUES):  # the producer takes the queues in turn
            await producer.send(Message(topic, b"g"))


async def commit_groups(
    namesrv: str, topic: str, groups: list[str], concurrency: int, offset: int
) -> float:
    t0 = time.perf_counter()
    async with AdminClient(namesrv) as admin:
        info = await admin.cluster_info()
        queues = [MessageQueue(topic, info[0].broker_name, q) for q in range(QUEUES)]

        def commit(g: str) -> Callable[[], Awaitable[Any]]:
            return lambda: admin.commit_offsets(g, dict.fromkeys(queues, offset))

        await bounded(concurrency, (commit(g) for g in groups))
    return time.perf_counter() - t0


def offsets_files(root: Path) -> dict[str, tuple[int, int, float]]:
    """The files that hold committed offsets (not the backup copy, which a rename makes)."""
    return {k: v for k, v in dir_bytes(root).items() if "consumerOffset" in k and ".bak" not in k}


def wait_persisted(
    root: Path, before: dict[str, tuple[int, int, float]], timeout: float
) -> dict[str, tuple[int, int, float]]:
    """Wait until the offsets' files change from ``before`` and then stay as they are for two
    persistence intervals (the persistence has ended, and nothing else was pending); the files
    then."""
    deadline = time.monotonic() + timeout
    now = offsets_files(root)
    while now == before:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no offset persistence within {timeout} s")
        time.sleep(0.05)  # polling the files' state, with a deadline
        now = offsets_files(root)
    stable_since = time.monotonic()
    while time.monotonic() - stable_since < 2 * PERSIST_INTERVAL_S:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the offsets' files kept changing for {timeout} s")
        time.sleep(0.05)
        later = offsets_files(root)
        if later != now:
            now, stable_since = later, time.monotonic()
    return now


def changed_bytes(
    before: dict[str, tuple[int, int, float]], after: dict[str, tuple[int, int, float]]
) -> int:
    """Bytes written between two views of the offsets' files: a file rewritten (a new inode)
    counts whole, one that grew counts its growth."""
    total = 0
    for name, (size, ino, mtime) in after.items():
        old = before.get(name)
        if old is None or old[1] != ino or size < old[0]:
            total += size
        elif mtime != old[2]:
            total += size - old[0]
    return total


def axis_groups(base: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    topic = "ScaleGroupsTopic"
    groups = [f"scale-group-{i:05d}" for i in range(n)]
    row: dict[str, Any] = {"axis": "groups", "step": n}
    with Step(base, f"groups-{n}") as step:
        run(create(step.broker.address, [topic], 1))
        run(nameserver_lists(step.namesrv, {topic}, 60))
        run(fill(step.namesrv, topic, 2))
        data = Path(step.broker.data_dir)
        before = offsets_files(data)
        committing = commit_groups(step.namesrv, topic, groups, args.concurrency, 1)
        row["commit_s"] = round(run(committing), 2)
        full = wait_persisted(data, before, 120)
        row["offsets_file_kib"] = round(sum(s for s, _, _ in full.values()) / 1024, 1)
        row["broker_rss_mb"] = proc_facts(step.pid)["rss_mb"]
        run(commit_groups(step.namesrv, topic, groups[:1], 1, 2))
        row["persist_bytes"] = changed_bytes(full, wait_persisted(data, full, 120))
    return row


# -- running ------------------------------------------------------------------------------------


AXES: dict[str, Callable[[Path, int, argparse.Namespace], dict[str, Any]]] = {
    "topics": axis_topics,
    "groups": axis_groups,
    "consumers": scale_clients.axis_consumers,
    "connections": scale_clients.axis_connections,
    "timers": scale_timers.axis_timers,
    "txns": scale_txns.axis_txns,
    "replicated-groups": scale_replicas.axis_replicated_groups,
}


def curves(rows: list[dict[str, Any]]) -> None:
    """One table per axis: each figure against the axis."""
    for axis in AXES:
        mine = [r for r in rows if r["axis"] == axis]
        if not mine:
            continue
        keys = [k for k in mine[0] if k not in ("axis", "step")]
        print(f"\n{axis}: " + " | ".join(str(r["step"]) for r in mine))
        for k in keys:
            print(f"  {k:24s} " + " | ".join(str(r.get(k, "-")) for r in mine))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--axis", choices=sorted(AXES), action="append")
    ap.add_argument("--steps", help="comma-separated steps (with one --axis)")
    ap.add_argument("--quick", action="store_true", help="the first two steps of each axis")
    ap.add_argument("--concurrency", type=int, default=32, help="admin calls at a time")
    ap.add_argument("--lookups", type=int, default=2_000, help="route lookups per step")
    ap.add_argument("--messages", type=int, default=20_000, help="the fixed load's messages")
    ap.add_argument("--no-touch", action="store_true", help="skip touching every queue")
    ap.add_argument("--send-window", type=int, default=2_000, help="timers: most sends unsettled")
    ap.add_argument("--probes", type=int, default=2_000, help="timers: probe timers per step")
    ap.add_argument("--cpu-window", type=float, default=10.0, help="txns: seconds of CPU read")
    ap.add_argument("--fresh", type=int, default=300, help="txns: fresh transactions timed")
    ap.add_argument("--scrapes", type=int, default=5, help="txns: /metrics scrapes timed")
    ap.add_argument("--no-checker", action="store_true", help="txns: without the checker")
    ap.add_argument(
        "--no-restart", action="store_true", help="timers, txns: skip the kill -9 and restart"
    )
    ap.add_argument("--dir", default=None, help="where to put the clusters (default: temp)")
    scale_clients.add_arguments(ap)
    scale_replicas.add_arguments(ap)
    args = ap.parse_args()
    axes = args.axis or list(AXES)
    if args.steps and len(axes) != 1:
        sys.exit("--steps goes with exactly one --axis")
    base = Path(args.dir or tempfile.gettempdir())
    rows = []
    for axis in axes:
        steps = (QUICK_STEPS if args.quick else DEFAULT_STEPS)[axis]
        if args.steps:
            steps = [int(s) for s in args.steps.split(",")]
        for n in steps:
            row = AXES[axis](base, n, args)
            print(json.dumps(row), flush=True)
            rows.append(row)
    curves(rows)


if __name__ == "__main__":
    main()
