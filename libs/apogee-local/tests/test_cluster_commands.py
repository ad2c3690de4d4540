"""``apogee cluster up | status | down`` as the ``apogee`` command gets them: from this
distribution's ``apogee.cli`` entry point, with their arguments checked and their errors one
line."""

from __future__ import annotations

import asyncio
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from apogee.cli.main import PLUGIN_GROUP, build_parser, main
from apogee.local import cluster as local_cluster
from apogee.local import commands


@pytest.mark.unit
def test_the_cluster_command_comes_from_this_distributions_entry_point() -> None:
    [ep] = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == "cluster"]
    assert ep.value == "apogee.local.commands:register"
    assert ep.dist is not None
    assert ep.dist.name == "apogee-local"
    assert ep.load() is commands.register
    help_lines = build_parser().format_help().splitlines()
    assert "    cluster          run a local cluster" in help_lines


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--brokers", "0"], "--brokers and --nameservers must be at least 1"),
        (["--nameservers", "0"], "--brokers and --nameservers must be at least 1"),
        (["--scrape-interval", "nan"], "--scrape-interval nan: must be at least 0.001 s"),
        (["--prometheus-port", "65536"], "--prometheus-port 65536: must be from 1 to 65535"),
    ],
)
def test_a_bad_argument_of_cluster_up_is_a_usage_error(
    argv: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--data", str(tmp_path / "cluster"), "cluster", "up", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("usage: apogee")
    assert err[-1] == f"apogee: error: {says}"
    assert not (tmp_path / "cluster").exists()  # nothing started


@pytest.mark.integration
async def test_cluster_status_says_each_brokers_last_recovery_and_rocketmq_endpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "local"
    await asyncio.to_thread(local_cluster.up, data, brokers=1, nameservers=1, console=False)
    try:
        assert await asyncio.to_thread(main, ["--data", str(data), "cluster", "status"]) == 0
        out = capsys.readouterr().out
        [broker_line] = [line for line in out.splitlines() if line.startswith("broker ")]
        assert "SERVING" in broker_line
        recovery = out.splitlines()[out.splitlines().index(broker_line) + 1]
        assert recovery.strip().startswith("last recovery ")
        assert "after a clean stop: " in recovery
        assert "bytes truncated, 0 files quarantined" in recovery
        address = broker_line.split()[2]
        endpoint = out.splitlines()[out.splitlines().index(broker_line) + 2]
        assert endpoint.strip() == f"RocketMQ 5 clients: endpoints={address}"
    finally:
        await asyncio.to_thread(local_cluster.down, data)
