"""What the container tests share: podman set up by ``scripts/container_engine.sh``, the images
built once by ``scripts/images.sh``, containers polled until their image's health check passes,
and a docker-compose.yml stack under ``podman-compose`` with a project name, ports and network
of its own, always taken down with its volumes.

Every podman command has a time limit, and a failing one raises with its output. Nothing waits
by sleeping alone: each wait polls a condition until a deadline.
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from apogee.testkit import ports
from apogee.testkit.waiting import wait_until

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("nameserver", "broker", "schedule", "txn-checker")
#: every image of the root Dockerfile (a stage each): the services' and the tools image
PYTHON_IMAGES = (*SERVICES, "operator", "console", "cli")
#: images scripts/images.sh builds for the tests: those, and compose's Prometheus
IMAGES = (*PYTHON_IMAGES, "prometheus")
#: the Dockerfile of every Python image
DOCKERFILE = ROOT / "Dockerfile"
UID = 10001
#: seconds: setting up podman on a fresh machine (packages, a debootstrap), all the builds
SETUP_TIMEOUT = 900.0
#: seconds one podman command may take (a compose up or down too)
COMMAND_TIMEOUT = 180.0
#: seconds a container may take to pass its health check
HEALTHY_TIMEOUT = 90.0


class ContainerError(AssertionError):
    """A podman or compose command failed; the message carries its output."""


def run(
    args: Sequence[str],
    *,
    timeout: float = COMMAND_TIMEOUT,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``args`` from the repository root; raise :class:`ContainerError` with its output when
    it fails (``check``) or outlives ``timeout``."""
    try:
        done = subprocess.run(
            list(args),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(env) if env is not None else None,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ContainerError(f"{' '.join(args)}: no end after {timeout:.0f} s") from exc
    except FileNotFoundError as exc:
        raise ContainerError(f"{args[0]} is not installed ({exc})") from exc
    if check and done.returncode != 0:
        raise ContainerError(
            f"{' '.join(args)} exited {done.returncode}\n"
            f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
        )
    return done


def podman(*args: str, timeout: float = COMMAND_TIMEOUT, check: bool = True) -> str:
    return run(["podman", *args], timeout=timeout, check=check).stdout


def set_up_engine() -> None:
    """``scripts/container_engine.sh``: podman installed and able to run a container, the
    base image made. Fails saying why when it cannot be."""
    run(["bash", "scripts/container_engine.sh"], timeout=SETUP_TIMEOUT)


def build_images() -> float:
    """``scripts/images.sh`` with podman for every image the tests use; returns its seconds."""
    start = time.monotonic()
    env = {**os.environ, "ENGINE": "podman", "QUIET": "1"}
    run(["bash", "scripts/images.sh", *IMAGES], timeout=SETUP_TIMEOUT, env=env)
    return time.monotonic() - start


def dockerfile_stages(dockerfile: Path = DOCKERFILE) -> dict[str, list[str]]:
    """Stage name -> its instructions (``FROM`` first; comments and blank lines left out, a
    continued instruction joined into one line), in the order of the file. An unnamed stage is
    named by its number."""
    stages: dict[str, list[str]] = {}
    current: list[str] | None = None
    text = re.sub(r"[ \t]*\\\n[ \t]*", " ", dockerfile.read_text())
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        words = line.split()
        if words[0].upper() == "FROM":
            name = words[3] if len(words) > 3 and words[2].upper() == "AS" else str(len(stages))
            current = stages[name] = []
        if current is not None:
            current.append(line)
    return stages


def wait_for(what: str, condition: Callable[[], bool], timeout: float, every: float = 0.5) -> None:
    """Poll ``condition`` every ``every`` seconds until it holds; fail naming ``what`` after
    ``timeout`` seconds (:func:`apogee.testkit.waiting.wait_until`, with the argument order the
    container tests read best in)."""
    wait_until(condition, timeout, what, every=every)


def wait_scraped(prometheus_port: int, members: set[str], timeout: float = 60) -> None:
    """Wait until the Prometheus on ``prometheus_port`` scrapes exactly ``members`` (by their
    ``member`` label), every one up; fail naming each target's health."""
    url = f"http://127.0.0.1:{prometheus_port}/api/v1/targets"
    seen: dict[str, str] = {}

    def all_up() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                targets = json.load(resp)["data"]["activeTargets"]
        except OSError:
            return False
        seen.clear()
        seen.update({t["labels"]["member"]: t["health"] for t in targets})
        return set(seen) == members and set(seen.values()) == {"up"}

    try:
        wait_for(f"{sorted(members)} scraped by Prometheus", all_up, timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: targets {seen}") from None


def wait_healthy(container: str, timeout: float = HEALTHY_TIMEOUT) -> None:
    """Poll the image's HEALTHCHECK in ``container`` until it passes (podman runs health checks
    by itself only through systemd timers, so each is run here, on demand); fail at once with
    the container's log when it stopped."""

    def check() -> bool:
        state = inspect(container)["State"]
        if state["Status"] != "running":
            raise AssertionError(
                f"{container} is {state['Status']} (exit code {state.get('ExitCode')})\n"
                + logs(container)
            )
        done = run(["podman", "healthcheck", "run", container], check=False, timeout=30)
        return done.returncode == 0

    wait_for(f"{container} answers its health check", check, timeout)


def inspect(name: str, kind: str = "container") -> dict[str, Any]:
    found: list[dict[str, Any]] = json.loads(podman(kind, "inspect", name))
    return found[0]


def logs(container: str, lines: int = 60) -> str:
    done = run(["podman", "logs", "--tail", str(lines), container], check=False, timeout=30)
    return f"--- {container}\n{done.stdout}{done.stderr}"


def free_port() -> int:
    """A TCP port free on every address of this machine (compose publishes on all of them)."""
    return ports.free_port("0.0.0.0")


def free_net_prefix() -> str:
    """A /24 for a compose network, as its first three numbers: one in 10.89.128-254 that no
    podman network and no route of this machine uses."""
    used = set()
    names = podman("network", "ls", "--format", "{{.Name}}").split()
    if names:
        for net in json.loads(podman("network", "inspect", *names)):
            for subnet in net.get("subnets") or []:
                used.add(".".join(subnet["subnet"].split(".")[:3]))
    used |= {".".join(ip.split(".")[:3]) for ip in _routed()}
    free = [f"10.89.{n}" for n in range(128, 255) if f"10.89.{n}" not in used]
    assert free, "no free 10.89.x.0/24 for the compose network"
    return random.choice(free)


def _routed() -> list[str]:
    """The destinations of this machine's IPv4 routes (``/proc/net/route``, hexadecimal in
    the host's byte order)."""
    lines = Path("/proc/net/route").read_text().splitlines()[1:]
    return [socket.inet_ntoa(int(line.split()[1], 16).to_bytes(4, sys.byteorder)) for line in lines]


@dataclass
class ComposeStack:
    """docker-compose.yml run by ``podman-compose`` under a project name of its own, with free
    published ports and a network of its own; :meth:`down` always (also after a failure)."""

    profiles: Sequence[str] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    project: str = field(default_factory=lambda: f"apogee-e2e-{uuid.uuid4().hex[:8]}")
    ports: dict[str, int] = field(default_factory=dict)
    net_prefix: str = ""

    def __post_init__(self) -> None:
        for name in ("NAMESERVER", "BROKER_A", "BROKER_B", "PROMETHEUS", "GRAFANA"):
            self.ports[name] = free_port()
        self.net_prefix = free_net_prefix()

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("APOGEE_")}
        env.update({f"APOGEE_{name}_PORT": str(port) for name, port in self.ports.items()})
        env["APOGEE_NET_PREFIX"] = self.net_prefix
        env.update(self.extra_env)
        return env

    @property
    def namesrv(self) -> str:
        """The nameserver as a client on this machine reaches it."""
        return f"127.0.0.1:{self.ports['NAMESERVER']}"

    @property
    def gateway(self) -> str:
        """The compose network's gateway: the host in the brokers' advertised addresses."""
        return f"{self.net_prefix}.1"

    @property
    def network(self) -> str:
        return f"{self.project}_default"

    def compose(self, *args: str, timeout: float = COMMAND_TIMEOUT) -> str:
        command = [sys.executable, "-m", "podman_compose", "-p", self.project]
        for profile in self.profiles:
            command += ["--profile", profile]
        return run([*command, *args], env=self.env, timeout=timeout).stdout

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def up(self) -> None:
        self.compose("up", "-d")

    def down(self) -> list[str]:
        """``down -v``, then whatever of the project is still there removed by force; returns
        what had to be forced (empty when compose took everything down)."""
        errors = []
        try:
            self.compose("down", "-v", "--timeout", "20")
        except ContainerError as exc:
            errors.append(str(exc))
        label = f"label=io.podman.compose.project={self.project}"
        left = podman("ps", "-a", "-q", "--filter", label, check=False).split()
        if left:
            podman("rm", "-f", "-v", "-t", "0", *left, check=False)
            errors.append(f"containers left: {left}")
        volumes = podman("volume", "ls", "-q", "--filter", label, check=False).split()
        if volumes:
            podman("volume", "rm", "-f", *volumes, check=False)
            errors.append(f"volumes left: {volumes}")
        if run(["podman", "network", "exists", self.network], check=False).returncode == 0:
            podman("network", "rm", "-f", self.network, check=False)
            errors.append(f"network left: {self.network}")
        return errors

    def log_tails(self, lines: int = 60) -> str:
        label = f"label=io.podman.compose.project={self.project}"
        names = podman("ps", "-a", "--format", "{{.Names}}", "--filter", label, check=False)
        return "\n".join(logs(name, lines) for name in names.split())
