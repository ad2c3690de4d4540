"""BrokerSettings: defaults, the advertised address, nameserver lists, and bad values named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from apogee.common.errors import ApogeeError
from apogee.store import FlushMode
from apogee_broker.settings import BrokerSettings, load_settings, store_host_of

pytestmark = pytest.mark.unit


def test_defaults_are_rocketmqs() -> None:
    s = load_settings(env={})
    assert (s.cluster, s.broker_name, s.listen) == ("DefaultCluster", "broker-a", "127.0.0.1:10911")
    assert s.nameservers == ["127.0.0.1:9876"]
    assert (s.flush_mode, s.auto_create_topics, s.default_topic_queues) == (
        FlushMode.ASYNC,
        False,
        8,
    )
    assert (s.heartbeat_interval_s, s.max_message_size, s.commitlog_file_size) == (
        30.0,
        4 << 20,
        1 << 30,
    )
    assert s.max_messages_per_request == 1024
    cfg = s.store_config()
    assert (cfg.commitlog_file_size, cfg.max_message_size, cfg.flush_mode) == (
        1 << 30,
        4 << 20,
        FlushMode.ASYNC,
    )


@pytest.mark.parametrize(
    ("listen", "advertised", "expected"),
    [
        ("0.0.0.0:10911", "", "127.0.0.1:40123"),
        ("127.0.0.1:0", "", "127.0.0.1:40123"),
        ("[::]:0", "", "127.0.0.1:40123"),
        ("10.0.0.5:0", "", "10.0.0.5:40123"),
        ("0.0.0.0:10911", "broker-0.broker.ns.svc:10911", "broker-0.broker.ns.svc:10911"),
    ],
)
def test_the_advertised_address_is_one_clients_can_reach(
    listen: str, advertised: str, expected: str
) -> None:
    s = BrokerSettings(listen=listen, advertised_address=advertised)
    assert s.advertised(40123) == expected


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "broker.toml"
    cfg.write_text(
        '[broker]\nbroker_name = "from-file"\nflush_mode = "sync"\n'
        'namesrv = "a:1; b:2;a:1"\nauto_create_topics = true\n'
    )
    env = {"APOGEE_BROKER_BROKER_NAME": "from-env", "APOGEE_BROKER_DEFAULT_TOPIC_QUEUES": "4"}
    s = load_settings(cfg, env, listen="127.0.0.1:0", data_dir=tmp_path / "d", broker_name=None)
    assert (s.broker_name, s.flush_mode, s.default_topic_queues) == ("from-env", FlushMode.SYNC, 4)
    assert s.nameservers == ["a:1", "b:2"]
    assert s.auto_create_topics
    assert (s.listen, s.data_dir) == ("127.0.0.1:0", tmp_path / "d")
    assert load_settings(env={}, namesrv="").nameservers == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"listen": "10911"}, "listen: '10911' is not host:port (port 0 to 65535)"),
        ({"namesrv": "ns:0"}, "namesrv: 'ns:0' is not host:port (port 1 to 65535)"),
        (
            {"advertised_address": "pod"},
            "advertised_address: 'pod' is not host:port (port 1 to 65535)",
        ),
        ({"broker_name": "a b"}, "broker_name: must be non-empty without spaces, got 'a b'"),
        ({"default_topic_queues": "0"}, "default_topic_queues: must be between 1 and 1024, got 0"),
        ({"heartbeat_interval_s": "0"}, "heartbeat_interval_s: must be positive"),
        ({"max_messages_per_request": "0"}, "max_messages_per_request: must be at least 1"),
        (
            {"log_level": "loud"},
            "log_level: 'loud' is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL",
        ),
        ({"flush_mode": "never"}, "--flush-mode: 'never' is not one of: sync, async"),
        (
            {"commitlog_file_size": str(1 << 20)},
            "commitlog_file_size: must hold the largest record (4227454 bytes with "
            "max_message_size 4194304); raise it or lower max_message_size",
        ),
    ],
)
def test_bad_values_name_the_setting_and_the_rule(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ApogeeError) as caught:
        load_settings(env={}, **overrides)
    assert str(caught.value) == message


def test_the_store_host_is_an_ip() -> None:
    assert store_host_of("10.1.2.3:10911") == "10.1.2.3:10911"
    assert store_host_of("localhost:10911") == "127.0.0.1:10911"
    assert store_host_of("no-such-host.invalid:10911") == ""
