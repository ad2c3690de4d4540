"""TxnCheckerSettings: defaults, each layer in order, and bad values of its own settings named
with their rule (the checks it shares with the schedule service are LeaderServiceSettings',
tested in apogee-service)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from apogee.common.errors import InvalidArgumentError
from apogee_txn_checker.settings import TxnCheckerSettings, load_settings

pytestmark = pytest.mark.unit


def test_defaults() -> None:
    s = load_settings(env={})
    assert s == TxnCheckerSettings()
    assert (s.namesrv, s.listen, s.lock_file) == (
        "127.0.0.1:9876",
        "127.0.0.1:9701",
        Path("./txn-checker.lock"),
    )
    assert (s.check_interval_s, s.immunity_s, s.max_check_times) == (60.0, 6.0, 15)
    assert (s.checks_per_group_per_s, s.check_burst, s.jitter_ms) == (100.0, 200, 100)
    assert (s.half_scan_batch, s.op_scan_batch, s.max_concurrent_checks) == (256, 1024, 16)
    assert (s.broker_refresh_s, s.rpc_timeout_s, s.lock_poll_s, s.shutdown_grace_s) == (
        5.0,
        5.0,
        1.0,
        5.0,
    )
    assert s.lane_capacity == 200 + 100 * 60
    assert s.nameservers == ["127.0.0.1:9876"]


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "apogee.toml"
    cfg.write_text(
        '[txn_checker]\nnamesrv = "a:1;b:2;a:1"\ncheck_interval_s = 30\nlog_level = "debug"\n'
        '[broker]\nlisten = "0.0.0.0:10911"\n'
    )
    env = {"APOGEE_TXN_CHECKER_CHECK_INTERVAL_S": "1", "APOGEE_TXN_CHECKER_MAX_CHECK_TIMES": "3"}
    s = load_settings(cfg, env, lock_file=str(tmp_path / "x.lock"), listen=None)
    assert s == TxnCheckerSettings(
        namesrv="a:1;b:2;a:1",
        check_interval_s=1.0,
        max_check_times=3,
        lock_file=tmp_path / "x.lock",
        log_level="DEBUG",
    )
    assert s.nameservers == ["a:1", "b:2"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"listen": "9701"}, "listen: '9701' is not host:port (port 0 to 65535)"),
        ({"check_interval_s": "0.5"}, "check_interval_s: must be between 1 and 86400, got 0.5"),
        ({"immunity_s": "-1"}, "immunity_s: must be between 0 and 86400, got -1.0"),
        ({"max_check_times": "0"}, "max_check_times: must be between 1 and 10000, got 0"),
        (
            {"checks_per_group_per_s": "0"},
            "checks_per_group_per_s: must be between 0.01 and 1e+06, got 0.0",
        ),
        ({"check_burst": "0"}, "check_burst: must be between 1 and 1e+06, got 0"),
        ({"jitter_ms": "-5"}, "jitter_ms: must be between 0 and 60000, got -5"),
        ({"half_scan_batch": "5000"}, "half_scan_batch: must be between 1 and 4096, got 5000"),
        ({"op_scan_batch": "0"}, "op_scan_batch: must be between 1 and 16384, got 0"),
        ({"max_check_times": "many"}, "--max-check-times: 'many' is not an integer"),
    ],
)
def test_bad_values_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        load_settings(env={}, **overrides)
    assert str(caught.value) == message


def test_a_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        load_settings(env={"APOGEE_TXN_CHECKER_CHECK_BURST": "lots"})
    assert str(caught.value) == "APOGEE_TXN_CHECKER_CHECK_BURST: 'lots' is not an integer"
