"""Commands another distribution adds (``apogee cluster``, from ``apogee-local``), through the
``apogee.cli`` entry point group: plugged in when installed; when not installed or broken, the
command still parses and exits 1 with one line saying what to install, and every other command
works as before."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import pytest

from apogee.cli.common import CommandError
from apogee.cli.main import PLUGIN_GROUP, build_parser, main

pytestmark = pytest.mark.unit

NOT_INSTALLED = (
    "apogee: `apogee cluster` needs apogee-local, which is not installed here; "
    "install it with `pip install apogee-local`"
)


@dataclass
class FakeEntryPoint:
    """What :func:`apogee.cli.main.add_plugins` uses of an entry point: its name and load()."""

    name: str
    load: Callable[[], Any]


def installed(monkeypatch: pytest.MonkeyPatch, *eps: FakeEntryPoint) -> list[str]:
    """Make ``eps`` the entry points of the group; returns the groups asked for."""
    asked: list[str] = []

    def entry_points(group: str) -> list[FakeEntryPoint]:
        asked.append(group)
        return list(eps)

    monkeypatch.setattr("apogee.cli.main.entry_points", entry_points)
    return asked


@pytest.mark.parametrize(
    "argv",
    [
        ["cluster", "up"],
        ["cluster", "up", "--monitoring", "--brokers", "2", "--prometheus-port", "9999"],
        ["cluster", "--no-console"],
        ["cluster"],
        ["--data", "somewhere", "cluster", "status"],
    ],
)
def test_without_the_local_cluster_installed_cluster_says_what_to_install(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    asked = installed(monkeypatch)
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", NOT_INSTALLED + "\n")
    assert asked == [PLUGIN_GROUP]


def test_without_the_local_cluster_the_help_names_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    installed(monkeypatch)
    lines = build_parser().format_help().splitlines()
    commands = [line.split()[0] for line in lines if line.startswith("    ")]
    assert commands[0] == "cluster"  # where it is when installed
    assert any("cluster" in line and "(needs apogee-local)" in line for line in lines)


def test_a_plugin_that_does_not_load_leaves_the_other_commands_working(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken() -> Any:
        raise ModuleNotFoundError("No module named 'apogee_broker'")

    installed(monkeypatch, FakeEntryPoint("cluster", broken))
    assert main(["cluster", "up"]) == 1
    assert capsys.readouterr().err == (
        "apogee: `apogee cluster` does not load from apogee-local (No module named "
        "'apogee_broker'); install it with `pip install apogee-local`\n"
    )
    assert main(["--namesrv", "127.0.0.1:1", "topic", "create", "bad topic"]) == 1
    assert "topic 'bad topic': has a character outside" in capsys.readouterr().err


def test_an_installed_plugin_adds_its_command_and_its_errors_are_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(args: argparse.Namespace, out: TextIO) -> int:
        if args.fail:
            raise CommandError(f"could not start in {args.data}")
        print(f"up with {args.brokers} brokers", file=out)
        return 0

    def register(sub: Any) -> None:
        up = sub.add_parser("cluster", help="run a local cluster").add_subparsers(
            dest="action", required=True
        )
        c_up = up.add_parser("up")
        c_up.add_argument("--brokers", type=int, default=1)
        c_up.add_argument("--fail", action="store_true")
        c_up.set_defaults(run=run)

    installed(monkeypatch, FakeEntryPoint("cluster", lambda: register))
    assert "(needs" not in build_parser().format_help()
    assert main(["cluster", "up", "--brokers", "3"]) == 0
    assert capsys.readouterr().out == "up with 3 brokers\n"
    assert main(["--data", "here", "cluster", "up", "--fail"]) == 1
    assert capsys.readouterr().err == "apogee: could not start in here\n"
