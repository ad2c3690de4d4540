"""A full disk, told once: when sends start being refused for lack of space, and when they stop.

While the store's volume is full every send fails with ``DISK_FULL`` (retriable: producers move
to other brokers). Logging each refusal would bury the log; logging none left operators blind
(producers saw 20 refusals while the broker said nothing). :class:`DiskFullEpisodes` logs one
WARNING when an episode starts, with the space free and what the refused append needed, and one
line when an append succeeds again, with how many were refused in between.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from apogee.common.errors import DiskFullError

log = logging.getLogger(__name__)


class DiskFullEpisodes:
    def __init__(self, root: Path) -> None:
        self.root = root
        #: appends refused in the current episode (0: the disk is not known to be full)
        self.refused = 0

    def failed(self, err: DiskFullError, needed: int) -> None:
        """An append of ``needed`` bytes was refused for lack of space."""
        self.refused += 1
        if self.refused == 1:
            log.warning(
                "disk full: sends are refused until space is freed (%s has %s bytes free; "
                "the refused append needed %d): %s",
                self.root,
                self._free(),
                needed,
                err,
            )

    def stored(self) -> None:
        """An append succeeded: ends an episode, if one was on."""
        if self.refused:
            log.warning(
                "disk no longer full: sends are stored again after %d refused (%s has %s bytes "
                "free)",
                self.refused,
                self.root,
                self._free(),
            )
            self.refused = 0

    def _free(self) -> str:
        try:
            return str(shutil.disk_usage(self.root).free)
        except OSError:
            return "an unknown number of"
