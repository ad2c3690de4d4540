"""Dead-letter pieces that need no server: a dead letter read from its record, filters, the
message a redrive sends, and the command line's arguments."""

from __future__ import annotations

import pytest

from apogee.cli.common import UsageError
from apogee.cli.dlq import parse_rate, parse_since
from apogee.client.consumer.records import decode_records
from apogee.client.dlq import DeadLetter, DeadLetterFilter, parse_filters, redriven_message
from apogee.codec import encode_record
from apogee.common.errors import InvalidArgumentError

pytestmark = pytest.mark.unit

PROPS = {
    "DLQ_ORIGIN_TOPIC": "Orders",
    "DLQ_REASON": "ValueError: no such customer",
    "ATTEMPTS": "17",
    "ORIGIN_MSG_ID": "FIRST",
    "REAL_TOPIC": "x",
    "DELAY": "3",
    "region": "eu",
}


def letter(body: bytes = b"hello", props: dict[str, str] | None = None) -> DeadLetter:
    record = encode_record(
        "%DLQ%billing",
        0,
        7,
        body,
        tags="paid",
        keys=("o-1", "c-9"),
        unique_id="DLQID",
        properties=PROPS if props is None else props,
        store_timestamp_ms=1_700_000_000_000,
        reconsume_times=16,
    )
    (m,) = decode_records(record, "broker-a", "%DLQ%billing", 0, 7)
    return DeadLetter.from_message(m)


def test_a_dead_letter_shows_where_it_came_from_and_why() -> None:
    d = letter()
    assert (d.unique_id, d.origin_topic, d.attempts, d.reason) == (
        "DLQID",
        "Orders",
        17,
        "ValueError: no such customer",
    )
    assert (d.keys, d.tags, d.body, d.broker_name, d.queue_offset) == (
        ("o-1", "c-9"),
        "paid",
        b"hello",
        "broker-a",
        7,
    )
    assert d.user_properties == {"region": "eu"}
    # without ATTEMPTS, the attempts are the record's reconsume times + 1
    assert letter(props={"DLQ_ORIGIN_TOPIC": "Orders"}).attempts == 17


def test_the_body_preview_is_one_short_printable_line() -> None:
    assert letter(b"line 1\nline\t2").body_preview == "line 1\\nline\\t2"
    assert letter(b"\xff\x00ok").body_preview == "\\xff\\x00ok"
    long = letter(b"y" * 500).body_preview
    assert len(long) == 60
    assert long.endswith("...")


def test_filters_take_what_matches_all_given() -> None:
    d = letter()
    assert DeadLetterFilter().matches(d)
    assert DeadLetterFilter(key="c-9", tag="paid", topic="Orders").matches(d)
    assert not DeadLetterFilter(key="o-2").matches(d)
    assert not DeadLetterFilter(tag="created").matches(d)
    assert not DeadLetterFilter(topic="Other").matches(d)
    assert DeadLetterFilter(since_ms=1_700_000_000_000).matches(d)
    assert not DeadLetterFilter(since_ms=1_700_000_000_001).matches(d)
    with pytest.raises(InvalidArgumentError, match="key: must be a non-empty string"):
        DeadLetterFilter(key="")
    for bad in (-1, 10**29):
        with pytest.raises(InvalidArgumentError, match="since_ms: must be a time from 1970-01-01"):
            DeadLetterFilter(since_ms=bad)


def test_a_redrive_keeps_the_message_and_leaves_the_brokers_properties() -> None:
    m = redriven_message(letter())
    assert (m.topic, m.body, m.tags, tuple(m.keys)) == ("Orders", b"hello", "paid", ("o-1", "c-9"))
    # the first id the message had (kept by the broker through its retries)
    assert dict(m.properties) == {"region": "eu", "ORIGIN_MSG_ID": "FIRST"}
    bare = redriven_message(letter(props={"DLQ_ORIGIN_TOPIC": "Orders"}))
    assert dict(bare.properties) == {"ORIGIN_MSG_ID": "DLQID"}


def test_filter_and_time_arguments() -> None:
    f = parse_filters(["key=o-1", "tag=paid", "topic=Orders"], since_ms=5)
    assert (f.key, f.tag, f.topic, f.since_ms) == ("o-1", "paid", "Orders", 5)
    for bad, message in [
        ("key", "'key' must be key=K, tag=T or topic=T"),
        ("colour=red", "'colour=red' must be key=K"),
        ("key=", "'key=' must be key=K"),
    ]:
        with pytest.raises(InvalidArgumentError, match=message):
            parse_filters([bad])
    with pytest.raises(InvalidArgumentError, match="key= is given twice"):
        parse_filters(["key=a", "key=b"])
    now = 1_700_000_000_000
    assert parse_since(None, now) == 0
    assert parse_since("60", now) == now - 60_000
    assert parse_since("0.5", now) == now - 500
    assert parse_since("2023-11-14T22:13:20", now) == 1_700_000_000_000
    assert parse_since("2023-11-14T23:13:20+01:00", now) == 1_700_000_000_000
    for bad in ("-5", "yesterday", "nan"):
        with pytest.raises(UsageError, match="--since"):
            parse_since(bad, now)
    assert parse_rate("50/s") == 50.0
    assert parse_rate("2.5") == 2.5
    for bad in ("0", "-1/s", "fast", "inf"):
        with pytest.raises(UsageError, match="--rate"):
            parse_rate(bad)
