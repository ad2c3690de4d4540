"""The CommitLog record, drawn once: the byte layout every writer and reader of records follows.

All integers are little-endian. One record::

     0       4       8       12      16      20              28              36      40
     +-------+-------+-------+-------+-------+---------------+---------------+-------+
     | size  | magic |  crc  | queue | flag  | queue offset  | phys offset   | sysflg|
     +-------+-------+-------+-------+-------+---------------+---------------+-------+
     40              48              56                  74                  92
     +---------------+---------------+-------------------+-------------------+
     | born ts (ms)  | store ts (ms) | born host (18)    | store host (18)   |
     +---------------+---------------+-------------------+-------------------+
     92      96              104     108     110     112
     +-------+---------------+-------+-------+-------+--------+--------+------------+
     | recon | prepared txn  | body  | topic | props | body   | topic  | properties |
     | times | offset        | len   | len   | len   | ...    | ...    | ...        |
     +-------+---------------+-------+-------+-------+--------+--------+------------+

``size`` counts the whole record. ``crc`` is the CRC-32 (:mod:`apogee.codec.crc`) of every byte
after it (bytes 12 to ``size``): header, body, topic and properties, so a garbled or torn record
anywhere fails the check (RocketMQ checks the body only; a torn tail can lose properties that
way). Hosts are 16 bytes of IPv6 address (IPv4 mapped) and a 2-byte port. Properties are
``name 0x01 value 0x02`` repeated, UTF-8 (:mod:`apogee.codec.properties`).

The end of a file that has no room for the next record is marked by a blank record: ``size`` (the
bytes left in the file) and the magic ``BLANK_MAGIC``; readers skip to the next file.

:data:`FIELDS` is the drawing as data; every struct, field index and byte offset below is derived
from it, so the layout is written down in one place only.
"""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Collection
from typing import Final

from apogee.common.errors import InvalidPropertyError

#: The fixed header, field by field: name and :mod:`struct` code, in byte order.
FIELDS: Final[tuple[tuple[str, str], ...]] = (
    ("size", "i"),
    ("magic", "I"),
    ("crc", "I"),
    ("queue_id", "i"),
    ("flag", "i"),
    ("queue_offset", "q"),
    ("phys_offset", "q"),
    ("sys_flag", "i"),
    ("born_timestamp", "q"),
    ("store_timestamp", "q"),
    ("born_host_raw", "18s"),
    ("store_host_raw", "18s"),
    ("reconsume_times", "i"),
    ("prepared_txn_offset", "q"),
    ("body_length", "i"),
    ("topic_length", "H"),
    ("properties_length", "H"),
)
FIELD_NAMES: Final = tuple(name for name, _ in FIELDS)


def header_struct(
    fields: tuple[tuple[str, str], ...] = FIELDS, skip: Collection[str] = ()
) -> struct.Struct:
    """The struct of ``fields`` (little-endian, no padding); the fields in ``skip`` are
    stepped over (pad bytes), so unpacking yields the others only."""
    return struct.Struct(
        "<"
        + "".join(f"{struct.calcsize(code)}x" if name in skip else code for name, code in fields)
    )


#: The whole fixed header.
HEADER: Final = header_struct()
HEADER_SIZE: Final = HEADER.size  # 112
#: Index of each field in a tuple that :data:`HEADER` unpacks.
INDEX: Final = {name: i for i, name in enumerate(FIELD_NAMES)}
#: Byte offset of each field from the start of a record.
OFFSET: Final = {
    name: struct.calcsize("<" + "".join(code for _, code in FIELDS[:i]))
    for i, name in enumerate(FIELD_NAMES)
}
#: The CRC covers the record from here to its end (everything after the ``crc`` field).
CRC_FROM: Final = OFFSET["queue_id"]
#: The part of the header before the CRC'd bytes (size, magic, crc), and the part after.
HEAD: Final = header_struct(FIELDS[: INDEX["queue_id"]])
TAIL: Final = header_struct(FIELDS[INDEX["queue_id"] :])
#: The blank record that ends a file.
BLANK: Final = header_struct(FIELDS[: INDEX["crc"]])
#: Room always kept at the end of a file for the blank record.
MIN_BLANK: Final = BLANK.size
HOST_SIZE: Final = struct.calcsize(dict(FIELDS)["born_host_raw"])
assert HEADER_SIZE == HEAD.size + TAIL.size == 112
assert CRC_FROM == HEAD.size == 12

# Field indices in a tuple unpacked with HEADER (for the loops that read many records).
SIZE: Final = INDEX["size"]
MAGIC: Final = INDEX["magic"]
CRC: Final = INDEX["crc"]
QUEUE_ID: Final = INDEX["queue_id"]
QUEUE_OFFSET: Final = INDEX["queue_offset"]
PHYS_OFFSET: Final = INDEX["phys_offset"]
SYS_FLAG: Final = INDEX["sys_flag"]
STORE_TIMESTAMP: Final = INDEX["store_timestamp"]
BODY_LENGTH: Final = INDEX["body_length"]
TOPIC_LENGTH: Final = INDEX["topic_length"]
PROPERTIES_LENGTH: Final = INDEX["properties_length"]

MESSAGE_MAGIC: Final = 0xAABBCCDD
BLANK_MAGIC: Final = 0xCBD43194

#: System flag bits.
SYSFLAG_COMPRESSED: Final = 0x1  # the body travels and is stored zlib-compressed
SYSFLAG_MULTI_TAGS: Final = 0x2
SYSFLAG_TXN_PREPARED: Final = 0x4
SYSFLAG_TXN_COMMIT: Final = 0x8
SYSFLAG_TXN_ROLLBACK: Final = 0xC

EMPTY_HOST: Final = bytes(HOST_SIZE)

_host_cache: dict[str, bytes] = {"": EMPTY_HOST}


def encode_host(host: str) -> bytes:
    """``"10.0.0.1:8080"`` or ``"[::1]:8080"`` as 18 bytes; ``""`` as zeros."""
    cached = _host_cache.get(host)
    if cached is not None:
        return cached
    addr, _, port = host.rpartition(":")
    try:
        ip = ipaddress.ip_address(addr.strip("[]"))
        packed = (
            ip.packed if ip.version == 6 else ipaddress.IPv6Address(f"::ffff:{ip}").packed
        ) + int(port).to_bytes(2, "little")
    except (ValueError, OverflowError) as exc:  # OverflowError: a port outside 0-65535
        raise InvalidPropertyError(field="born_host", rule=f"{host!r} is not ip:port") from exc
    if len(_host_cache) < 4096:
        _host_cache[host] = packed
    return packed


_host_text_cache: dict[bytes, str] = {EMPTY_HOST: ""}


def decode_host(raw: bytes) -> str:
    """The inverse of :func:`encode_host`."""
    cached = _host_text_cache.get(raw)
    if cached is not None:
        return cached
    ip = ipaddress.IPv6Address(raw[:16])
    port = int.from_bytes(raw[16:], "little")
    mapped = ip.ipv4_mapped
    text = f"{mapped}:{port}" if mapped else f"[{ip}]:{port}"
    if len(_host_text_cache) < 4096:
        _host_text_cache[bytes(raw)] = text
    return text
