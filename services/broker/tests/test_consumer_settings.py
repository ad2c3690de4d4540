"""The consumption settings of BrokerSettings: RocketMQ's defaults, and bad values named."""

from __future__ import annotations

from typing import Any

import pytest

from apogee.common.errors import ApogeeError
from apogee_broker.settings import load_settings

pytestmark = pytest.mark.unit


def test_defaults() -> None:
    s = load_settings(env={})
    assert (s.long_poll_max_ms, s.pull_max_messages, s.pull_max_bytes) == (15_000, 1024, 4 << 20)
    assert (s.consumer_expiry_ms, s.offset_persist_interval_s, s.lock_expiry_ms) == (
        120_000,
        5.0,
        60_000,
    )


def test_from_the_environment() -> None:
    s = load_settings(env={"APOGEE_BROKER_LONG_POLL_MAX_MS": "3000"})
    assert s.long_poll_max_ms == 3000


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("long_poll_max_ms", -1, "long_poll_max_ms: must be between 0 and 3600000, got -1"),
        ("pull_max_messages", 0, "pull_max_messages: must be between 1 and 65536, got 0"),
        ("pull_max_bytes", 100, "pull_max_bytes: must be between 1024 and 50331648, got 100"),
        ("consumer_expiry_ms", 10, "consumer_expiry_ms: must be between 1000 and 86400000"),
        ("lock_expiry_ms", 0, "lock_expiry_ms: must be between 1000 and 86400000, got 0"),
        (
            "offset_persist_interval_s",
            0,
            "offset_persist_interval_s: must be above 0 and at most 3600, got 0",
        ),
    ],
)
def test_bad_values_are_named(field: str, value: object, message: str) -> None:
    overrides: dict[str, Any] = {field: value}
    with pytest.raises(ApogeeError) as caught:
        load_settings(None, {}, **overrides)
    assert str(caught.value).startswith(message)
