"""Protobuf's varint, for the few places that write message bytes by hand (the producer's
request encoder, stream envelopes)."""

from __future__ import annotations

from typing import Final

ONE_BYTE: Final = tuple(bytes((n,)) for n in range(0x80))


def varint(n: int) -> bytes:
    """``n`` as a protobuf varint (a negative int64 as its 10-byte two's complement)."""
    if n < 0:
        n &= (1 << 64) - 1
    if n < 0x80:
        return ONE_BYTE[n]
    if n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
