"""One check round against an in-memory broker (the ``rounds`` fixture: a test double of the
checker's own seam, and virtual time): the remove map, due times, the progress arithmetic
(calculateOpOffset), outcomes, rate limiting, errors, and a checker killed mid-round."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from apogee.common.errors import NotFoundError, UnavailableError
from apogee_txn_checker.core.model import (
    CheckOutcome,
    Decision,
    HalfEntry,
    OpEntry,
    OpScan,
)
from apogee_txn_checker.core.rounds import HalfBook, OpBook, RoundReport, Stop

pytestmark = pytest.mark.unit

T0 = 1_700_000_000_000
SENT = CheckOutcome.CHECK_SENT


async def test_halves_with_an_op_record_are_passed_and_the_others_checked_when_due(
    rounds: Any,
) -> None:
    rounds.configure(half_scan_batch=2, op_scan_batch=1)
    b = rounds.broker
    for i in range(5):
        b.send_half(f"t{i}")
    b.end("t1")
    b.end("t3", Decision.ROLLBACK)
    await rounds.vt.advance(7)

    report = await rounds.round()
    assert b.checked() == [0, 2, 4]
    assert [c.outcome for c in b.calls] == [SENT] * 3
    assert [c.at_ms for c in b.calls] == [T0 + 7000] * 3
    assert (report.skipped_done, report.checks, report.stop) == (2, 3, Stop.END)
    # every half processed; both op records read are done (their halves are behind 5); the
    # checked copies' op records (op offsets 2, 3, 4) are the next round's to read
    assert b.commits == [(5, 2)]
    assert [(h.unique_id, h.check_times) for h in b.halves[5:]] == [
        ("t0", 1),
        ("t2", 1),
        ("t4", 1),
    ]

    # the next round (one interval later) passes the op records of the checked copies and
    # checks the new copies, check_interval_s (10 s) old now
    await rounds.vt.advance(10)
    report = await rounds.round()
    assert b.checked()[3:] == [5, 6, 7]
    assert [c.at_ms for c in b.calls[3:]] == [T0 + 17_000] * 3
    assert b.commits[-1] == (8, 5)
    snap = rounds.stats.snapshot()
    assert (snap.rounds, snap.checks_sent, snap.skipped_done) == (2, 6, 2)


async def test_op_progress_stops_at_the_first_op_record_not_done(rounds: Any) -> None:
    b = rounds.broker
    for i in range(10):
        b.send_half(f"t{i}", immunity_ms=100_000 if i == 5 else 0)
    b.end("t8")  # op 0: half 8, which the scan does not reach
    b.end("t1")  # op 1: half 1
    await rounds.vt.advance(7)

    report = await rounds.round()
    assert b.checked() == [0, 2, 3, 4]
    assert report.stop is Stop.NOT_DUE  # half 5 (immunity 100 s) ends the scan
    assert b.commits == [(5, 0)]  # op 1 is done, but op 0 before it is not

    # nothing moves while half 5 is not due: nothing is committed again
    await rounds.vt.advance(1)
    report = await rounds.round()
    assert (report.checks, report.skipped_done) == (0, 0)
    assert b.commits == [(5, 0)]

    # once it is, half 8 is passed and the op progress moves over every op record read
    await rounds.vt.advance(100)
    report = await rounds.round()
    assert b.checked()[4:9] == [5, 6, 7, 9, 10]
    assert report.skipped_done == 1
    assert b.commits[-1] == (14, 6)


async def test_a_half_is_first_due_after_its_immunity(rounds: Any) -> None:
    b = rounds.broker
    b.send_half("fast", immunity_ms=1000)
    b.send_half("slow")  # the checker's immunity_s: 6 s
    b.send_half("fast2", immunity_ms=1000)
    await rounds.vt.advance(2)

    report = await rounds.round()
    assert b.checked() == [0]
    assert (report.stop, b.commits) == (Stop.NOT_DUE, [(1, 0)])

    await rounds.vt.advance(4)
    await rounds.round()
    # halves 1 and 2 at 6 s; the copy of half 0 (stored at 2 s) check_interval_s later
    assert [(c.half_offset, c.at_ms - T0) for c in b.calls] == [
        (0, 2000),
        (1, 6000),
        (2, 6000),
        (3, 12_000),
    ]


def test_due_times(rounds: Any) -> None:
    r = rounds.new_round()
    first = HalfEntry(0, "t", "G", "Orders", store_timestamp_ms=T0 + 50, first_stored_ms=T0)
    assert r.due_ms(first) == T0 + 6000  # from the first copy's store time
    assert r.due_ms(HalfEntry(0, "t", "G", "Orders", T0, immunity_ms=1500)) == T0 + 1500
    copy = HalfEntry(7, "t", "G", "Orders", T0 + 9000, check_times=2, first_stored_ms=T0)
    assert r.due_ms(copy) == T0 + 9000 + 10_000  # check_interval_s after this copy


async def test_a_decided_half_is_closed_at_once_without_a_token(rounds: Any) -> None:
    b = rounds.broker
    b.send_half("a")
    b.send_half("b")
    b.decisions["a"] = Decision.COMMIT  # ended through another copy: this one has no op yet
    report = await rounds.round()
    assert [(c.half_offset, c.outcome) for c in b.calls] == [(0, CheckOutcome.DECIDED)]
    assert (report.stop, b.commits) == (Stop.NOT_DUE, [(1, 0)])
    assert rounds.limiter.available("G") == 200
    assert rounds.stats.decided == 1


async def test_after_max_check_times_the_broker_gives_up_and_a_warning_names_it(
    rounds: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rounds.configure(max_check_times=3, check_burst=1, checks_per_group_per_s=0.01)
    b = rounds.broker
    b.send_half("stuck", "Payments", check_times=3, stored_ms=T0 - 20_000)
    b.send_half("other", "Payments", stored_ms=T0 - 20_000)
    b.producers = {"Payments"}
    with caplog.at_level(logging.WARNING):
        await rounds.round()
    assert [(c.half_offset, c.outcome) for c in b.calls] == [
        (0, CheckOutcome.GAVE_UP),
        (1, SENT),
    ]
    assert [h.unique_id for h in b.moved] == ["stuck"]
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage() == (
        "transaction stuck of producer group Payments (topic Orders) is still undecided after "
        "3 checks: broker cluster/broker-a moved it to TRANS_CHECK_MAX_TIME_TOPIC"
    )
    # the give-up took no token: the one token went to the check of "other"
    assert rounds.limiter.available("Payments") < 1
    assert rounds.stats.gave_up == 1


async def test_no_producer_counts_as_a_check(rounds: Any) -> None:
    b = rounds.broker
    b.producers = set()
    b.send_half("t")
    await rounds.vt.advance(6)
    await rounds.round()
    assert [c.outcome for c in b.calls] == [CheckOutcome.NO_PRODUCER]
    assert b.halves[1].check_times == 1
    snap = rounds.stats.snapshot()
    assert (snap.no_producer, snap.checks_sent, snap.checks) == (1, 0, 1)


async def test_a_group_is_rate_limited_without_holding_up_other_groups(rounds: Any) -> None:
    # 1 check/s, bursts of 3, a 5 s round: a lane holds 3 + 5 = 8 of a group's halves
    rounds.configure(checks_per_group_per_s=1.0, check_burst=3, check_interval_s=5.0)
    b = rounds.broker
    b.producers = {"A", "B"}
    for i in range(10):
        b.send_half(f"a{i}", "A", stored_ms=T0 - 10_000)
    b.send_half("b0", "B", stored_ms=T0 - 10_000)

    report = await rounds.round()
    by_group = {
        g: [(c.half_offset, (c.at_ms - T0) / 1000) for c in b.calls if c.half_offset < 11]
        for g in "AB"
    }
    assert [(o, t) for o, t in by_group["A"] if o < 10] == [
        (0, 0.0),
        (1, 0.0),
        (2, 0.0),
        (3, 1.0),
        (4, 2.0),
        (5, 3.0),
        (6, 4.0),
    ]
    assert (10, 0.0) in by_group["B"]  # not behind group A's queue
    # a8, a9 did not fit the lane; a7 was still waiting for a token at the deadline
    assert (report.deferred, report.unchecked, report.stop) == (2, 1, Stop.DEADLINE)
    assert b.commits == [(7, 0)]  # the first half not processed

    # the next round goes on from a7; nothing is checked twice
    report = await rounds.round()
    assert {7, 8, 9} <= set(b.checked())
    assert len(b.checked()) == len(set(b.checked()))
    assert 10 not in b.checked()[8:]  # b0's op record passes it


async def test_a_checker_killed_mid_round_never_checks_a_copy_twice(rounds: Any) -> None:
    b = rounds.broker
    for i in range(6):
        b.send_half(f"t{i}")
    await rounds.vt.advance(7)

    def gate_third(offset: int) -> None:
        if offset == 2:  # the broker does it, but the answer never comes back
            b.gate = asyncio.Event()

    b.before_check = gate_third
    killed = asyncio.ensure_future(rounds.new_round().run())
    await rounds.vt.settle()
    assert b.checked() == [0, 1, 2]
    killed.cancel()  # kill -9: nothing more is committed
    await asyncio.wait({killed})
    assert b.commits == []

    b.gate = b.before_check = None
    report = await rounds.round()  # the restarted checker
    assert b.checked()[:6] == [0, 1, 2, 3, 4, 5]
    assert report.skipped_done == 3  # the copies checked before the kill have op records
    # what it checks next are the new copies (6, 7, 8 of the killed round's checks, and the
    # restarted one's), each once
    assert len(b.checked()) == len(set(b.checked()))
    assert report.outcomes[CheckOutcome.CLOSED] == 0
    assert b.commits[0][0] >= 6


async def test_a_stopped_round_commits_what_it_processed(rounds: Any) -> None:
    b = rounds.broker
    for i in range(6):
        b.send_half(f"t{i}")
    await rounds.vt.advance(7)

    def gate_third(offset: int) -> None:
        if offset == 2:
            b.gate = asyncio.Event()

    b.before_check = gate_third
    stopped = rounds.new_round()
    task = asyncio.ensure_future(stopped.run())
    await rounds.vt.settle()
    task.cancel()
    await asyncio.wait({task})
    await stopped.commit()  # as a session's stop does
    assert b.commits == [(2, 0)]  # half 2's check was in flight: not passed

    b.gate = b.before_check = None
    report = await rounds.round()
    assert b.checked()[:6] == [0, 1, 2, 3, 4, 5]
    assert len(b.checked()) == len(set(b.checked()))
    assert report.skipped_done == 1  # half 2, checked before the stop: its op record
    assert b.commits[-1][0] >= 6


async def test_a_copy_closed_meanwhile_is_counted_and_passed(rounds: Any) -> None:
    b = rounds.broker
    for i in range(3):
        b.send_half(f"t{i}")
    await rounds.vt.advance(7)

    def producer_ends_first(offset: int) -> None:
        if offset == 1:  # ended after the round read the op records
            b.end("t1")

    b.before_check = producer_ends_first
    report = await rounds.round()
    assert [c.outcome for c in b.calls] == [SENT, CheckOutcome.CLOSED, SENT]
    assert report.outcomes[CheckOutcome.CLOSED] == 1
    assert rounds.stats.closed == 1
    assert b.commits == [(3, 0)]


async def test_a_check_that_fails_for_good_is_left_for_the_next_round(
    rounds: Any, caplog: pytest.LogCaptureFixture
) -> None:
    b = rounds.broker
    for i in range(3):
        b.send_half(f"t{i}")
    await rounds.vt.advance(7)

    def refuse_second(offset: int) -> None:
        if offset == 1 and not b.calls[1:]:
            b.fail["check_half"] = NotFoundError(what="half offset 1", detail="a test")

    b.before_check = refuse_second
    with caplog.at_level(logging.ERROR):
        report = await rounds.round()
    assert b.checked() == [0, 2]
    assert (report.errors, rounds.stats.errors) == (1, 1)
    assert b.commits == [(1, 0)]
    assert "checking half offset 1 (transaction t1 of producer group G) failed" in caplog.text

    await rounds.round()
    assert b.checked()[2] == 1
    assert b.commits[-1][0] == 5  # and the copies of halves 0 and 2 (3 and 4)


async def test_a_broker_that_stops_answering_ends_the_round_uncommitted(rounds: Any) -> None:
    b = rounds.broker
    for i in range(3):
        b.send_half(f"t{i}")
    await rounds.vt.advance(7)
    b.before_check = lambda offset: (
        b.fail.update(check_half=UnavailableError(what="broker", detail="gone"))
        if offset == 1
        else None
    )
    with pytest.raises(UnavailableError):
        await rounds.round()
    assert b.commits == []
    assert rounds.stats.rounds == 0


async def test_retention_and_a_truncated_queue(
    rounds: Any, caplog: pytest.LogCaptureFixture
) -> None:
    b = rounds.broker
    for i in range(5):
        b.send_half(f"t{i}", stored_ms=T0 - 10_000)
    b.half_min = 3  # 0..2 removed by retention before anything was committed
    await rounds.round()
    assert b.checked() == [3, 4]
    assert b.commits == [(5, 0)]

    b.progress = (40, 0)  # beyond the queue's end: it was truncated by recovery
    with caplog.at_level(logging.WARNING):
        await rounds.round()
    assert "the committed half progress 40 is past the half queue's end 7" in caplog.text
    assert b.commits[-1] == (7, 2)  # the op records of halves 3 and 4 are done


def test_the_op_book_is_rocketmqs_remove_map_and_done_offsets() -> None:
    book = OpBook(start=10, half_start=5)
    more = book.add(
        OpScan(
            [
                OpEntry(10, 7),  # half 7 >= 5: remove map
                OpEntry(11, 2),  # half 2 < 5: done
                OpEntry(12, 7),  # a second op record for half 7 (both are tracked)
                OpEntry(13, 9),
                OpEntry(14, 30),  # beyond the limit: read next round
            ],
            15,
            15,
        ),
        limit=14,
    )
    assert not more
    assert book.end == 14
    assert book.remove == {7: [10, 12], 9: [13]}
    assert (book.closes(7), book.closes(2), book.closes(9)) == (True, False, True)
    assert book.progress(5) == 10  # half 7 not passed: stops at its first op record
    assert book.progress(8) == 13  # past both op records of half 7
    assert book.progress(10) == 14  # everything read is done


def test_the_half_book_progress_is_the_first_half_not_processed() -> None:
    book = HalfBook(3)
    assert book.progress() == 3
    book.passed(3)
    book.hold(4)
    book.hold(5)
    book.leave(6)
    book.hold(7)
    assert book.progress() == 4
    book.release(4)
    assert book.progress() == 5
    book.release(5)
    book.release(7)
    assert book.progress() == 6  # the first half left for the next round


def test_a_round_is_summed_up_in_one_line() -> None:
    report = RoundReport("b", half_from=4, half_to=9, op_from=1, op_to=3, duration_ms=12)
    report.outcomes.update({CheckOutcome.CHECK_SENT: 2, CheckOutcome.GAVE_UP: 1})
    report.skipped_done, report.deferred, report.unchecked = 3, 4, 1
    assert report.summary() == (
        "3 checked (2 sent to a producer, 1 given up), 3 passed as done, 5 left for the next "
        "round; half progress 4 -> 9, op progress 1 -> 3; scan ended: end; 12 ms"
    )
    assert report.eventful
    quiet = RoundReport("b", skipped_done=2)
    assert quiet.summary().startswith("0 checked, 2 passed as done; ")
    assert not quiet.eventful
