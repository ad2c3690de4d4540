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
import time


class IdGenerator:
    """Thread-safe without a lock: ``itertools.count`` hands out each number once (it advances
    in C, under the GIL), and the text of the current millisecond is one tuple, read and
    replaced whole."""

    def __init__(self, prefix: bytes | None = None) -> None:
        self._prefix = (prefix if prefix is not None else os.urandom(6)).hex().upper()
        if len(self._prefix) != 12:
            raise ValueError("prefix must be 6 bytes")
        self._counter = itertools.count()
        self._stamp: tuple[int, str] = (-1, "")  # a millisecond, and prefix and time as text

    def _head(self, ms: int) -> str:
        stamp = self._stamp
        if stamp[0] != ms:
            stamp = self._stamp = (ms, f"{self._prefix}{ms & 0xFFFFFFFFFFFF:012X}")
        return stamp[1]

    def next_id(self) -> str:
        n = next(self._counter) & 0xFFFFFFFF
        ms = time.time_ns() // 1_000_000
        stamp = self._stamp  # (what _head does, inline: this is every message's path)
        if stamp[0] != ms:
            stamp = self._stamp = (ms, f"{self._prefix}{ms & 0xFFFFFFFFFFFF:012X}")
        return f"{stamp[1]}{n:08X}"

    def next_ids(self, count: int) -> list[str]:
        """``count`` ids at once (a contiguous run of counters), cheaper than calling
        :meth:`next_id` in a loop."""
        numbers = list(itertools.islice(self._counter, count))  # one C call: contiguous
        head = self._head(time.time_ns() // 1_000_000)
        return [f"{head}{n & 0xFFFFFFFF:08X}" for n in numbers]


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
