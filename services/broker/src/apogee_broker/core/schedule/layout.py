"""Delayed and timer messages at the broker: where they are kept until the schedule service
delivers them.

A message with a delay level or a delivery time is stored under ``SCHEDULE_TOPIC_XXXX``, with
its real topic and queue in the ``REAL_TOPIC`` / ``REAL_QID`` properties and its delivery time
(ms since the epoch) in ``DELIVER_AT_MS``; the store's tag-code hook (:func:`schedule_tag_code`)
puts that time in the message's ConsumeQueue entry, so the schedule service can scan entries
without reading records. The schedule topic's queues (:class:`ScheduleLayout`):

- queue ``L - 1`` holds delay level ``L`` (1 to the delay table's length, at most
  :data:`FIRST_SLOT_QUEUE`): every message of one level waits equally long, so each such queue
  is in due order (RocketMQ's design);
- queues ``FIRST_SLOT_QUEUE + k`` for ``k`` in ``0 .. slots - 1`` are the timer wheel: a timer
  message due at ``T`` sits in slot ``(T // slot_ms) % slots`` when ``T`` is less than
  ``(slots - 4) * slot_ms`` ahead; further ahead it sits in the slot that far ahead (a *roll*),
  and the schedule service parks it again (:meth:`ScheduleLayout.slot_queue`) when that slot
  comes up. A message is therefore never kept more than a wheel's span before it is stored
  again, which keeps it ahead of retention.

The layout is fixed once timer messages exist: a broker keeps it in ``scheduleLayout.json`` and
refuses to start with other ``timer_slot_ms`` / ``timer_slots`` (:func:`check_layout_file`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from apogee.codec import PROP_DELAY, PROP_DELIVER_AT, PROP_REAL_QID, PROP_REAL_TOPIC, Message
from apogee.common.errors import InvalidArgumentError, StoreConfigError
from apogee.common.topics import SCHEDULE_TOPIC
from apogee.store.metadata import read_json, write_json_atomic
from apogee.store.records import tag_hash

#: Properties that only the schedule topic's copy carries; removed on delivery.
SCHEDULE_PROPERTIES: Final = frozenset(
    {PROP_REAL_TOPIC, PROP_REAL_QID, PROP_DELAY, PROP_DELIVER_AT}
)

#: Queue id of the first timer-wheel slot; queues below it are delay levels.
FIRST_SLOT_QUEUE: Final = 32
#: How many slots ahead a message may be placed directly (the rest of the wheel is kept clear so
#: that a slot being read never receives entries for its next revolution).
SLOT_MARGIN: Final = 4

DEFAULT_DELAY_LEVELS: Final = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
_UNITS: Final = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION: Final = re.compile(r"^(\d+)(ms|s|m|h|d)$")
LAYOUT_FILE: Final = "scheduleLayout.json"


def parse_delay_levels(text: str, field: str = "delay_levels") -> tuple[int, ...]:
    """``"1s 5s 1m 2h"`` as milliseconds. Units ms, s, m, h, d; 1 to 32 levels, each > 0."""
    words = text.split()
    if not words:
        raise InvalidArgumentError(field=field, rule="must list at least one delay, e.g. '1s 5s'")
    if len(words) > FIRST_SLOT_QUEUE:
        raise InvalidArgumentError(
            field=field, rule=f"lists {len(words)} delays; at most {FIRST_SLOT_QUEUE} are allowed"
        )
    out: list[int] = []
    for word in words:
        m = _DURATION.match(word)
        if m is None or int(m.group(1)) == 0:
            raise InvalidArgumentError(
                field=field,
                rule=f"{word!r} is not a positive duration like 500ms, 10s, 5m, 2h or 1d",
            )
        out.append(int(m.group(1)) * _UNITS[m.group(2)])
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ScheduleLayout:
    """The schedule topic's queues on one broker."""

    delay_ms: tuple[int, ...]
    slot_ms: int = 60_000
    slots: int = 1440

    @property
    def levels(self) -> int:
        return len(self.delay_ms)

    @property
    def queue_count(self) -> int:
        return FIRST_SLOT_QUEUE + self.slots

    @property
    def span_ms(self) -> int:
        """How far ahead a timer message is placed directly in its own slot."""
        return (self.slots - SLOT_MARGIN) * self.slot_ms

    def level_queue(self, level: int) -> int:
        return level - 1

    def is_level_queue(self, queue_id: int) -> bool:
        return 0 <= queue_id < self.levels

    def is_slot_queue(self, queue_id: int) -> bool:
        return FIRST_SLOT_QUEUE <= queue_id < FIRST_SLOT_QUEUE + self.slots

    def slot_queue(self, deliver_at_ms: int, now_ms: int) -> int:
        """The wheel slot a message due at ``deliver_at_ms`` is stored in at ``now_ms``."""
        # a time already past goes to the current slot (read now), not to its own old one
        at = min(max(deliver_at_ms, now_ms), now_ms + self.span_ms)
        return FIRST_SLOT_QUEUE + (at // self.slot_ms) % self.slots


def schedule_tag_code(topic: str, tags: str | None, props: Mapping[str, str], store_ts: int) -> int:
    """The store's tag-code hook: the delivery time for the schedule topic, else the tag hash."""
    if topic == SCHEDULE_TOPIC:
        raw = props.get(PROP_DELIVER_AT)
        if raw is not None and raw.isdigit():
            return int(raw)
        return store_ts
    return tag_hash(tags)


def to_scheduled(msg: Message, queue_id: int, deliver_at_ms: int, level: int = 0) -> None:
    """Turn ``msg`` (already checked against its real topic) into its schedule-topic copy."""
    props = dict(msg.properties or {})
    if msg.topic != SCHEDULE_TOPIC:
        # set from the message, never kept from what it carried (clients may not set these);
        # a message parked again in a later slot is already in the schedule topic and keeps them
        props[PROP_REAL_TOPIC] = msg.topic
        props[PROP_REAL_QID] = str(msg.queue_id)
    if level:
        props[PROP_DELAY] = str(level)
    props[PROP_DELIVER_AT] = str(deliver_at_ms)
    msg.properties = props
    msg.topic = SCHEDULE_TOPIC
    msg.queue_id = queue_id


def check_layout_file(data_dir: Path, layout: ScheduleLayout) -> None:
    """Record the wheel's geometry at first start; refuse another one later (entries already
    in slots would be read at the wrong times, or never)."""
    path = Path(data_dir) / LAYOUT_FILE
    want = {"version": 1, "slot_ms": layout.slot_ms, "slots": layout.slots}
    if not path.exists():
        write_json_atomic(path, want)
        return
    raw = read_json(path)
    have: dict[str, object] = raw if isinstance(raw, dict) else {}
    if (have.get("slot_ms"), have.get("slots")) != (layout.slot_ms, layout.slots):
        raise StoreConfigError(
            field="timer_slot_ms / timer_slots",
            rule=f"this broker's data was written with {have!r} ({path}); the timer wheel's "
            f"layout cannot change once it exists: set timer_slot_ms={have.get('slot_ms')} "
            f"and timer_slots={have.get('slots')}, or start with an empty data directory",
        )
