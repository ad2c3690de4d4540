"""What the Spark tests share besides fixtures: sending numbered messages, reading a topic back
through the SDK, and running a streaming query until it has seen what it should."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from apogee.client import AdminClient, Message, Producer, QueueReader, ReceivedMessage
from apogee.local import cluster as local_cluster
from apogee.local.cluster import ClusterState
from apogee.testkit.waiting import eventually, wait_until

T = TypeVar("T")

KiB = 1024
MiB = 1024 * KiB

NAMESERVER_ENV: Mapping[str, str] = {
    "APOGEE_NAMESERVER_BROKER_EXPIRY_S": "5",
    "APOGEE_NAMESERVER_SCAN_INTERVAL_S": "0.5",
    "APOGEE_NAMESERVER_SHUTDOWN_GRACE_S": "1",
}
BROKER_ENV: Mapping[str, str] = {
    "APOGEE_BROKER_HEARTBEAT_INTERVAL_S": "1",
    "APOGEE_BROKER_REGISTER_TIMEOUT_S": "1",
    "APOGEE_BROKER_COMMITLOG_FILE_SIZE": str(4 * MiB),
    "APOGEE_BROKER_MAX_MESSAGE_SIZE": str(256 * KiB),
    "APOGEE_BROKER_CONSUME_QUEUE_ENTRIES_PER_FILE": "4096",
    "APOGEE_BROKER_INDEX_SLOTS": "4999",
    "APOGEE_BROKER_INDEX_ENTRIES_PER_FILE": "65536",
    "APOGEE_BROKER_SHUTDOWN_GRACE_S": "2",
}


def in_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own (``local_cluster`` runs event loops of its own)."""
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run, name="spark-test-cluster")
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return out[0]


class Cluster:
    """A local cluster of processes; :meth:`close` always stops every member."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.data_dir = Path(state.data_dir)

    @classmethod
    def start(cls, data_dir: Path, brokers: int = 2, **broker_env: str) -> Cluster:
        env = {**BROKER_ENV, **broker_env}
        state = in_thread(
            lambda: local_cluster.up(
                data_dir,
                brokers=brokers,
                nameservers=1,
                timeout=60.0,
                nameserver_env=dict(NAMESERVER_ENV),
                broker_env=env,
                schedule=False,
                txn_checker=False,
                console=False,
            )
        )
        return cls(state)

    @property
    def namesrv(self) -> str:
        return self.state.namesrv

    def create_topic(self, topic: str, queues: int = 4) -> None:
        async def create() -> None:
            async with AdminClient(self.namesrv) as admin:
                await admin.create_or_update_topic(topic, queues=queues)

                async def routed() -> bool:
                    route = await admin.describe_topic(topic)
                    return len(route.brokers) == len(self.state.brokers)

                await eventually(routed, 20, f"a route to {topic}", every=0.05)

        in_thread(lambda: asyncio.run(create()))

    def kill(self, name: str) -> None:
        p = next(p for p in self.state.brokers if p.name == name)
        os.kill(p.pid, signal.SIGKILL)
        wait_until(lambda: not local_cluster.pid_alive(p.pid), 10, f"{name} gone")

    def restart(self, name: str) -> None:
        in_thread(lambda: local_cluster.restart(self.state, name, timeout=60.0))

    def close(self) -> None:
        try:
            in_thread(lambda: local_cluster.down(self.data_dir, 20.0))
        finally:
            for p in self.state.all():
                if local_cluster.pid_alive(p.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGKILL)


def send(namesrv: str, topic: str, bodies: Sequence[str], tags: Sequence[str] = ()) -> None:
    """Send one message per body (with the tag of the same place, if given) and wait."""

    async def run() -> None:
        async with Producer(namesrv) as producer:
            futures = []
            for i, body in enumerate(bodies):
                tag = tags[i] if tags else ""
                msg = Message(topic, body.encode(), tags=tag, keys=(f"k-{body}",))
                futures.append(producer.send_nowait(msg))
                if len(futures) >= 2000:
                    await asyncio.gather(*futures)
                    futures = []
            await asyncio.gather(*futures)

    asyncio.run(run())


def read_all(namesrv: str, topic: str) -> list[ReceivedMessage]:
    async def run() -> list[ReceivedMessage]:
        out: list[ReceivedMessage] = []
        async with QueueReader(namesrv) as reader:
            for q in await reader.queues(topic):
                bounds = await reader.offsets(q)
                out += [m async for m in reader.read(q, bounds.min_offset, bounds.max_offset)]
        return out

    return asyncio.run(run())


def reader(spark: SparkSession, namesrv: str, topic: str, **options: Any) -> Any:
    r = spark.read.format("apogee").option("namesrv", namesrv).option("topic", topic)
    for k, v in options.items():
        r = r.option(k, str(v))
    return r


def stream(spark: SparkSession, namesrv: str, topic: str, **options: Any) -> DataFrame:
    r = spark.readStream.format("apogee").option("namesrv", namesrv).option("topic", topic)
    for k, v in options.items():
        r = r.option(k, str(v))
    return r.load()


def bodies(df: DataFrame) -> list[str]:
    return [bytes(r.body).decode() for r in df.select("body").collect()]


def run_until(query: StreamingQuery, done: Any, timeout: float, what: str) -> None:
    """Let ``query`` run until ``done()``; fails if the query dies or time runs out."""
    deadline = time.monotonic() + timeout
    while not done():
        if query.exception() is not None:
            raise AssertionError(f"{what}: the query failed: {query.exception()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s ({query.lastProgress})")
        query.awaitTermination(0.2)  # type: ignore[arg-type]  # returns when the query stops
