"""Consumers against a cluster of real processes: a group shares 8 queues over 2 brokers and
gets every message once; a consumer killed with SIGKILL loses nothing (its queues move to the
others); orderly consumers keep per-key order across a kill; offsets survive restarts of the
broker and of the consumer.

Consumers that get killed run in processes of their own (:mod:`e2e.consumer_proc`), writing
what their listener received to a file; the others run in the test's process.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from apogee.client import AdminClient, Message, Producer
from apogee.client.consumer.push import PushConsumer
from apogee.client.consumer.records import ReceivedMessage
from apogee.local import cluster as local_cluster
from apogee.testkit.cluster import wait_committed
from e2e.harness import Cluster, ClusterFactory, eventually, wait_for_route, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
BROKERS = {"broker-a", "broker-b"}
QUEUES_PER_BROKER = 4


@dataclass
class ConsumerProcess:
    client_id: str
    out: Path
    proc: subprocess.Popen[bytes]

    def lines(self) -> list[list[str]]:
        if not self.out.exists():
            return []
        text = self.out.read_text()
        return [ln.split("\t") for ln in text.splitlines() if ln.count("\t") == 5]

    def assignment(self) -> list[str]:
        try:
            return list(json.loads((self.out.parent / (self.out.name + ".assignment")).read_text()))
        except (OSError, ValueError):
            return []


class Consumers:
    """Consumer processes of one test; all of them are gone at the end, whatever happens."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[ConsumerProcess] = []

    def start(self, namesrv: str, group: str, topic: str, name: str, orderly: bool = False) -> None:
        out = self.folder / f"{name}.txt"
        cmd = [
            sys.executable,
            "-m",
            "e2e.consumer_proc",
            "--namesrv",
            namesrv,
            "--group",
            group,
            "--topic",
            topic,
            "--out",
            str(out),
            "--client-id",
            name,
        ]
        if orderly:
            cmd.append("--orderly")
        log = open(self.folder / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.procs.append(ConsumerProcess(name, out, proc))

    def kill(self, name: str) -> None:
        p = next(p for p in self.procs if p.client_id == name)
        p.proc.send_signal(signal.SIGKILL)
        p.proc.wait(10)

    def alive(self) -> list[ConsumerProcess]:
        return [p for p in self.procs if p.proc.poll() is None]

    def lines(self) -> list[list[str]]:
        return [ln for p in self.procs for ln in p.lines()]

    async def settled(self, queues: int, timeout: float = 30.0, stable: float = 2.0) -> None:
        """Wait until the live consumers' assignments partition the queues, and have for
        ``stable`` seconds: rebalances of different members are not simultaneous, and while
        they converge a queue may briefly have two readers (delivery is at least once)."""
        since: list[float] = []

        async def partitioned() -> bool:
            owned = [q for p in self.alive() for q in p.assignment()]
            if len(owned) != queues or len(set(owned)) != queues:
                since.clear()
                return False
            if not since:
                since.append(time.monotonic())
            return time.monotonic() - since[0] >= stable

        await eventually(partitioned, timeout, "the live consumers sharing every queue")

    def stop(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.proc.wait(15)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait(5)

    def logs(self) -> str:
        return "\n".join(
            f"==> {f.name} <==\n{f.read_text(errors='replace')[-3000:]}"
            for f in sorted(self.folder.glob("*.log"))
        )


@pytest.fixture
def consumers(tmp_path: Path) -> Iterator[Consumers]:
    c = Consumers(tmp_path)
    try:
        yield c
    finally:
        c.stop()


async def topic_on_both(cluster: Cluster, topic: str) -> None:
    async with AdminClient(cluster.namesrv) as admin:
        await admin.create_or_update_topic(topic, queues=QUEUES_PER_BROKER)
    await wait_for_route(cluster.nameservers, topic, BROKERS)


async def send_all(namesrv: str, topic: str, n: int, rate: float = 0.0) -> list[str]:
    """``n`` messages, as fast as batching allows, or ``rate`` per second."""
    ids: list[str] = []
    async with Producer(namesrv, group="e2e-consumers") as producer:
        start = time.monotonic()
        step = 500
        for first in range(0, n, step):
            futures = [
                producer.send_nowait(Message(topic, f"{i}".encode(), keys=f"k{i}"))
                for i in range(first, min(first + step, n))
            ]
            ids += [r.message_id for r in await asyncio.gather(*futures)]
            if rate:
                ahead = start + (first + step) / rate - time.monotonic()
                if ahead > 0:
                    await asyncio.sleep(ahead)  # pacing the producer, not synchronisation
    return ids


async def test_a_group_of_three_gets_20000_messages_once_and_survives_a_kill(
    cluster: Cluster, consumers: Consumers
) -> None:
    topic = "E2EConsumeGroup"
    await topic_on_both(cluster, topic)
    for i in range(3):
        consumers.start(cluster.namesrv, "e2e-group", topic, f"member-{i}")
    await consumers.settled(2 * QUEUES_PER_BROKER)
    sent = await send_all(cluster.namesrv, topic, 20_000)

    async def all_in() -> bool:
        return len(consumers.lines()) >= len(sent)

    await eventually(all_in, 60, "20,000 messages consumed")
    # a duplicate reaches a listener before the offset past it is committed
    await wait_committed(cluster.namesrv, "e2e-group", topic, 2 * QUEUES_PER_BROKER, 30)
    got = [ln[1] for ln in consumers.lines()]
    assert len(got) == len(sent), consumers.logs()
    assert sorted(got) == sorted(sent)
    assert all(p.lines() for p in consumers.procs), "every member consumed a share"

    # kill -9 one member while 6,000 more arrive: the other two take its queues, nothing lost
    sending = asyncio.create_task(send_all(cluster.namesrv, topic, 6_000, rate=1_500))

    async def flowing() -> bool:  # the kill lands mid-stream
        return len(consumers.lines()) > len(sent)

    await eventually(flowing, 30, "the first of the 6,000 more consumed")
    consumers.kill("member-0")
    more = await asyncio.wait_for(sending, 60)
    await consumers.settled(2 * QUEUES_PER_BROKER)

    async def all_more_in() -> bool:
        return set(more) <= {ln[1] for ln in consumers.lines()}

    await eventually(all_more_in, 60, "every message sent around the kill consumed")


async def test_orderly_consumers_keep_per_key_order_across_a_kill(
    cluster: Cluster, consumers: Consumers
) -> None:
    topic = "E2EConsumeOrderly"
    await topic_on_both(cluster, topic)
    for i in range(4):
        consumers.start(cluster.namesrv, "e2e-orderly", topic, f"ordered-{i}", orderly=True)
    await consumers.settled(2 * QUEUES_PER_BROKER)
    keys = [f"key-{k}" for k in range(100)]
    rounds = 40

    async def send_ordered() -> None:
        async with Producer(cluster.namesrv, group="e2e-orderly-producer") as producer:
            for r in range(rounds):
                await asyncio.gather(
                    *(
                        producer.send_ordered(Message(topic, f"{r}".encode(), keys=k), k)
                        for k in keys
                    )
                )
                await asyncio.sleep(0.02)  # pacing: the kill lands mid-stream

    sending = asyncio.create_task(send_ordered())

    async def flowing() -> bool:  # the kill lands mid-stream
        return len(consumers.lines()) > 0

    await eventually(flowing, 30, "the first ordered messages consumed")
    consumers.kill("ordered-1")
    await asyncio.wait_for(sending, 60)

    async def complete() -> bool:
        seen = {(ln[4], ln[5]) for ln in consumers.lines()}
        return len(seen) >= len(keys) * rounds

    await eventually(complete, 60, "every ordered message consumed")
    # per key, in the order consumers saw them (each process's file is in its own order; a
    # key lives on one queue, so a takeover hands it from one process to the next): each
    # value is the next one or a redelivery of an earlier one, never a jump ahead
    by_key: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    for p in consumers.procs:
        for ln in p.lines():
            by_key[ln[4]].append((p.client_id, int(ln[5])))
    for key, seq in by_key.items():
        per_proc: dict[str, list[int]] = collections.defaultdict(list)
        for who, value in seq:
            per_proc[who].append(value)
        for who, values in per_proc.items():
            assert values == sorted(values), f"{key} out of order at {who}: {values}"
        assert set(v for _, v in seq) == set(range(rounds)), key


async def test_offsets_survive_a_broker_restart_and_a_consumer_restart(
    start_cluster: ClusterFactory,
) -> None:
    cluster = await asyncio.to_thread(start_cluster, "offsets", nameservers=1)
    topic = "E2EOffsets"
    await topic_on_both(cluster, topic)
    first = await send_all(cluster.namesrv, topic, 300)
    got: list[ReceivedMessage] = []

    async def listen(msgs: list[ReceivedMessage]) -> None:
        got.extend(msgs)

    options = {"rebalance_interval": 1.0, "offset_persist_interval": 0.2, "long_poll_timeout": 2.0}
    async with PushConsumer(
        cluster.namesrv,
        "e2e-offsets",
        listen,
        consume_from="earliest",
        **options,  # type: ignore[arg-type]
    ) as c:
        c.subscribe(topic)
        await c.start()

        async def first_in() -> bool:
            return len(got) >= len(first)

        await eventually(first_in, 30, "the first 300 messages")
        await wait_committed(cluster.namesrv, "e2e-offsets", topic, 2 * QUEUES_PER_BROKER)
    assert sorted(m.unique_id for m in got) == sorted(first)

    # graceful restart of both brokers (SIGTERM: offsets written at shutdown), then more
    for name in sorted(BROKERS):
        p = cluster.member(name)
        os.kill(p.pid, signal.SIGTERM)
        await asyncio.to_thread(
            lambda pid=p.pid: _wait_gone(pid, 20)  # type: ignore[misc]
        )
        await asyncio.to_thread(cluster.restart, name)
    await wait_for_route(cluster.nameservers, topic, BROKERS)
    second = await send_all(cluster.namesrv, topic, 200)
    got.clear()
    async with PushConsumer(
        cluster.namesrv,
        "e2e-offsets",
        listen,
        consume_from="earliest",
        **options,  # type: ignore[arg-type]
    ) as c:
        c.subscribe(topic)
        await c.start()

        async def second_in() -> bool:
            return len(got) >= len(second)

        await eventually(second_in, 30, "the next 200 messages")
        # one of the first 300 again would reach the listener before the end is committed
        await wait_committed(cluster.namesrv, "e2e-offsets", topic, 2 * QUEUES_PER_BROKER)
    assert sorted(m.unique_id for m in got) == sorted(second), "resumed where it left off"


def _wait_gone(pid: int, timeout: float) -> None:
    wait_until(lambda: not local_cluster.pid_alive(pid), timeout, f"pid {pid} gone")
