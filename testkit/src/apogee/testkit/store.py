"""Helpers for tests that drive a :class:`MessageStore`: Apogee's own, and users'."""

from __future__ import annotations

import random
import string
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from apogee.store.store import MessageStore

if TYPE_CHECKING:
    import pytest

#: A fixture's opener: ``open_store(config=None, *, root=None, **open_kwargs) -> MessageStore``.
OpenStore = Callable[..., MessageStore]


def dispatched(store: MessageStore, timeout: float = 10.0) -> None:
    """Wait until everything appended is readable through its queue; fail the test if not."""
    if not store.wait_dispatched(timeout):
        raise AssertionError(f"the dispatcher did not catch up within {timeout}s")


def watched_offsets(store: MessageStore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The offsets the store's arrival watches are registered at from now on: a held pull or
    a waiting delivery registers one at the end of what it has read, so a test sees it read on
    and wait again (not merely that it has not answered yet)."""
    offsets: list[int] = []
    watch = store.notifier.watch

    def recorded(topic: str, queue_id: int, offset: int, callback: Callable[[], None]) -> Any:
        offsets.append(offset)
        return watch(topic, queue_id, offset, callback)

    monkeypatch.setattr(store.notifier, "watch", recorded)
    return offsets


def crc32_twins() -> tuple[str, str]:
    """Two different strings of equal length with the same CRC-32, so the same ConsumeQueue
    tag code (a seeded birthday search: the same pair every run).

    CRC-32 is affine, so for strings of equal length a common prefix or suffix keeps the
    collision: ``crc32(p + a + s) == crc32(p + b + s)``. (Strings that differ only in a few
    trailing characters never collide: CRC-32 detects every burst of up to 32 bits, hence random
    strings.)"""
    rng = random.Random(1)
    alphabet = string.ascii_letters + string.digits
    seen: dict[int, str] = {}
    for _ in range(500_000):
        candidate = "".join(rng.choices(alphabet, k=12))
        h = zlib.crc32(candidate.encode())
        other = seen.get(h)
        if other is not None and other != candidate:
            return other, candidate
        seen[h] = candidate
    raise AssertionError("no CRC-32 collision among 500,000 strings")
