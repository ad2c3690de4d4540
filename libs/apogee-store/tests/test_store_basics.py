"""MessageStore basics: round trips, batches, many queues, CommitLog roll-over, get() statuses,
tag filtering and waiting for arrivals."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from pathlib import Path

import pytest

from apogee.codec import BLANK, BLANK_MAGIC, HEADER_SIZE
from apogee.common.clock import ManualClock
from apogee.store import GetStatus, Message, MessageStore, StoreConfig, tag_hash
from apogee.testkit.store import OpenStore, dispatched
from apogee.testkit.waiting import wait_until

pytestmark = pytest.mark.unit


FILE_SIZE = 256 * 1024
BLANK_SIZE = BLANK.size  # room always kept at the end of a file for the end marker


def commitlog_files(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "commitlog").iterdir())


# -- round trips --------------------------------------------------------------------------------


def test_single_message_round_trip(store: MessageStore, clock: ManualClock) -> None:
    msg = Message(
        topic="Orders",
        body=b"hello \x00\xff world",
        queue_id=3,
        tags="TagA",
        keys=["order-1", "customer-7"],
        properties={"color": "blue", "note": "a b=c; d"},
        unique_id="0123456789ABCDEF0123456789ABCDEF",
        flag=7,
        sys_flag=0,
        born_timestamp=1_600_000_000_123,
        born_host="10.1.2.3:4567",
        reconsume_times=2,
        prepared_txn_offset=0,
    )
    [res] = store.append(msg)
    assert res.topic == "Orders"
    assert res.queue_id == 3
    assert res.queue_offset == 0
    assert res.phys_offset == 0
    assert res.store_timestamp == clock.time_ms()
    assert res.unique_id == "0123456789ABCDEF0123456789ABCDEF"
    assert res.tag_code == tag_hash("TagA")
    dispatched(store)

    got = store.get("Orders", 3, 0)
    assert got.status is GetStatus.FOUND
    assert (got.next_offset, got.min_offset, got.max_offset) == (1, 0, 1)
    [stored] = got.messages
    assert stored.topic == "Orders"
    assert stored.queue_id == 3
    assert stored.body == b"hello \x00\xff world"
    assert stored.tags == "TagA"
    assert stored.keys == ["order-1", "customer-7"]
    assert stored.unique_id == "0123456789ABCDEF0123456789ABCDEF"
    assert stored.properties == {
        "TAGS": "TagA",
        "KEYS": "order-1 customer-7",
        "UNIQ_KEY": "0123456789ABCDEF0123456789ABCDEF",
        "color": "blue",
        "note": "a b=c; d",
    }
    assert stored.queue_offset == 0
    assert stored.phys_offset == 0
    assert stored.size == res.size
    assert stored.store_timestamp == res.store_timestamp
    assert stored.born_timestamp == 1_600_000_000_123
    assert stored.born_host == "10.1.2.3:4567"
    assert stored.store_host == ""
    assert stored.flag == 7
    assert stored.reconsume_times == 2
    assert store.message_at(res.phys_offset) == stored


def test_second_message_follows_the_first(store: MessageStore, clock: ManualClock) -> None:
    [first] = store.append(Message(topic="T", body=b"one"))
    clock.advance(1.5)
    [second] = store.append(Message(topic="T", body=b"two"))
    [other] = store.append(Message(topic="T", body=b"three", queue_id=1))
    assert second.phys_offset == first.phys_offset + first.size
    assert other.phys_offset == second.phys_offset + second.size
    assert (first.queue_offset, second.queue_offset, other.queue_offset) == (0, 1, 0)
    assert second.store_timestamp - first.store_timestamp == 1500
    # generated unique ids: 32 hex digits, all different
    ids = {first.unique_id, second.unique_id, other.unique_id}
    assert len(ids) == 3
    assert all(len(u) == 32 and set(u) <= set("0123456789ABCDEF") for u in ids)
    dispatched(store)
    msgs = store.get("T", 0, 0).messages
    assert [m.body for m in msgs] == [b"one", b"two"]
    assert [m.unique_id for m in msgs] == [first.unique_id, second.unique_id]
    # no born timestamp given: it is the store timestamp
    assert [m.born_timestamp for m in msgs] == [first.store_timestamp, second.store_timestamp]


def test_hosts_round_trip(open_store: OpenStore) -> None:
    store = open_store(store_host="192.168.0.7:10911")
    store.append(
        [
            Message(topic="H", body=b"v4", born_host="10.1.2.3:4567"),
            Message(topic="H", body=b"v6", born_host="[2001:db8::1]:9876"),
            Message(topic="H", body=b"none"),
        ]
    )
    dispatched(store)
    msgs = store.get("H", 0, 0).messages
    assert [m.born_host for m in msgs] == ["10.1.2.3:4567", "[2001:db8::1]:9876", ""]
    assert {m.store_host for m in msgs} == {"192.168.0.7:10911"}


def test_message_fields_win_over_reserved_property_names(store: MessageStore) -> None:
    store.append(
        Message(
            topic="T",
            body=b"x",
            tags="real",
            keys=["realkey"],
            unique_id="REAL-ID",
            properties={"TAGS": "fake", "KEYS": "fake", "UNIQ_KEY": "FAKE-ID", "own": "kept"},
        )
    )
    dispatched(store)
    [m] = store.get("T", 0, 0).messages
    assert (m.tags, m.keys, m.unique_id) == ("real", ["realkey"], "REAL-ID")
    assert m.properties["own"] == "kept"


def test_batch_round_trip(store: MessageStore, clock: ManualClock) -> None:
    batch = [
        Message(topic="Batch", body=f"body-{i}".encode() * (i + 1), queue_id=i % 3, keys=[f"k{i}"])
        for i in range(50)
    ]
    results = store.append(batch)
    assert len(results) == 50
    assert results[0].phys_offset == 0
    for prev, nxt in itertools.pairwise(results):
        assert nxt.phys_offset == prev.phys_offset + prev.size  # back to back, in order
    for q in range(3):
        assert [r.queue_offset for r in results if r.queue_id == q] == list(range(len(batch[q::3])))
    assert {r.store_timestamp for r in results} == {clock.time_ms()}  # one stamp per batch
    assert len({r.unique_id for r in results}) == 50
    dispatched(store)

    for msg, res in zip(batch, results, strict=True):
        got = store.get("Batch", res.queue_id, res.queue_offset, max_count=1)
        assert got.status is GetStatus.FOUND
        [stored] = got.messages
        assert stored.body == msg.body
        assert stored.keys == list(msg.keys)
        assert stored.phys_offset == res.phys_offset
        assert stored.queue_offset == res.queue_offset
        assert stored.store_timestamp == res.store_timestamp
        assert stored.unique_id == res.unique_id
        assert store.message_at(res.phys_offset) == stored
    # one read returns the whole queue in order
    whole = store.get("Batch", 1, 0, max_count=100)
    assert [m.body for m in whole.messages] == [m.body for m in batch[1::3]]


def test_empty_batch_appends_nothing(store: MessageStore) -> None:
    assert store.append([]) == []
    assert store.commitlog.max_offset == 0


def _check_queues(store: MessageStore, topics: list[str], queues: int, rounds: int) -> None:
    assert store.queue_max_offsets() == {(t, q): rounds for t in topics for q in range(queues)}
    for t in topics:
        for q in range(queues):
            got = store.get(t, q, 0, max_count=1000)
            assert got.status is GetStatus.FOUND
            assert [m.queue_offset for m in got.messages] == list(range(rounds))
            assert [m.body for m in got.messages] == [
                f"{t}/{q}/{r}".encode() * 20 for r in range(rounds)
            ]
            assert got.next_offset == rounds


def test_many_topics_and_queues_interleaved(open_store: OpenStore) -> None:
    topics = [f"topic-{t:02d}" for t in range(20)]
    queues, rounds = 8, 6
    store = open_store()
    for r in range(rounds):
        # alternate single appends and one batch holding every queue, interleaved
        msgs = [
            Message(topic=t, body=f"{t}/{q}/{r}".encode() * 20, queue_id=q)
            for q in range(queues)
            for t in topics
        ]
        results = store.append(msgs) if r % 2 else [res for m in msgs for res in store.append(m)]
        assert {res.queue_offset for res in results} == {r}
    assert store.commitlog.max_offset > FILE_SIZE  # the log rolled on the way
    dispatched(store)
    _check_queues(store, topics, queues, rounds)

    store.close()
    store = open_store()
    _check_queues(store, topics, queues, rounds)
    [res] = store.append(Message(topic="topic-05", body=b"after reopen", queue_id=7))
    assert res.queue_offset == rounds


def test_a_queue_spanning_consume_queue_files(store: MessageStore) -> None:
    # 64 entries per ConsumeQueue file: 150 messages need three files
    results = store.append([Message(topic="Long", body=str(i).encode()) for i in range(150)])
    assert [r.queue_offset for r in results] == list(range(150))
    dispatched(store)
    assert len(list((store.root / "consumequeue" / "Long" / "0").iterdir())) == 3
    got = store.get("Long", 0, 60, max_count=10)  # a read across the first boundary
    assert [m.body for m in got.messages] == [str(i).encode() for i in range(60, 70)]
    whole = store.get("Long", 0, 0, max_count=500)
    assert [m.body for m in whole.messages] == [str(i).encode() for i in range(150)]


# -- roll-over ----------------------------------------------------------------------------------

TOPIC = "Roll"
UID_LEN = 32


def uid(i: int) -> str:
    return f"U{i:0{UID_LEN - 1}d}"


def record_size(body_len: int) -> int:
    """Size of a record on topic ``TOPIC`` with a 32-character unique id and no tags or keys."""
    props = len(f"UNIQ_KEY\x01{uid(0)}\x02".encode())
    return HEADER_SIZE + body_len + len(TOPIC) + props


def body_for(size: int) -> int:
    return size - record_size(0)


def fill_first_file(store: MessageStore, room_left: int) -> list[Message]:
    """Append 16 KiB messages and then one sized so the first file has ``room_left`` bytes
    after it; returns the messages appended."""
    assert store.cfg.commitlog_file_size == FILE_SIZE
    full = record_size(16 * 1024)
    n = (FILE_SIZE - room_left) // full
    last_size = FILE_SIZE - room_left - n * full
    assert record_size(1) <= last_size <= full
    msgs = [Message(topic=TOPIC, body=bytes([i]) * 16 * 1024, unique_id=uid(i)) for i in range(n)]
    msgs.append(Message(topic=TOPIC, body=b"L" * body_for(last_size), unique_id=uid(n)))
    for m in msgs:
        [res] = store.append(m)
        assert res.size == record_size(len(m.body))
    assert store.commitlog.max_offset == FILE_SIZE - room_left
    return msgs


def read_all(store: MessageStore, topic: str, queue_id: int = 0) -> list[bytes]:
    got = store.get(topic, queue_id, 0, max_count=1000)
    return [m.body for m in got.messages]


def test_record_ending_at_the_blank_marker_stays_and_the_next_rolls(
    open_store: OpenStore, store_dir: Path
) -> None:
    store = open_store()
    msgs = fill_first_file(store, room_left=BLANK_SIZE)  # the last record fits exactly
    assert commitlog_files(store_dir) == ["00000000000000000000"]
    [nxt] = store.append(Message(topic=TOPIC, body=b"next", unique_id=uid(99)))
    assert nxt.phys_offset == FILE_SIZE
    msgs.append(Message(topic=TOPIC, body=b"next"))
    dispatched(store)
    assert read_all(store, TOPIC) == [m.body for m in msgs]
    store.close()

    assert commitlog_files(store_dir) == ["00000000000000000000", "00000000000000262144"]
    first = (store_dir / "commitlog" / "00000000000000000000").read_bytes()
    assert len(first) == FILE_SIZE
    assert BLANK.unpack(first[-BLANK_SIZE:]) == (BLANK_SIZE, BLANK_MAGIC)

    store = open_store()
    assert read_all(store, TOPIC) == [m.body for m in msgs]
    assert store.message_at(FILE_SIZE).body == b"next"
    [after] = store.append(Message(topic=TOPIC, body=b"after"))
    assert after.phys_offset == FILE_SIZE + nxt.size


def test_record_that_would_end_at_the_file_end_rolls(
    open_store: OpenStore, store_dir: Path
) -> None:
    store = open_store()
    # a record of exactly the free room leaves no space for the end marker: it must roll
    msgs = fill_first_file(store, room_left=2 * BLANK_SIZE + 1000)
    end_of_data = store.commitlog.max_offset
    size = FILE_SIZE - end_of_data
    big = Message(topic=TOPIC, body=b"B" * body_for(size), unique_id=uid(77))
    [res] = store.append(big)
    assert res.size == size
    assert res.phys_offset == FILE_SIZE
    msgs.append(big)
    # the later messages carry on in the second file
    later = [Message(topic=TOPIC, body=f"later-{i}".encode()) for i in range(5)]
    results = store.append(later)
    assert all(r.phys_offset >= FILE_SIZE for r in results)
    msgs += later
    dispatched(store)
    assert read_all(store, TOPIC) == [m.body for m in msgs]
    store.close()

    first = (store_dir / "commitlog" / "00000000000000000000").read_bytes()
    marker = first[end_of_data : end_of_data + BLANK_SIZE]
    assert BLANK.unpack(marker) == (FILE_SIZE - end_of_data, BLANK_MAGIC)
    assert commitlog_files(store_dir) == ["00000000000000000000", "00000000000000262144"]

    store = open_store()
    assert read_all(store, TOPIC) == [m.body for m in msgs]
    assert store.message_at(FILE_SIZE).body == big.body


@pytest.mark.parametrize("count", [40, 90])
def test_batch_spanning_file_boundaries(open_store: OpenStore, store_dir: Path, count: int) -> None:
    store = open_store()
    store.append(Message(topic="Other", body=b"first"))
    batch = [
        Message(topic=TOPIC, body=bytes([i % 251]) * 8000, queue_id=i % 2, unique_id=uid(i))
        for i in range(count)
    ]
    results = store.append(batch)
    files = -(-store.commitlog.max_offset // FILE_SIZE)
    assert files >= 2
    assert commitlog_files(store_dir) == [f"{n * FILE_SIZE:020d}" for n in range(files)]
    # records are back to back inside a file; a record that does not fit starts the next file
    # and the rest of the file it left is one blank record
    for prev, nxt in itertools.pairwise(results):
        if nxt.phys_offset != prev.phys_offset + prev.size:
            assert nxt.phys_offset % FILE_SIZE == 0
            assert nxt.phys_offset // FILE_SIZE == prev.phys_offset // FILE_SIZE + 1
            end = prev.phys_offset + prev.size
            assert nxt.phys_offset - end >= BLANK_SIZE
    assert [r.queue_offset for r in results if r.queue_id == 0] == list(range((count + 1) // 2))
    assert [r.queue_offset for r in results if r.queue_id == 1] == list(range(count // 2))
    dispatched(store)
    expected = {q: [m.body for m in batch if m.queue_id == q] for q in (0, 1)}
    assert read_all(store, TOPIC, 0) == expected[0]
    assert read_all(store, TOPIC, 1) == expected[1]
    store.close()

    for prev, nxt in itertools.pairwise(results):
        end = prev.phys_offset + prev.size
        if nxt.phys_offset != end:
            raw = (store_dir / "commitlog" / f"{end - end % FILE_SIZE:020d}").read_bytes()
            pos = end % FILE_SIZE
            assert BLANK.unpack(raw[pos : pos + BLANK_SIZE]) == (FILE_SIZE - pos, BLANK_MAGIC)

    store = open_store()
    assert read_all(store, TOPIC, 0) == expected[0]
    assert read_all(store, TOPIC, 1) == expected[1]
    for msg, res in zip(batch, results, strict=True):
        assert store.message_at(res.phys_offset).body == msg.body
    assert read_all(store, "Other") == [b"first"]


# -- get() statuses -----------------------------------------------------------------------------


def test_get_statuses(store: MessageStore) -> None:
    assert store.get("Nobody", 0, 0).status is GetStatus.NO_SUCH_QUEUE
    store.append([Message(topic="S", body=f"m{i}".encode(), queue_id=2) for i in range(10)])
    dispatched(store)
    assert store.get("S", 0, 0).status is GetStatus.NO_SUCH_QUEUE  # another queue of the topic

    found = store.get("S", 2, 3, max_count=4)
    assert found.status is GetStatus.FOUND
    assert [m.body for m in found.messages] == [b"m3", b"m4", b"m5", b"m6"]
    assert (found.next_offset, found.min_offset, found.max_offset) == (7, 0, 10)

    rest = store.get("S", 2, found.next_offset, max_count=100)
    assert [m.queue_offset for m in rest.messages] == [7, 8, 9]
    assert rest.next_offset == 10

    at_max = store.get("S", 2, 10)
    assert at_max.status is GetStatus.NO_NEW_MESSAGE
    assert (at_max.messages, at_max.next_offset) == ([], 10)

    beyond = store.get("S", 2, 11)
    assert beyond.status is GetStatus.OFFSET_OVERFLOW
    assert (beyond.messages, beyond.next_offset) == ([], 10)


@pytest.mark.parametrize("max_count", [1, 5, 32])
def test_get_respects_max_count(store: MessageStore, max_count: int) -> None:
    store.append([Message(topic="M", body=bytes([i])) for i in range(40)])
    dispatched(store)
    got = store.get("M", 0, 2, max_count=max_count)
    assert len(got.messages) == max_count
    assert [m.queue_offset for m in got.messages] == list(range(2, 2 + max_count))
    assert got.next_offset == 2 + max_count


def test_tag_filtering(store: MessageStore) -> None:
    tags = ["A", "B", "C", None]
    store.append(
        [Message(topic="Tagged", body=str(i).encode(), tags=tags[i % 4]) for i in range(40)]
    )
    dispatched(store)

    only_a = store.get("Tagged", 0, 0, max_count=100, tags={"A"})
    assert only_a.status is GetStatus.FOUND
    assert [m.body for m in only_a.messages] == [str(i).encode() for i in range(0, 40, 4)]
    assert {m.tags for m in only_a.messages} == {"A"}
    assert only_a.next_offset == 40

    a_or_c = store.get("Tagged", 0, 0, max_count=3, tags=["A", "C"])
    assert [m.body for m in a_or_c.messages] == [b"0", b"2", b"4"]
    assert a_or_c.next_offset == 5  # just past the last message returned

    # from offset 1 the next "A" is at 4: the entries before it are skipped
    skip = store.get("Tagged", 0, 1, max_count=1, tags={"A"})
    assert [m.queue_offset for m in skip.messages] == [4]
    assert skip.next_offset == 5

    none = store.get("Tagged", 0, 0, max_count=10, tags={"Z"})
    assert none.status is GetStatus.NO_MATCHED_MESSAGE
    assert none.messages == []
    assert none.next_offset == 40  # moved past every filtered entry

    # the filtered-out tail of the queue: a consumer at 37 moves on to 40
    tail = store.get("Tagged", 0, 37, tags={"A"})
    assert tail.status is GetStatus.NO_MATCHED_MESSAGE
    assert tail.next_offset == 40


def test_tag_filter_checks_the_tag_not_only_its_hash(
    store: MessageStore, crc32_twins: tuple[str, str]
) -> None:
    tag_a, tag_b = crc32_twins
    assert tag_hash(tag_a) == tag_hash(tag_b)
    store.append(
        [
            Message(topic="Twins", body=b"a0", tags=tag_a),
            Message(topic="Twins", body=b"b0", tags=tag_b),
            Message(topic="Twins", body=b"a1", tags=tag_a),
            Message(topic="Twins", body=b"b1", tags=tag_b),
        ]
    )
    dispatched(store)
    got_a = store.get("Twins", 0, 0, tags={tag_a})
    assert [m.body for m in got_a.messages] == [b"a0", b"a1"]
    got_b = store.get("Twins", 0, 0, tags={tag_b})
    assert [m.body for m in got_b.messages] == [b"b0", b"b1"]
    assert got_b.next_offset == 4


# -- waiting ------------------------------------------------------------------------------------


def test_wait_for_wakes_when_a_message_lands(store: MessageStore) -> None:
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            # append only once the waiter is registered, so the wake-up path is what is tested
            wait_until(lambda: store.notifier.pending() == 1, 10, "the waiter registered")
            store.append(Message(topic="Wait", body=b"here", queue_id=1))
        except BaseException as exc:
            errors.append(exc)

    producer = threading.Thread(target=produce)
    producer.start()
    t0 = time.monotonic()
    try:
        assert store.wait_for("Wait", 1, 0, timeout=10.0) is True
        elapsed = time.monotonic() - t0
    finally:
        producer.join(10.0)
    assert errors == []
    assert elapsed < 5.0
    got = store.get("Wait", 1, 0)
    assert [m.body for m in got.messages] == [b"here"]
    assert store.notifier.pending() == 0


def test_wait_for_times_out_when_nothing_arrives(store: MessageStore) -> None:
    store.append(Message(topic="Quiet", body=b"only"))
    dispatched(store)
    assert store.wait_for("Quiet", 0, 0, timeout=0.0) is True  # already there
    t0 = time.monotonic()
    assert store.wait_for("Quiet", 0, 1, timeout=0.3) is False
    assert time.monotonic() - t0 >= 0.29
    assert store.wait_for("Quiet", 3, 0, timeout=0.05) is False  # a queue never written
    assert store.notifier.pending() == 0  # timed-out waits leave nothing behind


def test_large_batches_are_indexed_by_the_dispatcher_thread_small_ones_inline(
    open_store: OpenStore, config: StoreConfig
) -> None:
    store = open_store(dataclasses.replace(config, dispatch_inline_max=4))
    threads: list[str] = []
    for size, at in ((4, 4), (5, 9)):
        fired = threading.Event()

        def callback(done: threading.Event = fired) -> None:
            threads.append(threading.current_thread().name)
            done.set()

        store.watch("Sized", 0, at - 1, callback)
        store.append([Message(topic="Sized", body=b"x") for _ in range(size)])
        assert fired.wait(10.0)
    assert threads == [threading.current_thread().name, "apogee-store-dispatch"]
    # either way every entry is readable, in order
    got = store.get("Sized", 0, 0, 100)
    assert [m.queue_offset for m in got.messages] == list(range(9))

    off = open_store(
        dataclasses.replace(config, dispatch_inline_max=0), root=store.root.parent / "off"
    )
    seen: list[str] = []
    done = threading.Event()

    def note() -> None:
        seen.append(threading.current_thread().name)
        done.set()

    off.watch("Sized", 0, 0, note)
    off.append(Message(topic="Sized", body=b"x"))
    assert done.wait(10.0)
    assert seen == ["apogee-store-dispatch"]


def test_watch_fires_once(store: MessageStore) -> None:
    calls: list[str] = []
    fired = threading.Event()

    def callback() -> None:
        calls.append(threading.current_thread().name)
        fired.set()

    store.watch("Watched", 0, 2, callback)  # fires when offset 2 exists
    store.append(Message(topic="Watched", body=b"0"))
    store.append(Message(topic="Watched", body=b"1"))
    dispatched(store)
    assert calls == []
    for i in range(2, 6):
        store.append(Message(topic="Watched", body=str(i).encode()))
    assert fired.wait(10.0)
    dispatched(store)
    assert len(calls) == 1
    # a lone message finding the dispatcher idle is indexed, and the watch called, right here
    assert calls[0] == threading.current_thread().name
    assert store.notifier.pending() == 0

    # already satisfied: called right away, on the caller's thread
    now: list[int] = []
    store.watch("Watched", 0, 5, lambda: now.append(1))
    assert now == [1]

    # cancelled: never called
    cancelled: list[int] = []
    w = store.watch("Watched", 0, 6, lambda: cancelled.append(1))
    store.cancel_watch(w)
    store.append(Message(topic="Watched", body=b"6"))
    dispatched(store)
    assert cancelled == []
