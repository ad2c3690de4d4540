"""Hostile input for every RPC of the internal protocol, and what is wrong with an answer:
the machinery of ``e2e/test_fuzz.py``.

- :func:`all_rpcs`: every method of every service in the generated descriptors
  (``apogee.v1.*_pb2``);
- :class:`Hostile`: requests built by walking a request's descriptor (see its docstring), and
  :func:`unparsable`: bytes that do not parse as it;
- :func:`build_call`: call ``index`` of a method, from (seed, method, index) alone;
- :func:`send`: one call over raw bytes, any of the four kinds of method, with a deadline and a
  bound beyond it; :func:`check_answer`: what is wrong with the answer.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import pkgutil
import random
import struct
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import grpc
import grpc.aio
from google.protobuf import text_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

import apogee.v1
from apogee.codec.send import encode_properties, encode_send_record
from apogee.rpc.errors import KIND_KEY

#: Seconds each call may take (its gRPC deadline), and how much longer before it counts as hung.
CALL_TIMEOUT: Final = 3.0
HANG_GRACE: Final = 3.0

INT32: Final = (-(2**31), 2**31 - 1)
UINT32: Final = (0, 2**32 - 1)
INT64: Final = (-(2**63), 2**63 - 1)
UINT64: Final = (0, 2**64 - 1)
INT_RANGES: Final = {
    FieldDescriptor.TYPE_INT32: INT32,
    FieldDescriptor.TYPE_SINT32: INT32,
    FieldDescriptor.TYPE_SFIXED32: INT32,
    FieldDescriptor.TYPE_UINT32: UINT32,
    FieldDescriptor.TYPE_FIXED32: UINT32,
    FieldDescriptor.TYPE_INT64: INT64,
    FieldDescriptor.TYPE_SINT64: INT64,
    FieldDescriptor.TYPE_SFIXED64: INT64,
    FieldDescriptor.TYPE_UINT64: UINT64,
    FieldDescriptor.TYPE_FIXED64: UINT64,
}
FLOATS: Final = (math.nan, math.inf, -math.inf, -0.0, 0.0, 1e308, 5e-324, 0.5, -1.0)
HOSTILE_STRINGS: Final = (
    "",
    "x" * 10_000,
    "漢" * 3_000,
    "a\x00b",
    "\x00",
    "line\nbreak",
    "a\x01b\x02c",
    "\x01\x02",
    "é漢字🚀",
    "\u202e\ufeff",
    " ",
    "*",
    "||",
    "TagA || TagB",
    "a = 'b' AND (",
    "color = 'red' AND size > 3",
    "%RETRY%",
    "%DLQ%",
    "TBW102",
    "SCHEDULE_TOPIC_XXXX",
    "RMQ_SYS_TRANS_HALF_TOPIC",
    "%DLQ%SYS_SCHEDULE",
    "../../etc/passwd",
    "127.0.0.1:1",
    "host:99999",
    ":",
    "[::1]:0",
    "-1",
    "NaN",
    "T" * 128,
    "G" * 121,
)
#: Characters of random strings: printable, control, separators and non-ASCII.
ALPHABET: Final = "abcXYZ019_-%|*: =()'\"\\\x00\x01\x02\n\t\x7féß漢🚀\u202e"
WIRE_BREAKERS: Final = (b"\x07", b"\x0f\x00", b"\x08\xff\xff\xff", b"\x12\x7f", b"\x00", b"\x0b")


# -- the protocol ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rpc:
    """One method of the internal protocol."""

    service: str
    name: str
    method: MethodDescriptor

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"

    @property
    def key(self) -> str:
        return f"{self.service}/{self.name}"

    @property
    def streaming_in(self) -> bool:
        return bool(self.method.client_streaming)

    @property
    def streaming_out(self) -> bool:
        return bool(self.method.server_streaming)


def protocol_modules() -> list[Any]:
    """Every generated ``*_pb2`` module of ``apogee.v1``."""
    return [
        importlib.import_module(f"apogee.v1.{m.name}")
        for m in pkgutil.iter_modules(apogee.v1.__path__)
        if m.name.endswith("_pb2")
    ]


def all_rpcs() -> list[Rpc]:
    """Every method of every service in the generated descriptors, sorted by path."""
    out = [
        Rpc(service.full_name, method.name, method)
        for module in protocol_modules()
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]
    return sorted(out, key=lambda r: r.path)


# -- hostile input -----------------------------------------------------------------------------


@dataclass
class Known:
    """Names and numbers that exist in the cluster, so that fuzzed calls reach the core."""

    strings: dict[str, list[str]] = field(default_factory=dict)
    ints: list[int] = field(default_factory=list)

    def for_field(self, name: str) -> list[str]:
        return self.strings.get(name, [])


def message_type(f: FieldDescriptor) -> Descriptor | None:
    """The message type of a message field that is not a map (None for the others)."""
    t = f.message_type if f.type == FieldDescriptor.TYPE_MESSAGE else None
    return None if t is None or t.GetOptions().map_entry else t


def map_entry(f: FieldDescriptor) -> Descriptor | None:
    """The entry type of a map field (None for the others)."""
    t = f.message_type if f.type == FieldDescriptor.TYPE_MESSAGE else None
    return t if t is not None and t.GetOptions().map_entry else None


class Hostile:
    """Builds hostile requests from descriptors with one seeded ``random.Random``: each field
    set or not, and set to empty, 10,000-character (and 3,000 CJK characters), control-character
    (``\x00``, ``\n``, ``\x01``, ``\x02``) and non-ASCII strings, names reserved or malformed,
    the limits of its integer type (int64 min and max, uint64 max), NaN and infinities, unknown
    enum numbers, 0, 1, a few or 1,000 repeated items (then small ones), nested messages up to
    :attr:`MAX_DEPTH` levels, empty, zero, random and few-KB bytes, and for a field named
    ``records`` send records (fields hostile or fine, the block mutated or not).

    ``tame`` (chosen per request) is the share of fields that get plausible values instead
    (names from :class:`Known`, small numbers, defined enum values): a wild request is refused
    at its first field, a tame one gets past the checks into the core with a few hostile values
    left."""

    MAX_DEPTH: Final = 3

    def __init__(self, rng: random.Random, known: Known) -> None:
        self.rng = rng
        self.known = known
        self.tame = rng.choice((0.2, 0.5, 0.9))

    def message(self, desc: Descriptor, depth: int = 0, small: bool = False) -> Message:
        msg: Message = GetMessageClass(desc)()
        if depth > self.MAX_DEPTH:
            return msg
        chosen_oneof = {o.name: self.rng.choice([*o.fields, None]) for o in desc.oneofs if o.fields}
        for f in desc.fields:
            oneof = f.containing_oneof
            if (
                oneof is not None
                and len(oneof.fields) > 1
                and chosen_oneof.get(oneof.name) is not f
            ):
                continue
            if self.rng.random() < (0.1 if self.tame > 0.5 else 0.25):
                continue  # left unset
            self._fill(msg, f, depth, small)
        return msg

    def _fill(self, msg: Message, f: FieldDescriptor, depth: int, small: bool) -> None:
        entry = map_entry(f)
        if entry is not None:
            self._fill_map(msg, f.name, entry, depth, small)
            return
        nested = message_type(f)
        if f.is_repeated:
            count = self.count(small)
            small = small or count > 3
            target = getattr(msg, f.name)
            for _ in range(count):
                if nested is not None:
                    target.add().CopyFrom(self.message(nested, depth + 1, small))
                else:
                    target.append(self.scalar(f, small))
            return
        if nested is not None:
            getattr(msg, f.name).CopyFrom(self.message(nested, depth + 1, small))
        else:
            setattr(msg, f.name, self.scalar(f, small))

    def _fill_map(
        self, msg: Message, name: str, entry: Descriptor, depth: int, small: bool
    ) -> None:
        key_f = entry.fields_by_name["key"]
        value_f = entry.fields_by_name["value"]
        nested = message_type(value_f)
        count = self.count(small)
        small = small or count > 3
        target = getattr(msg, name)
        for _ in range(count):
            key = self.scalar(key_f, small)
            if nested is not None:
                target[key].CopyFrom(self.message(nested, depth + 1, small))
            else:
                target[key] = self.scalar(value_f, small)

    def count(self, small: bool) -> int:
        """How many items a repeated field gets: 0, 1, a few or 1,000 (then each is small, and
        so is everything inside it)."""
        if small:
            return self.rng.choice((0, 1, 2))
        if self.rng.random() < self.tame:
            return self.rng.choice((1, 1, 2, 3))
        return self.rng.choice((0, 1, 2, 3, 1000))

    def scalar(self, f: FieldDescriptor, small: bool = False) -> Any:
        t = f.type
        rng = self.rng
        if t in INT_RANGES:
            return self.integer(*INT_RANGES[t])
        if t == FieldDescriptor.TYPE_BOOL:
            return rng.random() < 0.5
        if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            return rng.choice(FLOATS)
        if t == FieldDescriptor.TYPE_ENUM:
            assert f.enum_type is not None
            known = [v.number for v in f.enum_type.values]
            if rng.random() < self.tame:
                return rng.choice(known[1:] or known)  # a defined value, not the zero one
            return rng.choice([*known, 7, 99, -1, 2**31 - 1, -(2**31)])
        if t == FieldDescriptor.TYPE_STRING:
            return self.string(f.name, small)
        if t == FieldDescriptor.TYPE_BYTES:
            return self.bytes_(f.name, small)
        raise AssertionError(f"field {f.full_name}: type {t} is not fuzzed; add it")

    def integer(self, lo: int, hi: int) -> int:
        rng = self.rng
        roll = rng.random()
        if roll < self.tame / 2 and self.known.ints:
            return min(hi, max(lo, rng.choice(self.known.ints)))
        if roll < self.tame:
            return min(hi, max(lo, rng.randint(-3, 40)))
        if roll < (1 + self.tame) / 2:
            pool = [lo, hi, lo + 1, hi - 1, 0, 1, -1, 2, 3, 7, 1000, 2**31 - 1, -(2**31)]
            pool += [2**32 - 1, 2**53 + 1, 2**63 - 1, -(2**63), 2**64 - 1]
            return rng.choice([v for v in pool if lo <= v <= hi])
        return rng.randint(lo, hi)

    def string(self, name: str, small: bool) -> str:
        rng = self.rng
        known = self.known.for_field(name)
        roll = rng.random()
        if known and roll < self.tame:
            return rng.choice(known)
        if roll < (1 + self.tame) / 2:
            s = rng.choice(HOSTILE_STRINGS)
            return s[:64] if small else s
        length = rng.choice((1, 2, 5, 17) if small else (1, 5, 17, 64, 300))
        return "".join(rng.choices(ALPHABET, k=length))

    def bytes_(self, name: str, small: bool) -> bytes:
        rng = self.rng
        if name == "records" and not small and rng.random() < 0.7:
            return self.send_records()
        choice = rng.randrange(5)
        if choice == 0:
            return b""
        if choice == 1:
            return b"\x00" * rng.randint(1, 64)
        if choice == 2 or small:
            return rng.randbytes(rng.randint(1, 32))
        if choice == 3:
            return rng.randbytes(rng.randint(2048, 6144))
        return b"x"

    def send_records(self) -> bytes:
        """A few send records (fields hostile or fine), the block mutated or not."""
        rng = self.rng
        topics = self.known.for_field("topic")[:1] or ["T"]
        block = bytearray()
        for _ in range(rng.choice((1, 1, 2, 3))):
            topic = rng.choice((*topics, *topics, "TBW102", "bad topic", "", "T" * 128))
            props = encode_properties(
                rng.choice((None, "TagA", "a\x01b")),
                rng.choice(((), ("k1",), ("a b", ""))),
                rng.choice(("", "ID1", "x" * 300, "a\x02b")),
                rng.choice((None, {"p": "v"}, {"REAL_TOPIC": "X"}, {"": "v"})),
            )
            if rng.random() < 0.2:
                props += rng.randbytes(rng.randint(1, 40))
            block += encode_send_record(
                topic.encode(),
                rng.choice((b"body", b"", rng.randbytes(rng.randint(1, 3000)), b"x\x9c\x03\x00")),
                props,
                queue_id=self.integer(*INT32),
                flag=self.integer(*INT32),
                sys_flag=rng.choice((0, 1, 2, 4, 0x7FFFFFFF, -1)),
                born_timestamp=self.integer(*INT64),
                delay_level=rng.choice((0, 0, 1, 18, 19, -1, 2**31 - 1)),
                deliver_at_ms=rng.choice((0, 0, 1, int(time.time() * 1000) + 2000, -1, 2**63 - 1)),
            )
        mutation = rng.randrange(6)
        if mutation == 1 and block:
            block[rng.randrange(len(block))] ^= 1 << rng.randrange(8)
        elif mutation == 2:
            del block[rng.randrange(len(block)) :]
        elif mutation == 3:
            block += rng.randbytes(rng.randint(1, 100))
        elif mutation == 4:
            struct.pack_into("<i", block, 0, rng.choice((0, -1, 2**31 - 1, 4, 8)))
        return bytes(block)


def unparsable(rng: random.Random, desc: Descriptor) -> bytes:
    """Bytes that do not parse as ``desc``'s message (random bytes ending in a broken tag)."""
    cls = GetMessageClass(desc)
    for _ in range(100):
        data = rng.randbytes(rng.randint(0, 48)) + rng.choice(WIRE_BREAKERS)
        try:
            cls.FromString(data)
        except DecodeError:
            return data
    raise AssertionError(f"no unparsable bytes for {desc.full_name} in 100 tries")


@dataclass
class Call:
    """What one fuzzed call sends: reproducible from (seed, method, index) alone."""

    rpc: Rpc
    seed: int
    index: int
    kind: str  # "unparsable", "random bytes" or "hostile"
    payloads: list[bytes]

    @property
    def where(self) -> str:
        return f"{self.rpc.key} #{self.index} (seed {self.seed}, {self.kind})"

    def parsed(self) -> list[Message | None]:
        """Each payload as the method's request (None: it does not parse)."""
        cls = GetMessageClass(self.rpc.method.input_type)
        out: list[Message | None] = []
        for payload in self.payloads:
            try:
                out.append(cls.FromString(payload))
            except DecodeError:
                out.append(None)
        return out

    def describe(self, limit: int = 1500) -> str:
        """What was sent, message by message (bytes in hex, requests in text form)."""
        if not self.payloads:
            return "  no message: the stream was closed at once"
        parts = []
        for i, (payload, msg) in enumerate(zip(self.payloads, self.parsed(), strict=True)):
            text = f"bytes {payload[:300].hex()}{'...' if len(payload) > 300 else ''}"
            if msg is not None:
                text = ("" if self.kind == "hostile" else text + " = ") + (
                    text_format.MessageToString(msg, as_one_line=True)
                )
            cut = text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
            parts.append(f"  message {i} ({len(payload)} bytes): {cut}")
        return "\n".join(parts)

    def holds(self) -> bool:
        """Whether a request asks to be held (a ``hold_ms`` above 0 anywhere in it): only such
        a call may run into its deadline."""
        return any(msg is not None and _has_hold(msg) for msg in self.parsed())


def _has_hold(msg: Message) -> bool:
    for f, value in msg.ListFields():
        if f.name == "hold_ms" and not f.is_repeated and value > 0:
            return True
        if message_type(f) is not None:
            values = value if f.is_repeated else [value]
            if any(_has_hold(v) for v in values):
                return True
    return False


def build_call(rpc: Rpc, seed: int, index: int, known: Known) -> Call:
    """Call ``index`` of ``rpc``: every 8th sends bytes that do not parse (on a stream, after
    hostile messages), the next random bytes, the others hostile requests (a stream gets 0 to 4
    messages)."""
    rng = random.Random(f"{seed}/{rpc.key}/{index}")
    kind = {0: "unparsable", 1: "random bytes"}.get(index % 8, "hostile")
    count = rng.choice((0, 1, 2, 3, 4)) if rpc.streaming_in else 1  # 0: closed at once
    if kind == "unparsable":
        count = max(count, 1)
    desc = rpc.method.input_type
    hostile = Hostile(rng, known)
    payloads = []
    for i in range(count):
        if kind == "unparsable" and i == count - 1:
            payloads.append(unparsable(rng, desc))
        elif kind == "random bytes":
            payloads.append(rng.randbytes(rng.choice((1, 3, 16, 200, 3000))))
        else:
            payloads.append(hostile.message(desc).SerializeToString())
    return Call(rpc, seed, index, kind, payloads)


# -- calling -----------------------------------------------------------------------------------


@dataclass
class Answer:
    code: grpc.StatusCode
    details: str
    kind: str | None
    responses: list[bytes]
    seconds: float
    hung: bool = False

    @property
    def lost(self) -> bool:
        """Whether the status is grpcio's own, not the server's: a client still writing a
        request stream when the server ends the call sometimes fails the write and reports
        INTERNAL "Internal error from Core" in place of the status the server sent."""
        return (
            self.code == grpc.StatusCode.INTERNAL
            and self.details == "Internal error from Core"
            and self.kind is None
        )


async def _paced(payloads: list[bytes]) -> AsyncIterator[bytes]:
    """A request stream with a moment between messages, in which the client can learn that the
    server ended the call (see :attr:`Answer.lost`)."""
    for i, payload in enumerate(payloads):
        if i:
            await asyncio.sleep(0.005)
        yield payload


def _kind(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == KIND_KEY:
            return value if isinstance(value, str) else bytes(value).decode()
    return None


async def send(channel: grpc.aio.Channel, call: Call) -> Answer:
    """Make ``call`` on ``channel``: the status, its details and kind, the raw responses."""
    rpc = call.rpc
    start = time.monotonic()
    responses: list[bytes] = []
    grpc_call: Any = None
    try:
        async with asyncio.timeout(CALL_TIMEOUT + HANG_GRACE):
            if rpc.streaming_in and rpc.streaming_out:
                bidi: grpc.aio.StreamStreamMultiCallable[bytes, bytes] = channel.stream_stream(
                    rpc.path
                )
                grpc_call = bidi(_paced(call.payloads), timeout=CALL_TIMEOUT)
            elif rpc.streaming_in:
                upload: grpc.aio.StreamUnaryMultiCallable[bytes, bytes] = channel.stream_unary(
                    rpc.path
                )
                grpc_call = upload(_paced(call.payloads), timeout=CALL_TIMEOUT)
            elif rpc.streaming_out:
                download: grpc.aio.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(
                    rpc.path
                )
                grpc_call = download(call.payloads[0], timeout=CALL_TIMEOUT)
            else:
                unary: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
                    rpc.path
                )
                grpc_call = unary(call.payloads[0], timeout=CALL_TIMEOUT)
            try:
                if rpc.streaming_out:
                    async for r in grpc_call:
                        responses.append(r)
                else:
                    responses.append(await grpc_call)
            except grpc.aio.AioRpcError:
                pass  # the status is read below
            return Answer(
                await grpc_call.code(),
                await grpc_call.details() or "",
                _kind(await grpc_call.trailing_metadata()),
                responses,
                time.monotonic() - start,
            )
    except TimeoutError:
        if grpc_call is not None:
            grpc_call.cancel()
        return Answer(
            grpc.StatusCode.DEADLINE_EXCEEDED, "", None, responses, time.monotonic() - start, True
        )


def check_answer(call: Call, answer: Answer) -> list[str]:
    """What is wrong with ``answer`` (nothing: an empty list)."""
    problems: list[str] = []
    code = answer.code
    if answer.hung:
        problems.append(
            f"no answer within {CALL_TIMEOUT + HANG_GRACE:.0f}s: the call outlived its "
            f"{CALL_TIMEOUT:.0f}s deadline"
        )
    elif code == grpc.StatusCode.UNKNOWN:
        problems.append(f"status UNKNOWN: {answer.details!r}")
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED and not call.holds():
        problems.append(
            f"DEADLINE_EXCEEDED after {answer.seconds:.1f}s, though no request asked to be held "
            f"({answer.details!r})"
        )
    elif code != grpc.StatusCode.OK and not answer.details.strip():
        problems.append(f"status {code.name} without details")
    elif code not in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED) and not answer.kind:
        problems.append(
            f"status {code.name} without an Apogee error kind (not the server's own answer): "
            f"{answer.details[:300]!r}"
        )
    if code == grpc.StatusCode.INTERNAL:
        problems.append(f"status INTERNAL (a handler failed): {answer.details!r}")
    refused = code == grpc.StatusCode.INVALID_ARGUMENT and answer.kind == "INVALID_ARGUMENT"
    if call.kind == "unparsable" and not call.rpc.streaming_in and not refused:
        problems.append(
            f"bytes that do not parse got {code.name} (kind {answer.kind}), "
            f"not INVALID_ARGUMENT: {answer.details!r}"
        )
    out_cls = GetMessageClass(call.rpc.method.output_type)
    for i, raw in enumerate(answer.responses):
        try:
            resp = out_cls.FromString(raw)
        except DecodeError as err:
            problems.append(f"response {i} does not parse as {out_cls.DESCRIPTOR.full_name}: {err}")
            continue
        for path, status in _statuses(resp, "response"):
            if status.code == grpc.StatusCode.UNKNOWN.value[0]:
                problems.append(f"{path}: status UNKNOWN: {status.message!r}")
            elif status.code == grpc.StatusCode.INTERNAL.value[0]:
                problems.append(f"{path}: status INTERNAL (a handler failed): {status.message!r}")
            elif status.code != 0 and not status.message.strip():
                problems.append(f"{path}: status {status.code} without a message")
    return problems


def _statuses(msg: Message, path: str) -> Iterator[tuple[str, Any]]:
    """Every ``apogee.v1.Status`` inside ``msg``, with where it is."""
    if msg.DESCRIPTOR.full_name == "apogee.v1.Status":
        yield path, msg
        return
    for f, value in msg.ListFields():
        if message_type(f) is None:
            continue
        if f.is_repeated:
            for i, v in enumerate(value):
                yield from _statuses(v, f"{path}.{f.name}[{i}]")
        else:
            yield from _statuses(value, f"{path}.{f.name}")
