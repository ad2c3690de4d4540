"""Dropping a message the broker already stored: the dedup window.

A producer that may send the same message again (a Spark sink replaying a micro-batch after a
failure) names each message with a deterministic id in the user property
:data:`DEDUP_PROPERTY`. For ``dedup_window_s`` seconds after the broker stored a message with
such an id in a topic, another message of that topic carrying the same id is not stored: the
send succeeds and answers the first copy's queue offset (0 while the first copy is still being
stored). Messages without the property, which plain producers send, are never looked at.

The ids live in memory, oldest first, at most ``dedup_max_ids`` of them (the oldest go first
when there are more). A broker that starts (after a stop or a crash alike) rebuilds them from
the records its CommitLog stored within the last ``dedup_window_s`` (:mod:`.dedup_log`), so a
copy sent again across a broker restart is still stored once. Idempotent producers
(``idempotent=True``) set the property to each message's id.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

#: The user property that asks for deduplication, and the id it gives.
DEDUP_PROPERTY: Final = "APOGEE_DEDUP_ID"
_AT_START: Final = DEDUP_PROPERTY + "\x01"
_INSIDE: Final = "\x02" + DEDUP_PROPERTY + "\x01"
#: a queue offset not known yet (the first copy is being stored)
PENDING: Final = -1


def dedup_id(props: str) -> str:
    """The dedup id in a record's properties text (``name 0x01 value 0x02`` ...), or ``""``."""
    if props.startswith(_AT_START):
        start = len(_AT_START)
    else:
        at = props.find(_INSIDE)
        if at < 0:
            return ""
        start = at + len(_INSIDE)
    end = props.find("\x02", start)
    return props[start:] if end < 0 else props[start:end]


class DedupWindow:
    """The ids stored in the last ``window_s`` seconds, per topic."""

    def __init__(
        self, window_s: float, max_ids: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window_s = window_s
        self.max_ids = max_ids
        #: seconds (monotonic by default) that ``window_s`` is counted on
        self.clock = clock
        #: (topic, id) -> [first seen (clock seconds), queue offset or PENDING]
        self._ids: OrderedDict[tuple[str, str], list[float | int]] = OrderedDict()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._ids)

    def claim(self, topic: str, key: str) -> int | None:
        """``None`` when ``key`` is new in ``topic`` (it is then claimed: :meth:`stored` or
        :meth:`release` follows); else the first copy's queue offset, or :data:`PENDING`."""
        now = self.clock()
        ids = self._ids
        while ids:
            first = next(iter(ids.values()))
            if now - first[0] < self.window_s:
                break
            ids.popitem(last=False)
        entry = ids.get((topic, key))
        if entry is not None:
            self.dropped += 1
            return int(entry[1])
        ids[(topic, key)] = [now, PENDING]
        if len(ids) > self.max_ids:
            ids.popitem(last=False)
        return None

    def remember(self, topic: str, key: str, first_seen: float, queue_offset: int) -> bool:
        """Note an id stored earlier (rebuilding the window at start-up, in log order:
        ``first_seen`` on this window's clock); False when it was known already."""
        ids = self._ids
        if (topic, key) in ids:
            return False
        ids[(topic, key)] = [first_seen, queue_offset]
        if len(ids) > self.max_ids:
            ids.popitem(last=False)
        return True

    def offset_of(self, topic: str, key: str) -> int:
        """The first copy's queue offset; :data:`PENDING` while unknown (or forgotten)."""
        entry = self._ids.get((topic, key))
        return PENDING if entry is None else int(entry[1])

    def stored(self, topic: str, key: str, queue_offset: int) -> None:
        entry = self._ids.get((topic, key))
        if entry is not None:
            entry[1] = queue_offset

    def release(self, topic: str, key: str) -> None:
        """The claimed message was not stored: a later copy may be."""
        self._ids.pop((topic, key), None)
