"""The examples under examples/spark: the Kubernetes manifest against the Kubernetes schemas,
and the jobs (the batch export, the streaming aggregate in a bounded run, the dead-letter
summary) run against a real cluster."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import ModuleType

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from pyspark.sql import SparkSession
from spark_support import Cluster, read_all, send

from apogee.client import AdminClient, Message, Producer, ReceivedMessage
from apogee.client.consumer.config import ConsumerOptions
from apogee.client.consumer.pull import PullConsumer
from apogee.common.errors import NotFoundError

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "spark"


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
def test_the_job_manifest_is_valid_kubernetes() -> None:
    documents = [d for d in yaml.safe_load_all((EXAMPLES / "job.yaml").read_text()) if d]
    assert {d["kind"] for d in documents} == {
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "PersistentVolumeClaim",
        "Job",
    }
    for document in documents:
        kubernetes_validate.validate(document, "1.30", strict=True)
    [job] = [d for d in documents if d["kind"] == "Job"]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--master") + 1].startswith("k8s://")
    assert "/opt/apogee/examples/spark/streaming_aggregate.py" in args


@pytest.mark.integration
def test_the_export_writes_the_time_range_to_parquet(
    spark: SparkSession, cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic = "SparkExport"
    cluster.create_topic(topic, queues=2)
    begin = datetime.now(UTC)
    send(cluster.namesrv, topic, [str(i) for i in range(200)])
    # the range ends a millisecond after the last store time, and the late ones come after it
    end = datetime.now(UTC) + timedelta(milliseconds=2)
    while datetime.now(UTC) <= end:
        pass
    send(cluster.namesrv, topic, [f"late-{i}" for i in range(20)])
    out = tmp_path / "export"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "export_parquet.py",
            "--namesrv",
            cluster.namesrv,
            "--topic",
            topic,
            "--begin",
            begin.isoformat(),
            "--end",
            end.isoformat(),
            "--out",
            str(out),
        ],
    )
    _example("export_parquet").main()
    rows = spark.read.parquet(str(out)).collect()
    assert sorted(bytes(r.body).decode() for r in rows) == sorted(str(i) for i in range(200))


@pytest.mark.integration
def test_the_streaming_aggregate_sends_the_counts_per_tag(
    spark: SparkSession, cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, target = "SparkAggregateIn", "SparkAggregateOut"
    cluster.create_topic(source, queues=2)
    cluster.create_topic(target, queues=2)
    tags = ["A"] * 30 + ["B"] * 20 + [""] * 10
    send(cluster.namesrv, source, [str(i) for i in range(len(tags))], tags=tags)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "streaming_aggregate.py",
            "--namesrv",
            cluster.namesrv,
            "--source",
            source,
            "--target",
            target,
            "--checkpoint",
            str(tmp_path / "checkpoint"),
            "--available-now",
        ],
    )
    _example("streaming_aggregate").main()
    counts: dict[str, int] = {}
    for m in read_all(cluster.namesrv, target):
        count = json.loads(m.body)
        assert m.tags == count["tag"]
        assert m.keys == (f"{count['tag']}@{count['minute']}",)
        counts[count["tag"]] = counts.get(count["tag"], 0) + count["messages"]
    # the messages may straddle a minute: each minute is counted once, and the counts add up
    assert counts == {"A": 30, "B": 20, "": 10}


def _dead_letter(namesrv: str, topic: str, group: str, reasons: list[str]) -> None:
    """Send one message per reason and fail it in ``group`` past its retries: the broker
    stores it in ``%DLQ%<group>`` with the reason."""

    async def run() -> None:
        async with Producer(namesrv) as producer:
            for i in range(len(reasons)):
                await producer.send(Message(topic, f"order {i}".encode(), keys=(f"k{i}",)))
        options: ConsumerOptions = {
            "rebalance_interval": 1.0,
            "long_poll_timeout": 2.0,
            "consume_from": "earliest",
            "max_reconsume_times": 0,  # the first failure is the last
        }
        async with PullConsumer(namesrv, group, auto_commit=False, **options) as consumer:
            consumer.subscribe(topic)
            await consumer.start()
            polled: list[ReceivedMessage] = []
            async with asyncio.timeout(15):
                while len(polled) < len(reasons):
                    polled += await consumer.poll(timeout=5, max_messages=len(reasons))
            for m in polled:
                await consumer.send_back(m, reasons[int(m.keys[0][1:])])
            await consumer.commit()
        # the brokers made the dead-letter topic just now: a read needs its route
        async with AdminClient(namesrv) as admin:
            async with asyncio.timeout(15):
                while True:
                    with contextlib.suppress(NotFoundError):
                        if (await admin.describe_topic(f"%DLQ%{group}")).brokers:
                            return
                    await asyncio.sleep(0.05)

    asyncio.run(run())


@pytest.mark.integration
def test_the_dlq_summary_counts_the_dead_letters_per_reason(
    spark: SparkSession,
    cluster: Cluster,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic, group = "SparkDlqOrders", "spark-dlq-workers"
    cluster.create_topic(topic, queues=2)
    reasons = ["ValueError: bad amount"] * 3 + ["KeyError: 'sku'"] * 2
    _dead_letter(cluster.namesrv, topic, group, reasons)
    summary = _example("dlq_summary").summarise(spark, cluster.namesrv, group).collect()
    assert [(r.topic, r.reason, r.messages, r.most_attempts) for r in summary] == [
        (topic, "ValueError: bad amount", 3, 1),
        (topic, "KeyError: 'sku'", 2, 1),
    ]
    assert all(r.first <= r.last for r in summary)
    # the command prints the same table
    monkeypatch.setattr(
        sys, "argv", ["dlq_summary.py", "--namesrv", cluster.namesrv, "--group", group]
    )
    _example("dlq_summary").main()
    table = [
        [cell.strip() for cell in line.strip("|").split("|")][:4]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("|")
    ]
    assert table == [
        ["topic", "reason", "messages", "most_attempts"],
        [topic, "ValueError: bad amount", "3", "1"],
        [topic, "KeyError: 'sku'", "2", "1"],
    ]
