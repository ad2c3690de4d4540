"""The parts of transactions that need no server: the records' layout, what the broker remembers
(decisions, closed copies, progress, the rebuild from the op queue, its bounds) and the
producer registry."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from apogee.codec import Message, StoredMessage
from apogee.common.clock import ManualClock
from apogee.common.errors import InvalidArgumentError, UnavailableError
from apogee.common.topics import TRANS_CHECK_MAX_TIME_TOPIC, TRANS_HALF_TOPIC, TRANS_OP_HALF_TOPIC
from apogee.store import MessageStore, StoreConfig
from apogee_broker.core.clients.producers import CheckEvent, Hello, ProducerRegistry
from apogee_broker.core.txn.locks import KeyedLocks
from apogee_broker.core.txn.records import (
    TRANSACTION_PROPERTIES,
    Decision,
    OpKind,
    given_up_copy,
    half_info,
    next_copy,
    op_message,
    parse_op,
    read_copy,
    real_message,
    to_half,
)
from apogee_broker.core.txn.state import (
    ClosedHalves,
    Decided,
    DecidedTransactions,
    TransactionProgress,
    rebuild,
)

pytestmark = pytest.mark.unit

MiB = 1 << 20


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MessageStore]:
    cfg = StoreConfig(
        commitlog_file_size=MiB,
        max_message_size=64 * 1024,
        consume_queue_entries_per_file=1024,
        index_slots=997,
        index_entries_per_file=4096,
    )
    s = MessageStore.open(tmp_path / "store", cfg)
    yield s
    s.close()


def stored(store: MessageStore, msg: Message) -> StoredMessage:
    [r] = store.append([msg])
    return store.message_at(r.phys_offset)


def half(uid: str = "TX-1", **props: str) -> Message:
    m = Message(
        "Orders",
        b"body",
        queue_id=3,
        tags="t",
        keys=("k1", "k2"),
        properties={"region": "eu", **props},
        unique_id=uid,
        born_timestamp=123,
    )
    to_half(m, "g1", 3)
    return m


# -- records ------------------------------------------------------------------------------------


def test_a_half_carries_its_real_place_and_group_and_commits_without_them(
    store: MessageStore,
) -> None:
    copy = stored(store, half(CHECK_IMMUNITY_TIME_IN_SECONDS="30"))
    info = half_info(copy)
    assert (info.topic, info.unique_id, info.producer_group, info.real_topic) == (
        TRANS_HALF_TOPIC,
        "TX-1",
        "g1",
        "Orders",
    )
    assert (info.real_queue_id, info.check_times, info.immunity_ms, info.keys) == (
        3,
        0,
        30_000,
        "k1 k2",
    )
    assert info.first_stored_ms == copy.store_timestamp

    again, props = next_copy(copy, info)
    assert props["TRANSACTION_CHECK_TIMES"] == "1"
    assert props["TRAN_FIRST_STORED"] == str(copy.store_timestamp)
    second = half_info(stored(store, again))
    assert (second.check_times, second.first_stored_ms, second.unique_id) == (
        1,
        copy.store_timestamp,
        "TX-1",
    )

    kept = given_up_copy(copy, info)
    assert kept.topic == TRANS_CHECK_MAX_TIME_TOPIC
    assert kept.properties is not None
    assert kept.properties["REAL_TOPIC"] == "Orders"

    real = real_message(read_copy(copy), "Orders", 3)
    assert (real.topic, real.queue_id, real.unique_id, real.body, real.born_timestamp) == (
        "Orders",
        3,
        "TX-1",
        b"body",
        123,
    )
    assert (real.tags, list(real.keys)) == ("t", ["k1", "k2"])
    assert real.properties == {"region": "eu"}
    assert "CHECK_IMMUNITY_TIME_IN_SECONDS" in TRANSACTION_PROPERTIES


def test_op_records_read_back_as_written(store: MessageStore) -> None:
    commit = parse_op(stored(store, op_message(7, OpKind.COMMIT, "TX-1", "g1", real=("Orders", 2))))
    assert (commit.copy_offset, commit.half_offset, commit.kind, commit.unique_id) == (
        7,
        7,
        OpKind.COMMIT,
        "TX-1",
    )
    assert (commit.producer_group, commit.real_topic, commit.real_queue_id) == ("g1", "Orders", 2)
    assert commit.kind is not None
    assert commit.kind.decision is Decision.COMMIT
    gone = parse_op(stored(store, op_message(9, OpKind.GONE)))
    assert (gone.half_offset, gone.unique_id, gone.kind) == (9, "", OpKind.GONE)
    assert gone.kind is not None
    assert gone.kind.decision is None
    parked = parse_op(
        stored(store, op_message(0, OpKind.ROLLBACK, "TX-2", copy_topic=TRANS_CHECK_MAX_TIME_TOPIC))
    )
    assert (parked.copy_offset, parked.half_offset, parked.copy_topic) == (
        0,
        -1,
        TRANS_CHECK_MAX_TIME_TOPIC,
    )
    # the index finds an op record by its transaction and by the copy it closes
    store.wait_dispatched(5)
    assert [m.phys_offset for m in store.by_key(TRANS_OP_HALF_TOPIC, "TX-1")] == [
        commit.phys_offset
    ]
    assert [m.phys_offset for m in store.by_key(TRANS_OP_HALF_TOPIC, "half@9")] == [
        gone.phys_offset
    ]


# -- what the broker remembers ------------------------------------------------------------------


def test_decisions_forget_the_oldest_beyond_the_limit_and_say_from_where_they_are_complete() -> (
    None
):
    d = DecidedTransactions(limit=10)
    assert d.complete_for(None)
    for i in range(11):
        d.remember(f"T{i}", Decided(Decision.COMMIT, 0, 100 + i))
    d.remember("T5", Decided(Decision.ROLLBACK, 0, 999))  # the first decision of an id wins
    assert len(d) == 10
    assert d.get("T0") is None  # forgotten ...
    assert d.complete_from_phys == 101  # ... so what is older must be read from the op records
    assert not d.complete_for(100)
    assert not d.complete_for(None)
    assert d.complete_for(101)
    found = d.get("T5")
    assert found is not None
    assert found.decision is Decision.COMMIT


def test_closed_copies_are_known_where_complete_and_unknown_elsewhere() -> None:
    c = ClosedHalves(complete_from_offset=5, complete_from_phys=1000, limit=10)
    c.add(3)  # before the progress: not kept
    c.add(6)
    assert 3 not in c
    assert c.known(6, 0) is True
    assert c.known(7, 2000) is False
    assert c.known(7, 10) is None  # stored before the op records read
    assert c.known(4, 2000) is None  # before the progress
    assert c.advance(7) == 1
    assert (c.complete_from_offset, c.known(6, 2000)) == (7, None)
    assert c.advance(3) == 0  # progress going back forgets nothing more
    for o in range(10, 21):
        c.add(o)
    assert len(c) == 10
    assert c.complete_from_offset == 11
    assert c.known(10, 2000) is None


def test_progress_is_written_atomically_and_read_back(tmp_path: Path) -> None:
    clock = ManualClock()
    p = TransactionProgress(tmp_path, clock)
    p.load()
    assert (p.half, p.op, p.updated_ms) == (-1, -1, 0)
    p.commit(12, 9)
    again = TransactionProgress(tmp_path, clock)
    again.load()
    assert (again.half, again.op, again.updated_ms) == (12, 9, clock.time_ms())
    assert not list(tmp_path.glob("*.tmp"))


def test_the_rebuild_reads_the_newest_op_records_and_marks_where_it_is_complete(
    store: MessageStore,
) -> None:
    ops = [
        op_message(0, OpKind.CHECKED, "A", "g"),
        op_message(1, OpKind.COMMIT, "A", "g", real=("Orders", 1)),
        op_message(2, OpKind.ROLLBACK, "B", "g"),
        op_message(3, OpKind.GAVE_UP, "C", "g"),
        op_message(4, OpKind.GONE),
    ]
    results = store.append(ops)
    decided, closed, report = rebuild(store, half_progress=2)
    assert (report.op_records, report.decisions, report.closed, report.truncated) == (
        5,
        2,
        3,
        False,
    )
    a = decided.get("A")
    assert a is not None
    assert (a.decision, a.topic, a.queue_id, a.queue_offset) == (Decision.COMMIT, "Orders", 1, -1)
    b = decided.get("B")
    assert b is not None
    assert b.decision is Decision.ROLLBACK
    assert sorted(o for o in range(6) if o in closed) == [2, 3, 4]
    assert decided.complete_for(None)

    decided, closed, report = rebuild(store, half_progress=0, max_records=2)
    assert (report.first_offset, report.op_records, report.truncated) == (3, 2, True)
    assert decided.get("A") is None
    assert decided.complete_from_phys == results[3].phys_offset
    assert not decided.complete_for(results[0].phys_offset)
    assert closed.known(0, results[0].phys_offset) is None
    assert "the older ones left to the index" in report.summary()


async def test_a_lock_per_key_serializes_and_is_dropped_after_use() -> None:
    locks = KeyedLocks()
    order: list[str] = []

    async def hold(key: str, tag: str) -> None:
        async with locks.hold(key):
            order.append(f"{tag}+")
            await asyncio.sleep(0.01)
            order.append(f"{tag}-")

    await asyncio.gather(hold("x", "a"), hold("x", "b"), hold("y", "c"))
    assert order.index("a-") < order.index("b+")
    assert len(locks) == 0


# -- producers ----------------------------------------------------------------------------------


def event(uid: str) -> CheckEvent:
    return CheckEvent(None, uid, 0, 1, "Orders")  # type: ignore[arg-type]


async def test_producers_are_picked_in_turn_and_forgotten_when_silent() -> None:
    clock = ManualClock()
    reg = ProducerRegistry(expiry_s=30, broker_name="b1", clock=clock)
    a, b, c = (reg.open("h") for _ in range(3))
    reg.hello(a, Hello("g", "a"))
    reg.hello(b, Hello("g", "b", heartbeat_interval_ms=20_000))  # 3 x 20 s: expires after 60 s
    reg.hello(c, Hello("other", "c"))
    assert reg.groups() == {"g": ["a", "b"], "other": ["c"]}
    picked = [reg.pick("g") for _ in range(3)]
    assert [p.client_id if p else None for p in picked] == ["a", "b", "a"]
    assert reg.pick("nobody") is None

    clock.advance(20)
    reg.heartbeat(c)
    clock.advance(15)
    assert [s.client_id for s in reg.expire()] == ["a"]
    assert a.closed
    assert a.error is not None
    assert "the next heartbeat of producer a in group g" in str(a.error)
    assert reg.groups() == {"g": ["b"], "other": ["c"]}
    assert not a.offer(event("T"))
    assert b.offer(event("T1"))
    got = []
    b_events = b.events()
    got.append(await anext(b_events))
    assert got[0].unique_id == "T1"
    reg.close(b)
    assert reg.groups() == {"other": ["c"]}
    await reg.stop()
    assert c.closed
    assert isinstance(c.error, UnavailableError)
    with pytest.raises(UnavailableError):
        reg.open("h")


def test_a_hello_is_checked_and_said_once() -> None:
    reg = ProducerRegistry(expiry_s=30, broker_name="b1", clock=ManualClock())
    s = reg.open("h")
    with pytest.raises(InvalidArgumentError, match=r"hello\.client_id: must not be empty"):
        reg.hello(s, Hello("g", ""))
    reg.hello(s, Hello("g", "c1"))
    with pytest.raises(InvalidArgumentError, match="is sent once"):
        reg.hello(s, Hello("g", "c1"))
    newer = reg.open("h2")
    reg.hello(newer, Hello("g", "c1"))
    assert s.closed
    assert "opened a newer session" in str(s.error)
    assert reg.pick("g") is newer
