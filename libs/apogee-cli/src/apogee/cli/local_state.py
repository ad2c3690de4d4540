"""What the admin commands need to find a local cluster: its folder and the record of its members.

A local cluster (started by ``apogee cluster up``, which comes with ``apogee-local``: see
:mod:`apogee.local.cluster`) is recorded in ``<data>/cluster.json``, ``<data>`` being
``$APOGEE_HOME/local`` (``~/.apogee/local``) unless ``--data`` says otherwise. The commands read
it for the nameservers (when neither ``--namesrv`` nor ``APOGEE_NAMESRV`` gives them) and for the
members' metrics addresses (``apogee top``); only the local cluster writes it.

``cluster.json`` is :class:`ClusterState` as JSON: ``data_dir``, then one list of members
(:class:`Process`) per role field, in the order members start::

    {"data_dir": "/abs/path",
     "nameservers": [{"role": "nameserver", "name": "nameserver-0", "address": "127.0.0.1:9876",
                      "pid": 4242, "log": ".../logs/nameserver-0.log", "data_dir": "",
                      "argv": ["-m", "apogee_nameserver", ...], "env": {...},
                      "metrics": "127.0.0.1:9880"}],
     "brokers": [...], "schedule": [...], "txn_checker": [...], "console": [...],
     "prometheus": [...]}

A field missing from an older file reads as no members. ``apogee cluster down`` removes the file;
the members' ports stay in ``<data>/ports.json`` for the next start (see ``apogee.local.ports``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Final

STATE_FILE: Final = "cluster.json"

#: the members' roles
NAMESERVER: Final = "nameserver"
BROKER: Final = "broker"
SCHEDULE: Final = "schedule"
TXN_CHECKER: Final = "txn-checker"
#: the role (and name) of the local cluster's web console
CONSOLE: Final = "console"
#: the role (and name) of the local cluster's Prometheus
PROMETHEUS: Final = "prometheus"


def default_data_dir() -> Path:
    """The local cluster's folder when ``--data`` is not given: ``$APOGEE_HOME/local``."""
    return Path(os.environ.get("APOGEE_HOME", Path.home() / ".apogee")) / "local"


@dataclass
class Process:
    """One member of the local cluster."""

    role: str
    name: str
    address: str
    pid: int
    log: str
    data_dir: str = ""
    #: how it was started, so that it can be started again
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    #: host:port of its /metrics endpoint ("" when it has none)
    metrics: str = ""

    @property
    def broker_name(self) -> str:
        """A broker's name in routes: its ``--name`` (the replicas of a group share it, each a
        member of its own, ``<name>-<n>``), else the member's name."""
        if "--name" in self.argv[:-1]:
            return self.argv[self.argv.index("--name") + 1]
        return self.name


@dataclass
class ClusterState:
    """The members of a local cluster, as recorded in ``<data_dir>/cluster.json``."""

    data_dir: str
    nameservers: list[Process] = field(default_factory=list)
    brokers: list[Process] = field(default_factory=list)
    #: the schedule service (none, or one)
    schedule: list[Process] = field(default_factory=list)
    #: the transaction checker (none, or one)
    txn_checker: list[Process] = field(default_factory=list)
    #: the web console (none, or one)
    console: list[Process] = field(default_factory=list)
    #: Prometheus, scraping the others (none, or one)
    prometheus: list[Process] = field(default_factory=list)

    @property
    def namesrv(self) -> str:
        return ";".join(p.address for p in self.nameservers)

    def all(self) -> list[Process]:
        return [
            *self.nameservers,
            *self.brokers,
            *self.schedule,
            *self.txn_checker,
            *self.console,
            *self.prometheus,
        ]

    def save(self) -> None:
        """Write ``cluster.json`` (whole: a reader never sees half of it)."""
        path = Path(self.data_dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, data_dir: Path) -> ClusterState | None:
        """The cluster recorded in ``data_dir``; None when there is none."""
        path = data_dir / STATE_FILE
        if not path.exists():
            return None
        raw = json.loads(path.read_text())
        return cls(
            data_dir=raw["data_dir"],
            nameservers=[Process(**p) for p in raw.get("nameservers", [])],
            brokers=[Process(**p) for p in raw.get("brokers", [])],
            schedule=[Process(**p) for p in raw.get("schedule", [])],
            txn_checker=[Process(**p) for p in raw.get("txn_checker", [])],
            console=[Process(**p) for p in raw.get("console", [])],
            prometheus=[Process(**p) for p in raw.get("prometheus", [])],
        )
