"""Dead letters against real nameservers and brokers in this process: listing a group's
dead-letter topic on every broker (filters, since, limit; nothing consumed), redriving to the
original topics (dry run, filter, rate; ids and properties), and the ``apogee dlq`` command."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from apogee.cli.main import main
from apogee.client import AdminClient, Message, Producer, ReceivedMessage, SyncAdminClient
from apogee.client.consumer.config import ConsumerOptions
from apogee.client.consumer.pull import PullConsumer
from apogee.common.errors import InvalidArgumentError
from apogee.testkit.cluster import InProcessCluster

pytestmark = pytest.mark.integration

TOPIC = "Orders"
GROUP = "g-billing"
FAST: ConsumerOptions = {
    "rebalance_interval": 1.0,
    "long_poll_timeout": 2.0,
    "consume_from": "earliest",
}

#: the group's consumers dead-letter what they send back
DEAD_LETTERING: ConsumerOptions = {**FAST, "max_reconsume_times": 0}


class Dead:
    """Six messages of TOPIC, dead-lettered by GROUP in two rounds; ``middle_ms`` is between."""

    ids: dict[str, str]
    middle_ms: int


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    async with InProcessCluster(tmp_path, nameservers=1) as c:
        await c.create_topic(TOPIC, queues=2)
        yield c


async def poll_all(consumer: PullConsumer, n: int) -> list[ReceivedMessage]:
    out: list[ReceivedMessage] = []
    async with asyncio.timeout(15):
        while len(out) < n:
            out += await consumer.poll(timeout=5, max_messages=n - len(out))
    return out


@pytest.fixture
async def dead(cluster: InProcessCluster) -> Dead:
    d = Dead()
    async with Producer(cluster.namesrv) as producer:
        results = [
            await producer.send(
                Message(
                    TOPIC,
                    f"order {i}".encode(),
                    tags="AB"[i % 2],
                    keys=(f"k{i}", "shared"),
                    properties={"n": str(i)},
                )
            )
            for i in range(6)
        ]
    d.ids = {f"k{i}": r.message_id for i, r in enumerate(results)}
    async with PullConsumer(
        cluster.namesrv, GROUP, auto_commit=False, **DEAD_LETTERING
    ) as consumer:
        consumer.subscribe(TOPIC)
        await consumer.start()
        polled = sorted(await poll_all(consumer, 6), key=lambda m: m.keys[0])
        for m in polled[:3]:
            await consumer.send_back(m, f"cannot bill {m.keys[0]}")
        d.middle_ms = int(time.time() * 1000) + 1
        await asyncio.sleep(0.005)  # store times are in ms: the second round starts later
        for m in polled[3:]:
            await consumer.send_back(m, f"cannot bill {m.keys[0]}")
        await consumer.commit()
    # the brokers made the topic just now: listings need its route at the nameservers
    await cluster.wait_route(f"%DLQ%{GROUP}", {"broker-a", "broker-b"})
    return d


async def test_listing_reads_every_broker_and_filters(
    cluster: InProcessCluster, dead: Dead
) -> None:
    async with AdminClient(cluster.namesrv) as admin:
        letters = await admin.list_dead_letters(GROUP)
        assert [d.keys[0] for d in letters] == ["k0", "k1", "k2", "k3", "k4", "k5"]
        assert {d.broker_name for d in letters} == {"broker-a", "broker-b"}
        first = letters[0]
        assert (first.unique_id, first.origin_topic, first.reason, first.attempts) == (
            dead.ids["k0"],
            TOPIC,
            "cannot bill k0",
            1,
        )
        assert (first.tags, first.body_preview, first.user_properties) == (
            "A",
            "order 0",
            {"n": "0"},
        )
        by_key = await admin.list_dead_letters(GROUP, key="k4")
        assert [d.unique_id for d in by_key] == [dead.ids["k4"]]
        assert [d.keys[0] for d in await admin.list_dead_letters(GROUP, tag="B")] == [
            "k1",
            "k3",
            "k5",
        ]
        since = await admin.list_dead_letters(GROUP, since_ms=dead.middle_ms)
        assert [d.keys[0] for d in since] == ["k3", "k4", "k5"]
        limited = await admin.list_dead_letters(GROUP, key="shared", limit=2)
        assert [d.keys[0] for d in limited] == ["k0", "k1"]
        assert await admin.list_dead_letters(GROUP, topic="Elsewhere") == []
        assert await admin.list_dead_letters("g-without-failures") == []
        # reading consumed nothing and committed nothing: the same again, no reader group
        assert "apogee-dlq-reader" not in [g.group for g in await admin.list_groups()]
        assert [d.unique_id for d in await admin.list_dead_letters(GROUP)] == [
            d.unique_id for d in letters
        ]
        with pytest.raises(InvalidArgumentError, match="limit: must be an integer from 1"):
            await admin.list_dead_letters(GROUP, limit=0)
        with pytest.raises(InvalidArgumentError, match="group: 'bad group'"):
            await admin.list_dead_letters("bad group")


async def redriven(namesrv: str, group: str, n: int) -> list[ReceivedMessage]:
    """The redriven messages of TOPIC (those with ORIGIN_MSG_ID), read as a new group."""
    async with PullConsumer(namesrv, group, **FAST) as consumer:
        consumer.subscribe(TOPIC)
        await consumer.start()
        found = [m for m in await poll_all(consumer, 6 + n) if "ORIGIN_MSG_ID" in m.properties]
    return sorted(found, key=lambda m: m.keys[0])


async def test_redrive_sends_again_with_the_old_id_paced_to_the_rate(
    cluster: InProcessCluster, dead: Dead
) -> None:
    async with AdminClient(cluster.namesrv) as admin:
        dry = await admin.redrive_dead_letters(GROUP, tag="A", dry_run=True)
        assert (dry.matched, dry.sent, dry.failed, dry.dry_run) == (3, 0, 0, True)
        assert sorted(i.old_id for i in dry.items) == sorted(
            dead.ids[k] for k in ("k0", "k2", "k4")
        )
        status = await admin.describe_topic(TOPIC)
        assert status.messages == 6  # a dry run sends nothing

        started = time.monotonic()
        result = await admin.redrive_dead_letters(GROUP, key="shared", rate=20)
        elapsed = time.monotonic() - started
    assert (result.matched, result.sent, result.failed) == (6, 6, 0)
    assert elapsed >= 5 / 20  # six sends at 20/s: five gaps of 50 ms at least
    pairs = dict(result.redriven)
    assert sorted(pairs) == sorted(dead.ids.values())
    got = await redriven(cluster.namesrv, "g-check", 6)
    assert [m.properties["ORIGIN_MSG_ID"] for m in got] == [dead.ids[f"k{i}"] for i in range(6)]
    assert [m.unique_id for m in got] == [pairs[dead.ids[f"k{i}"]] for i in range(6)]
    for i, m in enumerate(got):
        assert (m.topic, m.body, m.tags, m.keys) == (
            TOPIC,
            f"order {i}".encode(),
            "AB"[i % 2],
            (f"k{i}", "shared"),
        )
        assert dict(m.properties) == {"n": str(i), "ORIGIN_MSG_ID": dead.ids[f"k{i}"]}
    async with AdminClient(cluster.namesrv) as admin:
        assert len(await admin.list_dead_letters(GROUP)) == 6  # the dead letters stay
        with pytest.raises(InvalidArgumentError, match="rate: must be a number"):
            await admin.redrive_dead_letters(GROUP, rate=0)


async def test_the_dlq_command(
    cluster: InProcessCluster, dead: Dead, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--namesrv", cluster.namesrv, "dlq"]
    assert await asyncio.to_thread(main, [*base, "list", "--group", GROUP]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 7
    assert lines[-1] == f"6 dead letters of group {GROUP}"
    row = lines[0].split("\t")
    assert row[0] == dead.ids["k0"]
    assert row[2:] == [TOPIC, "1", "A", "k0,shared", "cannot bill k0", "order 0"]

    cmd = [*base, "list", "--group", GROUP, "--filter", "key=k2", "--since", "3600"]
    assert await asyncio.to_thread(main, cmd) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[0] for line in lines[:-1]] == [dead.ids["k2"]]
    assert lines[-1] == f"1 matching dead letters of group {GROUP}"

    cmd = [*base, "redrive", "--group", GROUP, "--filter", "tag=B", "--dry-run"]
    assert await asyncio.to_thread(main, cmd) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == f"dry run: 3 dead letters of group {GROUP} match; nothing sent"
    assert sorted(line.split("\t")[0] for line in lines[:-1]) == sorted(
        dead.ids[k] for k in ("k1", "k3", "k5")
    )

    cmd = [*base, "redrive", "--group", GROUP, "--filter", "key=k5", "--rate", "50/s"]
    assert await asyncio.to_thread(main, cmd) == 0
    lines = capsys.readouterr().out.splitlines()
    old, new, topic = lines[0].split("\t")
    assert (old, topic) == (dead.ids["k5"], TOPIC)
    assert lines[-1] == f"redrove 1 of 1 matching dead letters of group {GROUP}; 0 failed"
    (again,) = await redriven(cluster.namesrv, "g-check-cli", 1)
    assert again.unique_id == new

    for bad, message in [
        (["list", "--group", GROUP, "--limit", "0"], "--limit must be from 1 to 100000"),
        (["list", "--group", GROUP, "--filter", "colour=red"], "--filter: 'colour=red'"),
        (["redrive", "--group", GROUP, "--rate", "fast"], "--rate 'fast'"),
        (["redrive", "--group", GROUP, "--since", "last week"], "--since 'last week'"),
    ]:
        assert await asyncio.to_thread(main, [*base, *bad]) == 2
        assert message in capsys.readouterr().err
    assert await asyncio.to_thread(main, [*base, "list", "--group", "bad group"]) == 1
    assert "group: 'bad group'" in capsys.readouterr().err


async def test_no_dead_letters_where_brokers_create_topics_automatically(tmp_path: Path) -> None:
    """There the nameservers route any topic (to the brokers that would create it): a group
    without a dead-letter topic still has no dead letters, and nothing is created."""
    async with (
        InProcessCluster(
            tmp_path, nameservers=1, brokers=("broker-a",), auto_create_topics=True
        ) as c,
        AdminClient(c.namesrv) as admin,
    ):
        assert await admin.list_dead_letters("g-fine") == []
        result = await admin.redrive_dead_letters("g-fine")
        assert (result.matched, result.sent, result.failed) == (0, 0, 0)
        assert "%DLQ%g-fine" not in await admin.list_topics()


async def test_the_sync_admin_client_lists_and_redrives_too(
    cluster: InProcessCluster, dead: Dead
) -> None:
    def work() -> tuple[list[str], int]:
        with SyncAdminClient(cluster.namesrv) as admin:
            keys = [d.keys[0] for d in admin.list_dead_letters(GROUP, tag="B")]
            dry = admin.redrive_dead_letters(GROUP, key="k1", dry_run=True)
        return keys, dry.matched

    keys, matched = await asyncio.to_thread(work)
    assert (sorted(keys), matched) == (["k1", "k3", "k5"], 1)
