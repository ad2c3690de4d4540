"""The schedule topic's layout as a broker reports it, and the wheel arithmetic on it.

Queues ``0 .. levels - 1`` hold delay level ``1 .. levels`` (each in due order). Queues
``first_slot_queue + k`` (``k`` in ``0 .. slots - 1``) are the timer wheel: absolute slot ``n``
covers the window ``[n * slot_ms, (n + 1) * slot_ms)`` and lives in queue
``first_slot_queue + n % slots``. A broker stores a timer message due at ``T`` in the slot of
``T`` when ``T`` is less than ``(slots - 4) * slot_ms`` ahead, else in the slot that far ahead
(a roll)::

    time ──►   c-1     c      c+1    c+2    c+3   ...   c+slots-4 (rolls land here)
             [active: scanned continuously ]  later slots: their entries wait
                    ▲ now is in slot c

*Active* slots are those whose window meets ``[now - slot_ms, now + 2 * slot_ms]`` (``c - 1 ..
c + 2``); an entry read from one of them due before the end of the last active window goes to
the in-memory heap, a later one (a roll, or an entry for a later revolution) is parked again.
*Catch-up* slots are those whose windows passed while nobody read them (the service was down):
read once, their entries are due already (delivered at once) or parked.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class Action(enum.Enum):
    """What to do with a scanned entry."""

    #: keep it in memory and deliver it when due
    HOLD = "hold"
    #: store it again in the slot its time calls for (it is not due within the active window)
    PARK = "park"


@dataclass(frozen=True, slots=True)
class Layout:
    delay_ms: tuple[int, ...]
    first_slot_queue: int
    slots: int
    slot_ms: int

    def __post_init__(self) -> None:
        if self.slot_ms <= 0 or self.slots <= 0:
            raise ValueError(f"a timer wheel needs slots and a slot width, got {self!r}")
        if len(self.delay_ms) > self.first_slot_queue:
            raise ValueError(f"{len(self.delay_ms)} delay levels overlap the wheel in {self!r}")

    @property
    def level_queues(self) -> range:
        return range(len(self.delay_ms))

    @property
    def slot_queues(self) -> range:
        return range(self.first_slot_queue, self.first_slot_queue + self.slots)

    def is_level_queue(self, queue_id: int) -> bool:
        return 0 <= queue_id < len(self.delay_ms)

    def is_slot_queue(self, queue_id: int) -> bool:
        return self.first_slot_queue <= queue_id < self.first_slot_queue + self.slots

    def slot_number(self, t_ms: int) -> int:
        """The absolute slot whose window holds ``t_ms``."""
        return t_ms // self.slot_ms

    def queue_of_slot(self, slot: int) -> int:
        return self.first_slot_queue + slot % self.slots

    def active_slots(self, now_ms: int) -> range:
        """Absolute slots whose window meets ``[now - slot_ms, now + 2 * slot_ms]``."""
        return range(
            self.slot_number(now_ms - self.slot_ms), self.slot_number(now_ms + 2 * self.slot_ms) + 1
        )

    def active_queues(self, now_ms: int) -> list[int]:
        return self._queues(self.active_slots(now_ms))

    def horizon_ms(self, now_ms: int) -> int:
        """The end of the last active window: a slot entry due before it is held in memory."""
        return (self.active_slots(now_ms)[-1] + 1) * self.slot_ms

    def catch_up_queues(self, since_ms: int, now_ms: int) -> list[int]:
        """Slot queues whose windows passed between ``since_ms - 2 * slot_ms`` and ``now_ms``
        (every slot queue when that is a revolution or more, or when ``since_ms`` is 0: the
        progress was never committed)."""
        first = self.slot_number(since_ms - 2 * self.slot_ms)
        last = self.slot_number(now_ms)
        if since_ms <= 0 or last - first + 1 >= self.slots:
            return list(self.slot_queues)
        return self._queues(range(first, last + 1))

    def action(self, queue_id: int, deliver_at_ms: int, now_ms: int) -> Action:
        """Level entries are read only when due within the lead: held. A slot entry is held
        when it is due before the end of the active windows, else parked."""
        if self.is_slot_queue(queue_id) and deliver_at_ms >= self.horizon_ms(now_ms):
            return Action.PARK
        return Action.HOLD

    def _queues(self, slots: Iterable[int]) -> list[int]:
        out: dict[int, None] = {}
        for n in slots:
            out[self.queue_of_slot(n)] = None
        return list(out)
