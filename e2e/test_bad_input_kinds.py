"""The kinds of bad input that :mod:`e2e.test_bad_input` sends, as tables, and a test that the
tables cover every rule the codec names.

Each kind is sent one way or several ways:

- through the SDK (:class:`Case`): a :class:`~apogee.client.Message` the producer refuses before
  sending, or the broker refuses with the sentence the producer passes on;
- as a protobuf message of a raw ``apogee.v1.Broker/SendMessages`` request (:class:`RawCase`),
  which reaches the broker's message path with whatever a caller put in it (its own unique id,
  any system flag, any time);
- as a send record of a raw request (:class:`RecordCase`): the bytes the SDK would send had it
  not refused the message first, which reach the broker's record path;
- as a request that fails as a whole (:class:`RequestCase`);
- as arguments of the ``apogee`` command (:class:`CliCase`), run against the cluster.

The groups: properties only brokers set, and a message's own fields as properties; every ASCII
control character (0x00-0x1F, 0x7F) in a property name; unique ids too long or unprintable;
bodies flagged compressed that are not one zlib stream of 1 byte to the maximum; delivery times,
delay levels and born timestamps out of range; topics, queues, keys and tags. A fragment of a
sentence may hold ``{i}``: the message's place in its request.
"""

from __future__ import annotations

import gzip
import math
import random
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import grpc
import pytest

from apogee.client import Message
from apogee.codec import BROKER_PREFIXES, BROKER_PROPERTIES, MAX_UNIQUE_ID, OWN_FIELDS
from apogee.codec.send import encode_properties, encode_send_record
from apogee.v1 import broker_pb2, common_pb2
from e2e.harness import SHARED_MAX_MESSAGE_SIZE, MiB

pytestmark = [pytest.mark.e2e]

TOPIC: Final = "E2EInput"
QUEUES: Final = 8
UNKNOWN: Final = "E2ENoSuchTopic"
LONG_TOPIC: Final = "T" * 128
TOO_LARGE: Final = SHARED_MAX_MESSAGE_SIZE + 1
BIG_PROPERTIES: Final = {"note": "p" * 40_000}
DAY_S: Final = 86_400
DAY_MS: Final = DAY_S * 1000
INT64_MAX: Final = (1 << 63) - 1
#: an hour past the brokers' cap on delivery times (timer_max_delay_s, 7 days)
PAST_CAP_MS: Final = 7 * DAY_MS + 3_600_000
INT64_MIN: Final = -(1 << 63)

#: Every name only brokers may set: each of BROKER_PROPERTIES, and one under each prefix.
BROKER_ONLY: Final = [*sorted(BROKER_PROPERTIES), *(f"{p}ANYTHING" for p in BROKER_PREFIXES)]
#: The names a message's own fields (tags, keys, unique id) are kept under.
OWN: Final = sorted(OWN_FIELDS)
#: Every ASCII control character; the first two are the separators of the properties' text.
CONTROL: Final = [*map(chr, range(0x20)), "\x7f"]
SEPARATORS: Final = ("\x01", "\x02")

ARG: Final = "INVALID_ARGUMENT"
PROP: Final = "INVALID_PROPERTY"
#: a message's place in its request, in a sentence
MSG: Final = "messages[{i}]"
BROKERS_ONLY_RULE: Final = (
    "is set by brokers only; use the message's delay_level or deliver_at_ms for a delayed message"
)
SDK_BROKERS_ONLY_RULE: Final = (
    "is set by brokers only; use Message.delay_level or Message.deliver_at for a delayed message"
)
OWN_RULE: Final = "is reserved; use the message's tags, keys or unique id"
SDK_OWN_RULE: Final = "is reserved; use Message.tags, Message.keys or the message id"
TWICE_RULE: Final = "appears more than once; a message has one"
CONTROL_RULE: Final = "a property name must not contain control characters, got"
SEPARATOR_RULE: Final = "a property name must be non-empty, without \\x01 or \\x02"
VALUE_RULE: Final = "a value must not contain \\x01 or \\x02"
ID_RULE: Final = "unique_id: must not contain spaces or control characters"
COMPRESSED: Final = f"{MSG}.body: is flagged compressed (sys_flag 0x1) but "
NOT_ZLIB: Final = "does not inflate with zlib (Error -3 while decompressing data: "
TOO_BIG: Final = f"inflates to more than {SHARED_MAX_MESSAGE_SIZE} bytes (max_message_size)"
DELAY_RULE: Final = "must be between 1 and 18, the levels of this broker's delay table"
AT_RULE: Final = f"{MSG}.deliver_at_ms: must be a time in ms since the epoch (0: none), got"
AHEAD_RULE: Final = "days ahead; the maximum is 7 days (604800 s, the broker's timer_max_delay_s)"
BOTH_RULE: Final = f"{MSG}: delay_level and deliver_at_ms are both set; give one or the other"
SDK_TIME_RULE: Final = "deliver_at: must be a time from 1970-01-01 to 9999-12-31 UTC, got"
BORN_RULE: Final = "born_timestamp: must be an integer from 0 to 9223372036854775807, got"
SYS_FLAG_RULE: Final = f"{MSG}.sys_flag: only bit 0x1 (body compressed with zlib) may be set"
TIME_RULE: Final = "must be a time from 1970-01-01 to 9999-12-31 UTC"


@dataclass(frozen=True)
class Case:
    """A message sent through the SDK and what must come back: the error kind, its gRPC status
    code and fragments of the sentence (the field and the rule)."""

    name: str
    message: Callable[[], Message]
    kind: str
    code: str
    says: tuple[str, ...]


@dataclass(frozen=True)
class RawCase:
    """A protobuf message of a raw send request (or what makes it when it is sent: a time
    relative to now) and the status it must get."""

    name: str
    message: common_pb2.Message | Callable[[], common_pb2.Message]
    kind: str
    code: grpc.StatusCode
    says: tuple[str, ...]


@dataclass(frozen=True)
class RecordCase:
    """A send record of a raw send request (or what makes it when it is sent) and the status
    it must get."""

    name: str
    record: bytes | Callable[[], bytes]
    kind: str
    code: grpc.StatusCode
    says: tuple[str, ...]


@dataclass(frozen=True)
class RequestCase:
    """A raw send request that fails as a whole: INVALID_ARGUMENT, the kind in the trailer."""

    name: str
    request: Callable[[], broker_pb2.SendMessagesRequest]
    says: str


@dataclass(frozen=True)
class CliCase:
    """Arguments of ``apogee --namesrv <cluster>``: the exit status and the last line's words."""

    name: str
    argv: tuple[str, ...]
    status: int
    says: str


# -- builders ------------------------------------------------------------------------------------


def sdk_case(name: str, kind: str, says: str, body: bytes = b"bad-sdk", **fields: Any) -> Case:
    """A message made when it is sent (a value given as a function is called then)."""

    def make() -> Message:
        return Message(TOPIC, body, **{k: v() if callable(v) else v for k, v in fields.items()})

    return Case(name, make, kind, ARG, (says,))


def pb(topic: str = TOPIC, body: bytes = b"bad-raw", **fields: Any) -> common_pb2.Message:
    return common_pb2.Message(topic=topic, body=body, **fields)


def raw(
    name: str, message: common_pb2.Message | Callable[[], common_pb2.Message], kind: str, *says: str
) -> RawCase:
    return RawCase(name, message, kind, grpc.StatusCode.INVALID_ARGUMENT, says)


def record(
    uid: str = "BAD-RECORD",
    *,
    body: bytes = b"bad-record",
    topic: str = TOPIC,
    properties: dict[str, str] | None = None,
    raw_properties: bytes | None = None,
    queue_id: int = 0,
    sys_flag: int = 0,
    born: int = 0,
    delay: int = 0,
    at: int = 0,
) -> bytes:
    """A send record as a producer lays it out, but with any property (own field names too),
    or ``raw_properties``: the properties' text as given, however malformed."""
    props = raw_properties
    if props is None:
        props = encode_properties(None, (), uid, None)
        props += "".join(f"{k}\x01{v}\x02" for k, v in (properties or {}).items()).encode()
    return bytes(
        encode_send_record(topic.encode(), body, props, queue_id, 0, sys_flag, born, delay, at)
    )


def rec(name: str, data: bytes | Callable[[], bytes], kind: str, *says: str) -> RecordCase:
    return RecordCase(name, data, kind, grpc.StatusCode.INVALID_ARGUMENT, says)


def ahead_ms(ms: int) -> int:
    """A delivery time ``ms`` from now (called as the message is sent)."""
    return time.time_ns() // 1_000_000 + ms


def named(c: str) -> str:
    """A property name holding control character ``c``."""
    return f"ctl{c}name"


# -- shared by several ways ----------------------------------------------------------------------

HELLO: Final = zlib.compress(b"hello, compressed")
#: 64 bytes no zlib stream starts with (fixed: the same bytes every run)
NOISE: Final = random.Random(137).randbytes(64)

#: (what, a body flagged compressed, the sentence's end after COMPRESSED)
COMPRESSION: Final = [
    ("random bytes", NOISE, NOT_ZLIB),
    ("plain text", b"plain text, never compressed", f"{NOT_ZLIB}incorrect header check)"),
    ("a gzip stream", gzip.compress(b"hello"), NOT_ZLIB),
    ("a raw deflate stream", HELLO[2:-4], NOT_ZLIB),
    ("a wrong checksum", HELLO[:-1] + bytes([HELLO[-1] ^ 0xFF]), f"{NOT_ZLIB}incorrect data"),
    ("a truncated stream", HELLO[:-3], "ends before its zlib stream does"),
    ("only the zlib header", HELLO[:2], "ends before its zlib stream does"),
    ("trailing junk", HELLO + b"junk", "has 4 bytes after its zlib stream"),
    ("two streams", HELLO + HELLO, f"has {len(HELLO)} bytes after its zlib stream"),
    ("one byte more than the maximum", zlib.compress(b"z" * TOO_LARGE), TOO_BIG),
    ("a bomb of 16 MiB in 16 KiB", zlib.compress(bytes(16 * MiB), 9), TOO_BIG),
    ("a stream of nothing", zlib.compress(b""), "inflates to 0 bytes; a body must not be empty"),
]

#: (what, a unique id, the sentence)
IDS: Final = [
    ("129 characters", "u" * 129, "unique_id: is 129 characters; at most 128 are allowed"),
    ("10,000 characters", "u" * 10_000, "unique_id: is 10000 characters; at most 128 are allowed"),
    ("a space", "two words", ID_RULE),
    ("a leading space", " lead", ID_RULE),
    ("one space only", " ", ID_RULE),
    ("a tab", "tab\there", ID_RULE),
    ("a newline", "new\nline", ID_RULE),
    ("a carriage return", "cr\r", ID_RULE),
    ("a NUL", "nul\x00", ID_RULE),
    ("an escape sequence", "esc\x1b[0m", ID_RULE),
    ("a DEL", "del\x7f", ID_RULE),
]
#: ids only a protobuf message can carry (in a record, a separator ends the id)
SEPARATOR_IDS: Final = [("a \\x01", "sep\x01arated", ID_RULE), ("a \\x02", "sep\x02x", ID_RULE)]


# -- through the SDK -----------------------------------------------------------------------------

SDK_KINDS: Final = [
    *(
        sdk_case(f"broker-only property {n}", PROP, f"property {n!r}: {SDK_BROKERS_ONLY_RULE}",
                 properties={n: "v"})
        for n in BROKER_ONLY
    ),
    *(
        sdk_case(f"own field {n} as a property", PROP, f"property {n!r}: {SDK_OWN_RULE}",
                 properties={n: "forged"})
        for n in OWN
    ),
    *(
        sdk_case(f"property name with {c!r}", PROP, f"property {named(c)!r}: {CONTROL_RULE} {c!r}",
                 properties={named(c): "v"})
        for c in "\x00\t\n\r\x1b\x7f"
    ),
    *(
        sdk_case(f"property name with {c!r}", PROP, f"property {named(c)!r}: {SEPARATOR_RULE}",
                 properties={named(c): "v"})
        for c in SEPARATORS
    ),
    sdk_case("empty property name", PROP, f"property '': {SEPARATOR_RULE}", properties={"": "v"}),
    sdk_case("separator in a value", PROP, f"property 'n': {VALUE_RULE}", properties={"n": "\x02"}),
    sdk_case("a value not a str", PROP, "property 'n': a value must be a str, got int",
             properties={"n": 3}),
    sdk_case("separator in the tags", PROP, f"property 'tags': {VALUE_RULE}", tags="a\x01b"),
    sdk_case("a key with a space", PROP, "property 'keys': key 'a b' must be non-empty, without",
             keys=["a b"]),
    sdk_case("an empty key", PROP, "property 'keys': key '' must be non-empty", keys=["k", ""]),
    sdk_case("a body that is text", ARG, "body: must be bytes, got str", body="text"),  # type: ignore[arg-type]
    # delivery times: the SDK takes 1970 to 9999, the broker at most 7 days ahead
    sdk_case("deliver_at before 1970", ARG, f"{SDK_TIME_RULE} -1.0", deliver_at=-1.0),
    sdk_case("deliver_at in 1900", ARG, f"{SDK_TIME_RULE} 1900-01-01T00:00:00+00:00",
             deliver_at=datetime(1900, 1, 1, tzinfo=UTC)),
    sdk_case("deliver_at in 33658", ARG, f"{SDK_TIME_RULE} 1000000000000000.0", deliver_at=1e15),
    *(
        sdk_case(f"deliver_at {v!r}", ARG, f"deliver_at: must be a finite number of seconds, "
                 f"got {v!r}", deliver_at=v)
        for v in (math.nan, math.inf, -math.inf)
    ),
    sdk_case("deliver_at a naive datetime", ARG, "deliver_at: a datetime must be timezone-aware",
             deliver_at=datetime(2030, 1, 1)),  # naive on purpose
    sdk_case("deliver_at a string", ARG, "deliver_at: must be a timezone-aware datetime or "
             "seconds since the epoch, got str", deliver_at="tomorrow"),
    sdk_case("deliver_at 7 days and an hour ahead", ARG, f"7.04 {AHEAD_RULE}",
             deliver_at=lambda: time.time() + 7 * DAY_S + 3600),
    sdk_case("deliver_at the last millisecond of 9999", ARG, AHEAD_RULE,
             deliver_at=datetime(9999, 12, 31, 23, 59, 59, 999_000, tzinfo=UTC)),
    sdk_case("deliver_at and a delay level", ARG, "deliver_at: cannot be combined with "
             "delay_level (3); set one of them", delay_level=3, deliver_at=time.time),
    *(
        sdk_case(f"delay level {v!r}", ARG, f"delay_level: must be an integer from 0 to 18, got "
                 f"{v!r}", delay_level=v)
        for v in (-1, 2**31, True, 1.5, "3")
    ),
]  # fmt: skip


# -- raw protobuf messages -----------------------------------------------------------------------

RAW_RESERVED: Final = [
    *(
        raw(f"broker-only property {n}", pb(properties={"ok": "1", n: "v"}), PROP,
            f"property {n!r}: {BROKERS_ONLY_RULE}")
        for n in BROKER_ONLY
    ),
    *(
        raw(f"own field {n} as a property", pb(properties={n: "forged"}), PROP,
            f"property {n!r}: {OWN_RULE}")
        for n in OWN
    ),
]  # fmt: skip

RAW_NAMES: Final = [
    *(
        raw(f"property name with {c!r}", pb(properties={named(c): "v"}), PROP,
            f"property {named(c)!r}: {CONTROL_RULE} {c!r}")
        for c in CONTROL
    ),
    raw("empty property name", pb(properties={"": "v"}), PROP, f"property '': {SEPARATOR_RULE}"),
    raw("separator \\x02 in a value", pb(properties={"n": "\x02"}), PROP, f"'n': {VALUE_RULE}"),
]  # fmt: skip

RAW_IDS: Final = [
    raw(f"unique id of {what}", pb(unique_id=uid), ARG, says)
    for what, uid, says in [*IDS, *SEPARATOR_IDS]
]

RAW_COMPRESSION: Final = [
    *(
        raw(f"compressed body: {what}", pb(body=body, sys_flag=1), ARG, COMPRESSED + end)
        for what, body, end in COMPRESSION
    ),
    raw("empty body flagged compressed", pb(body=b"", sys_flag=1), ARG, f"{MSG}.body: must not"),
    *(raw(f"system flag {f:#x}", pb(sys_flag=f), ARG, f"{SYS_FLAG_RULE}, got {f:#x}")
      for f in (0x5, -1, -(2**31))),
]  # fmt: skip

RAW_TIMES: Final = [
    *(raw(f"deliver_at_ms {at}", pb(deliver_at_ms=at), ARG, f"{AT_RULE} {at}")
      for at in (-1, -DAY_MS, INT64_MIN)),
    raw("deliver_at_ms 7 days and an hour ahead",
        lambda: pb(deliver_at_ms=ahead_ms(PAST_CAP_MS)), ARG,
        f"{MSG}.deliver_at_ms: is 7.04 {AHEAD_RULE}"),
    raw("deliver_at_ms in 9999", pb(deliver_at_ms=253_402_300_799_999), ARG,
        f"{MSG}.deliver_at_ms: is ", AHEAD_RULE),
    raw("deliver_at_ms the largest int64", pb(deliver_at_ms=INT64_MAX), ARG,
        f"{MSG}.deliver_at_ms: is ", AHEAD_RULE),
    raw("deliver_at_ms and a delay level",
        lambda: pb(delay_level=3, deliver_at_ms=ahead_ms(60_000)), ARG, BOTH_RULE),
    *(raw(f"delay level {v}", pb(delay_level=v), ARG, f"{MSG}.delay_level {v}: {DELAY_RULE}")
      for v in (-1, 2**31 - 1, -(2**31))),
    *(raw(f"born timestamp {v}", pb(born_timestamp_ms=v), ARG, f"{BORN_RULE} {v}")
      for v in (-1, INT64_MIN)),
]  # fmt: skip

RAW_OTHER: Final = [
    RawCase("empty topic", pb(""), "INVALID_TOPIC", grpc.StatusCode.INVALID_ARGUMENT,
            ("topic '': must not be empty",)),
    RawCase("newline in the topic", pb("E2E\nInput"), "INVALID_TOPIC",
            grpc.StatusCode.INVALID_ARGUMENT,
            ("topic 'E2E\\nInput': has a character outside [%|a-zA-Z0-9_-]",)),
    RawCase("negative queue id", pb(queue_id=-1), "INVALID_QUEUE_ID",
            grpc.StatusCode.INVALID_ARGUMENT, (f"queue_id -1: must be between 0 and {QUEUES - 1}",
                                               )),
    raw("a key with a space", pb(keys=["a b"]), PROP, "property 'keys': key 'a b' must be"),
    raw("an empty key", pb(keys=["k", ""]), PROP, "property 'keys': key '' must be non-empty"),
    raw("separator in the tags", pb(tags="a\x02b"), PROP, f"property 'tags': {VALUE_RULE}"),
    raw("a born host not ip:port", pb(born_host="nowhere"), PROP, "'born_host': 'nowhere' is "
        "not ip:port"),
]  # fmt: skip

#: Messages on the good side of each rule's edge: stored, and read back as sent.
RAW_EDGES: Final[list[tuple[str, Callable[[str], common_pb2.Message]]]] = [
    (f"a unique id of exactly {MAX_UNIQUE_ID} characters",
     lambda b: pb(body=b"good-edge-id", unique_id=f"EDGE-{b}-".ljust(MAX_UNIQUE_ID, "u"))),
    ("a delivery time in 1970, long past: delivered at once",
     lambda b: pb(body=b"good-edge-past", deliver_at_ms=1)),
    ("a compressed body that inflates to exactly the maximum",
     lambda b: pb(body=zlib.compress(b"g" * SHARED_MAX_MESSAGE_SIZE), sys_flag=1)),
    ("control characters in a value: only names are ruled",
     lambda b: pb(body=b"good-edge-value", properties={"note": "two\nlines\ttab\x00"})),
    ("names near the brokers' own: ORIGIN_MSG_ID, a prefix inside a name",
     lambda b: pb(body=b"good-edge-names", properties={"ORIGIN_MSG_ID": "x", "MY_REAL_X": "y"})),
]  # fmt: skip


# -- raw send records ----------------------------------------------------------------------------

RECORD_KINDS: Final = [
    *(
        rec(f"broker-only property {n}", record(properties={"ok": "1", n: "v"}), PROP,
            f"property {n!r}: {BROKERS_ONLY_RULE}")
        for n in BROKER_ONLY
    ),
    # in a record a message's own fields are properties, each once
    *(
        rec(f"own field {n} twice", record(raw_properties=(
            f"TAGS\x01t\x02KEYS\x01k\x02UNIQ_KEY\x01BAD-TWICE-{n}\x02{n}\x01forged\x02").encode()),
            PROP, f"property {n!r}: {TWICE_RULE}")
        for n in OWN
    ),
    *(
        rec(f"property name with {c!r}", record(properties={named(c): "v"}), PROP,
            f"property {named(c)!r}: {CONTROL_RULE} {c!r}")
        for c in CONTROL
        if c not in SEPARATORS
    ),
    # a separator in a name splits its entry: what is left is no entry a writer makes
    rec("property name with '\\x01'", record(properties={named("\x01"): "v"}), PROP,
        f"property 'ctl': {VALUE_RULE}"),
    rec("property name with '\\x02'", record(properties={named("\x02"): "v"}), PROP,
        "property 'properties': entry 'ctl' has no \\x01 between a name and a value"),
    rec("empty property name", record(properties={"": "v"}), PROP,
        f"property '': {SEPARATOR_RULE}"),
    rec("the last entry without \\x02", record(raw_properties=b"UNIQ_KEY\x01B-END\x02n\x01v"),
        PROP, "property 'properties': must end each entry with \\x02; 'n\\x01v' does not"),
    rec("properties not UTF-8", record(raw_properties=b"UNIQ_KEY\x01B-UTF\x02n\x01\xff\x02"),
        PROP, "property 'properties': must be UTF-8"),
    *(rec(f"unique id of {what}", record(uid), ARG, says) for what, uid, says in IDS),
    *(
        rec(f"compressed body: {what}", record(body=body, sys_flag=1), ARG, COMPRESSED + end)
        for what, body, end in COMPRESSION
    ),
    rec("deliver_at_ms -1", record(at=-1), ARG, f"{AT_RULE} -1"),
    rec("deliver_at_ms 7 days and an hour ahead", lambda: record(at=ahead_ms(PAST_CAP_MS)),
        ARG, f"{MSG}.deliver_at_ms: is 7.04 {AHEAD_RULE}"),
    rec("deliver_at_ms the largest int64", record(at=INT64_MAX), ARG,
        f"{MSG}.deliver_at_ms: is ", AHEAD_RULE),
    rec("deliver_at_ms and a delay level", lambda: record(delay=3, at=ahead_ms(60_000)), ARG,
        BOTH_RULE),
    *(rec(f"delay level {v}", record(delay=v), ARG, f"{MSG}.delay_level {v}: {DELAY_RULE}")
      for v in (-1, 19)),
    rec("born timestamp -1", record(born=-1), ARG, f"{BORN_RULE} -1"),
    RecordCase("queue id past the topic's queues", record(queue_id=QUEUES), "INVALID_QUEUE_ID",
               grpc.StatusCode.INVALID_ARGUMENT,
               (f"queue_id {QUEUES}: must be between 0 and {QUEUES - 1}",)),
    rec("system flag 0x4", record(sys_flag=0x4), ARG, f"{SYS_FLAG_RULE}, got 0x4"),
    rec("empty body", record(body=b""), ARG, f"{MSG}.body: must not be empty"),
    RecordCase("unknown topic", record(topic=UNKNOWN), "UNKNOWN_TOPIC",
               grpc.StatusCode.NOT_FOUND, (f"topic '{UNKNOWN}' does not exist on broker",)),
    RecordCase("system topic TBW102", record(topic="TBW102"), "PERMISSION_DENIED",
               grpc.StatusCode.PERMISSION_DENIED, ("topic 'TBW102': is a system topic",)),
]  # fmt: skip


# -- whole requests ------------------------------------------------------------------------------


def request(
    messages: Sequence[common_pb2.Message] = (), records: bytes = b""
) -> Callable[[], broker_pb2.SendMessagesRequest]:
    return lambda: broker_pb2.SendMessagesRequest(messages=messages, records=records)


REQUEST_KINDS: Final = [
    RequestCase("no messages", request(), "messages: must not be empty"),
    RequestCase("1025 messages", request([pb(body=b"m")] * 1025),
                "messages: 1025 messages in one request; at most 1024 are allowed"),
    RequestCase("1025 records", request(records=record("BAD-MANY") * 1025),
                "messages: 1025 messages in one request; at most 1024 are allowed"),
    RequestCase("messages and records together", request([pb()], record()),
                "records: a request carries messages or records, not both"),
    RequestCase("records that are not records", request(records=b"junk" * 40),
                "records[0] (at byte 0): its magic or sizes do not make a record"),
    RequestCase("a record cut short", request(records=record("BAD-CUT")[:-3]),
                "records[0] (at byte 0): its magic or sizes do not make a record"),
    RequestCase("fewer bytes than a header", request(records=bytes(20)),
                "records[0] (at byte 0): 20 bytes is shorter than a record's header"),
]  # fmt: skip


# -- the command ---------------------------------------------------------------------------------

SEND: Final = ("send", TOPIC)
RESET: Final = ("group", "reset-offset", "g", "--topic", TOPIC, "--timestamp")

CLI_KINDS: Final = [
    CliCase("send with a broker-only property", (*SEND, "--property", "REAL_TOPIC=X", "bad"), 1,
            "property 'REAL_TOPIC': is set by brokers only"),
    CliCase("send with an own field", (*SEND, "--property", "UNIQ_KEY=forged", "bad"), 1,
            "property 'UNIQ_KEY': is reserved"),
    CliCase("send with a tab in a property name", (*SEND, "--property", "a\tb=v", "bad"), 1,
            f"property 'a\\tb': {CONTROL_RULE} '\\t'"),
    CliCase("send with delay level 19", (*SEND, "--delay-level", "19", "bad"), 2,
            "--delay-level 19: must be from 1 to 18"),
    CliCase("send for 2999: the broker refuses", (*SEND, "--deliver-at", "2999-01-01T00:00Z",
            "bad"), 1, AHEAD_RULE),
    CliCase("send for 1969", (*SEND, "--deliver-at", "1969-12-31T00:00:00Z", "bad"), 1,
            f"{SDK_TIME_RULE} 1969-12-31T00:00:00+00:00"),
    CliCase("send with a negative delay", (*SEND, "--deliver-in", "-5", "bad"), 2,
            "--deliver-in -5.0: must be a number of seconds, at least 0"),
    CliCase("reset-offset past 9999", (*RESET, "99999999999999999999"), 2,
            f"--timestamp 99999999999999999999: {TIME_RULE}"),
    CliCase("reset-offset before 1970", (*RESET, "-1"), 2, f"--timestamp -1: {TIME_RULE}"),
    CliCase("query from past 9999", ("message", "query", "--topic", TOPIC, "--begin",
            "99999999999999999999"), 2, f"--begin '99999999999999999999': {TIME_RULE}"),
    CliCase("send to a topic no broker has", ("send", UNKNOWN, "bad"), 1, f"topic '{UNKNOWN}'"),
]  # fmt: skip


def test_the_tables_cover_every_rule_of_the_codec() -> None:
    """Every broker-only name and prefix, every own field and every control character is sent
    each way it can travel, and no table names a case twice."""
    for n in BROKER_ONLY:
        for table in (SDK_KINDS, RAW_RESERVED, RECORD_KINDS):
            assert [c for c in table if c.name == f"broker-only property {n}"], n
    assert [n for n in BROKER_ONLY if n not in BROKER_PROPERTIES] == [
        f"{p}ANYTHING" for p in BROKER_PREFIXES
    ]
    for n in OWN:
        assert [c for c in SDK_KINDS if c.name == f"own field {n} as a property"]
        assert [c for c in RAW_RESERVED if c.name == f"own field {n} as a property"]
        assert [c for c in RECORD_KINDS if c.name == f"own field {n} twice"]
    assert len(CONTROL) == 33
    for c in CONTROL:
        assert [r for r in RAW_NAMES if r.name == f"property name with {c!r}"], repr(c)
        assert [r for r in RECORD_KINDS if r.name == f"property name with {c!r}"], repr(c)
    with pytest.raises(zlib.error):
        zlib.decompress(NOISE)
    tables: list[Sequence[Case | RawCase | RecordCase | RequestCase | CliCase]] = [
        SDK_KINDS, RAW_RESERVED, RAW_NAMES, RAW_IDS, RAW_COMPRESSION, RAW_TIMES, RAW_OTHER,
        RECORD_KINDS, REQUEST_KINDS, CLI_KINDS,
    ]  # fmt: skip
    for cases in tables:
        names = [c.name for c in cases]
        assert len(names) == len(set(names)), names
