"""Protobuf's wire format, for the few places that handle message bytes by hand: the
producer's request encoder and stream envelopes write varints; a consumer takes the records of
a large pull answer out of the bytes in place (:func:`split_field`) instead of letting protobuf
copy them twice."""

from __future__ import annotations

from typing import Final

ONE_BYTE: Final = tuple(bytes((n,)) for n in range(0x80))

#: wire types
_VARINT: Final = 0
_I64: Final = 1
_LEN: Final = 2
_I32: Final = 5


class WireError(ValueError):
    """Bytes that are not a protobuf message."""


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


def read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at ``buf[pos]`` and the position after it; it must end before ``end``."""
    result = shift = 0
    while pos < end and shift < 70:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
    raise WireError(f"a varint at byte {pos} runs past its message or over 10 bytes")


def split_field(buf: bytes, start: int, end: int, field: int) -> tuple[bytes, int, int]:
    """Take the length-delimited field number ``field`` out of the message ``buf[start:end]``.

    Returns the message's other fields (bytes for protobuf to parse: small when the field was
    the bulk) and where the field's value lies in ``buf`` (``value_start, value_end``; the last
    occurrence, as protobuf keeps for a scalar; ``-1, -1`` when it is absent). Raises
    :class:`WireError` for bytes that are not a well-formed message."""
    kept: list[bytes] = []
    run = start  # the start of the bytes kept since the last occurrence
    found = (-1, -1)
    at = start
    while at < end:
        key_at = at
        key, at = read_varint(buf, at, end)
        wire = key & 7
        if wire == _VARINT:
            _, at = read_varint(buf, at, end)
        elif wire == _LEN:
            n, at = read_varint(buf, at, end)
            if key >> 3 == field and at + n <= end:
                kept.append(buf[run:key_at])
                found = (at, at + n)
                run = at + n
            at += n
        elif wire == _I64:
            at += 8
        elif wire == _I32:
            at += 4
        else:
            raise WireError(f"wire type {wire} at byte {key_at - start} is not one protobuf writes")
        if key >> 3 == 0:
            raise WireError(f"field number 0 at byte {key_at - start}")
    if at != end:
        raise WireError(f"the last field runs {at - end} byte(s) past the message's end")
    if found[0] < 0:
        return buf[start:end], -1, -1
    kept.append(buf[run:end])
    return b"".join(kept), found[0], found[1]
