"""Axis ``replicated-groups`` of the scale benchmark (``scale_bench.py``): one offset persistence
on a replica group's leader, at a series of group counts (10, 1,000, 10,000 by default), each on
a fresh group of three replicas of ``broker-a`` in this process (``apogee.testkit.replicas``: file
coordination, every replica with its own data directory and port) beside a nameserver of its
own. The ``groups`` axis measures a lone broker; here a persistence also waits until the
followers hold what it persists (the commits shipped as they were made, or a whole snapshot).

At each step, ``n`` groups commit an offset on every queue of one topic of 8 queues (through an
``AdminClient``, ``--concurrency`` at a time; the periodic persistence is off, each one below is
called on the leader), then:

- ``commit_s``: those commits;
- ``first_persist_ms``: the term's first persistence, which ships a whole snapshot (all n
  groups) to the followers and waits for them;
- ``persist_ms``, ``persist_max_ms``: the median and the slowest of ``--persists`` (20)
  persistences, each after one group's offsets changed (a commit, then the persistence,
  timed alone); ``persist_bytes``: what each appended to the leader's offsets journal, on
  average;
- ``leader_rss_mb``: this process (three replicas and a nameserver).

    python bench/scale_bench.py --axis replicated-groups --steps 10,10000
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from scale_common import bounded, run

from apogee.client import AdminClient, Message, MessageQueue, Producer
from apogee.testkit.cluster import InProcessCluster
from apogee.testkit.replicas import ReplicaGroup

DEFAULT_STEPS = (10, 1_000, 10_000)
QUEUES = 8
TOPIC = "ScaleReplicatedGroups"


async def replicated_groups(base: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"axis": "replicated-groups", "step": n}
    with tempfile.TemporaryDirectory(prefix=f"scale-replicated-{n}-", dir=base) as d:
        tmp = Path(d)
        async with (
            InProcessCluster(tmp / "ns", nameservers=1, brokers=()) as ns,
            ReplicaGroup(tmp, ns.namesrv, 3, offset_persist_interval_s=3600.0) as group,
        ):
            await group.start_all()
            leader = await group.wait_leader(in_sync=3)
            async with AdminClient(group.namesrv) as admin:
                await admin.create_or_update_topic(TOPIC, queues=QUEUES)
                async with Producer(group.namesrv) as producer:
                    # room for every commit below: the producer takes the queues in turn
                    for _ in range((args.persists + 2) * QUEUES):
                        await producer.send(Message(TOPIC, b"g"))
                queues = [MessageQueue(TOPIC, "broker-a", q) for q in range(QUEUES)]

                def commit(g: str, offset: int) -> Any:
                    return lambda: admin.commit_offsets(g, dict.fromkeys(queues, offset))

                groups = [f"scale-group-{i:05d}" for i in range(n)]
                t0 = time.perf_counter()
                await bounded(args.concurrency, (commit(g, 1) for g in groups))
                row["commit_s"] = round(time.perf_counter() - t0, 2)
                assert leader.app is not None
                offsets = leader.app.offsets
                assert offsets is not None
                t0 = time.perf_counter()
                await offsets.persist()
                row["first_persist_ms"] = round((time.perf_counter() - t0) * 1000, 1)
                times, grown = [], []
                for i in range(args.persists):
                    await admin.commit_offsets(groups[i % n], dict.fromkeys(queues, 2 + i))
                    before = offsets.files.journal_bytes
                    t0 = time.perf_counter()
                    if not await offsets.persist():
                        raise RuntimeError("a persistence after a commit wrote nothing")
                    times.append((time.perf_counter() - t0) * 1000)
                    grown.append(offsets.files.journal_bytes - before)
            row["persist_ms"] = round(statistics.median(times), 1)
            row["persist_max_ms"] = round(max(times), 1)
            row["persist_bytes"] = round(statistics.mean(grown))
            row["leader_rss_mb"] = round(
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1
            )
    return row


def axis_replicated_groups(base: Path, n: int, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = run(replicated_groups(base, n, args))
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--persists", type=int, default=20, help="replicated-groups: persistences timed"
    )
