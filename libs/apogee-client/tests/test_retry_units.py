"""Retry pieces that need no server: the retry options, failure reasons on one line, retried
messages shown under their original topic, which properties are the brokers' own."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from apogee.client import PushConsumer, ReceivedMessage
from apogee.client.consumer.config import ConsumerConfig
from apogee.client.consumer.records import decode_records
from apogee.client.consumer.retry import is_internal_property, one_line, present_retried
from apogee.codec import encode_record
from apogee.common.errors import InvalidArgumentError

pytestmark = pytest.mark.unit


def received(topic: str, props: dict[str, str], reconsume_times: int = 0) -> ReceivedMessage:
    record = encode_record(
        topic, 0, 5, b"body", unique_id="ID1", properties=props, reconsume_times=reconsume_times
    )
    (m,) = decode_records(record, "broker-a", topic, 0, 5)
    return m


def test_retry_options_have_rocketmqs_defaults_and_bounds() -> None:
    cfg = ConsumerConfig.create("127.0.0.1:9876", "g", {})
    assert (cfg.max_reconsume_times, cfg.first_retry_delay_level) == (16, 3)
    ok = ConsumerConfig.create(
        "127.0.0.1:9876", "g", {"max_reconsume_times": 0, "first_retry_delay_level": 18}
    )
    assert (ok.max_reconsume_times, ok.first_retry_delay_level) == (0, 18)
    cases: Sequence[tuple[str, object, str]] = [
        ("max_reconsume_times", -1, "max_reconsume_times: must be an integer of at least 0"),
        ("max_reconsume_times", 1001, "max_reconsume_times: must be at most 1000, got 1001"),
        ("max_reconsume_times", 2.5, "max_reconsume_times: must be an integer"),
        ("first_retry_delay_level", 0, "first_retry_delay_level: must be an integer of at least 1"),
        (
            "first_retry_delay_level",
            19,
            "first_retry_delay_level: must be a delay level from 1 to 18, got 19",
        ),
    ]
    for name, value, message in cases:
        with pytest.raises(InvalidArgumentError) as info:
            PushConsumer("127.0.0.1:9876", "g", print, **{name: value})  # type: ignore[arg-type]
        assert str(info.value).startswith(message), (name, value, str(info.value))


def test_a_clustering_group_name_leaves_room_for_its_retry_topic() -> None:
    ConsumerConfig.create("127.0.0.1:9876", "g" * 120, {})
    with pytest.raises(InvalidArgumentError) as info:
        ConsumerConfig.create("127.0.0.1:9876", "g" * 121, {})
    assert str(info.value) == (
        "group: is 121 characters; a clustering group's name has at most 120, for its retry "
        "topic %RETRY%<group> is a topic name (at most 127 characters)"
    )
    # broadcasting groups have no retry topic
    ConsumerConfig.create("127.0.0.1:9876", "g" * 255, {"mode": "broadcasting"})


def test_failure_reasons_are_one_line_and_bounded() -> None:
    assert one_line("ValueError: bad\n  value\tthere") == "ValueError: bad value there"
    long = one_line("x" * 5000)
    assert len(long) == 1024
    assert long.endswith("...")


def test_retried_messages_show_their_original_topic_and_count() -> None:
    m = received("%RETRY%g", {"RETRY_TOPIC": "Orders", "ORIGIN_MSG_ID": "ID0"}, 3)
    plain = received("%RETRY%g", {})
    present_retried([m, plain])
    assert (m.topic, m.reconsume_times, m.unique_id) == ("Orders", 3, "ID1")
    assert m.properties["ORIGIN_MSG_ID"] == "ID0"
    assert plain.topic == "%RETRY%g"  # nothing to go by: the retry topic's name stays


def test_the_brokers_own_properties_are_recognised() -> None:
    internal = [
        "REAL_TOPIC",
        "REAL_QID",
        "DELAY",
        "DELIVER_AT_MS",
        "RETRY_TOPIC",
        "ORIGIN_MSG_ID",
        "DLQ_ORIGIN_TOPIC",
        "DLQ_REASON",
        "ATTEMPTS",
    ]
    assert all(is_internal_property(p) for p in internal)
    assert not any(is_internal_property(p) for p in ("order", "REALM", "trace", "delay"))
