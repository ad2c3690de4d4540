"""Which properties a client may set: one answer for the SDK, the message path and send records."""

from __future__ import annotations

import pytest

from apogee.codec import (
    BROKER_PROPERTIES,
    PROP_CHECK_IMMUNITY,
    PROP_PRODUCER_GROUP,
    PROP_TRAN_FIRST_STORED,
    PROP_TRAN_MSG,
    PROP_TRANSACTION_CHECK_TIMES,
    check_immunity_rule,
    control_character_rule,
    encode_properties,
    find_broker_property,
    find_control_in_name,
    is_broker_property,
    properties_text_problem,
    reserved_property_rule,
    unique_id_rule,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", [*sorted(BROKER_PROPERTIES), "REAL_X", "DLQ_X", "TIMER_DELAY"])
def test_what_brokers_set_is_found_in_a_records_properties(name: str) -> None:
    assert is_broker_property(name)
    props = encode_properties("t", ("k",), "U-1", {"region": "eu", name: "v"})
    assert find_broker_property(props) == name
    assert find_broker_property(f"{name}\x01v\x02") == name  # first entry too
    assert reserved_property_rule(name) == (
        "is set by brokers only; use the message's delay_level or deliver_at_ms for a delayed "
        "message"
    )


@pytest.mark.parametrize(
    "props",
    [
        {"region": "eu"},
        {"ORIGIN_MSG_ID": "U-0"},  # a redriven dead letter carries it from its sender
        {"DELAYED": "1", "REAL": "x", "my_DELAY": "1"},  # names that only look alike
        {"note": "REAL_TOPIC\x03"},  # a value that names one is just a value
    ],
)
def test_what_clients_may_set_is_not_found(props: dict[str, str]) -> None:
    assert find_broker_property(encode_properties("t", (), "U-1", props)) is None
    assert all(reserved_property_rule(n) is None for n in props)


def test_a_messages_own_fields_are_reserved_as_properties() -> None:
    for name in ("TAGS", "KEYS", "UNIQ_KEY"):
        assert reserved_property_rule(name) == (
            "is reserved; use the message's tags, keys or unique id"
        )
        assert not is_broker_property(name)


@pytest.mark.parametrize(
    ("uid", "rule"),
    [
        ("7F0000015C2C18B4AAC2710D7B1F0000", None),
        ("order-42:retry.1", None),
        ("u" * 128, None),
        ("u" * 129, "is 129 characters; at most 128 are allowed"),
        ("", "must not be empty"),
        ("two words", "must not contain spaces or control characters"),
        ("tab\there", "must not contain spaces or control characters"),
    ],
)
def test_unique_ids_are_short_and_printable(uid: str, rule: str | None) -> None:
    assert unique_id_rule(uid) == rule


def test_a_control_character_in_a_name_is_found_and_one_in_a_value_is_not() -> None:
    assert find_control_in_name(encode_properties("t", (), "U-1", {"a\nb": "v"})) == "a\nb"
    assert find_control_in_name(encode_properties("t", (), "U-1", {"k": "two\nlines"})) is None
    assert control_character_rule("nul\x00") == (
        "a property name must not contain control characters, got '\\x00'"
    )
    assert control_character_rule("fine") is None


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ("", None),
        (encode_properties("t", ("k",), "U-1", {"region": "eu", "note": "two\nlines"}), None),
        ("UNIQ_KEY\x01\x02", None),
        (
            "UNIQ_KEY\x01U-1\x02\x01v\x02",
            ("", "a property name must be non-empty, without \\x01 or \\x02"),
        ),
        (
            "a\x01v\x02nul\x00\x01v\x02",
            ("nul\x00", "a property name must not contain control characters, got '\\x00'"),
        ),
        ("a\x01b\x01c\x02", ("a", "a value must not contain \\x01 or \\x02")),
        (
            "a\x01b\x02junk\x02",
            ("properties", "entry 'junk' has no \\x01 between a name and a value"),
        ),
        ("a\x01b", ("properties", "must end each entry with \\x02; 'a\\x01b' does not")),
    ],
)
def test_properties_text_is_entries_of_a_printable_name_and_a_value(
    raw: str, problem: tuple[str, str] | None
) -> None:
    assert properties_text_problem(raw) == problem


@pytest.mark.parametrize("code", [*range(0x20), 0x7F])
def test_every_control_character_in_a_name_is_found_in_the_text(code: int) -> None:
    name = f"a{chr(code)}b"
    field, rule = properties_text_problem(f"UNIQ_KEY\x01U-1\x02{name}\x01v\x02") or ("", "")
    if code in (0x01, 0x02):  # a separator splits the entry: it is no longer that name
        assert field in ("a", "properties"), (field, rule)
    else:
        assert (field, rule) == (name, control_character_rule(name))


def test_a_transactions_properties_are_the_brokers_but_its_immunity_is_the_clients() -> None:
    for name in (
        PROP_TRAN_MSG,
        PROP_PRODUCER_GROUP,
        PROP_TRANSACTION_CHECK_TIMES,
        PROP_TRAN_FIRST_STORED,
    ):
        assert is_broker_property(name), name
    assert (PROP_TRAN_MSG, PROP_PRODUCER_GROUP) == ("TRAN_MSG", "PGROUP")
    assert PROP_CHECK_IMMUNITY == "CHECK_IMMUNITY_TIME_IN_SECONDS"
    assert reserved_property_rule(PROP_CHECK_IMMUNITY) is None


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("1", True),
        ("60", True),
        ("86400", True),
        ("0", False),
        ("86401", False),
        ("-5", False),
        ("1.5", False),
        ("", False),
        (" 6", False),
        ("\u0666", False),  # a digit, but not an ASCII one
        ("9" * 40, False),
    ],
)
def test_a_check_immunity_is_whole_seconds_from_one_to_a_day(value: str, ok: bool) -> None:
    rule = check_immunity_rule(value)
    if ok:
        assert rule is None
    else:
        assert rule == (
            "must be a whole number of seconds from 1 to 86400 (how long after it is stored a "
            f"half is first checked), got {value!r}"
        )
