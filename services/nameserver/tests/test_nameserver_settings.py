"""NameServerSettings: defaults, each layer in order, and bad values named with their rule."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from apogee.common.errors import InvalidArgumentError
from apogee_nameserver.settings import NameServerSettings, load_settings

pytestmark = pytest.mark.unit


def test_defaults() -> None:
    s = load_settings(env={})
    assert s == NameServerSettings()
    assert (s.listen, s.broker_expiry_s, s.scan_interval_s, s.shutdown_grace_s, s.log_level) == (
        "127.0.0.1:9876",
        120.0,
        5.0,
        5.0,
        "INFO",
    )
    assert s.log_level_number == logging.INFO


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "apogee.toml"
    cfg.write_text(
        '[nameserver]\nlisten = "127.0.0.1:19876"\nbroker_expiry_s = 60\nlog_level = "debug"\n'
        '[broker]\nlisten = "0.0.0.0:10911"\n'
    )
    env = {"APOGEE_NAMESERVER_BROKER_EXPIRY_S": "45", "APOGEE_NAMESERVER_SCAN_INTERVAL_S": "1"}
    s = load_settings(cfg, env, listen="127.0.0.1:0", log_level=None)
    assert s == NameServerSettings(
        listen="127.0.0.1:0", broker_expiry_s=45.0, scan_interval_s=1.0, log_level="DEBUG"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"listen": "9876"}, "listen: '9876' must be host:port, with a port from 0 to 65535"),
        (
            {"listen": "0.0.0.0:99999"},
            "listen: '0.0.0.0:99999' must be host:port, with a port from 0 to 65535",
        ),
        ({"broker_expiry_s": "0"}, "broker_expiry_s: must be greater than 0, got 0.0"),
        ({"scan_interval_s": "-1"}, "scan_interval_s: must be greater than 0, got -1.0"),
        ({"shutdown_grace_s": "-0.5"}, "shutdown_grace_s: must be 0 or more, got -0.5"),
        (
            {"log_level": "loud"},
            "log_level: 'loud' is not one of: DEBUG, INFO, WARNING, ERROR, CRITICAL",
        ),
        ({"broker_expiry_s": "soon"}, "--broker-expiry-s: 'soon' is not a number"),
    ],
)
def test_bad_values_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        load_settings(env={}, **overrides)
    assert str(caught.value) == message


def test_a_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        load_settings(env={"APOGEE_NAMESERVER_SHUTDOWN_GRACE_S": "later"})
    assert str(caught.value) == "APOGEE_NAMESERVER_SHUTDOWN_GRACE_S: 'later' is not a number"
