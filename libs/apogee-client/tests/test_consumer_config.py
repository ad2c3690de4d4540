"""Every consumer option that is refused names the option and the rule."""

from __future__ import annotations

from typing import Any

import pytest

from apogee.client.consumer.config import ConsumeFrom, ConsumeMode, ConsumerConfig
from apogee.client.consumer.pull import PullConsumer
from apogee.common.errors import InvalidArgumentError

pytestmark = pytest.mark.unit

NS = "127.0.0.1:9876"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"mode": "sometimes"},
            "mode: must be one of 'clustering', 'broadcasting', got 'sometimes'",
        ),
        ({"consume_from": "middle"}, "consume_from: must be one of"),
        ({"allocate": "random"}, "allocate: 'random' is not a strategy"),
        ({"rebalance_interval": 0}, "rebalance_interval: must be a number above 0, got 0"),
        ({"consume_timeout": -1}, "consume_timeout: must be a number above 0, got -1"),
        ({"pull_batch_size": 0}, "pull_batch_size: must be an integer of at least 1, got 0"),
        ({"pull_batch_size": 2048}, "pull_batch_size: must be at most 1024, got 2048"),
        ({"consume_concurrency": 1.5}, "consume_concurrency: must be an integer of at least 1"),
        ({"max_span": True}, "max_span: must be an integer of at least 1, got True"),
        ({"close_timeout": -0.5}, "close_timeout: must be a number of at least 0, got -0.5"),
        ({"consume_from": "timestamp"}, "consume_timestamp_ms: must be set"),
        (
            {"orderly": True, "mode": "broadcasting"},
            "orderly: orderly consumption needs clustering",
        ),
        ({"client_id": "has space"}, "client_id: 'has space' must be 1 to 255 characters"),
    ],
)
def test_bad_options_are_named(options: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        ConsumerConfig.create(NS, "g", options)  # type: ignore[arg-type]
    assert str(info.value).startswith(message)


def test_bad_group_and_unknown_option() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^group: 'a b' must be 1 to 255 characters"):
        ConsumerConfig.create(NS, "a b", {})
    with pytest.raises(TypeError, match=r"unknown consumer option.*: pull_size"):
        ConsumerConfig.create(NS, "g", {"pull_size": 3})  # type: ignore[typeddict-unknown-key]


def test_orderly_pull_consumer_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^orderly: is for PushConsumer"):
        PullConsumer(NS, "g", orderly=True)


def test_defaults_and_generated_client_id() -> None:
    cfg = ConsumerConfig.create(NS, "g", {"mode": "broadcasting", "consume_from": "earliest"})
    assert cfg.mode is ConsumeMode.BROADCASTING
    assert cfg.consume_from is ConsumeFrom.EARLIEST
    assert cfg.allocate.name == "average"
    assert cfg.client_id.count("@") == 2
    assert not cfg.client_id_given
    assert ConsumerConfig.create(NS, "g", {"client_id": "svc-1@host"}).client_id_given
