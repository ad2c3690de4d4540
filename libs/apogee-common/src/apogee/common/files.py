"""Small files written so that a crash leaves the old content or the new, never a mix.

:func:`write_json_atomic` writes ``<name>.tmp``, fsyncs it, keeps the current file as
``<name>.bak`` and renames the temp file into place, then fsyncs the directory. The store's
metadata (``apogee.store.metadata``, which also reads the ``.bak`` copy back when needed) and
the SDK's local offset file both write this way.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "write_json_atomic"]


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, value: Any) -> None:
    """Write ``value`` as JSON to ``path`` atomically (see the module's docstring)."""
    data = json.dumps(value, indent=2, sort_keys=True).encode()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if path.exists():
        os.replace(path, path.with_name(path.name + ".bak"))
    os.replace(tmp, path)
    fsync_dir(path.parent)
