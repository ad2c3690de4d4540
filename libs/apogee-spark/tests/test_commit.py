"""``commitGroup`` without Spark: a stream's offsets committed as a group's through the SDK's
admin client, against nameservers and brokers in this process; a broker that is not live is
logged and the others keep their commit."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from apogee.client import AdminClient, Message, Producer
from apogee.spark.commit import commit_group
from apogee.spark.options import Offsets, ReadOptions
from apogee.testkit.cluster import InProcessCluster

pytestmark = pytest.mark.integration

TOPIC = "SparkCommit"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster(tmp_path, nameservers=1) as c:
        await c.create_topic(TOPIC, queues=2)
        yield c


async def _committed(namesrv: str, group: str) -> dict[tuple[str, int], int | None]:
    async with AdminClient(namesrv) as admin:
        desc = await admin.describe_group(group)
    return {(q.broker_name, q.queue_id): q.consumer_offset for q in desc.queues}


async def test_commit_group_sets_the_offsets_and_logs_a_broker_that_is_not_live(
    cluster: InProcessCluster, caplog: pytest.LogCaptureFixture
) -> None:
    async with Producer(cluster.namesrv) as producer:
        for _ in range(16):  # about 4 in each queue: no commit below goes past a queue's end
            await producer.send(Message(TOPIC, b"x"))
    opts = ReadOptions.parse(
        {"namesrv": cluster.namesrv, "topic": TOPIC, "commitGroup": "spark-g"}, streaming=True
    )
    offsets: Offsets = {TOPIC: {"broker-a": {0: 1, 1: 2}, "broker-b": {0: 1, 1: 0}}}
    await asyncio.to_thread(commit_group, opts, offsets)
    assert await _committed(cluster.namesrv, "spark-g") == {
        ("broker-a", 0): 1,
        ("broker-a", 1): 2,
        ("broker-b", 0): 1,
        ("broker-b", 1): 0,
    }

    offsets[TOPIC]["broker-a"] = {0: 2, 1: 2}
    offsets[TOPIC]["broker-z"] = {0: 7}
    with caplog.at_level(logging.WARNING, logger="apogee.spark.commit"):
        await asyncio.to_thread(commit_group, opts, offsets)  # logged, not raised
    [warning] = [r.getMessage() for r in caplog.records if r.name == "apogee.spark.commit"]
    assert warning.startswith("committing group spark-g failed: ")
    assert "broker 'broker-z' is unavailable" in warning
    assert "(committed on: broker-a, broker-b; run it again)" in warning
    assert (await _committed(cluster.namesrv, "spark-g"))[("broker-a", 0)] == 2
