"""The record CRC: zlib-ng's implementation gives zlib's values, chained or not."""

from __future__ import annotations

import random
import zlib

import pytest

from apogee.codec import crc

pytestmark = pytest.mark.unit


def test_the_fast_implementation_is_the_one_in_use() -> None:
    # zlib-ng is a dependency of the codec: losing it silently would cost every send and pull
    assert crc.implementation == "zlib-ng"


def test_values_match_zlib_whole_and_chained() -> None:
    rng = random.Random(7)
    for size in (0, 1, 15, 16, 17, 63, 64, 65, 1024, 1221, 65_536 + 3):
        data = rng.randbytes(size)
        assert crc.crc32(data) == zlib.crc32(data), size
        cut = size // 3
        chained = crc.crc32(data[cut:], crc.crc32(data[:cut]))
        assert chained == zlib.crc32(data), size
        assert crc.crc32(memoryview(data)[cut:]) == zlib.crc32(data[cut:]), size
