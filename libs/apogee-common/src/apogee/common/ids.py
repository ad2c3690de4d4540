"""Unique message ids.

An id is 16 bytes shown as 32 upper-case hex digits::

    0        6               12        16
    +--------+---------------+---------+
    | prefix | time ms (48b) | counter |
    +--------+---------------+---------+

``prefix`` is random per generator (per process), ``time`` the generation time in milliseconds and
``counter`` a 32-bit sequence, so ids from one generator sort by creation and never repeat within
2**32 ids per millisecond; ids from different processes differ in their prefix.
"""

from __future__ import annotations

import itertools
import os
import threading
import time


class IdGenerator:
    def __init__(self, prefix: bytes | None = None) -> None:
        self._prefix = (prefix if prefix is not None else os.urandom(6)).hex().upper()
        if len(self._prefix) != 12:
            raise ValueError("prefix must be 6 bytes")
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def next_id(self) -> str:
        with self._lock:
            n = next(self._counter) & 0xFFFFFFFF
        return f"{self._prefix}{time.time_ns() // 1_000_000 & 0xFFFFFFFFFFFF:012X}{n:08X}"

    def next_ids(self, count: int) -> list[str]:
        """``count`` ids at once, cheaper than calling :meth:`next_id` in a loop."""
        with self._lock:
            start = next(self._counter)
            if count > 1:
                self._counter = itertools.count(start + count)
        head = f"{self._prefix}{time.time_ns() // 1_000_000 & 0xFFFFFFFFFFFF:012X}"
        return [f"{head}{(start + i) & 0xFFFFFFFF:08X}" for i in range(count)]


_DEFAULT = IdGenerator()


def new_id() -> str:
    return _DEFAULT.next_id()


def id_timestamp_ms(uid: str) -> int | None:
    """The generation time encoded in an id made here, or None if ``uid`` is not of that form."""
    if len(uid) != 32:
        return None
    try:
        return int(uid[12:24], 16)
    except ValueError:
        return None
