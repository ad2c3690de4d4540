"""Small metadata files (topics, groups, offsets, progress), written atomically.

A write (:func:`apogee.common.files.write_json_atomic`) goes to ``<name>.tmp``, is fsynced, the
current file becomes ``<name>.bak`` and the temp file takes its place; the directory is fsynced.
A reader that finds the file missing or unreadable falls back to the ``.bak`` copy, so a crash at
any point leaves the old or the new content.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from apogee.common.errors import CorruptRecordError
from apogee.common.files import write_json_atomic

__all__ = ["read_json", "write_json_atomic"]

log = logging.getLogger(__name__)


def read_json(path: Path) -> Any | None:
    """The content of ``path`` (or of its ``.bak`` when it is missing or damaged); None when
    neither exists. Raises :class:`CorruptRecordError` when both exist and are unreadable."""
    problems: list[str] = []
    for candidate in (path, path.with_name(path.name + ".bak")):
        if not candidate.exists():
            continue
        try:
            return json.loads(candidate.read_bytes())
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning("metadata file %s is unreadable (%s); trying its backup", candidate, exc)
            problems.append(f"{candidate.name}: {exc}")
    if problems:
        raise CorruptRecordError(where=str(path), detail="; ".join(problems))
    return None
