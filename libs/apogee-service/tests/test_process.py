"""run_service: argv → settings → run, with exit status 0 after a stop by signal, 2 for bad
settings (named on standard error) and 1 when the service cannot start; tracing set up once
logging is, for a service that traces; a leader-elected service's flags."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from apogee.common import tracing
from apogee.common.errors import InvalidArgumentError
from apogee.service import process
from apogee.service.leader_app import leader_parser
from apogee.service.process import run_service

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Settings:
    config: Path | None
    flags: dict[str, Any]
    log_level_number: int = logging.INFO


def load_settings(config_file: Path | None, **flags: Any) -> Settings:
    if flags.get("namesrv") == "nowhere":
        raise InvalidArgumentError(field="namesrv", rule="'nowhere' is not host:port")
    return Settings(config_file, flags)


class App:
    """Starts (or fails to, with ``error``); a start that works sends this process SIGTERM."""

    def __init__(self, settings: Settings, error: OSError | None = None) -> None:
        self.settings = settings
        self.error = error
        self.calls: list[str] = []

    async def start(self) -> int:
        self.calls.append("start")
        if self.error is not None:
            raise self.error
        os.kill(os.getpid(), signal.SIGTERM)
        return 1234

    async def stop(self) -> None:
        self.calls.append("stop")


def parser() -> argparse.ArgumentParser:
    return leader_parser("apogee-demo", "A demo.", listen="0.0.0.0:1")


@pytest.fixture(autouse=True)
def no_logging_setup(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The level run_service asks for (the test process's own logging left alone)."""
    levels: list[int] = []
    monkeypatch.setattr(process, "configure_logging", levels.append)
    return levels


def test_the_flags_come_in_order_and_each_names_a_setting() -> None:
    p = parser()
    flags = [a.option_strings[-1] for a in p._actions if a.option_strings][1:]
    assert flags == ["--config", "--namesrv", "--listen", "--lock-file", "--log-level"]
    assert "host:port of the health service (default 0.0.0.0:1)" in p.format_help()
    args = vars(p.parse_args(["--lock-file", "x.lock", "--log-level", "debug"]))
    assert args == {
        "config": None,
        "namesrv": None,
        "listen": None,
        "lock_file": Path("x.lock"),
        "log_level": "debug",
    }


def test_a_graceful_stop_exits_with_0(no_logging_setup: list[int]) -> None:
    apps: list[App] = []

    def new_app(settings: Settings) -> App:
        apps.append(App(settings))
        return apps[-1]

    argv = ["--config", "demo.toml", "--namesrv", "a:1"]
    assert run_service(parser(), load_settings, new_app, "demo", argv) == 0
    [app] = apps
    assert app.calls == ["start", "stop"]
    assert app.settings.config == Path("demo.toml")
    assert app.settings.flags["namesrv"] == "a:1"
    assert no_logging_setup == [logging.INFO]


def test_a_service_that_traces_sets_it_up_once_logging_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    steps: list[str] = []
    monkeypatch.setattr(process, "configure_logging", lambda level: steps.append("logging"))
    monkeypatch.setattr(tracing, "configure", lambda name: steps.append(f"tracing {name}"))

    def new_app(settings: Settings) -> App:
        steps.append("app")
        return App(settings)

    assert run_service(parser(), load_settings, new_app, "demo", []) == 0
    assert steps == ["logging", "app"]  # no tracing unless asked for
    steps.clear()
    assert (
        run_service(parser(), load_settings, new_app, "demo", [], tracing_name="apogee-demo") == 0
    )
    assert steps == ["logging", "tracing apogee-demo", "app"]


def test_bad_settings_exit_with_2_naming_the_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_service(parser(), load_settings, App, "demo", ["--namesrv", "nowhere"]) == 2
    assert capsys.readouterr().err == "apogee-demo: namesrv: 'nowhere' is not host:port\n"


def test_a_service_that_cannot_start_exits_with_1_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def new_app(settings: Settings) -> App:
        return App(settings, OSError("demo cannot listen on 0.0.0.0:1"))

    assert run_service(parser(), load_settings, new_app, "demo", []) == 1
    assert "demo could not start: demo cannot listen on 0.0.0.0:1" in caplog.text
