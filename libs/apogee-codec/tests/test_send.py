"""Send records: a producer's encoding, read back as the broker and the store read it."""

from __future__ import annotations

import pytest

from apogee.codec import EMPTY_HOST, decode
from apogee.codec.send import (
    QUEUE_AT,
    QUEUE_ID,
    check_send_records,
    encode_properties,
    encode_send_record,
    own_fields,
)
from apogee.common.errors import InvalidArgumentError

pytestmark = pytest.mark.unit


def test_a_send_record_is_a_record_with_the_brokers_fields_left_zero() -> None:
    props = encode_properties("t", ("k1", "k2"), "U1", {"p": "v", "TAGS": "ignored"})
    record = encode_send_record(
        b"Orders",
        b"body",
        props,
        flag=7,
        sys_flag=1,
        born_timestamp=42,
        delay_level=3,
        deliver_at_ms=0,
    )
    QUEUE_ID.pack_into(record, QUEUE_AT, 5)
    got = decode(bytes(record), "test", verify_crc=False)
    assert (got.topic, got.body, got.queue_id, got.flag, got.sys_flag) == (
        "Orders",
        b"body",
        5,
        7,
        1,
    )
    assert got.properties == {"TAGS": "t", "KEYS": "k1 k2", "UNIQ_KEY": "U1", "p": "v"}
    assert (got.born_timestamp, got.queue_offset, got.phys_offset) == (42, 3, 0)
    assert (got.crc, got.store_timestamp, got.born_host_raw, got.store_host_raw) == (
        0,
        0,
        EMPTY_HOST,
        EMPTY_HOST,
    )
    assert own_fields(got.properties_raw) == ("t", ("k1", "k2"), "U1", True)


def test_check_send_records_refuses_a_block_that_does_not_match() -> None:
    one = encode_send_record(b"T", b"x", encode_properties(None, (), "U", None))
    ref = ("T", 0, len(one), 0, (), "U")
    check_send_records(bytes(one) * 2, [ref, ref], 8)
    for block, refs, says in (
        (bytes(one), [("T", 1, *ref[2:])], r"records\[0\]"),
        (bytes(one), [("U", *ref[1:])], r"records\[0\]"),
        (bytes(one) + b"x", [ref], "1 bytes follow the last record"),
        (bytes(one)[:-1], [ref], r"records\[0\]"),
    ):
        with pytest.raises(InvalidArgumentError, match=says):
            check_send_records(block, refs, 8)


@pytest.mark.parametrize(
    ("props", "want"),
    [
        (
            "TAGS\x01a\x02KEYS\x01k1 k2\x02UNIQ_KEY\x01U1\x02x\x01y\x02",
            ("a", ("k1", "k2"), "U1", True),
        ),
        ("UNIQ_KEY\x01U1\x02", (None, (), "U1", True)),
        ("UNIQ_KEY\x01U1\x02TAGS\x01late\x02", ("late", (), "U1", False)),
        ("x\x01y\x02TAGS\x01a\x02UNIQ_KEY\x01U2\x02", ("a", (), "U2", False)),
        ("TAGS\x01a\x02", ("a", (), "", False)),
    ],
)
def test_own_fields(props: str, want: tuple[object, ...]) -> None:
    assert own_fields(props) == want
