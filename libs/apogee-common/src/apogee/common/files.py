"""Small files written so that a crash leaves the old content or the new, never a mix.

:func:`write_json_atomic` writes ``<name>.tmp``, fsyncs it, keeps the current file as
``<name>.bak`` and renames the temp file into place, then fsyncs the directory. The store's
metadata (``apogee.store.metadata``, which also reads the ``.bak`` copy back when needed) and
the SDK's local offset file both write this way.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["append_durably", "fsync_dir", "sync_filesystem", "write_json_atomic"]


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_filesystem(path: Path) -> bool:
    """Make everything written to the file system holding ``path`` durable, with one
    ``syncfs`` (Linux): the data and metadata of every file there, where an ``fsync`` each
    would cost a journal commit each. False when the system has no ``syncfs`` (the caller
    then syncs file by file); an ``OSError`` when it failed (a write-back error: Linux 5.8
    and later report them)."""
    syncfs = _syncfs()
    if syncfs is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        if syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs: {os.strerror(err)}", str(path))
    finally:
        os.close(fd)
    return True


@functools.cache
def _syncfs() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn: Callable[[int], int] = libc.syncfs
    except (OSError, AttributeError):
        return None
    return fn


def write_json_atomic(path: Path, value: Any) -> None:
    """Write ``value`` as JSON to ``path`` atomically (see the module's docstring), compact:
    with no indentation ``json`` encodes in C, 3.8 times as fast (measured: 120 ms against
    32 ms for a table of 10,000 topics, which the broker rewrites at every change of one)."""
    data = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if path.exists():
        os.replace(path, path.with_name(path.name + ".bak"))
    os.replace(tmp, path)
    fsync_dir(path.parent)


def append_durably(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path`` (created when missing) and make it durable: the file
    fsynced, and its directory too when the file is new."""
    created = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        fsync_dir(path.parent)
