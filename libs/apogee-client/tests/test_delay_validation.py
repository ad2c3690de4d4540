"""Delayed and timer messages on the client: what ``delay_level`` and ``deliver_at`` accept, the
sentences of what they refuse (before anything is queued), their bytes on the wire, and the
flags of ``apogee send``."""

from __future__ import annotations

import math
import random
import time
from datetime import UTC, datetime, timedelta, timezone

import pytest

from apogee.cli.commands import _delivery, parse_deliver_at
from apogee.cli.common import UsageError
from apogee.cli.main import build_parser, main
from apogee.client import Message, Producer, SendHook
from apogee.client.message import MAX_DELIVER_AT_MS, deliver_at_ms
from apogee.client.producer import wire
from apogee.client.producer.validation import MessageValidator, validate_batch, validate_message
from apogee.codec import StoredMessage as RecordView
from apogee.codec import decode
from apogee.common.errors import InvalidArgumentError
from apogee.v1 import broker_pb2

pytestmark = pytest.mark.unit

#: 2026-11-21T10:00:00Z
AT = datetime(2026, 11, 21, 10, 0, tzinfo=UTC)
AT_MS = 1_795_255_200_000


def msg(**kw: object) -> Message:
    fields: dict[str, object] = {"topic": "Orders", "body": b"x"}
    fields.update(kw)
    return Message(**fields)  # type: ignore[arg-type]


# -- what a delivery time is -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "ms"),
    [
        (None, 0),
        (AT, AT_MS),
        (AT.astimezone(timezone(timedelta(hours=5, minutes=30))), AT_MS),  # same instant
        (AT + timedelta(microseconds=1_499), AT_MS + 1),  # nearest millisecond
        (AT + timedelta(microseconds=1_500), AT_MS + 2),
        (AT_MS / 1000, AT_MS),
        (AT_MS // 1000, AT_MS),  # an int is seconds too
        (AT_MS / 1000 + 0.0004, AT_MS),
        (AT_MS / 1000 + 0.0006, AT_MS + 1),
        (0.001, 1),  # the past is fine: delivered at once
        (datetime(9999, 12, 31, 23, 59, 59, 999_000, tzinfo=UTC), MAX_DELIVER_AT_MS),
    ],
)
def test_a_delivery_time_in_milliseconds(value: datetime | float | None, ms: int) -> None:
    assert deliver_at_ms(value) == ms
    assert msg(deliver_at=value).deliver_at_ms == ms
    validate_message(msg(deliver_at=value))


INVALID = [
    (
        msg(deliver_at=datetime(2026, 11, 21, 10, 0)),
        "deliver_at: a datetime must be timezone-aware, got the naive 2026-11-21T10:00:00 "
        "(use datetime.now(UTC) + timedelta(...), or .astimezone())",
    ),
    (
        msg(deliver_at="2026-11-21T10:00:00Z"),
        "deliver_at: must be a timezone-aware datetime or seconds since the epoch, got str",
    ),
    (
        msg(deliver_at=True),
        "deliver_at: must be a timezone-aware datetime or seconds since the epoch, got bool",
    ),
    (msg(deliver_at=math.nan), "deliver_at: must be a finite number of seconds, got nan"),
    (msg(deliver_at=math.inf), "deliver_at: must be a finite number of seconds, got inf"),
    (
        msg(deliver_at=-1.0),
        "deliver_at: must be a time from 1970-01-01 to 9999-12-31 UTC, got -1.0",
    ),
    (
        msg(deliver_at=datetime(1969, 12, 31, 23, 59, tzinfo=UTC)),
        "deliver_at: must be a time from 1970-01-01 to 9999-12-31 UTC, got "
        "1969-12-31T23:59:00+00:00",
    ),
    (
        msg(deliver_at=1e12),
        "deliver_at: must be a time from 1970-01-01 to 9999-12-31 UTC, got 1000000000000.0",
    ),
    (
        msg(delay_level=3, deliver_at=AT),
        "deliver_at: cannot be combined with delay_level (3); set one of them",
    ),
    (msg(delay_level=19), "delay_level: must be an integer from 0 to 18, got 19"),
    (msg(delay_level=-1), "delay_level: must be an integer from 0 to 18, got -1"),
    (msg(delay_level=2.0), "delay_level: must be an integer from 0 to 18, got 2.0"),
]


@pytest.mark.parametrize(("message", "text"), INVALID)
def test_refused_delays(message: Message, text: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        validate_message(message)
    assert str(info.value) == text
    assert not info.value.retriable


@pytest.mark.parametrize(("message", "text"), INVALID)
def test_the_producers_validator_refuses_them_too(message: Message, text: str) -> None:
    """The producer's validator skips checks for topics and tags it has seen pass; a delivery
    time is never skipped."""
    check = MessageValidator()
    check(msg())
    check(msg(deliver_at=AT))
    with pytest.raises(InvalidArgumentError) as info:
        check(message)
    assert str(info.value) == text


@pytest.mark.parametrize(
    ("batch", "text"),
    [
        (
            [msg(), msg(delay_level=3)],
            "delay_level: delay is not supported for batch sends; message 1 has level 3",
        ),
        (
            [msg(deliver_at=AT), msg()],
            "deliver_at: delay is not supported for batch sends; message 0 has deliver_at set",
        ),
        (
            [msg(), msg(deliver_at=0.0)],  # even a time long past: a batch is never delayed
            "deliver_at: delay is not supported for batch sends; message 1 has deliver_at set",
        ),
    ],
)
def test_batches_cannot_be_delayed(batch: list[Message], text: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        validate_batch(batch)
    assert str(info.value) == text


async def test_the_producer_refuses_bad_delays_before_queueing_them() -> None:
    seen: list[Message] = []
    async with Producer("127.0.0.1:1", group="g", hooks=[SendHook(before=seen.append)]) as producer:
        with pytest.raises(InvalidArgumentError, match="cannot be combined with delay_level"):
            await producer.send(msg(delay_level=1, deliver_at=AT))
        with pytest.raises(InvalidArgumentError, match="must be timezone-aware"):
            producer.send_nowait(msg(deliver_at=datetime(2026, 1, 1)))
        with pytest.raises(InvalidArgumentError, match="from 0 to 18, got 19"):
            await producer.send_oneway(msg(delay_level=19))
        with pytest.raises(InvalidArgumentError, match="not supported for batch sends"):
            await producer.send_batch([msg(), msg(deliver_at=AT)])
        with pytest.raises(InvalidArgumentError, match="not supported for batch sends"):
            await producer.send_batch([msg(delay_level=1)])
        assert producer.stats().requests == 0
        assert seen == []


def test_the_message_object_is_left_as_given() -> None:
    m = msg(deliver_at=AT)
    validate_message(m)
    wire.encode(m, "UID", 1, compress_over=-1)
    assert m.deliver_at is AT
    assert m.delay_level == 0


# -- on the wire -----------------------------------------------------------------------------


def send_records(request: bytes) -> list[RecordView]:
    """The send records of a serialized request, decoded as the broker reads them."""
    data = broker_pb2.SendMessagesRequest.FromString(request).records
    out = []
    pos = 0
    while pos < len(data):
        size = int.from_bytes(data[pos : pos + 4], "little")
        out.append(decode(data[pos : pos + size], "request", verify_crc=False))
        pos += size
    return out


@pytest.mark.parametrize(
    "deliver_at", [None, 0.0, 0.001, 0.128, 16.383, AT, AT_MS / 1000, MAX_DELIVER_AT_MS / 1000]
)
def test_deliver_at_on_the_wire_is_the_records_second_slot(
    deliver_at: datetime | float | None,
) -> None:
    """A send record carries the delivery time where the broker writes the physical offset."""
    m = msg(tags="t", deliver_at=deliver_at)
    [got] = send_records(wire.request([wire.encode(m, "UID", 1234, compress_over=-1)], b""))
    assert (got.topic, got.body, got.tags, got.unique_id) == ("Orders", b"x", "t", "UID")
    assert got.born_timestamp == 1234
    assert (got.queue_offset, got.phys_offset) == (0, deliver_at_ms(deliver_at))


def test_delayed_messages_in_one_request_keep_their_own_delay() -> None:
    """A request mixing delayed, timer and plain messages (as transparent batching makes
    them): each record carries its own delay level, delivery time and queue."""
    rng = random.Random(13)
    records = []
    expected = []
    for i in range(200):
        level = 0
        at: datetime | float | None = None
        kind = rng.randrange(3)
        if kind == 1:
            level = rng.randint(1, 18)
        elif kind == 2:
            choices: list[datetime | float] = [AT, AT_MS / 1000 + rng.random() * 1e6, time.time()]
            at = rng.choice(choices)
        m = msg(body=f"m{i}".encode(), keys=(f"k{i}",), delay_level=level, deliver_at=at)
        queue_id = rng.randrange(16)
        record = wire.encode(m, f"U{i}", 1234, compress_over=-1)
        wire.set_queue(record, queue_id)
        records.append(record)
        expected.append((m.body, [f"k{i}"], f"U{i}", queue_id, level, deliver_at_ms(at)))
    got = send_records(wire.request(records, wire.group_field("g")))
    assert [
        (r.body, r.keys, r.unique_id, r.queue_id, r.queue_offset, r.phys_offset) for r in got
    ] == expected


# -- apogee send -----------------------------------------------------------------------------


def send_args(*flags: str) -> list[str]:
    return ["--namesrv", "127.0.0.1:1", "send", "Orders", "body", *flags]


def test_send_flags_make_the_delay_of_every_message() -> None:
    parser = build_parser()
    level = _delivery(parser.parse_args(send_args("--delay-level", "3")))
    assert level() == (3, None)
    assert _delivery(parser.parse_args(send_args()))() == (0, None)
    at = _delivery(parser.parse_args(send_args("--deliver-at", "2026-11-21T11:00:00+01:00")))
    assert at() == (0, AT)
    before = time.time()
    later = _delivery(parser.parse_args(send_args("--deliver-in", "2.5")))
    first, second = later(), later()  # counted from each message
    assert first[0] == 0
    assert isinstance(first[1], float)
    assert isinstance(second[1], float)
    assert before + 2.5 <= first[1] <= second[1] <= time.time() + 2.5


def test_deliver_at_takes_z_and_offsets() -> None:
    assert parse_deliver_at("2026-11-21T10:00:00Z") == AT
    assert parse_deliver_at("2026-11-21T15:30:00.000+05:30") == AT


@pytest.mark.parametrize(
    ("flags", "text"),
    [
        (
            ("--deliver-at", "2026-11-21T10:00:00"),
            "--deliver-at '2026-11-21T10:00:00': add a UTC offset (+01:00) or Z; a time "
            "without one is ambiguous",
        ),
        (
            ("--deliver-at", "tomorrow"),
            "--deliver-at 'tomorrow': use ISO 8601 with a UTC offset, e.g. "
            "2026-11-21T18:30:00+01:00",
        ),
        (("--delay-level", "19"), "--delay-level 19: must be from 1 to 18"),
        (("--delay-level", "0"), "--delay-level 0: must be from 1 to 18"),
        (("--deliver-in", "-1"), "--deliver-in -1.0: must be a number of seconds, at least 0"),
        (("--deliver-in", "nan"), "--deliver-in nan: must be a number of seconds, at least 0"),
    ],
)
def test_bad_send_flags(
    flags: tuple[str, ...], text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(UsageError) as info:
        _delivery(build_parser().parse_args(send_args(*flags)))
    assert str(info.value) == text
    # the command says the same, as a usage error (exit 2), without reaching for a broker
    assert main(send_args(*flags)) == 2
    assert capsys.readouterr().err.endswith(f"apogee: error: {text}\n")


@pytest.mark.parametrize(
    "flags",
    [
        ("--delay-level", "3", "--deliver-in", "5"),
        ("--deliver-in", "5", "--deliver-at", "2026-11-21T10:00:00Z"),
        ("--delay-level", "3", "--deliver-at", "2026-11-21T10:00:00Z"),
    ],
)
def test_one_delay_flag_at_most(flags: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(send_args(*flags))
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_send_help_tells_the_delay_flags_and_the_time_rule(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["send", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--delay-level N" in text
    assert "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h" in text
    assert "--deliver-in SECONDS" in text
    assert "with a UTC offset or Z" in text
    assert "applies to every message sent" in text
