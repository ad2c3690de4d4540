"""Reading topics with Spark, batch and streaming, from a cluster of real processes."""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
from pyspark.errors import AnalysisException, StreamingQueryException
from pyspark.sql import SparkSession
from spark_support import Cluster, bodies, read_all, reader, run_until, send, stream

from apogee.client import SyncAdminClient
from apogee.common.errors import ApogeeError
from apogee.testkit.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_batch_read_takes_every_message_of_both_brokers_within_the_options(
    spark: SparkSession, cluster: Cluster
) -> None:
    topic = "SparkBatch"
    cluster.create_topic(topic, queues=4)
    n = 10_000
    sent = [str(i) for i in range(n)]
    send(cluster.namesrv, topic, sent, tags=["even" if i % 2 == 0 else "odd" for i in range(n)])

    df = reader(spark, cluster.namesrv, topic).load()
    rows = df.select("body", "broker", "queue", "queue_offset").collect()
    assert sorted(bytes(r.body).decode() for r in rows) == sorted(sent)
    assert {r.broker for r in rows} == {"broker-a", "broker-b"}
    assert len({(r.broker, r.queue, r.queue_offset) for r in rows}) == n

    one = df.where("body = cast('7' as binary)").collect()[0]
    assert (one.topic, one.tags, list(one.keys), one.delivery_attempt) == (topic, "odd", ["k-7"], 1)
    assert one.message_id
    assert one.store_timestamp >= one.born_timestamp.replace(microsecond=0)

    # the broker filters by tag; a SQL filter is the broker's too
    odd = bodies(reader(spark, cluster.namesrv, topic, tagFilter="odd").load())
    assert sorted(odd) == sorted(s for s in sent if int(s) % 2)

    # Spark's own filter on tags, taken to the brokers when pushdown is on
    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    try:
        pushed = reader(spark, cluster.namesrv, topic, filterPushdown="true").load()
        assert pushed.where("tags = 'even'").count() == n // 2
        assert pushed.where("tags in ('even', 'odd')").count() == n
    finally:
        spark.conf.unset("spark.sql.python.filterPushdown.enabled")

    # up to offset 100 of broker-a's queue 0 only, the rest of the topic from nowhere
    ending = {topic: {"broker-a": {"0": 100}}}
    starting = {topic: {"broker-a": {"0": 50}, "broker-b": {"0": -1, "1": -1, "2": -1, "3": -1}}}
    part = (
        reader(
            spark,
            cluster.namesrv,
            topic,
            startingOffsets=json.dumps(starting),
            endingOffsets=json.dumps(ending),
        )
        .load()
        .where("broker = 'broker-a' and queue = 0")
        .select("queue_offset")
        .collect()
    )
    assert sorted(r.queue_offset for r in part) == list(range(50, 100))

    # a time: nothing stored after now
    later = reader(spark, cluster.namesrv, topic, startingOffsets=str(int(time.time() * 1000) + 5))
    assert later.load().count() == 0
    no_props = reader(spark, cluster.namesrv, topic, includeProperties="false").load()
    assert "properties" not in no_props.columns


def _sink(spark: SparkSession, path: Path) -> list[str]:
    try:
        return bodies(spark.read.parquet(str(path)))
    except AnalysisException:  # nothing written yet
        return []


def test_a_stream_stopped_and_restarted_on_its_checkpoint_delivers_every_message_once(
    spark: SparkSession, cluster: Cluster, tmp_path: Path
) -> None:
    topic = "SparkStream"
    cluster.create_topic(topic, queues=2)
    first = [f"a{i}" for i in range(1500)]
    send(cluster.namesrv, topic, first)
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"

    def start() -> object:
        df = stream(
            spark,
            cluster.namesrv,
            topic,
            startingOffsets="earliest",
            maxOffsetsPerTrigger=500,
            commitGroup="spark-stream",
        )
        return (
            df.select("body", "broker", "queue", "queue_offset")
            .writeStream.format("parquet")
            .option("path", str(out))
            .option("checkpointLocation", str(checkpoint))
            .trigger(processingTime="200 milliseconds")
            .start()
        )

    query = start()
    run_until(query, lambda: len(_sink(spark, out)) >= 1500, 120, "the first 1,500")  # type: ignore[arg-type]
    progress = query.recentProgress  # type: ignore[attr-defined]
    assert max(p["numInputRows"] for p in progress) <= 500
    query.stop()  # type: ignore[attr-defined]

    second = [f"b{i}" for i in range(1000)]
    send(cluster.namesrv, topic, second)
    query = start()
    run_until(query, lambda: len(_sink(spark, out)) >= 2500, 120, "all 2,500")  # type: ignore[arg-type]
    # one more trigger's worth of time: nothing more may come
    query.processAllAvailable()  # type: ignore[attr-defined]

    # the query's progress, committed as a group's offsets: all it read, within a trigger
    def committed() -> int:
        with SyncAdminClient(cluster.namesrv) as admin:
            lag = admin.describe_group("spark-stream")
        return sum(q.consumer_offset or 0 for q in lag.queues if q.topic == topic)

    run_until(query, lambda: committed() == 2500, 60, "the group's offsets at 2,500")  # type: ignore[arg-type]
    query.stop()  # type: ignore[attr-defined]
    got = _sink(spark, out)
    assert sorted(got) == sorted(first + second)


def test_available_now_reads_what_is_there_and_stops(
    spark: SparkSession, cluster: Cluster, tmp_path: Path
) -> None:
    topic = "SparkNow"
    cluster.create_topic(topic, queues=2)
    send(cluster.namesrv, topic, [str(i) for i in range(300)])
    query = (
        stream(
            spark,
            cluster.namesrv,
            topic,
            startingOffsets="earliest",
            maxOffsetsPerTrigger=70,
            commitGroup="spark-now",
        )
        .select("body")
        .writeStream.format("parquet")
        .option("path", str(tmp_path / "out"))
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(120)
    assert query.exception() is None
    assert sorted(_sink(spark, tmp_path / "out")) == sorted(str(i) for i in range(300))
    assert len([p for p in query.recentProgress if p["numInputRows"]]) >= 5
    # every batch the query finished is committed as the group's offsets: nothing left to read
    with SyncAdminClient(cluster.namesrv) as admin:
        group = admin.describe_group("spark-now")
    queues = [q for q in group.queues if q.topic == topic]
    assert len(queues) == 4  # two queues on each broker
    assert sum(q.consumer_offset or 0 for q in queues) == 300
    assert group.lag_messages == 0


def test_a_broker_killed_and_restarted_under_a_running_stream_loses_and_doubles_nothing(
    spark: SparkSession, cluster: Cluster, tmp_path: Path
) -> None:
    topic = "SparkKill"
    cluster.create_topic(topic, queues=2)
    out = tmp_path / "out"
    query = (
        stream(spark, cluster.namesrv, topic, startingOffsets="earliest", retryTimeoutMs=60000)
        .select("body", "broker", "queue", "queue_offset")
        .writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        sent: list[str] = []
        stop = threading.Event()

        def produce() -> None:
            i = 0
            while not stop.is_set() and i < 40:
                batch = [f"k{i}-{j}" for j in range(100)]
                try:
                    send(cluster.namesrv, topic, batch)
                except ApogeeError:  # broker-b died under the sends: the batch goes again
                    continue
                sent.extend(batch)
                i += 1

        producer = threading.Thread(target=produce)
        producer.start()
        run_until(query, lambda: len(_sink(spark, out)) >= 500, 120, "a first part")
        cluster.kill("broker-b")
        run_until(query, lambda: len(_sink(spark, out)) >= 1500, 120, "more, broker-b dead")
        cluster.restart("broker-b")
        producer.join()
        stored = read_all(cluster.namesrv, topic)
        run_until(query, lambda: len(_sink(spark, out)) >= len(stored), 180, "everything")
        query.processAllAvailable()
    finally:
        query.stop()
    rows = spark.read.parquet(str(out)).collect()
    # exactly what the topic holds (a send retried after the kill may be stored twice there)
    assert sorted((r.broker, r.queue, r.queue_offset) for r in rows) == sorted(
        (m.broker_name, m.queue_id, m.queue_offset) for m in stored
    )
    assert set(sent) <= {bytes(r.body).decode() for r in rows}


def test_data_removed_by_retention_fails_the_query_or_is_skipped(
    spark: SparkSession, tmp_path: Path
) -> None:
    aging = Cluster.start(
        tmp_path / "cluster",
        brokers=1,
        APOGEE_BROKER_COMMITLOG_FILE_SIZE=str(64 * 1024),
        APOGEE_BROKER_MAX_MESSAGE_SIZE=str(8 * 1024),
        APOGEE_BROKER_RETENTION_HOURS="0.0002",
        APOGEE_BROKER_RETENTION_CHECK_INTERVAL_S="0.1",
    )
    try:
        topic = "SparkAging"
        aging.create_topic(topic, queues=1)
        send(aging.namesrv, topic, [str(i).ljust(1024, ".") for i in range(5)])

        def run(checkpoint: Path, out: Path, fail: bool) -> object:
            query = (
                stream(
                    spark,
                    aging.namesrv,
                    topic,
                    startingOffsets="earliest",
                    failOnDataLoss=str(fail).lower(),
                )
                .select("queue_offset")
                .writeStream.format("parquet")
                .option("path", str(out))
                .option("checkpointLocation", str(checkpoint))
                .trigger(availableNow=True)
                .start()
            )
            with contextlib.suppress(StreamingQueryException):  # looked at by the caller
                query.awaitTermination(120)
            return query

        first = run(tmp_path / "cp", tmp_path / "out", True)
        assert first.exception() is None  # type: ignore[attr-defined]
        send(aging.namesrv, topic, [str(i).ljust(1024, ".") for i in range(5, 300)])
        with SyncAdminClient(aging.namesrv) as admin:
            since: list[tuple[int, float]] = []

            def trimmed() -> bool:
                low = admin.describe_topic(topic).brokers[0].queues[0].min_offset
                if low <= 5 or not since or since[0][0] != low:
                    since[:] = [(low, time.monotonic())]
                    return False
                return time.monotonic() - since[0][1] >= 1.0

            wait_until(trimmed, 30, "retention deleting the oldest messages", every=0.1)
        earliest = since[0][0]

        # the same query twice from where it stopped (its checkpoint and its file sink's log)
        shutil.copytree(tmp_path / "cp", tmp_path / "cp2")
        shutil.copytree(tmp_path / "out", tmp_path / "out2")
        failing = run(tmp_path / "cp", tmp_path / "out", True)
        assert failing.exception() is not None  # type: ignore[attr-defined]
        assert "failOnDataLoss" in str(failing.exception())  # type: ignore[attr-defined]

        skipping = run(tmp_path / "cp2", tmp_path / "out2", False)
        assert skipping.exception() is None  # type: ignore[attr-defined]
        offsets = sorted(
            r.queue_offset for r in spark.read.parquet(str(tmp_path / "out2")).collect()
        )
        assert [o for o in offsets if o >= 5] == list(range(earliest, 300))
    finally:
        aging.close()
