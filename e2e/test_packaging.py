"""The parts install alone, as a user installs them: wheels built from this workspace, each put
into a fresh virtual environment of its own.

- ``apogee-client`` alone (with Apogee's small libraries it declares, and grpcio and protobuf):
  the storage engine, the services and the command are not there, and it sends to and consumes
  from a running cluster (this session's shared one).
- ``apogee-cli`` alone: the ``apogee`` command over the SDK, without the services, the storage
  engine, the local cluster or ``kubernetes``; its admin commands work against the shared
  cluster, and ``apogee cluster up`` says to install ``apogee-local``.
- ``apogee-local``: ``apogee cluster up`` starts a local cluster with the services it declares,
  and stops it.

Each environment is built with ``uv`` (``uv build``, ``uv venv``, ``uv pip install``): Apogee's
distributions as the wheels built here, named one by one (what the lock says the distribution
needs, so that nothing of the same name comes from the index), third-party packages from the
package index through uv's cache, held to the lock's versions. Processes and folders are cleaned
up whatever happens, and every step has a time limit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from apogee.local import cluster as local_cluster
from e2e.harness import Cluster, in_thread

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
TOPIC = "E2EPackaging"
CLI_TOPIC = "E2EPackagingCli"
#: Seconds a build or an install may take (a cold uv cache downloads grpcio and protobuf).
INSTALL_TIMEOUT = 300.0
#: Seconds a script in a fresh environment, or one `apogee` command, may take.
RUN_TIMEOUT = 90.0

#: What the client's environment must hold, and what it must not.
CLIENT_MODULES = ["apogee.client", "apogee.codec", "apogee.common", "apogee.rpc", "apogee.v1"]
NOT_IN_CLIENT = [
    "apogee.store",
    "apogee.cli",
    "apogee_broker",
    "apogee_nameserver",
    "apogee_schedule",
]
#: What the command's environment must not hold: distributions, and modules.
NOT_WITH_CLI = [
    "apogee-broker",
    "apogee-store",
    "apogee-nameserver",
    "apogee-schedule",
    "apogee-txn-checker",
    "apogee-service",
    "apogee-local",
    "kubernetes",
]
NOT_IN_CLI = ["apogee.local", "apogee.store", "apogee.service", "apogee_broker", "kubernetes"]
CLUSTER_NOT_INSTALLED = (
    "apogee: `apogee cluster` needs apogee-local, which is not installed here; "
    "install it with `pip install apogee-local`"
)


def _env() -> dict[str, str]:
    """The environment of the commands: no virtual environment, path or Apogee setting leaks in
    from the one running the tests."""
    drop = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "UV_PROJECT_ENVIRONMENT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("APOGEE_")}
    env["UV_PYTHON_DOWNLOADS"] = "never"
    return env


def _run(
    args: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> str:
    done = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or _env(),
        cwd=cwd,
        check=False,
    )
    assert done.returncode == 0, (
        f"{' '.join(args)} exited {done.returncode}\nstdout: {done.stdout}\nstderr: {done.stderr}"
    )
    return done.stdout


def _uv() -> str:
    uv = shutil.which("uv")
    assert uv, "these tests build wheels and environments with uv, which is not on PATH"
    return uv


class Wheels:
    """The workspace's distributions as wheels in ``folder``, each built when first needed (a
    build takes seconds; the command's environment needs 6 of the 17)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def of(self, distribution: str) -> list[Path]:
        """The wheels of ``distribution`` and of the workspace's distributions it needs."""
        out: list[Path] = []
        for name in _members(distribution):
            pattern = f"{name.replace('-', '_')}-*.whl"
            if not any(self.folder.glob(pattern)):
                build = [_uv(), "build", "--wheel", "--quiet", "--package", name]
                _run([*build, "-o", str(self.folder)], INSTALL_TIMEOUT, cwd=ROOT)
            out += self.folder.glob(pattern)
        return out


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wheels]:
    out = tmp_path_factory.mktemp("wheels")
    try:
        yield Wheels(out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """A folder for the test's environments, removed afterwards, failed test or not (an
    environment holds tens of megabytes)."""
    try:
        yield tmp_path
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _export(distribution: str, *options: str) -> str:
    """What the lock says ``distribution`` needs (no development groups), as requirements."""
    export = [_uv(), "export", "--frozen", "--no-dev", "--no-hashes", "--package", distribution]
    return _run([*export, *options], RUN_TIMEOUT, cwd=ROOT)


def _members(distribution: str) -> list[str]:
    """The workspace's distributions ``distribution`` needs, itself included."""
    lines = _export(distribution, "--no-annotate", "--no-header").splitlines()
    folders = [line.removeprefix("-e ").strip() for line in lines if line.startswith("-e ")]
    return [
        tomllib.loads((ROOT / f / "pyproject.toml").read_text())["project"]["name"] for f in folders
    ]


def _venv_with(wheels: Wheels, where: Path, distribution: str) -> Path:
    """A fresh virtual environment at ``where`` holding the wheel of ``distribution`` and what
    it declares (Apogee's from ``wheels``, the rest from the index at the lock's versions); its
    Python."""
    _run([_uv(), "venv", "--quiet", "--python", sys.executable, str(where)], INSTALL_TIMEOUT)
    python = where / "bin" / "python"
    pins = where.parent / f"{where.name}-pins.txt"
    pins.write_text(_export(distribution, "--no-emit-workspace"))
    install = [_uv(), "pip", "install", "--quiet", "--python", str(python), "-c", str(pins)]
    _run([*install, *map(str, wheels.of(distribution))], INSTALL_TIMEOUT)
    return python


def _installed(python: Path) -> set[str]:
    """The distributions of the environment of ``python``."""
    listed = _run([_uv(), "pip", "list", "--format", "json", "--python", str(python)], RUN_TIMEOUT)
    return {d["name"] for d in json.loads(listed)}


FIND_MODULES = """
import importlib.util, json, sys
print(json.dumps({m: importlib.util.find_spec(m) is not None for m in sys.argv[1:]}))
"""

SEND_AND_CONSUME = """
import asyncio, json, sys

from apogee.client import AdminClient, Message, Producer, PullConsumer

async def main(namesrv: str, topic: str) -> None:
    async with AdminClient(namesrv) as admin:
        await admin.create_or_update_topic(topic, queues=2)
    async with Producer(namesrv, group="packaging") as producer:
        sent = await producer.send(Message(topic, b"from a client installed alone", tags="t"))
    got = []
    options = {"rebalance_interval": 1.0, "long_poll_timeout": 2.0, "consume_from": "earliest"}
    async with PullConsumer(namesrv, "packaging-readers", **options) as consumer:
        consumer.subscribe(topic)
        await consumer.start()
        async with asyncio.timeout(60):
            while not got:
                got = await consumer.poll(timeout=2)
    m = got[0]
    print(json.dumps({"sent": sent.message_id, "got": m.unique_id, "body": m.body.decode(),
                      "tags": m.tags, "count": len(got)}))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_the_client_installs_alone_and_talks_to_a_cluster(
    wheels: Wheels, scratch: Path, cluster: Cluster
) -> None:
    python = _venv_with(wheels, scratch / "client-venv", "apogee-client")

    found = json.loads(
        _run([str(python), "-I", "-c", FIND_MODULES, *CLIENT_MODULES, *NOT_IN_CLIENT], RUN_TIMEOUT)
    )
    assert {m for m in CLIENT_MODULES if not found[m]} == set(), found
    assert {m for m in NOT_IN_CLIENT if found[m]} == set(), found
    installed = _run([_uv(), "pip", "list", "--python", str(python)], RUN_TIMEOUT)
    assert "apogee-store" not in installed, installed
    assert "apogee-broker" not in installed, installed
    assert not (scratch / "client-venv" / "bin" / "apogee").exists()

    outcome = json.loads(
        _run([str(python), "-I", "-c", SEND_AND_CONSUME, cluster.namesrv, TOPIC], RUN_TIMEOUT)
    )
    assert outcome["got"] == outcome["sent"]
    assert (outcome["body"], outcome["tags"], outcome["count"]) == (
        "from a client installed alone",
        "t",
        1,
    )


def test_the_command_installs_without_the_services_and_talks_to_a_cluster(
    wheels: Wheels, scratch: Path, cluster: Cluster
) -> None:
    python = _venv_with(wheels, scratch / "cli-venv", "apogee-cli")
    installed = _installed(python)
    assert {"apogee-cli", "apogee-client"} <= installed, installed
    assert installed.isdisjoint(NOT_WITH_CLI), installed & set(NOT_WITH_CLI)
    found = json.loads(
        _run([str(python), "-I", "-c", FIND_MODULES, "apogee.cli", *NOT_IN_CLI], RUN_TIMEOUT)
    )
    assert found == {"apogee.cli": True, **dict.fromkeys(NOT_IN_CLI, False)}, found

    apogee = str(python.parent / "apogee")
    env = {**_env(), "APOGEE_HOME": str(scratch / "home")}
    admin = [apogee, "--namesrv", cluster.namesrv, "topic"]
    created = _run([*admin, "create", CLI_TOPIC, "--queues", "2"], RUN_TIMEOUT, env)
    assert f"created {CLI_TOPIC} on broker-a" in created, created
    assert CLI_TOPIC in _run([*admin, "list"], RUN_TIMEOUT, env).splitlines()

    # the local cluster is not there: the command says what to install, and starts nothing
    up = subprocess.run(
        [apogee, "cluster", "up", "--brokers", "2"],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env=env,
        check=False,
    )
    assert (up.returncode, up.stdout, up.stderr) == (1, "", CLUSTER_NOT_INSTALLED + "\n")
    assert not (scratch / "home").exists()


def test_the_local_cluster_installs_with_the_services_it_starts(
    wheels: Wheels, scratch: Path
) -> None:
    python = _venv_with(wheels, scratch / "local-venv", "apogee-local")
    apogee = str(python.parent / "apogee")
    data = scratch / "cluster"
    env = {**_env(), "APOGEE_HOME": str(scratch / "home")}
    try:
        up = _run([apogee, "--data", str(data), "cluster", "up"], RUN_TIMEOUT, env)
        state = local_cluster.ClusterState.load(data.resolve())
        assert state is not None, up
        members = state.all()
        roles = {p.role for p in members}
        assert roles == {"nameserver", "broker", "schedule", "txn-checker"}, up
        for p in members:  # each runs the command environment's interpreter and services
            argv = Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")
            assert argv[0].decode() == str(python), (p.name, argv)
        status = _run([apogee, "--data", str(data), "cluster", "status"], RUN_TIMEOUT, env)
        assert status.count("SERVING") == len(members), status
        down = _run([apogee, "--data", str(data), "cluster", "down"], RUN_TIMEOUT, env)
        assert down.count("stopped") == len(members), down
        assert not [p.name for p in members if local_cluster.pid_alive(p.pid)], down
    finally:  # whatever happened, nothing the command started keeps running
        left = local_cluster.ClusterState.load(data.resolve()) if data.exists() else None
        if left is not None:
            in_thread(lambda: local_cluster.down(data))
            for p in left.all():
                if local_cluster.pid_alive(p.pid):
                    os.kill(p.pid, signal.SIGKILL)
