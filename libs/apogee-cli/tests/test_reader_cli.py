"""``apogee message read`` and ``apogee consume --from TIME`` against a real cluster."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from apogee.cli.main import main
from apogee.client import AdminClient, Message, Producer, SendResult
from apogee.codec import SYSFLAG_COMPRESSED
from apogee.codec import Message as StoredRecord
from apogee.testkit.cluster import InProcessCluster

pytestmark = pytest.mark.integration

TOPIC = "ReadCli"


@pytest.fixture
async def sent(tmp_path: Path) -> AsyncIterator[tuple[InProcessCluster, list[SendResult]]]:
    async with InProcessCluster(tmp_path) as c:
        async with AdminClient(c.namesrv) as admin:
            await admin.create_or_update_topic(TOPIC, queues=1, brokers=["broker-a"])
        async with Producer(c.namesrv) as producer:
            results = [
                await producer.send(
                    Message(TOPIC, f"m{i}".encode(), tags="even" if i % 2 == 0 else "odd")
                )
                for i in range(6)
            ]
        yield c, results


async def run(namesrv: str, *args: str) -> int:
    return await asyncio.to_thread(main, ["--namesrv", namesrv, *args])


def offsets_printed(out: str) -> list[int]:
    return [int(line.split("\t")[2]) for line in out.splitlines()]


async def test_message_read_ranges_queues_and_tags(
    sent: tuple[InProcessCluster, list[SendResult]], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster, results = sent
    assert await run(cluster.namesrv, "message", "read", TOPIC) == 0
    out = capsys.readouterr().out
    assert offsets_printed(out) == [0, 1, 2, 3, 4, 5]
    rows = [line.split("\t") for line in out.splitlines()]
    assert [r[0] for r in rows] == [r.message_id for r in results]
    assert [r[1] for r in rows] == ["broker-a/0"] * 6
    assert [r[5] for r in rows] == [f"m{i}" for i in range(6)]

    assert await run(cluster.namesrv, "message", "read", TOPIC, "--from", "2", "--to", "4") == 0
    assert offsets_printed(capsys.readouterr().out) == [2, 3]

    assert (
        await run(
            cluster.namesrv, "message", "read", TOPIC, "--queue", "broker-a/0", "--count", "2"
        )
        == 0
    )
    assert offsets_printed(capsys.readouterr().out) == [0, 1]

    assert await run(cluster.namesrv, "message", "read", TOPIC, "--tag", "odd") == 0
    assert offsets_printed(capsys.readouterr().out) == [1, 3, 5]


async def test_message_read_since_a_time(
    sent: tuple[InProcessCluster, list[SendResult]], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster, results = sent
    since = results[3].store_timestamp_ms
    expected = [i for i, r in enumerate(results) if r.store_timestamp_ms >= since]
    assert expected[0] <= 3
    assert await run(cluster.namesrv, "message", "read", TOPIC, "--since", str(since)) == 0
    assert offsets_printed(capsys.readouterr().out) == expected


async def test_message_read_bad_input(
    sent: tuple[InProcessCluster, list[SendResult]], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster, _ = sent
    assert await run(cluster.namesrv, "message", "read", TOPIC, "--queue", "broker-a") == 2
    assert "--queue 'broker-a': use BROKER/ID, e.g. broker-a/0" in capsys.readouterr().err
    assert await run(cluster.namesrv, "message", "read", TOPIC, "--from", "4", "--to", "1") == 2
    assert "--to 1 is before --from 4" in capsys.readouterr().err
    assert await run(cluster.namesrv, "message", "read", TOPIC, "--from", "9") != 0
    assert "start: 9 is past the max offset 6 of ReadCli/broker-a/0" in capsys.readouterr().err
    assert await run(cluster.namesrv, "message", "read", TOPIC, "--queue", "broker-a/7") != 0
    assert "queue_id 7" in capsys.readouterr().err


async def test_consume_from_a_time(
    sent: tuple[InProcessCluster, list[SendResult]], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster, results = sent
    since = results[4].store_timestamp_ms
    expected = [i for i, r in enumerate(results) if r.store_timestamp_ms >= since]
    cmd = ["consume", TOPIC, "--group", "g-time", "--from", str(since)]
    assert await run(cluster.namesrv, *cmd, "--count", str(len(expected)), "--timeout", "10") == 0
    assert offsets_printed(capsys.readouterr().out) == expected


async def test_consume_with_an_sql_filter(
    sent: tuple[InProcessCluster, list[SendResult]], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster, _ = sent
    async with Producer(cluster.namesrv) as producer:
        for i in range(6, 12):
            await producer.send(Message(TOPIC, f"m{i}".encode(), properties={"n": str(i)}))
    cmd = ["consume", TOPIC, "--group", "g-sql", "--from", "earliest"]
    sql = ["--sql", "n > 7 AND n <= 10 OR TAGS = 'odd' AND n IS NULL"]
    assert await run(cluster.namesrv, *cmd, *sql, "--count", "6", "--timeout", "3") == 0
    assert offsets_printed(capsys.readouterr().out) == [1, 3, 5, 8, 9, 10]


async def test_readers_report_a_record_they_cannot_decode_and_go_on(
    sent: tuple[InProcessCluster, list[SendResult]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A body flagged compressed that does not inflate (brokers refuse one now; older data may
    hold it) is reported with where it is and why, and every reader goes past it."""
    cluster, _ = sent
    store = cluster.brokers["broker-a"].store
    assert store is not None
    store.append(
        StoredRecord(TOPIC, b"not zlib", 0, unique_id="POISON-1", sys_flag=SYSFLAG_COMPRESSED)
    )
    async with Producer(cluster.namesrv) as producer:
        await producer.send(Message(TOPIC, b"after"))

    cmd = ["consume", TOPIC, "--group", "g-poison", "--from", "earliest"]
    assert await run(cluster.namesrv, *cmd, "--count", "8", "--timeout", "10") == 0
    out, err = capsys.readouterr()
    assert offsets_printed(out) == [0, 1, 2, 3, 4, 5, 7]
    assert "apogee: skipped broker-a/0 offset 6 (id POISON-1): " in err
    assert "the compressed body does not inflate" in err

    assert await run(cluster.namesrv, "message", "read", TOPIC, "--queue", "broker-a/0") == 0
    out, err = capsys.readouterr()
    assert offsets_printed(out) == [0, 1, 2, 3, 4, 5, 7]
    assert "offset 6 (id POISON-1)" in err

    assert await run(cluster.namesrv, "message", "get", "POISON-1") == 0
    out = capsys.readouterr().out
    assert "body:        (8 stored bytes that cannot be read: the compressed body does not " in out


async def test_reset_offset_of_a_group_no_broker_knows_fails(
    sent: tuple[InProcessCluster, list[SendResult]], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster, _ = sent
    reset = ["group", "reset-offset", "nobody", "--topic", TOPIC, "--to", "earliest"]
    assert await run(cluster.namesrv, *reset) == 1
    err = capsys.readouterr().err
    assert "apogee: group 'nobody' not found: no broker knows it" in err

    consume = ["consume", TOPIC, "--group", "known", "--from", "earliest", "--count", "6"]
    assert await run(cluster.namesrv, *consume, "--timeout", "10") == 0
    capsys.readouterr()
    reset = ["group", "reset-offset", "known", "--topic", TOPIC, "--to", "earliest"]
    assert await run(cluster.namesrv, *reset) == 0
    assert "reset group known on topic ReadCli to the earliest message" in capsys.readouterr().out


def test_an_unexpected_error_is_one_line_unless_asked_for(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(*_: object) -> int:
        raise RuntimeError("something nobody expected")

    monkeypatch.setattr("apogee.cli.commands.cmd_topic_list", broken)
    monkeypatch.delenv("APOGEE_DEBUG", raising=False)
    assert main(["--namesrv", "127.0.0.1:1", "topic", "list"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "apogee: unexpected error (RuntimeError: something nobody expected); "
        "set APOGEE_DEBUG=1 for the traceback\n"
    )
    monkeypatch.setenv("APOGEE_DEBUG", "1")
    assert main(["--namesrv", "127.0.0.1:1", "topic", "list"]) == 1
    assert "Traceback" in capsys.readouterr().err


async def test_message_get_lists_every_copy_of_an_id_stored_twice(
    sent: tuple[InProcessCluster, list[SendResult]], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster, results = sent
    store = cluster.brokers["broker-a"].store
    assert store is not None
    twice = results[2].message_id
    store.append(StoredRecord(TOPIC, b"stored again", 0, unique_id=twice))  # a retried send's copy
    assert await run(cluster.namesrv, "message", "get", twice) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"2 messages are stored with id {twice} (a retried send can be stored")
    assert out.count(f"id:          {twice}") == 2
    assert out.index("body:        stored again") < out.index("body:        m2")

    assert await run(cluster.namesrv, "message", "get", results[0].message_id) == 0
    assert capsys.readouterr().out.startswith(f"id:          {results[0].message_id}")
