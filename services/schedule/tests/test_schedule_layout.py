"""The wheel arithmetic: slots, active and catch-up sets, hold or park."""

from __future__ import annotations

import pytest

from apogee_schedule.core.layout import Action, Layout

pytestmark = pytest.mark.unit

# 2 delay levels, a wheel of 10 slots of 1 s from queue 32
LAYOUT = Layout(delay_ms=(1000, 2000), first_slot_queue=32, slots=10, slot_ms=1000)
T0 = 1_700_000_000_000  # a whole second: slot 1_700_000_000, queue 32 + 0


def test_slot_of_a_time_and_its_queue_wrap_around_the_wheel() -> None:
    assert LAYOUT.slot_number(T0) == 1_700_000_000
    assert LAYOUT.slot_number(T0 + 999) == 1_700_000_000
    assert LAYOUT.slot_number(T0 + 1000) == 1_700_000_001
    assert LAYOUT.queue_of_slot(LAYOUT.slot_number(T0)) == 32
    assert LAYOUT.queue_of_slot(LAYOUT.slot_number(T0 + 9_500)) == 41
    assert LAYOUT.queue_of_slot(LAYOUT.slot_number(T0 + 10_000)) == 32  # one revolution on
    assert list(LAYOUT.level_queues) == [0, 1]
    assert list(LAYOUT.slot_queues) == list(range(32, 42))
    assert LAYOUT.is_level_queue(1)
    assert not LAYOUT.is_level_queue(2)
    assert LAYOUT.is_slot_queue(41)
    assert not LAYOUT.is_slot_queue(42)


@pytest.mark.parametrize(
    ("now", "queues"),
    [
        # now in slot c (queue 32): windows of c-1 .. c+2 meet [now - 1 s, now + 2 s]
        (T0, [41, 32, 33, 34]),
        (T0 + 500, [41, 32, 33, 34]),
        (T0 + 999, [41, 32, 33, 34]),
        (T0 + 1000, [32, 33, 34, 35]),
        (T0 + 8_700, [39, 40, 41, 32]),  # wraps
    ],
)
def test_active_slots_are_the_previous_the_current_and_the_next_two(
    now: int, queues: list[int]
) -> None:
    assert LAYOUT.active_queues(now) == queues
    # the windows of the active slots really meet [now - slot_ms, now + 2 * slot_ms]
    for n in LAYOUT.active_slots(now):
        assert n * 1000 <= now + 2000
        assert (n + 1) * 1000 > now - 1000


def test_horizon_is_the_end_of_the_last_active_window() -> None:
    assert LAYOUT.horizon_ms(T0) == T0 + 3000
    assert LAYOUT.horizon_ms(T0 + 999) == T0 + 3000
    assert LAYOUT.horizon_ms(T0 + 1000) == T0 + 4000


def test_slot_entries_due_within_the_active_windows_are_held_later_ones_parked() -> None:
    now = T0 + 400
    assert LAYOUT.action(33, T0 + 1500, now) is Action.HOLD
    assert LAYOUT.action(32, T0 - 60_000, now) is Action.HOLD  # long overdue: deliver at once
    assert LAYOUT.action(34, T0 + 2999, now) is Action.HOLD
    assert LAYOUT.action(35, T0 + 3000, now) is Action.PARK
    # a roll (far ahead) read from an active slot, and an entry of the next revolution
    assert LAYOUT.action(34, T0 + 86_400_000, now) is Action.PARK
    assert LAYOUT.action(33, T0 + 11_000, now) is Action.PARK
    # level queues are read only up to now + lead: always held, whatever the lead
    assert LAYOUT.action(1, T0 + 5000, now) is Action.HOLD


def test_an_entry_parked_from_an_active_slot_never_lands_in_an_active_slot() -> None:
    """The broker parks an entry in the slot of its time (or span ahead for a roll); neither
    may be active, or the scanner would read and park it again at once."""
    span = (LAYOUT.slots - 4) * LAYOUT.slot_ms
    for now in range(T0, T0 + 10_000, 250):
        active = set(LAYOUT.active_queues(now))
        for due in range(LAYOUT.horizon_ms(now), now + 3 * span, 100):
            assert LAYOUT.action(32, due, now) is Action.PARK
            target = LAYOUT.queue_of_slot(LAYOUT.slot_number(min(due, now + span)))
            assert target not in active, (now - T0, due - T0)


def test_catch_up_covers_the_slots_that_passed_since_progress_was_committed() -> None:
    # committed 3.5 s ago: slots from (committed - 2 s) to now
    now = T0 + 5_000
    assert LAYOUT.catch_up_queues(T0 + 1_500, now) == [41, 32, 33, 34, 35, 36, 37]
    # never committed: every slot
    assert LAYOUT.catch_up_queues(0, now) == list(range(32, 42))
    # down for longer than a revolution: every slot
    assert LAYOUT.catch_up_queues(now - 9_000, now) == list(range(32, 42))
    assert LAYOUT.catch_up_queues(now - 6_500, now) == list(range(32, 42))
    assert LAYOUT.catch_up_queues(now - 5_000, now) == [40, 41, 32, 33, 34, 35, 36, 37]


def test_a_layout_that_makes_no_sense_is_refused() -> None:
    with pytest.raises(ValueError, match="slot width"):
        Layout(delay_ms=(1000,), first_slot_queue=32, slots=10, slot_ms=0)
    with pytest.raises(ValueError, match="overlap the wheel"):
        Layout(delay_ms=(1000,) * 33, first_slot_queue=32, slots=10, slot_ms=1000)
