"""Long-poll holds (pulls, schedule scans): how long a held call may wait before it answers."""

from __future__ import annotations

from typing import Final

#: A held call is answered this long before its deadline (at most), for the answer's trip.
DEADLINE_MARGIN_S: Final = 0.1


def within_deadline(hold_s: float, time_remaining_s: float | None) -> float:
    """``hold_s``, shortened so that the answer arrives before the call's deadline
    (``time_remaining_s``: how long until it, None when the call has none)."""
    if time_remaining_s is None:
        return hold_s
    return min(hold_s, time_remaining_s - DEADLINE_MARGIN_S)
