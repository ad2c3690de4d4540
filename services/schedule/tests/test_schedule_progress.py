"""Progress per queue: the smallest unresolved offset, else the next scan offset."""

from __future__ import annotations

import pytest

from apogee_schedule.core.progress import ProgressBook, QueueProgress, QueueState

pytestmark = pytest.mark.unit


def test_progress_is_the_first_unresolved_offset_whatever_the_order_of_resolution() -> None:
    qp = QueueProgress(10)
    assert qp.progress == 10
    for off in range(10, 17):
        qp.scanned(off)
    qp.advance(17)
    assert qp.progress == 10
    for off in (10, 11, 13, 15, 16):
        qp.resolved(off)
    assert qp.progress == 12  # 12 and 14 are still open
    qp.resolved(14)
    assert qp.progress == 12
    qp.resolved(12)
    assert qp.progress == 17  # everything read is resolved: the next scan offset
    assert qp.pending == 0


def test_the_cursor_follows_the_broker_and_repeats_are_harmless() -> None:
    qp = QueueProgress(5)
    qp.advance(9)
    assert qp.cursor == 9
    qp.advance(7)  # the broker's queue ends before the cursor (its store was reset)
    assert qp.cursor == 7
    qp.advance(9)
    qp.scanned(8)
    qp.scanned(8)
    qp.resolved(8)
    qp.resolved(8)  # resolving twice (a retry that raced) changes nothing
    assert qp.progress == 9


def test_a_book_starts_from_the_committed_progress_or_the_earliest_entry() -> None:
    book = ProgressBook(
        [
            QueueState(0, min_offset=0, max_offset=40, progress=25),
            QueueState(33, min_offset=100, max_offset=120, progress=-1),  # never committed
        ]
    )
    assert book.cursor(0) == 25
    assert book.cursor(33) == 100
    assert book.cursor(34) == 0  # a queue that did not exist at the start
    # only what changed since the start (or the last commit) needs a commit
    assert book.uncommitted() == {0: 25, 33: 100, 34: 0}
    book.committed({0: 25, 33: 100, 34: 0})
    assert book.uncommitted() is None
    book.queue(0).scanned(25)
    book.queue(0).advance(26)
    assert book.uncommitted() is None  # 25 is read but not resolved: progress stays
    book.queue(0).resolved(25)
    assert book.uncommitted() == {0: 26, 33: 100, 34: 0}
    assert book.pending == 0
