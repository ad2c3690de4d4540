"""Benchmark of the Spark data source beside the plain SDK, in one run on one cluster: two
brokers and a nameserver as separate processes (``apogee.local.cluster``, async flush), a
topic of 8 queues (4 per broker), Spark ``local[2]`` in this process, 1 KiB bodies.

Prints one JSON object per line (see ``figures.emit``):

- ``sdk_send``: a ``Producer`` fills the backlog of ``--messages`` (``send_nowait``, 4,096 in
  flight);
- ``sdk_consume``: one ``PullConsumer`` drains that backlog (``poll`` of up to 1,024);
- ``spark_stream_read``: a streaming query (``Trigger.AvailableNow``, the ``noop`` sink) reads
  the same backlog from the earliest offsets; ``vs_sdk`` is its rate over ``sdk_consume``'s;
- ``spark_batch_write``: ``df.write.format("apogee")`` of as many 1 KiB rows (``spark.range``)
  to another topic of 8 queues, with dedup ids; ``vs_sdk`` over ``sdk_send``'s rate.

Spark's start and its first query's Python workers are not timed (a warm-up query runs first).

    python bench/spark_bench.py                      # 1,000,000 messages (some minutes)
    python bench/spark_bench.py --messages 100000    # a quick run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from figures import emit
from load import create_topics

from apogee.client import Message, Producer
from apogee.client.consumer.pull import PullConsumer
from apogee.local import cluster as local_cluster

SOURCE = "BenchSparkIn"
TARGET = "BenchSparkOut"
WARM = "BenchSparkWarm"
BODY = 1024


async def sdk_send(namesrv: str, topic: str, count: int) -> float:
    body = os.urandom(BODY)
    start = time.perf_counter()
    async with Producer(namesrv, group="bench-spark-fill") as producer:
        pending: set[asyncio.Future[Any]] = set()
        for _ in range(count):
            pending.add(producer.send_nowait(Message(topic, body, tags="TagA")))
            if len(pending) >= 4096:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for f in done:
                    f.result()
        await asyncio.gather(*pending)
    return time.perf_counter() - start


async def sdk_consume(namesrv: str, count: int) -> float:
    consumer = PullConsumer(
        namesrv, "bench-spark-sdk", consume_from="earliest", pull_batch_size=1024
    )
    consumer.subscribe(SOURCE)
    got = 0
    start = time.perf_counter()
    async with consumer:
        await consumer.start()
        while got < count:
            got += len(await consumer.poll(timeout=5.0, max_messages=1024))
    return time.perf_counter() - start


def spark_session() -> Any:
    from pyspark.sql import SparkSession  # noqa: PLC0415

    from apogee.spark import register  # noqa: PLC0415

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("apogee-spark-bench")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def stream_read(spark: Any, namesrv: str, topic: str, checkpoint: Path) -> tuple[float, int]:
    query = (
        spark.readStream.format("apogee")
        .option("namesrv", namesrv)
        .option("topic", topic)
        .option("startingOffsets", "earliest")
        .load()
        .writeStream.format("noop")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    start = time.perf_counter()
    query.awaitTermination()
    seconds = time.perf_counter() - start
    if query.exception() is not None:
        raise RuntimeError(str(query.exception()))
    return seconds, sum(p["numInputRows"] for p in query.recentProgress)


def batch_write(spark: Any, namesrv: str, topic: str, count: int) -> float:
    from pyspark.sql import functions as F  # noqa: PLC0415

    df = spark.range(count, numPartitions=4).select(
        F.expr(f"repeat('x', {BODY})").alias("body"), F.lit("TagA").alias("tags")
    )
    start = time.perf_counter()
    df.write.format("apogee").option("namesrv", namesrv).option("topic", topic).mode(
        "append"
    ).save()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    n = args.messages

    base = Path(args.dir or tempfile.gettempdir())
    data = Path(tempfile.mkdtemp(prefix="spark-bench-", dir=base))
    try:
        state = local_cluster.up(
            data / "cluster",
            brokers=2,
            nameservers=1,
            flush_mode="async",
            schedule=False,
            txn_checker=False,
            console=False,
        )
        namesrv = state.namesrv
        asyncio.run(create_topics(namesrv, [SOURCE, TARGET, WARM], 4))

        seconds = asyncio.run(sdk_send(namesrv, SOURCE, n))
        emit("sdk_send", n, BODY, seconds, [])
        send_rate = n / seconds
        seconds = asyncio.run(sdk_consume(namesrv, n))
        emit("sdk_consume", n, BODY, seconds, [])
        consume_rate = n / seconds

        spark = spark_session()
        asyncio.run(sdk_send(namesrv, WARM, 1000))
        stream_read(spark, namesrv, WARM, data / "warm")  # Spark's workers start here
        seconds, rows = stream_read(spark, namesrv, SOURCE, data / "checkpoint")
        emit(
            "spark_stream_read",
            rows,
            BODY,
            seconds,
            [],
            vs_sdk=round(rows / seconds / consume_rate, 2),
        )
        seconds = batch_write(spark, namesrv, TARGET, n)
        emit("spark_batch_write", n, BODY, seconds, [], vs_sdk=round(n / seconds / send_rate, 2))
        spark.stop()
    finally:
        with contextlib.suppress(Exception):
            local_cluster.down(data / "cluster")
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
