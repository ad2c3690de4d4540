"""Every member of the local cluster serves /metrics on a port of its own, recorded in
``cluster.json`` and shown by ``apogee cluster status``; a send shows in the broker's metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from apogee.cli.main import main
from apogee.common.metrics import scrape
from apogee.local import cluster as local_cluster
from apogee.local.cluster import ClusterState

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PREFIXES = {
    "nameserver": "process_",
    "broker": "apogee_broker_",
    "schedule": "apogee_schedule_",
    "txn-checker": "apogee_txn_checker_",
}


def test_every_member_serves_metrics_on_its_own_port(
    data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = local_cluster.up(data, brokers=2, timeout=60, console=False)
    members = state.all()
    assert [p.role for p in members] == [
        "nameserver",
        "broker",
        "broker",
        "schedule",
        "txn-checker",
    ]
    addresses = [p.metrics for p in members]
    ports = [int(a.rpartition(":")[2]) for a in addresses]
    grpc_ports = [int(p.address.rpartition(":")[2]) for p in members]
    assert len(set(ports) | set(grpc_ports)) == 2 * len(members)
    assert ClusterState.load(data) == state  # recorded in cluster.json
    for p in members:
        names = scrape(p.metrics).names()
        assert any(n.startswith(PREFIXES[p.role]) for n in names), p.name
        assert "process_cpu_seconds_total" in names

    assert main(["--data", str(data), "send", "Metered", "hello"]) == 0
    capsys.readouterr()
    counted = [
        scrape(b.metrics).get_sample("apogee_broker_messages_in_total", topic="Metered") or 0
        for b in state.brokers
    ]
    assert sum(counted) == 1

    assert main(["--data", str(data), "cluster", "status"]) == 0
    shown = capsys.readouterr().out
    for p in members:
        assert f"metrics http://{p.metrics}/metrics" in shown
