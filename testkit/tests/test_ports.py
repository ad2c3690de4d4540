"""Free ports, and the default ports a test must never bind: the list is every service's and
the local cluster's defaults, and the session holds them."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from apogee.local import cluster, prometheus, webconsole
from apogee.testkit.ports import DEFAULT_PORTS, free_port, holding
from apogee_broker.settings import BrokerSettings
from apogee_console.settings import ConsoleSettings
from apogee_nameserver.settings import NameServerSettings
from apogee_operator.settings import OperatorSettings
from apogee_schedule.settings import ScheduleSettings
from apogee_txn_checker.settings import TxnCheckerSettings

pytestmark = pytest.mark.unit

SETTINGS: list[tuple[str, type]] = [
    ("nameserver", NameServerSettings),
    ("broker", BrokerSettings),
    ("schedule", ScheduleSettings),
    ("txn-checker", TxnCheckerSettings),
    ("operator", OperatorSettings),
    ("console", ConsoleSettings),
]


def default_port(settings: type, name: str) -> int:
    [field] = [f for f in dataclasses.fields(settings) if f.name == name]
    return int(str(field.default).rpartition(":")[2])


@pytest.mark.parametrize(("service", "settings"), SETTINGS)
def test_every_default_listen_address_of_the_services_is_listed(
    service: str, settings: type
) -> None:
    assert DEFAULT_PORTS[service] == default_port(settings, "listen")
    assert DEFAULT_PORTS[f"{service} metrics"] == default_port(settings, "metrics_listen")


def test_the_local_clusters_first_ports_are_listed() -> None:
    firsts = {
        cluster.NAMESERVER_PORT,
        cluster.NAMESERVER_METRICS_PORT,
        cluster.BROKER_PORT,
        cluster.BROKER_METRICS_PORT,
        cluster.SCHEDULE_PORT,
        cluster.SCHEDULE_METRICS_PORT,
        cluster.TXN_CHECKER_PORT,
        cluster.TXN_CHECKER_METRICS_PORT,
        prometheus.DEFAULT_PORT,
        webconsole.PORT,
        webconsole.METRICS_PORT,
    }
    assert firsts <= set(DEFAULT_PORTS.values())


def bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


@pytest.mark.parametrize("port", sorted(DEFAULT_PORTS.values()))
def test_no_test_can_bind_a_default_port(port: int) -> None:
    # held by this session, or by someone else (a running local cluster)
    assert not bindable("127.0.0.1", port)


def test_a_free_port_is_free_and_a_held_one_is_not() -> None:
    port = free_port()
    assert bindable("127.0.0.1", port)
    with holding([port, port]) as held:
        assert held == [port]  # the second try finds it taken, and leaves it
        assert not bindable("127.0.0.1", port)
        assert not bindable("0.0.0.0", port)
    assert bindable("127.0.0.1", port)
    assert bindable("0.0.0.0", free_port("0.0.0.0"))
