"""Messages on the wire, encoded once.

A message is serialized to its ``apogee.v1.Message`` bytes once, when it is sent, without its
queue id; each attempt adds the queue id it chose as one trailing varint field (protobuf
accepts fields in any order, and the last value of a field wins), and frames the result as
field 1 of ``SendMessagesRequest``. A request is then the concatenation of its messages' frames
and the producer group, so batching costs no protobuf object per request and a retry on
another queue does not serialize the message again. Byte counts for the batch caps are exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from apogee.client.message import Message, SendResult, SendStatus, encode_body
from apogee.common.errors import ApogeeError
from apogee.rpc.errors import from_status
from apogee.v1 import broker_pb2, common_pb2

_TAG_MESSAGES: Final = b"\x0a"  # SendMessagesRequest.messages: field 1, length-delimited
_TAG_GROUP: Final = b"\x12"  # SendMessagesRequest.producer_group: field 2, length-delimited
_TAG_QUEUE_ID: Final = b"\x50"  # Message.queue_id: field 10, varint
SEND_METHOD: Final = "/apogee.v1.Broker/SendMessages"


def varint(n: int) -> bytes:
    if n < 0:
        n &= (1 << 64) - 1
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode(msg: Message, unique_id: str, born_ms: int, compress_over: int, flag: int = 0) -> bytes:
    """``msg`` as ``apogee.v1.Message`` bytes, without a queue id; the body compressed when
    longer than ``compress_over`` and smaller for it."""
    raw = msg.body if type(msg.body) is bytes else bytes(msg.body)
    body, sys_flag = encode_body(raw, compress_over)
    pb = common_pb2.Message(
        topic=msg.topic, body=body, unique_id=unique_id, born_timestamp_ms=born_ms
    )
    if msg.tags:
        pb.tags = msg.tags
    if msg.keys:
        pb.keys.extend(msg.keys)
    if msg.properties:
        pb.properties.update(msg.properties)
    if flag:
        pb.flag = flag
    if sys_flag:
        pb.sys_flag = sys_flag
    if msg.delay_level:
        pb.delay_level = msg.delay_level
    return pb.SerializeToString()


def frame(encoded: bytes, queue_id: int) -> bytes:
    """One message's frame in a request, placed on ``queue_id``."""
    if queue_id:
        tail = _TAG_QUEUE_ID + varint(queue_id)
        return b"".join((_TAG_MESSAGES, varint(len(encoded) + len(tail)), encoded, tail))
    return b"".join((_TAG_MESSAGES, varint(len(encoded)), encoded))


def group_field(group: str) -> bytes:
    raw = group.encode()
    return _TAG_GROUP + varint(len(raw)) + raw if raw else b""


def request(frames: Sequence[bytes], group_bytes: bytes) -> bytes:
    """The serialized ``SendMessagesRequest`` of ``frames``."""
    return b"".join((*frames, group_bytes))


def outcomes(
    resp: broker_pb2.SendMessagesResponse, broker_name: str
) -> list[SendResult | BaseException]:
    """One outcome per message of a request: where it was stored, or its error."""
    name = resp.broker_name or broker_name
    out: list[SendResult | BaseException] = []
    for r in resp.results:
        status = r.status
        if status.code == 0:
            out.append(
                SendResult(
                    r.unique_id,
                    r.topic,
                    r.queue_id,
                    r.queue_offset,
                    name,
                    SendStatus.OK,
                    r.store_timestamp_ms,
                )
            )
        elif status.reason == "FLUSH_TIMEOUT":  # stored; durability not confirmed in time
            out.append(
                SendResult(
                    r.unique_id,
                    r.topic,
                    r.queue_id,
                    r.queue_offset,
                    name,
                    SendStatus.FLUSH_DISK_TIMEOUT,
                    r.store_timestamp_ms,
                )
            )
        else:
            err = from_status(status)
            out.append(err if err is not None else ApogeeError.from_wire("INTERNAL", "no status"))
    return out
