"""ScheduleSettings: defaults, each layer in order, and bad values of its own settings named with
their rule (the checks it shares with the transaction checker are LeaderServiceSettings', tested
in apogee-service)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from apogee.common.errors import InvalidArgumentError
from apogee_schedule.settings import ScheduleSettings, load_settings

pytestmark = pytest.mark.unit


def test_defaults() -> None:
    s = load_settings(env={})
    assert s == ScheduleSettings()
    assert (s.namesrv, s.listen, s.lock_file, s.lead_ms, s.scan_hold_ms, s.max_batch) == (
        "127.0.0.1:9876",
        "127.0.0.1:9700",
        Path("./schedule.lock"),
        2000,
        500,
        512,
    )
    assert (s.progress_interval_s, s.broker_refresh_s, s.rpc_timeout_s, s.lock_poll_s) == (
        1.0,
        10.0,
        5.0,
        1.0,
    )
    assert s.nameservers == ["127.0.0.1:9876"]


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    cfg = tmp_path / "apogee.toml"
    cfg.write_text(
        '[schedule]\nnamesrv = "a:1;b:2;a:1"\nlead_ms = 3000\nlog_level = "debug"\n'
        '[broker]\nlisten = "0.0.0.0:10911"\n'
    )
    env = {"APOGEE_SCHEDULE_LEAD_MS": "2500", "APOGEE_SCHEDULE_MAX_BATCH": "64"}
    s = load_settings(cfg, env, lock_file="/tmp/x.lock", listen=None)
    assert s == ScheduleSettings(
        namesrv="a:1;b:2;a:1",
        lead_ms=2500,
        max_batch=64,
        lock_file=Path("/tmp/x.lock"),
        log_level="DEBUG",
    )
    assert s.nameservers == ["a:1", "b:2"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"listen": "9700"}, "listen: '9700' is not host:port (port 0 to 65535)"),
        ({"lead_ms": "0"}, "lead_ms: must be between 50 and 600000, got 0"),
        ({"scan_hold_ms": "20000"}, "scan_hold_ms: must be between 1 and 15000, got 20000"),
        ({"max_batch": "0"}, "max_batch: must be between 1 and 8192, got 0"),
        (
            {"progress_interval_s": "-1"},
            "progress_interval_s: must be between 0.01 and 3600, got -1.0",
        ),
        ({"lead_ms": "soon"}, "--lead-ms: 'soon' is not an integer"),
    ],
)
def test_bad_values_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        load_settings(env={}, **overrides)
    assert str(caught.value) == message


def test_a_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        load_settings(env={"APOGEE_SCHEDULE_MAX_BATCH": "many"})
    assert str(caught.value) == "APOGEE_SCHEDULE_MAX_BATCH: 'many' is not an integer"
