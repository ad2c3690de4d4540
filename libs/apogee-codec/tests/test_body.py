"""Which bodies flagged compressed a broker stores: one zlib stream of 1 to ``limit`` bytes."""

from __future__ import annotations

import gzip
import zlib

import pytest

from apogee.codec import inflate_problem

pytestmark = pytest.mark.unit

HELLO = zlib.compress(b"hello")


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (HELLO, None),
        (zlib.compress(b"x" * 100), None),
        (b"not zlib", "does not inflate with zlib (Error -3 while decompressing data: incorrect "),
        (gzip.compress(b"hello"), "does not inflate with zlib ("),
        (HELLO[:-1] + bytes([HELLO[-1] ^ 1]), "does not inflate with zlib ("),
        (zlib.compress(b"x" * 101), "inflates to more than 100 bytes (max_message_size)"),
        (HELLO[:-2], "ends before its zlib stream does"),
        (HELLO[:2], "ends before its zlib stream does"),
        (HELLO + b"junk", "has 4 bytes after its zlib stream"),
        (HELLO + HELLO, f"has {len(HELLO)} bytes after its zlib stream"),
        (zlib.compress(b""), "inflates to 0 bytes; a body must not be empty"),
    ],
)
def test_a_compressed_body_is_one_stream_of_1_to_limit_bytes(
    body: bytes, problem: str | None
) -> None:
    found = inflate_problem(body, 100)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert found.startswith(problem), found


def test_a_bomb_is_inflated_no_further_than_the_limit() -> None:
    bomb = zlib.compress(b"\0" * (64 * 1024 * 1024))
    assert inflate_problem(memoryview(bomb), 1024) == (
        "inflates to more than 1024 bytes (max_message_size)"
    )
