"""Writing topics with Spark, batch and streaming, and a replayed micro-batch storing nothing
twice."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from spark_support import Cluster, read_all, send, stream

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_batch_write_sends_every_row_with_its_columns(
    spark: SparkSession, cluster: Cluster
) -> None:
    topic = "SparkWrite"
    cluster.create_topic(topic, queues=4)
    n = 2000
    df = spark.range(n).select(
        F.col("id").cast("string").alias("body"),
        F.array(F.concat(F.lit("k-"), F.col("id").cast("string"))).alias("keys"),
        F.when(F.col("id") % 2 == 0, "even").otherwise("odd").alias("tags"),
        F.create_map(F.lit("n"), F.col("id").cast("string")).alias("properties"),
        (F.col("id") % 3).cast("string").alias("sharding_key"),
    )
    df.write.format("apogee").option("namesrv", cluster.namesrv).option("topic", topic).mode(
        "append"
    ).save()
    stored = read_all(cluster.namesrv, topic)
    assert sorted(m.body.decode() for m in stored) == sorted(str(i) for i in range(n))
    for m in stored[:50]:
        i = int(m.body)
        assert m.keys == (f"k-{i}",)
        assert m.tags == ("even" if i % 2 == 0 else "odd")
        assert m.properties["n"] == str(i)
        assert m.properties["APOGEE_DEDUP_ID"]
    # one sharding key, one queue, in row order
    by_key: dict[str, set[tuple[str, int]]] = {}
    for m in stored:
        by_key.setdefault(str(int(m.body) % 3), set()).add((m.broker_name, m.queue_id))
    assert all(len(queues) == 1 for queues in by_key.values())


def test_a_replayed_micro_batch_stores_nothing_twice(
    spark: SparkSession, cluster: Cluster, tmp_path: Path
) -> None:
    source, target = "SparkCopyIn", "SparkCopyOut"
    cluster.create_topic(source, queues=2)
    cluster.create_topic(target, queues=2)
    send(cluster.namesrv, source, [str(i) for i in range(1200)])
    checkpoint = tmp_path / "cp"

    def run() -> list[int]:
        query = (
            stream(
                spark, cluster.namesrv, source, startingOffsets="earliest", maxOffsetsPerTrigger=500
            )
            .select("body", "keys", "tags")
            .writeStream.format("apogee")
            .option("namesrv", cluster.namesrv)
            .option("topic", target)
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        assert query.awaitTermination(120)
        assert query.exception() is None
        return [p["numInputRows"] for p in query.recentProgress]

    rows = run()
    assert sum(rows) == 1200
    assert len(read_all(cluster.namesrv, target)) == 1200

    # as if the query died after the last micro-batch was sent but before Spark recorded it:
    # Spark runs that micro-batch again, with the same offsets
    commits = sorted((checkpoint / "commits").iterdir(), key=lambda p: p.name)
    last = [p for p in commits if p.name.isdigit()][-1]
    last.unlink()
    (checkpoint / "commits" / f".{last.name}.crc").unlink(missing_ok=True)
    replayed = run()
    assert sum(replayed) > 0  # the micro-batch did run again
    stored = read_all(cluster.namesrv, target)
    assert sorted(m.body.decode() for m in stored) == sorted(str(i) for i in range(1200))

    # a streaming write of new rows still goes through
    send(cluster.namesrv, source, [str(i) for i in range(1200, 1300)])
    assert sum(run()) == 100
    assert len(read_all(cluster.namesrv, target)) == 1300
