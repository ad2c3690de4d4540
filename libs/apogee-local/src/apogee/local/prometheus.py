"""A Prometheus server of one's own: write its configuration, start it, wait until it is ready,
and ask it questions over its HTTP API. The local cluster (``apogee cluster up --monitoring``)
runs one this way; tests and tools that draw pictures of the metrics use the same calls.

The server is the ``prometheus`` program of Debian's ``prometheus`` package
(``apt-get install -y prometheus``); nothing here downloads it. ::

    jobs = [ScrapeJob("broker", (Target("127.0.0.1:10912", {"member": "broker-a"}),))]
    config = write_config(folder / "prometheus.yml", jobs, scrape_interval_s=1.0)
    log = folder / "prometheus.log"
    proc = start(config, folder / "data", "127.0.0.1:9090", log)
    try:
        wait_ready("127.0.0.1:9090", time.monotonic() + 30, proc=proc, log=log)
        rates = "sum by (topic) (rate(apogee_broker_messages_in_total[1m]))"
        for s in query("127.0.0.1:9090", rates):
            print(s.labels["topic"], s.value)
        series = query_range("127.0.0.1:9090", rates, time.time() - 600, time.time(), step=5)
    finally:
        stop(proc)

- :func:`find_binary`: the program's path, or :class:`PrometheusNotFoundError` saying to install
  the package.
- :func:`config_text` / :func:`write_config`: one scrape job per :class:`ScrapeJob` (its
  targets' ``host:port`` and labels), a global scrape interval (the scrape timeout equals it).
  Written as JSON, which is YAML, so no YAML library is needed.
- :func:`scrape_jobs`: the jobs of a set of members (anything with ``role``, ``name`` and
  ``metrics``, such as the local cluster's ``Process``): one job per role, label ``member``.
- :func:`command`, :func:`start`, :func:`stop`: the program's arguments; a start in a session of
  its own (it outlives the caller), its output appended to a log; a bounded stop.
- :func:`is_ready`, :func:`wait_ready`: ``GET /-/ready``; waiting polls it until a deadline and
  fails early, quoting the log, when the process has exited.
- :func:`query`, :func:`query_range`, :func:`targets`: ``/api/v1/query``,
  ``/api/v1/query_range`` and ``/api/v1/targets``. A ready Prometheus loads its targets on a
  5-second tick: poll :func:`targets` until they are ``up`` before expecting their series.

Errors::

    PrometheusError                 anything below, with a sentence saying what and where
     ├── PrometheusNotFoundError    the program is not installed
     └── QueryError                 the API refused a query or could not be reached
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol

#: The program's name, as Debian's ``prometheus`` package installs it (``/usr/bin/prometheus``).
BINARY: Final = "prometheus"
#: Where Prometheus listens unless told otherwise (the local cluster takes the next free port).
DEFAULT_PORT: Final = 9090
#: Seconds between scrapes of each target unless told otherwise.
DEFAULT_SCRAPE_INTERVAL_S: Final = 5.0
#: The line that says how to get the program.
INSTALL_HINT: Final = "install Debian's prometheus package (apt-get install -y prometheus)"
#: Seconds between two looks at ``/-/ready`` while waiting.
_POLL_S: Final = 0.1


class PrometheusError(Exception):
    """Starting or asking Prometheus failed; the message says what and where to look."""


class PrometheusNotFoundError(PrometheusError):
    """The ``prometheus`` program is not installed."""


class QueryError(PrometheusError):
    """The HTTP API refused a query (bad PromQL, a bad time) or could not be reached."""


@dataclass(frozen=True)
class Target:
    """One endpoint to scrape: ``host:port`` (its ``/metrics``) and labels added to its series."""

    address: str
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ScrapeJob:
    """A scrape job: its ``job`` label and its targets."""

    name: str
    targets: tuple[Target, ...]


class Member(Protocol):
    """What :func:`scrape_jobs` reads of a member (the local cluster's ``Process`` has it)."""

    @property
    def role(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def metrics(self) -> str: ...


@dataclass(frozen=True)
class Sample:
    """One element of an instant query's answer: labels, value, and time (epoch seconds)."""

    labels: dict[str, str]
    value: float
    timestamp: float


@dataclass(frozen=True)
class Series:
    """One series of a range query's answer: labels and (epoch seconds, value) points."""

    labels: dict[str, str]
    points: list[tuple[float, float]]


@dataclass(frozen=True)
class TargetHealth:
    """One active target as Prometheus sees it: ``health`` is ``up``, ``down`` or ``unknown``
    (not scraped yet); ``last_error`` is empty when the last scrape worked."""

    job: str
    address: str
    labels: dict[str, str]
    health: str
    last_error: str


# -- the program --------------------------------------------------------------------------------


def find_binary(name: str = BINARY) -> str:
    """The path of the ``prometheus`` program (``name`` may be a path or a name on ``PATH``)."""
    found = shutil.which(name)
    if found is None:
        raise PrometheusNotFoundError(
            f"Prometheus is not installed (no {name!r} program on PATH): {INSTALL_HINT}"
        )
    return found


def duration_text(seconds: float) -> str:
    """A Prometheus duration for ``seconds`` (``5s``, ``250ms``); at least 1 ms."""
    if not math.isfinite(seconds) or seconds < 0.001:
        raise ValueError(f"a scrape interval must be at least 0.001 s, got {seconds!r}")
    ms = round(seconds * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def scrape_jobs(members: Iterable[Member]) -> list[ScrapeJob]:
    """One job per role (``job`` = the role: ``nameserver``, ``broker``, ``schedule``,
    ``txn-checker``), in order of first appearance, with a target per member that serves
    metrics, labelled ``member`` = its name. Members without a metrics address are left out."""
    by_role: dict[str, list[Target]] = {}
    for m in members:
        if m.metrics:
            by_role.setdefault(m.role, []).append(Target(m.metrics, {"member": m.name}))
    return [ScrapeJob(role, tuple(targets)) for role, targets in by_role.items()]


def config_text(jobs: Sequence[ScrapeJob], scrape_interval_s: float) -> str:
    """The configuration file's text: every job scraped each ``scrape_interval_s``."""
    interval = duration_text(scrape_interval_s)
    config: dict[str, Any] = {
        "global": {
            "scrape_interval": interval,
            "scrape_timeout": interval,
            "evaluation_interval": interval,
        },
        "scrape_configs": [
            {
                "job_name": job.name,
                "static_configs": [
                    {"targets": [t.address], "labels": dict(t.labels)} for t in job.targets
                ],
            }
            for job in jobs
        ],
    }
    return json.dumps(config, indent=2) + "\n"


def write_config(path: Path, jobs: Sequence[ScrapeJob], scrape_interval_s: float) -> Path:
    """Write :func:`config_text` to ``path`` atomically (temp file, rename); returns ``path``."""
    text = config_text(jobs, scrape_interval_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def command(config: Path, data_dir: Path, listen: str, binary: str | None = None) -> list[str]:
    """The program and its arguments: ``config``, its TSDB in ``data_dir``, HTTP on
    ``listen`` (``host:port``)."""
    return [
        binary or find_binary(),
        f"--config.file={config}",
        f"--storage.tsdb.path={data_dir}",
        f"--web.listen-address={listen}",
    ]


def start(
    config: Path, data_dir: Path, listen: str, log: Path, binary: str | None = None
) -> subprocess.Popen[bytes]:
    """Start Prometheus in a session of its own (it outlives the caller), its output appended
    to ``log``. It is not ready yet: see :func:`wait_ready`."""
    argv = command(config, data_dir, listen, binary)
    data_dir.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; returns the exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def is_ready(address: str, timeout: float = 1.0) -> bool:
    """Whether Prometheus at ``address`` (``host:port``) answers ``/-/ready`` with 200."""
    try:
        with urllib.request.urlopen(f"http://{address}/-/ready", timeout=timeout) as resp:
            return int(resp.status) == 200
    except (OSError, ValueError, http.client.HTTPException):  # refused, timed out, 503, ...
        return False


def wait_ready(
    address: str,
    deadline: float,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
) -> None:
    """Poll ``/-/ready`` until it answers 200 or ``deadline`` (``time.monotonic()``) passes;
    fails at once when ``proc`` (the server, if the caller started it) has exited."""
    where = f"; see {log}" if log is not None else ""
    while not is_ready(address):
        if proc is not None and proc.poll() is not None:
            raise PrometheusError(
                f"prometheus exited with code {proc.returncode} while starting on {address}"
                f"{where}" + (f":\n{_tail(log)}" if log is not None else "")
            )
        if time.monotonic() > deadline:
            raise PrometheusError(f"prometheus on {address} not ready in time{where}")
        time.sleep(_POLL_S)  # polling another process, with a deadline


def _tail(path: Path, lines: int = 10) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# -- the HTTP API -------------------------------------------------------------------------------


def _get(address: str, path: str, params: Mapping[str, str], timeout: float) -> Any:
    """The ``data`` of a JSON answer of the HTTP API."""
    url = f"http://{address}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 400, 422, 503: the body says why
        try:
            body = json.loads(exc.read())
        except ValueError:
            raise QueryError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except (OSError, ValueError, http.client.HTTPException) as exc:
        raise QueryError(f"prometheus at {address} cannot be asked ({path}): {exc}") from None
    if body.get("status") != "success":
        raise QueryError(
            f"prometheus at {address} refused {dict(params)}: "
            f"{body.get('errorType', 'error')}: {body.get('error', body)}"
        )
    return body["data"]


def query(address: str, promql: str, at: float | None = None, timeout: float = 5.0) -> list[Sample]:
    """An instant query (``/api/v1/query``) at ``at`` (epoch seconds; default now): one
    :class:`Sample` per element of the vector (a scalar gives one with no labels)."""
    params = {"query": promql}
    if at is not None:
        params["time"] = f"{at:.3f}"
    data = _get(address, "/api/v1/query", params, timeout)
    kind, result = data["resultType"], data["result"]
    if kind == "vector":
        return [
            Sample(dict(r["metric"]), float(r["value"][1]), float(r["value"][0])) for r in result
        ]
    if kind == "scalar":
        return [Sample({}, float(result[1]), float(result[0]))]
    raise QueryError(f"{promql!r} gives a {kind}; use query_range for series over time")


def query_range(
    address: str,
    promql: str,
    start: float,
    end: float,
    step: float,
    timeout: float = 10.0,
) -> list[Series]:
    """A range query (``/api/v1/query_range``) from ``start`` to ``end`` (epoch seconds) every
    ``step`` seconds: one :class:`Series` per series."""
    params = {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
    data = _get(address, "/api/v1/query_range", params, timeout)
    return [
        Series(dict(r["metric"]), [(float(t), float(v)) for t, v in r["values"]])
        for r in data["result"]
    ]


def targets(address: str, timeout: float = 5.0) -> list[TargetHealth]:
    """The active targets (``/api/v1/targets``) and the health of their last scrape."""
    data = _get(address, "/api/v1/targets", {"state": "active"}, timeout)
    return [
        TargetHealth(
            job=t["labels"].get("job", t.get("scrapePool", "")),
            address=t["labels"].get("instance", ""),
            labels=dict(t["labels"]),
            health=t.get("health", "unknown"),
            last_error=t.get("lastError", ""),
        )
        for t in data["activeTargets"]
    ]
