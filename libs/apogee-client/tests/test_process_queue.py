"""ProcessQueue: the offset to commit never passes an unfinished message, flow-control figures
stay exact, and orderly take/commit/rollback hand messages out in queue order."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apogee.client.consumer.process_queue import ProcessQueue
from apogee.client.consumer.records import ReceivedMessage, decode_records
from apogee.codec import encode_record
from apogee.common.errors import InvalidArgumentError

pytestmark = pytest.mark.unit


def pulled(offsets: Sequence[int], body: bytes = b"x" * 10) -> list[ReceivedMessage]:
    """Messages at ``offsets`` as one pull returns them."""
    buf = b"".join(encode_record("T", 0, o, body) for o in offsets)
    return decode_records(buf, "b", "T", 0, offsets[0] if offsets else 0)


def test_commit_offset_waits_for_the_oldest_unfinished_message() -> None:
    pq = ProcessQueue()
    assert pq.offset_to_commit() == -1  # nothing known yet
    batch = pulled(range(100, 105))
    pq.add(batch)
    assert (pq.count, pq.bytes) == (5, 5 * batch[0].size)
    assert pq.remove([batch[2]]) == 100  # 100 is still being consumed
    assert pq.remove([batch[0]]) == 101
    assert pq.remove([batch[1], batch[1]]) == 103  # finishing twice is harmless
    assert pq.remove([batch[4]]) == 103
    assert pq.remove([batch[3]]) == 105  # all done: one past the highest
    assert (pq.count, pq.bytes, pq.max_span) == (0, 0, 0)
    pq.add(pulled([105, 106]))
    assert pq.offset_to_commit() == 105


def test_start_offset_and_skips_answer_when_nothing_is_in_flight() -> None:
    pq = ProcessQueue(start_offset=40)
    assert pq.offset_to_commit() == 40
    pq.skip_to(47)  # a tag filter skipped 40..46
    assert (pq.offset_to_commit(), pq.next_offset) == (47, 47)
    pq.skip_to(45)  # never backwards
    assert pq.offset_to_commit() == 47
    msgs = pulled([47, 52])
    pq.add(msgs)
    pq.skip_to(60)
    assert pq.remove(msgs[:1]) == 52
    assert pq.remove(msgs[1:]) == 60


def test_offsets_must_ascend_across_pulls() -> None:
    pq = ProcessQueue()
    pq.add(pulled([5, 6]))
    with pytest.raises(InvalidArgumentError) as info:
        pq.add(pulled([6, 7]))
    assert str(info.value) == (
        "msgs: offsets must ascend across pulls: 6 is below 7, where the previous pull ended"
    )
    pq.add([])  # an empty pull changes nothing
    assert pq.count == 2


def test_max_span_follows_the_oldest_and_newest_in_flight() -> None:
    pq = ProcessQueue()
    msgs = pulled([10, 11, 15, 30])
    pq.add(msgs)
    assert pq.max_span == 20
    pq.remove([msgs[3]])
    assert pq.max_span == 5
    pq.remove([msgs[0]])
    assert pq.max_span == 4
    pq.remove([msgs[2]])
    assert pq.max_span == 0
    assert pq.offset_to_commit() == 11


def test_times_flags_and_drop() -> None:
    pq = ProcessQueue(now=5.0)
    assert (pq.last_pull_time, pq.last_consume_time, pq.dropped, pq.locked) == (
        5.0,
        5.0,
        False,
        False,
    )
    pq.mark_pulled(7.5)
    pq.mark_consumed(8.0)
    pq.mark_locked(9.0)
    assert (pq.last_pull_time, pq.last_consume_time, pq.last_lock_time, pq.locked) == (
        7.5,
        8.0,
        9.0,
        True,
    )
    pq.drop()
    assert pq.dropped


def test_clear_returns_what_was_in_flight() -> None:
    pq = ProcessQueue()
    msgs = pulled([1, 2, 3])
    pq.add(msgs)
    pq.remove([msgs[1]])
    pq.take(1)
    assert [m.queue_offset for m in pq.clear(start_offset=0)] == [1, 3]
    assert (pq.count, pq.bytes, pq.taken, pq.offset_to_commit()) == (0, 0, 0, 0)
    pq.add(pulled([0]))  # after a reset, pulls may start lower
    assert pq.count == 1


def test_orderly_take_commit_and_rollback() -> None:
    pq = ProcessQueue()
    pq.add(pulled([0, 1, 2, 3, 4]))
    assert [m.queue_offset for m in pq.take(2)] == [0, 1]
    assert [m.queue_offset for m in pq.take(2)] == [2, 3]
    assert pq.taken == 4
    pq.rollback_taken()  # the listener asked to retry: all four come back, in order
    assert pq.taken == 0
    again = pq.take(3)
    assert [m.queue_offset for m in again] == [0, 1, 2]
    assert pq.count == 5  # taken messages are still in flight
    assert pq.commit_taken() == 3
    assert pq.count == 2
    pq.add(pulled([7, 8]))
    assert [m.queue_offset for m in pq.take(10)] == [3, 4, 7, 8]
    assert pq.take(1) == []
    assert pq.commit_taken() == 9
    pq.rollback_taken()  # nothing taken: nothing to do
    assert (pq.count, pq.offset_to_commit()) == (0, 9)


@pytest.mark.parametrize("how", ["remove", "take"])
def test_finishing_in_order_is_not_quadratic(how: str) -> None:
    """100,000 messages, 50,000 of them in flight, finished one by one in order: an O(n) scan
    per call would take minutes; amortised O(1) takes a fraction of a second."""
    pq = ProcessQueue()
    added: list[ReceivedMessage] = []
    done = 0
    started = time.perf_counter()
    for base in range(0, 100_000, 64):
        msgs = pulled(range(base, base + 64), body=b"")
        pq.add(msgs)
        added += msgs
        if base < 50_000:
            continue
        for m in added[done : done + 64]:
            if how == "remove":
                committed = pq.remove([m])
            else:
                assert pq.take(1) == [m]
                committed = pq.commit_taken()
        done += 64
        assert committed == added[done].queue_offset
    assert pq.count == len(added) - done
    assert time.perf_counter() - started < 20, "finishing must not scan the whole queue"


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_committed_offset_never_passes_an_unfinished_message(data: st.DataObject) -> None:
    pq = ProcessQueue(start_offset=0)
    inflight: dict[int, ReceivedMessage] = {}
    taken: list[int] = []
    next_offset = 0
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        op = data.draw(st.sampled_from(["add", "remove", "take", "commit", "rollback", "skip"]))
        if op == "add":
            gaps = data.draw(st.lists(st.integers(0, 3), min_size=0, max_size=8), label="gaps")
            offsets = []
            for gap in gaps:
                offsets.append(next_offset + gap)
                next_offset += gap + 1
            msgs = pulled(offsets) if offsets else []
            pq.add(msgs)
            inflight.update((m.queue_offset, m) for m in msgs)
        elif op == "remove" and inflight:
            chosen = data.draw(st.lists(st.sampled_from(sorted(inflight)), max_size=5))
            pq.remove([inflight[o] for o in chosen])
            for o in chosen:
                inflight.pop(o, None)
        elif op == "take":
            n = data.draw(st.integers(0, 4))
            got = [m.queue_offset for m in pq.take(n)]
            waiting = [o for o in sorted(inflight) if o not in taken]
            assert got == waiting[:n]
            taken += got
        elif op == "commit":
            pq.commit_taken()
            for o in taken:
                inflight.pop(o, None)
            taken = []
        elif op == "rollback":
            pq.rollback_taken()
            taken = []
        elif op == "skip":
            next_offset += data.draw(st.integers(0, 3))
            pq.skip_to(next_offset)
        # the invariants
        committed = pq.offset_to_commit()
        assert committed == (min(inflight) if inflight else next_offset)
        assert all(committed <= o for o in inflight)
        assert pq.count == len(inflight)
        assert pq.bytes == sum(m.size for m in inflight.values())
        assert pq.max_span == (max(inflight) - min(inflight) if inflight else 0)
        taken = [o for o in taken if o in inflight]
        assert pq.taken >= len(taken)
