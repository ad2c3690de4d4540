"""Logging as every Apogee service does it: one line per record on standard output.

``2026-01-31T12:00:00.123Z INFO apogee_broker.app message``; tracebacks stay on the line
(newlines escaped), so log collectors see one record per line.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Final

from apogee.common.errors import InvalidArgumentError

LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class OneLineFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return f"{stamp}.{int(record.msecs):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", "\\n")


def check_log_level(value: str, field: str = "log_level") -> str:
    """``value`` as one of :data:`LOG_LEVELS` (any case in); raises naming ``field``."""
    level = value.upper()
    if level not in LOG_LEVELS:
        raise InvalidArgumentError(
            field=field, rule=f"{value!r} is not one of: {', '.join(LOG_LEVELS)}"
        )
    return level


def configure_logging(level: int | str) -> None:
    """Send every record at ``level`` or above to standard output, one line each."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(OneLineFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if isinstance(level, str) else level)
