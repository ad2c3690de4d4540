"""The ports of a local cluster's members, kept from one start to the next.

While the cluster runs, ``cluster.json`` records each member's address and metrics address.
``apogee cluster down`` removes that file and keeps the ports in ``<data>/ports.json``, each
member's by name (one that has left the cluster, a console left out say, keeps its entry)::

    {"nameserver-0": {"address": "127.0.0.1:9876", "metrics": "127.0.0.1:9880"},
     "broker-a": {"address": "127.0.0.1:10911", "metrics": "127.0.0.1:10912"}, ...}

``apogee cluster up`` gives each member it starts the ports recorded for its name (a
``cluster.json`` left behind by a cluster that stopped without ``down``, after a reboot say,
is added to this file first), and fails naming the port and the process that holds it when one
is taken; a member recorded nowhere gets a free port from its default. Deleting ``ports.json``
forgets the ports.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from apogee.cli.local_state import STATE_FILE, ClusterState, Process
from apogee.local import processes
from apogee.local.processes import ClusterError

PORTS_FILE: Final = "ports.json"


@dataclass(frozen=True)
class Recorded:
    """The ports recorded for one member, and the file they were recorded in."""

    port: int | None
    metrics: int | None
    source: Path


def port_of(address: str) -> int | None:
    """The port of ``host:port`` (None when there is none: an empty address)."""
    port = address.rpartition(":")[2]
    return int(port) if port.isdigit() else None


def recorded(data_dir: Path) -> dict[str, Recorded]:
    """Each member's ports recorded in ``ports.json``, by name."""
    return {
        name: Recorded(port_of(address), port_of(metrics), data_dir / PORTS_FILE)
        for name, (address, metrics) in _load(data_dir).items()
    }


def remember(state: ClusterState) -> None:
    """Write ``ports.json``: ``state``'s members over those recorded before."""
    data_dir = Path(state.data_dir)
    ports = {
        name: {"address": address, "metrics": metrics}
        for name, (address, metrics) in _load(data_dir).items()
    }
    for p in state.all():
        ports[p.name] = {"address": p.address, "metrics": p.metrics}
    path = data_dir / PORTS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(ports, indent=2))
    tmp.replace(path)


def _load(data_dir: Path) -> dict[str, tuple[str, str]]:
    """name -> (address, metrics) from ``ports.json`` ({} when there is none)."""
    path = data_dir / PORTS_FILE
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text())
        return {
            str(n): (str(e.get("address", "")), str(e.get("metrics", ""))) for n, e in raw.items()
        }
    except (OSError, ValueError, AttributeError) as exc:
        raise ClusterError(
            f"{path}: not a record of ports ({exc}); delete it to start on new ports"
        ) from None


class Allotment:
    """Ports for the members being started: each one's recorded port (kept from its last start,
    :mod:`apogee.local.ports`), which must be free, else one ``pick`` finds from its default;
    none given twice (``taken``)."""

    def __init__(
        self, taken: set[int], recorded: dict[str, Recorded], pick: Callable[[int, set[int]], int]
    ) -> None:
        self.taken = taken
        self.recorded = recorded
        #: a free port at or above a default, not in ``taken`` (which it adds it to)
        self.pick = pick

    def check(self, names: Iterable[str]) -> None:
        """Fail, before anything starts, when a port recorded for one of ``names`` is taken."""
        for name in names:
            r = self.recorded.get(name)
            if r is None:
                continue
            for port, what in ((r.port, "address"), (r.metrics, "metrics address")):
                if port is not None and not processes.port_free(port):
                    raise taken_error(port, name, what, r.source)

    def port(self, name: str, preferred: int) -> int:
        r = self.recorded.get(name)
        return self._claim(name, r.port if r else None, "address", preferred)

    def metrics(self, name: str, prefix: str, preferred: int, env: dict[str, str]) -> str:
        """The member's metrics address: the one ``env`` sets, else its recorded port or a free
        one at or above ``preferred``, put into ``env`` as ``APOGEE_<prefix>_METRICS_LISTEN``."""
        var = f"APOGEE_{prefix}_METRICS_LISTEN"
        if var not in env:
            r = self.recorded.get(name)
            port = self._claim(name, r.metrics if r else None, "metrics address", preferred)
            env[var] = f"127.0.0.1:{port}"
        return env[var]

    def _claim(self, name: str, recorded: int | None, what: str, preferred: int) -> int:
        if recorded is None:
            return self.pick(preferred, self.taken)
        if recorded in self.taken or not processes.port_free(recorded):
            raise taken_error(recorded, name, what, self.recorded[name].source)
        self.taken.add(recorded)
        return recorded


def taken_error(port: int, name: str, what: str, source: Path) -> ClusterError:
    """The error for ``name``'s recorded ``port`` (its ``what``, recorded in ``source``) taken
    by another process: who holds it, and what to do."""
    record = source.parent / PORTS_FILE
    forget = (
        f"delete {record}" if source == record else f"run `apogee cluster down` and delete {record}"
    )
    return ClusterError(
        f"port {port} of {name} (its {what}, recorded in {source}) is taken by "
        f"{processes.port_holder(port)}; stop that process and run `apogee cluster up` again, "
        f"or {forget} to start on new ports"
    )


def check_restartable(state: ClusterState, member: Process) -> None:
    """Fail, before anything starts, when ``member`` cannot start again as recorded: no
    command recorded, or one of its ports taken."""
    if not member.argv:
        raise ClusterError(
            f"{member.name} in {Path(state.data_dir) / STATE_FILE} has no recorded command; "
            "run `apogee cluster down` and `apogee cluster up`"
        )
    source = Path(state.data_dir) / STATE_FILE
    for address, what in ((member.address, "address"), (member.metrics, "metrics address")):
        port = port_of(address)
        if port is not None and not processes.port_free(port):
            raise taken_error(port, member.name, what, source)
