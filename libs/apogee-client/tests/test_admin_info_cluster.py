"""AdminClient's questions about the cluster's members and offsets, against real nameservers and
brokers in this process: nameserver health, what each broker says of itself, schedule state,
offsets for a time and a group's offsets committed queue by queue; a member that does not
answer is named, and hides nothing of the others."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from apogee.client import AdminClient, Message, MessageQueue, Producer, SendResult
from apogee.client.admin import BrokerInfo
from apogee.common.errors import (
    InvalidArgumentError,
    UnavailableError,
    UnknownTopicError,
)
from apogee.testkit.cluster import InProcessCluster
from apogee.testkit.waiting import eventually

pytestmark = pytest.mark.integration

TOPIC = "Timeline"


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessCluster]:
    """Two nameservers and two brokers, in this process; the topic on both, two queues each."""
    async with InProcessCluster(tmp_path) as c:
        await c.create_topic(TOPIC, queues=2)
        yield c


@pytest.fixture
def refused() -> Iterator[str]:
    """An address nothing answers on: a port bound by this test and not listening (so no one
    else binds it, and connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}"


class WithGhost(AdminClient):
    """An admin client whose nameservers also list broker-z, which does not answer."""

    def __init__(self, namesrv: str, ghost: str) -> None:
        super().__init__(namesrv, timeout=1.0)
        self.ghost = BrokerInfo("TestCluster", "broker-z", ghost, 1, 0, False)

    async def cluster_info(self) -> list[BrokerInfo]:
        return [*await super().cluster_info(), self.ghost]


async def test_nameserver_health_in_the_order_given(
    cluster: InProcessCluster, refused: str
) -> None:
    async with AdminClient(f"{cluster.namesrv};{refused}", timeout=1.0) as admin:
        health = await admin.nameserver_health()
    assert [(h.address, h.ok) for h in health] == [
        *((a, True) for a in cluster.namesrv.split(";")),
        (refused, False),
    ]


async def test_each_broker_describes_itself(cluster: InProcessCluster) -> None:
    async with AdminClient(cluster.namesrv) as admin:
        answers = await admin.describe_brokers()
        assert [a.broker.broker_name for a in answers] == ["broker-a", "broker-b"]
        for a in answers:
            assert a.ok
            assert a.error is None
            assert a.value is not None
            app = cluster.brokers[a.broker.broker_name]
            assert (a.value.broker_name, a.value.cluster, a.value.address) == (
                a.broker.broker_name,
                "TestCluster",
                app.address,
            )
            assert app.store is not None
            assert a.value.flush_mode == app.store.cfg.flush_mode.value
            assert a.value.topic_count >= 1  # the topic of the fixture, and system topics
            assert 0 <= a.value.commitlog_min_offset <= a.value.commitlog_max_offset
            assert a.value.last_recovery.broker_name == a.broker.broker_name
        [only_b] = await admin.describe_brokers(["broker-b"])
        assert only_b.broker.broker_name == "broker-b"
        assert only_b.ok
        with pytest.raises(InvalidArgumentError) as bad:
            await admin.describe_brokers(["broker-z"])
        assert str(bad.value) == (
            "brokers: 'broker-z' is not a live broker (live: broker-a, broker-b)"
        )


async def test_a_broker_that_does_not_answer_is_named_and_hides_nothing(
    cluster: InProcessCluster, refused: str
) -> None:
    async with WithGhost(cluster.namesrv, refused) as admin:
        described = await admin.describe_brokers()
        schedules = await admin.schedule_states()
    for answers in (described, schedules):
        by_name = {a.broker.broker_name: a for a in answers}
        assert list(by_name) == ["broker-a", "broker-b", "broker-z"]
        assert by_name["broker-a"].ok
        assert by_name["broker-b"].ok
        ghost = by_name["broker-z"]
        assert not ghost.ok
        assert ghost.value is None
        assert isinstance(ghost.error, UnavailableError)
        assert f"broker broker-z at {refused}" in str(ghost.error)


async def test_schedule_state_shows_a_delayed_message_waiting(cluster: InProcessCluster) -> None:
    async with Producer(cluster.namesrv) as producer:
        stored = await producer.send(Message(TOPIC, b"in 10 s", delay_level=3))
    async with AdminClient(cluster.namesrv) as admin:
        answers = await admin.schedule_states()
    assert [a.broker.broker_name for a in answers] == ["broker-a", "broker-b"]
    states = {a.broker.broker_name: a.value for a in answers}
    for name, state in states.items():
        assert state is not None
        assert state.broker_name == name
        assert state.delay_ms[:3] == (1000, 5000, 10_000)
        assert state.level_of(2) == 3
        assert state.level_of(len(state.delay_ms)) is None
        waiting = {q.queue_id: q.waiting for q in state.queues if q.waiting}
        # no schedule service runs here: the message waits in level 3's queue (queue 2)
        assert waiting == ({2: 1} if name == stored.broker_name else {})
        assert all(
            state.level_of(q.queue_id) is not None or state.is_timer_queue(q.queue_id)
            for q in state.queues
        )


async def test_offsets_for_a_time_are_where_a_reset_to_it_goes(cluster: InProcessCluster) -> None:
    async with Producer(cluster.namesrv) as producer:
        before = [await producer.send(Message(TOPIC, b"before")) for _ in range(8)]
        last = max(r.store_timestamp_ms for r in before)
        await eventually(lambda: time.time() * 1000 > last + 1, 5, "the clock past the sends")
        after = [await producer.send(Message(TOPIC, b"after")) for _ in range(8)]
    at = min(r.store_timestamp_ms for r in after)
    assert at > last
    expected = _first_at_or_after([*before, *after], at)
    assert any(o > 0 for o in expected.values())  # the time falls inside the queues

    async with AdminClient(cluster.namesrv) as admin:
        found = await admin.offsets_for_time(TOPIC, at)
        assert {(o.broker_name, o.queue_id): o.offset for o in found} == expected
        assert [(o.broker_name, o.queue_id) for o in found] == sorted(expected)
        assert {o.topic for o in found} == {TOPIC}

        everything = await admin.offsets_for_time(TOPIC, 0)
        assert {o.offset for o in everything} == {0}
        future = await admin.offsets_for_time(TOPIC, int(time.time() * 1000) + 3_600_000)
        status = await admin.describe_topic(TOPIC)
        assert {(o.broker_name, o.queue_id): o.offset for o in future} == {
            (b.broker_name, q.queue_id): q.max_offset for b in status.brokers for q in b.queues
        }

        reset = await admin.reset_offsets("g-time", TOPIC, timestamp_ms=at)
        assert {(r.broker_name, r.queue_id): r.offset for r in reset} == expected

        with pytest.raises(InvalidArgumentError) as negative:
            await admin.offsets_for_time(TOPIC, -1)
        assert str(negative.value) == (
            "timestamp_ms: must be a time from 1970-01-01 to 9999-12-31 UTC "
            "(0 to 253402300799999 ms since the epoch), got -1"
        )
        with pytest.raises(InvalidArgumentError, match=r"\(0 to 253402300799999 ms.*got 1000"):
            await admin.offsets_for_time(TOPIC, 10**29)
        with pytest.raises(UnknownTopicError):
            await admin.offsets_for_time("Nowhere", 0)


def _first_at_or_after(results: list[SendResult], at: int) -> dict[tuple[str, int], int]:
    """Per queue, the first offset stored at or after ``at``; the queue's end when none is."""
    out: dict[tuple[str, int], int] = {}
    for r in sorted(results, key=lambda r: r.queue_offset):
        key = (r.broker_name, r.queue_id)
        if r.store_timestamp_ms >= at:
            out.setdefault(key, r.queue_offset)
    for r in results:
        key = (r.broker_name, r.queue_id)
        ends = max(x.queue_offset for x in results if (x.broker_name, x.queue_id) == key) + 1
        out.setdefault(key, ends)
    return out


async def test_commit_offsets_sets_a_group_queue_by_queue(cluster: InProcessCluster) -> None:
    async with Producer(cluster.namesrv) as producer:
        for _ in range(12):
            await producer.send(Message(TOPIC, b"x"))
    async with AdminClient(cluster.namesrv) as admin:
        status = await admin.describe_topic(TOPIC)
        # the end of each queue, and one before it (a broker refuses an offset past the end)
        wanted = {
            MessageQueue(TOPIC, b.broker_name, q.queue_id): q.max_offset - q.queue_id
            for b in status.brokers
            for q in b.queues
        }
        assert len(wanted) == 4
        assert min(wanted.values()) > 0
        queues = list(wanted)
        committed = await admin.commit_offsets("g-commit", wanted, client_id="a-test")
        assert [(c.broker_name, c.topic, c.queue_id, c.offset) for c in committed] == [
            (mq.broker_name, mq.topic, mq.queue_id, o) for mq, o in wanted.items()
        ]
        desc = await admin.describe_group("g-commit")
        assert {
            MessageQueue(q.topic, q.broker_name, q.queue_id): q.consumer_offset for q in desc.queues
        } == wanted

        # a broker that is not live: the others commit, the error names it
        again = {mq: 0 for mq in queues} | {MessageQueue(TOPIC, "broker-z", 0): 5}
        with pytest.raises(UnavailableError) as partial:
            await admin.commit_offsets("g-commit", again)
        assert str(partial.value) == (
            "committing the offsets of group 'g-commit' is unavailable: broker 'broker-z' is "
            "unavailable: it is not registered with the nameservers (live: broker-a, broker-b) "
            "(committed on: broker-a, broker-b; run it again)"
        )
        desc = await admin.describe_group("g-commit")
        assert {q.consumer_offset for q in desc.queues} == {0}

        assert await admin.commit_offsets("g-commit", {}) == []
        with pytest.raises(InvalidArgumentError, match=r"^group: "):
            await admin.commit_offsets("bad group", {queues[0]: 1})
        with pytest.raises(InvalidArgumentError) as negative:
            await admin.commit_offsets("g-commit", {queues[0]: -1})
        assert str(negative.value) == (
            f"offsets: {queues[0]}: the offset must be an int >= 0, got -1"
        )


async def test_no_live_broker_is_an_empty_answer(tmp_path: Path) -> None:
    async with (
        InProcessCluster(tmp_path, nameservers=1, brokers=()) as empty,
        AdminClient(empty.namesrv) as admin,
    ):
        assert await admin.describe_brokers() == []
        assert await admin.schedule_states() == []
        with pytest.raises(UnavailableError, match="no live broker is registered"):
            await admin.last_recoveries()
