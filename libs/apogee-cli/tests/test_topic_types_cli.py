"""``apogee topic create|update --type`` and the type in ``topic list`` and ``topic describe``,
against a real cluster."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from apogee.cli.main import main
from apogee.client import AdminClient, MessageType
from apogee.testkit.cluster import InProcessCluster

pytestmark = pytest.mark.integration


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    """Two nameservers and two brokers, in this process (see apogee.testkit.cluster)."""
    async with InProcessCluster(tmp_path) as c:
        yield c


async def run(namesrv: str, *args: str) -> int:
    return await asyncio.to_thread(main, ["--namesrv", namesrv, *args])


async def test_a_topic_is_created_with_a_type_in_any_case_and_an_update_changes_it(
    cluster: InProcessCluster, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        await run(cluster.namesrv, "topic", "create", "Seq", "--queues", "2", "--type", "fifo") == 0
    )
    created = capsys.readouterr().out.splitlines()
    assert created == [
        "created Seq on broker-a: 2 write / 2 read queues, perm rw, type FIFO",
        "created Seq on broker-b: 2 write / 2 read queues, perm rw, type FIFO",
    ]
    assert await run(cluster.namesrv, "topic", "create", "Plain", "--queues", "1") == 0
    assert "perm rw, type MIXED" in capsys.readouterr().out  # the default

    # an update without --type keeps the type; with it, changes it
    assert await run(cluster.namesrv, "topic", "update", "Seq", "--queues", "3") == 0
    assert capsys.readouterr().out.count("type FIFO") == 2
    update = ["topic", "update", "Seq", "--queues", "3", "--type", "DELAY", "--broker", "broker-b"]
    assert await run(cluster.namesrv, *update) == 0
    assert capsys.readouterr().out.splitlines() == [
        "updated Seq on broker-b: 3 write / 3 read queues, perm rw, type DELAY"
    ]
    async with AdminClient(cluster.namesrv) as admin:
        status = await admin.describe_topic("Seq")
    assert [b.topic.message_type for b in status.brokers] == [MessageType.FIFO, MessageType.DELAY]

    assert await run(cluster.namesrv, "topic", "list") == 0
    assert {"Plain", "Seq"} <= set(capsys.readouterr().out.split())  # names alone, for scripts
    assert await run(cluster.namesrv, "topic", "list", "--long") == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].split() == ["NAME", "TYPE"]
    rows = {line.split(maxsplit=1)[0]: line.split(maxsplit=1)[1] for line in listed[1:]}
    assert rows["Plain"] == "MIXED"
    assert rows["Seq"] == "FIFO/DELAY (brokers differ)"
    assert listed[0].index("TYPE") == listed[1].index(rows[listed[1].split()[0]])  # a column

    assert await run(cluster.namesrv, "topic", "describe", "Plain") == 0
    described = capsys.readouterr().out.splitlines()
    assert described[0] == "topic Plain: 0 messages, type MIXED"
    assert described[1].endswith(": 1 write / 1 read queues, perm rw, type MIXED")
