"""Compressed bodies: a body stored with :data:`~apogee.codec.layout.SYSFLAG_COMPRESSED` is one
whole zlib stream (RFC 1950), as :func:`zlib.compress` writes it.

Brokers check that a body flagged compressed is such a stream, and that it inflates to at least
one byte and no more than their ``max_message_size`` (:func:`inflate_problem`), before they store
it: a body that does not inflate would otherwise reach every reader as a record none of them can
read, and one that inflates to nothing is the empty body every sender is refused.
"""

from __future__ import annotations

import zlib

__all__ = ["inflate_problem"]


def inflate_problem(body: bytes | memoryview, limit: int) -> str | None:
    """Why ``body`` is not one zlib stream that inflates to 1 to ``limit`` bytes, as a phrase
    that follows "is flagged compressed but"; None when it is."""
    d = zlib.decompressobj()
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as exc:
        return f"does not inflate with zlib ({exc})"
    if len(out) > limit:
        return f"inflates to more than {limit} bytes (max_message_size)"
    if not d.eof:
        return "ends before its zlib stream does"
    if d.unused_data:
        return f"has {len(d.unused_data)} bytes after its zlib stream"
    if not out:
        return "inflates to 0 bytes; a body must not be empty"
    return None
