"""A follower that was down while its leader's retention deleted the files it would copy next
starts over at the leader's first offset: it discards its log, copies the leader's from there,
joins the in-sync set again, and can take over with every acknowledged message retention kept.
Three replicas of one broker name in one process, on the file coordination, a nameserver beside
them; only the first leader deletes old files (its retention is a second)."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from apogee.client import Message, Producer
from apogee.common.errors import ApogeeError
from apogee.store import MessageStore
from apogee.testkit.cluster import InProcessCluster
from apogee.testkit.replicas import ReplicaGroup as Group
from apogee.testkit.waiting import eventually
from apogee_broker.replication.node import ReplicaNode

pytestmark = pytest.mark.integration

TOPIC = "Retained"
KiB = 1024
FILE_SIZE = 64 * KiB
#: retention of the first leader: files last written more than a second ago go
LEADER_RETENTION = {"retention_hours": 1 / 3600, "retention_check_interval_s": 0.2}


@pytest.fixture
async def group(tmp_path: Path) -> AsyncIterator[Group]:
    async with (
        InProcessCluster(tmp_path / "ns", nameservers=1, brokers=()) as ns,
        Group(
            tmp_path,
            ns.namesrv,
            3,
            commitlog_file_size=FILE_SIZE,
            max_message_size=16 * KiB,
            consume_queue_entries_per_file=64,
        ) as g,
    ):
        yield g


def store_of(node: ReplicaNode) -> MessageStore:
    assert node.store is not None
    return node.store


def readable_ids(store: MessageStore) -> set[str]:
    """The unique ids of every message of the topic a consumer reads from each queue's start."""
    found: set[str] = set()
    for cq in store.cqs:
        if cq.topic == TOPIC:
            got = store.get(TOPIC, cq.queue_id, cq.min_offset, 100_000)
            found |= {m.unique_id for m in got.messages}
    return found


@pytest.mark.parametrize("successor", ["other", "restarted"])
async def test_a_follower_behind_the_leaders_retention_starts_over_and_rejoins(
    group: Group, caplog: pytest.LogCaptureFixture, successor: str
) -> None:
    first = await group.start(0, **LEADER_RETENTION)
    await group.wait_leader(in_sync=1)
    await group.start(1)
    behind = await group.start(2)
    assert await group.wait_leader(in_sync=3) is first
    lead = store_of(first)
    acked: list[str] = []
    async with Producer(group.namesrv, route_refresh_interval=0.2) as producer:
        for i in range(10):
            acked.append((await producer.send(Message(TOPIC, f"early-{i}".encode()))).message_id)

        async def copied() -> bool:
            return store_of(behind).commitlog.max_offset == lead.commitlog.max_offset

        await eventually(copied, 10, "replica 2 at the leader's log end")
        held = store_of(behind).commitlog.max_offset
        behind_id = behind.replica_id
        await group.stop(2)

        for _ in range(200):  # sixteen a file (incompressible): the log rolls a dozen times
            result = await producer.send(Message(TOPIC, os.urandom(4 * KiB)))
            acked.append(result.message_id)

        def deleted() -> bool:
            return lead.commitlog.min_offset > held and len(lead.commitlog.files.files) == 1

        await eventually(
            deleted,
            15,
            "the leader's retention past replica 2's log end",
            detail=lambda: (
                f"held {held}, leader files {[f.start for f in lead.commitlog.files.files]}"
            ),
        )
        log_start = lead.commitlog.min_offset

        with caplog.at_level(logging.WARNING, logger="apogee_broker.replication.follower"):
            again = await group.start(2)
            assert first.leader is not None
            term = first.leader

            def rejoined() -> bool:
                return behind_id in term.in_sync

            await eventually(rejoined, 30, "replica 2 back in the in-sync set")
        assert any(
            f"starting over at offset {log_start}" in r.getMessage()
            and r.levelno == logging.WARNING
            for r in caplog.records
        ), [r.getMessage() for r in caplog.records]

        # it holds the leader's bytes from the leader's first offset, and nothing before
        copy = store_of(again)
        end = lead.commitlog.max_offset

        async def caught_up() -> bool:
            return copy.commitlog.max_offset == end

        await eventually(caught_up, 10, "replica 2 at the leader's log end")
        assert copy.commitlog.min_offset == log_start
        assert copy.read_log(log_start, 1 << 30) == lead.read_log(log_start, 1 << 30)
        kept = readable_ids(lead)
        assert kept
        assert kept <= set(acked)
        assert readable_ids(copy) == kept

        # the leader goes: its successor has every acknowledged message the retention kept,
        # and the remaining replica reconciles with it and follows
        other = group.nodes[1]
        assert other is not None
        target, rest = (again, other) if successor == "restarted" else (other, again)
        await first.hand_off(target.replica_id)
        await group.stop(0)
        new = await group.wait_leader(in_sync=1)
        assert new is target
        assert readable_ids(store_of(new)) >= kept

        def both_in_sync() -> bool:
            term = new.leader
            return (
                term is not None
                and rest.replica_id in term.in_sync
                and store_of(rest).commitlog.max_offset == term.written_end
            )

        await eventually(both_in_sync, 20, "the other replica in sync with the new leader")
        sent: list[str] = []

        async def send_after() -> bool:
            try:
                sent.append((await producer.send(Message(TOPIC, b"after"))).message_id)
            except ApogeeError:
                return False
            return True

        await eventually(send_after, 15, "a send acknowledged by the new leader")
    for node in (new, rest):
        store = store_of(node)

        def has_it(store: MessageStore = store) -> bool:
            return sent[0] in readable_ids(store)

        await eventually(has_it, 10, "the last send on both replicas")
        assert readable_ids(store) >= kept
