"""Fixtures shared by the broker's tests."""

from __future__ import annotations

import random
import string
import zlib

import pytest


@pytest.fixture(scope="session")
def crc32_twins() -> tuple[str, str]:
    """Two different tags of equal length with the same CRC-32 (so the same ConsumeQueue tag
    code): a seeded birthday search over random strings."""
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
    raise AssertionError("no CRC-32 collision among 500,000 strings")  # pragma: no cover
