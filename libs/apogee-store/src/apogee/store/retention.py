"""Retention: delete the oldest CommitLog files, and the queue and index files that only point
into them.

A round deletes, oldest first and never the file being written:

* files last written more than ``retention_hours`` ago, during the hours listed in
  ``retention_delete_hours`` (all hours by default);
* when the disk is fuller than ``disk_high_water_ratio``, the oldest files whatever their age,
  at any hour, until it is not.

At most ``files_deleted_per_round`` files go per round. Afterwards ConsumeQueue minimum offsets move
to the first message still kept, so a reader behind them is told the earliest available offset.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from apogee.common.clock import Clock
from apogee.store.commitlog import CommitLog
from apogee.store.config import StoreConfig
from apogee.store.consumequeue import ConsumeQueueTable
from apogee.store.indexfile import IndexService

log = logging.getLogger(__name__)


def disk_used_ratio(path: Path) -> float:
    usage = shutil.disk_usage(path)
    return usage.used / usage.total if usage.total else 0.0


@dataclass(frozen=True, slots=True)
class RetentionResult:
    commitlog_files: int
    queue_files: int
    index_files: int
    reason: str


class Retention:
    def __init__(
        self,
        commitlog: CommitLog,
        cqs: ConsumeQueueTable,
        index: IndexService,
        config: StoreConfig,
        clock: Clock,
        disk_usage: Callable[[], float],
    ) -> None:
        self.commitlog = commitlog
        self.cqs = cqs
        self.index = index
        self.cfg = config
        self.clock = clock
        self.disk_usage = disk_usage

    def run_once(self) -> RetentionResult:
        files = self.commitlog.files.files
        now_ms = self.clock.time_ms()
        full = self.disk_usage() > self.cfg.disk_high_water_ratio
        hour = time.localtime(now_ms / 1000).tm_hour
        count = 0
        reason = ""
        limit = self.cfg.files_deleted_per_round
        if full:
            count = min(limit, len(files) - 1)
            reason = f"disk above {self.cfg.disk_high_water_ratio:.0%}"
        elif hour in self.cfg.retention_delete_hours:
            cutoff = now_ms - self.cfg.retention_hours * 3600 * 1000
            for mf in files[: max(0, len(files) - 1)]:
                if count >= limit or mf.mtime() * 1000 > cutoff:
                    break
                count += 1
            reason = f"older than {self.cfg.retention_hours:g}h"
        deleted = self.commitlog.files.drop_first(count) if count > 0 else []
        if not deleted:
            return RetentionResult(0, 0, 0, "")
        log_min = self.commitlog.files.min_offset
        queue_files = sum(cq.delete_expired(log_min) for cq in self.cqs)
        index_files = self.index.delete_below(log_min)
        log.info(
            "retention (%s): deleted %d commitlog files, %d queue files, %d index files; "
            "the log now starts at %d",
            reason,
            len(deleted),
            queue_files,
            index_files,
            log_min,
        )
        return RetentionResult(len(deleted), queue_files, index_files, reason)
