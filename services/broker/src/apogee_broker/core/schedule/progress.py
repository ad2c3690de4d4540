"""The schedule service's progress at this broker, kept in ``scheduleProgress.json``.

Per schedule queue, the first offset the schedule service has not resolved yet, written
atomically (:mod:`apogee.store.metadata`) before the call that commits it returns::

    {"version": 1, "updated_ms": 1767225600000, "offsets": {"0": 1520, "32": 7}}

A file that cannot be read is logged, and delivery starts again from the start of each queue
(at-least-once).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from apogee.common.clock import Clock
from apogee.common.errors import CorruptRecordError
from apogee.store.metadata import read_json, write_json_atomic

log = logging.getLogger(__name__)

PROGRESS_FILE: Final = "scheduleProgress.json"


class ScheduleProgress:
    """The schedule service's committed offsets at this broker (``scheduleProgress.json``)."""

    def __init__(self, data_dir: Path, clock: Clock) -> None:
        self.path = Path(data_dir) / PROGRESS_FILE
        self.clock = clock
        self.offsets: dict[int, int] = {}
        self.updated_ms = 0

    def load(self) -> None:
        try:
            data = read_json(self.path)
        except CorruptRecordError:
            log.exception("schedule progress unreadable; delivering again from the start")
            return
        if not isinstance(data, dict):
            return
        raw: Any = data.get("offsets", {})
        if isinstance(raw, dict):
            self.offsets = {
                int(q): int(o) for q, o in raw.items() if str(q).isdigit() and int(o) >= 0
            }
        self.updated_ms = int(data.get("updated_ms", 0) or 0)

    def commit(self, offsets: Mapping[int, int]) -> dict[str, Any]:
        """Write the progress with ``offsets`` merged in; returns the file's content."""
        merged = dict(self.offsets)
        merged.update(offsets)
        now = self.clock.time_ms()
        content = {
            "version": 1,
            "updated_ms": now,
            "offsets": {str(q): o for q, o in merged.items()},
        }
        write_json_atomic(self.path, content)
        self.offsets = merged
        self.updated_ms = now
        return content
