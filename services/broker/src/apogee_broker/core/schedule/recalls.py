"""Recalled delay and timer messages: a producer may cancel a message it sent with a delivery
time while that time has not come (RocketMQ 5's RecallMessage). The broker notes the message's
unique id here; when the message falls due, the schedule path drops it instead of delivering it.

The notes live in ``<data_dir>/recalled.log``, one line per recall, ``<due ms> <unique id>``,
appended and fsynced before the recall is answered, so a recall survives any crash. A note is
kept until a day after its message was due (the schedule service may resolve a message late,
never a day late); older ones are dropped when the file is read at start-up, which then writes
it anew (temp file, fsync, rename) when it dropped any.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Final

from apogee.common.clock import SYSTEM_CLOCK, Clock

log = logging.getLogger(__name__)

FILE_NAME: Final = "recalled.log"
#: How long after its due time a note is kept.
KEEP_MS: Final = 86_400_000


class Recalls:
    def __init__(self, data_dir: Path, clock: Clock = SYSTEM_CLOCK) -> None:
        self.path = Path(data_dir) / FILE_NAME
        self.clock = clock
        self._due: dict[str, int] = {}

    def load(self) -> int:
        """Read the notes; returns how many are kept."""
        if not self.path.exists():
            return 0
        now = self.clock.time_ms()
        lines = self.path.read_text(errors="replace").splitlines()
        for line in lines:
            due, _, uid = line.partition(" ")
            if due.isdigit() and uid and int(due) + KEEP_MS > now:
                self._due[uid] = int(due)
        if len(self._due) < len(lines):
            tmp = self.path.with_suffix(".new")
            with open(tmp, "w") as f:
                f.writelines(f"{due} {uid}\n" for uid, due in self._due.items())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        log.info("%d recalled messages noted (%d lines read)", len(self._due), len(lines))
        return len(self._due)

    def add(self, unique_id: str, due_ms: int) -> None:
        """Note a recall (durably, before returning)."""
        if unique_id in self._due:
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{due_ms} {unique_id}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self._due[unique_id] = due_ms

    def __contains__(self, unique_id: object) -> bool:
        return unique_id in self._due

    def __len__(self) -> int:
        return len(self._due)
