"""LeaderServiceSettings: the checks a leader-elected service's settings share, each refusal
naming the field and the rule; the service's own ranges checked in the order of its fields; the
TLS and authentication checks of a service that calls others."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from apogee.common.errors import InvalidArgumentError
from apogee.common.settings import SecuritySettings, doc, load
from apogee.service.leader_settings import (
    LOCK_FILE_DOC,
    LeaderServiceSettings,
    Ranges,
    listen_doc,
    namesrv_doc,
)

pytestmark = pytest.mark.unit


@dataclass(frozen=True, slots=True)
class DemoSettings(LeaderServiceSettings):
    namesrv: str = doc("127.0.0.1:9876", namesrv_doc("the brokers are served."))
    listen: str = doc("0.0.0.0:9799", listen_doc("apogee.demo.Process"))
    metrics_listen: str = doc("0.0.0.0:9798", "")
    lock_file: Path = doc(Path("./demo.lock"), LOCK_FILE_DOC)
    lock_poll_s: float = doc(1.0, "")
    batch: int = doc(10, "")
    broker_refresh_s: float = doc(5.0, "")
    rpc_timeout_s: float = doc(5.0, "")
    shutdown_grace_s: float = doc(5.0, "")
    window_s: float = doc(1.0, "")
    log_level: str = doc("INFO", "")

    RANGES: ClassVar[Ranges] = (("window_s", 0.5, 10.0), ("batch", 1, 100))


def test_defaults_pass_and_derive_the_nameservers_and_the_log_level() -> None:
    s = DemoSettings(namesrv="a:1; b:2;a:1", log_level="debug")
    assert s.nameservers == ["a:1", "b:2"]
    assert (s.log_level, s.log_level_number) == ("DEBUG", logging.DEBUG)


def test_the_shared_descriptions_name_the_service() -> None:
    assert namesrv_doc("the brokers are served.").endswith(
        "Every one is asked; the brokers are served."
    )
    assert "the service `apogee.demo.Process` is SERVING while the process runs" in listen_doc(
        "apogee.demo.Process"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"namesrv": " ; "}, "namesrv: must name at least one host:port"),
        ({"namesrv": "a:1;nowhere"}, "namesrv: 'nowhere' is not host:port (port 1 to 65535)"),
        ({"listen": "9799"}, "listen: '9799' is not host:port (port 0 to 65535)"),
        (
            {"metrics_listen": "nowhere"},
            "metrics_listen: 'nowhere' is not host:port (port 0 to 65535)",
        ),
        ({"lock_file": ""}, "lock_file: must be a file path"),
        ({"lock_poll_s": "0"}, "lock_poll_s: must be between 0.01 and 60, got 0.0"),
        ({"broker_refresh_s": "0"}, "broker_refresh_s: must be between 0.05 and 3600, got 0.0"),
        ({"rpc_timeout_s": "0"}, "rpc_timeout_s: must be between 0.1 and 300, got 0.0"),
        ({"shutdown_grace_s": "-1"}, "shutdown_grace_s: must be between 0 and 300, got -1.0"),
        ({"window_s": "11"}, "window_s: must be between 0.5 and 10, got 11.0"),
        ({"batch": "0"}, "batch: must be between 1 and 100, got 0"),
        (
            {"log_level": "loud"},
            "log_level: 'loud' is not one of: DEBUG, INFO, WARNING, ERROR, CRITICAL",
        ),
    ],
)
def test_bad_values_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        load(DemoSettings, "demo", env={}, **overrides)
    assert str(caught.value) == message


@dataclass(frozen=True, slots=True)
class SecureDemoSettings(LeaderServiceSettings, SecuritySettings):
    namesrv: str = "127.0.0.1:9876"
    listen: str = "127.0.0.1:0"
    metrics_listen: str = ""
    lock_file: Path = Path("demo.lock")
    lock_poll_s: float = 1.0
    broker_refresh_s: float = 5.0
    rpc_timeout_s: float = 5.0
    shutdown_grace_s: float = 5.0
    log_level: str = "INFO"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tls_key_file": "demo.key"}, "tls_cert_file: must name the certificate of tls_key_file"),
        (
            {"auth_enabled": True, "auth_users_file": "users.toml"},
            "auth_credentials_file: must name this service's access key file when auth_enabled",
        ),
    ],
)
def test_the_security_settings_are_those_of_a_service_that_calls_others(
    overrides: dict[str, Any], message: str
) -> None:
    SecureDemoSettings()
    with pytest.raises(InvalidArgumentError) as caught:
        SecureDemoSettings(**overrides)
    assert str(caught.value) == message


def test_ranges_are_checked_in_the_order_of_the_fields() -> None:
    # batch is declared before the shared broker_refresh_s, window_s after it
    with pytest.raises(InvalidArgumentError, match=r"^batch: "):
        DemoSettings(batch=0, broker_refresh_s=0, window_s=0)
    with pytest.raises(InvalidArgumentError, match=r"^broker_refresh_s: "):
        DemoSettings(broker_refresh_s=0, window_s=0)
