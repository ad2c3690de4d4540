"""apogee.local.prometheus without a Prometheus: the configuration it writes, the answers of the
HTTP API it reads (from a stand-in server), waiting for readiness, the program missing; and
``apogee cluster up --monitoring`` without the program starting nothing."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from apogee.cli.main import main
from apogee.local import cluster as local_cluster
from apogee.local import prometheus
from apogee.local.prometheus import ScrapeJob, Target

pytestmark = pytest.mark.unit


@dataclass
class Member:
    role: str
    name: str
    metrics: str


def test_the_config_has_a_job_per_role_and_the_interval_as_scrape_interval_and_timeout(
    tmp_path: Path,
) -> None:
    members = [
        Member("nameserver", "nameserver-0", "127.0.0.1:9880"),
        Member("broker", "broker-a", "127.0.0.1:10912"),
        Member("broker", "broker-b", "127.0.0.1:10922"),
        Member("schedule", "schedule", "127.0.0.1:9710"),
        Member("txn-checker", "txn-checker", "127.0.0.1:9711"),
        Member("prometheus", "prometheus", ""),  # serves no apogee metrics: left out
    ]
    jobs = prometheus.scrape_jobs(members)
    assert [j.name for j in jobs] == ["nameserver", "broker", "schedule", "txn-checker"]
    assert jobs[1].targets == (
        Target("127.0.0.1:10912", {"member": "broker-a"}),
        Target("127.0.0.1:10922", {"member": "broker-b"}),
    )
    path = prometheus.write_config(tmp_path / "p" / "prometheus.yml", jobs, 1.0)
    config = json.loads(path.read_text())  # JSON, which is YAML
    assert config["global"] == {
        "scrape_interval": "1s",
        "scrape_timeout": "1s",
        "evaluation_interval": "1s",
    }
    brokers = config["scrape_configs"][1]
    assert brokers == {
        "job_name": "broker",
        "static_configs": [
            {"targets": ["127.0.0.1:10912"], "labels": {"member": "broker-a"}},
            {"targets": ["127.0.0.1:10922"], "labels": {"member": "broker-b"}},
        ],
    }
    assert [p.name for p in path.parent.iterdir()] == ["prometheus.yml"]  # no temp file left


@pytest.mark.parametrize(
    ("seconds", "text"), [(5.0, "5s"), (1.0, "1s"), (0.25, "250ms"), (1.5, "1500ms")]
)
def test_durations_are_written_as_prometheus_reads_them(seconds: float, text: str) -> None:
    assert prometheus.duration_text(seconds) == text


@pytest.mark.parametrize("seconds", [0.0, -1.0, 0.0004, float("nan"), float("inf")])
def test_a_scrape_interval_under_a_millisecond_is_refused(seconds: float) -> None:
    with pytest.raises(ValueError, match=r"at least 0\.001 s"):
        prometheus.duration_text(seconds)


def test_the_command_line_names_config_data_and_address(tmp_path: Path) -> None:
    argv = prometheus.command(tmp_path / "c.yml", tmp_path / "d", "127.0.0.1:9999", "/x/prom")
    assert argv == [
        "/x/prom",
        f"--config.file={tmp_path / 'c.yml'}",
        f"--storage.tsdb.path={tmp_path / 'd'}",
        "--web.listen-address=127.0.0.1:9999",
    ]


def test_a_missing_program_says_to_install_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(prometheus.PrometheusNotFoundError) as err:
        prometheus.find_binary()
    assert "install Debian's prometheus package (apt-get install -y prometheus)" in str(err.value)


def test_cluster_up_with_monitoring_and_no_program_starts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    data = tmp_path / "cluster"
    assert main(["--data", str(data), "cluster", "up", "--monitoring"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [
        "apogee: monitoring: Prometheus is not installed (no 'prometheus' program on PATH): "
        "install Debian's prometheus package (apt-get install -y prometheus); nothing was started"
    ]
    assert not data.exists()  # no folder, no cluster.json, no process


def test_a_dead_prometheus_not_asked_for_is_forgotten_and_status_checks_it_over_http(
    tmp_path: Path,
) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    member = local_cluster.Process("prometheus", "prometheus", "127.0.0.1:1", gone.pid, "log")
    state = local_cluster.ClusterState(str(tmp_path), prometheus=[member])
    state.save()
    assert local_cluster.ClusterState.load(tmp_path) == state  # recorded in cluster.json
    [(p, alive, healthy)] = local_cluster.status(state)
    assert (p.name, alive, healthy) == ("prometheus", False, False)
    # (kept, to start again, to start anew): an `up` without --monitoring forgets it
    assert local_cluster._optional(state.prometheus, set(), wanted=False) == ([], [], False)


# -- the HTTP API, from a stand-in ---------------------------------------------------------------


class StandIn:
    """Answers the API paths with canned JSON and records the queries asked."""

    def __init__(self) -> None:
        self.answers: dict[str, tuple[int, Any]] = {}
        self.asked: list[tuple[str, dict[str, list[str]]]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                url = urlsplit(self.path)
                outer.asked.append((url.path, parse_qs(url.query)))
                code, body = outer.answers.get(url.path, (404, {"status": "error"}))
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    server = StandIn()
    try:
        yield server
    finally:
        server.close()


def ok(data: Any) -> tuple[int, Any]:
    return 200, {"status": "success", "data": data}


def test_an_instant_query_gives_labels_values_and_times(stand_in: StandIn) -> None:
    stand_in.answers["/api/v1/query"] = ok(
        {
            "resultType": "vector",
            "result": [
                {"metric": {"topic": "Orders"}, "value": [1700000000.5, "200.25"]},
                {"metric": {"topic": "Idle"}, "value": [1700000000.5, "NaN"]},
            ],
        }
    )
    got = prometheus.query(stand_in.address, "sum by (topic) (x)", at=1700000000.5)
    assert got[0] == prometheus.Sample({"topic": "Orders"}, 200.25, 1700000000.5)
    assert got[1].labels == {"topic": "Idle"}
    assert got[1].value != got[1].value  # NaN
    assert stand_in.asked == [
        ("/api/v1/query", {"query": ["sum by (topic) (x)"], "time": ["1700000000.500"]})
    ]
    stand_in.answers["/api/v1/query"] = ok({"resultType": "scalar", "result": [1.0, "3"]})
    assert prometheus.query(stand_in.address, "scalar(x)") == [prometheus.Sample({}, 3.0, 1.0)]


def test_a_range_query_gives_series_of_points(stand_in: StandIn) -> None:
    stand_in.answers["/api/v1/query_range"] = ok(
        {
            "resultType": "matrix",
            "result": [{"metric": {"job": "broker"}, "values": [[10, "1"], [11, "2.5"]]}],
        }
    )
    [series] = prometheus.query_range(stand_in.address, "up", 10.0, 11.0, 1.0)
    assert series == prometheus.Series({"job": "broker"}, [(10.0, 1.0), (11.0, 2.5)])
    assert stand_in.asked[0][1] == {
        "query": ["up"],
        "start": ["10.000"],
        "end": ["11.000"],
        "step": ["1"],
    }


def test_targets_give_their_job_address_and_health(stand_in: StandIn) -> None:
    stand_in.answers["/api/v1/targets"] = ok(
        {
            "activeTargets": [
                {
                    "labels": {"job": "broker", "instance": "127.0.0.1:10912", "member": "b"},
                    "health": "down",
                    "lastError": "connection refused",
                }
            ]
        }
    )
    [t] = prometheus.targets(stand_in.address)
    assert (t.job, t.address, t.health, t.last_error) == (
        "broker",
        "127.0.0.1:10912",
        "down",
        "connection refused",
    )
    assert t.labels["member"] == "b"


def test_a_refused_query_says_why(stand_in: StandIn) -> None:
    stand_in.answers["/api/v1/query"] = (
        400,
        {"status": "error", "errorType": "bad_data", "error": "parse error: unclosed paren"},
    )
    with pytest.raises(prometheus.QueryError, match="bad_data: parse error: unclosed paren"):
        prometheus.query(stand_in.address, "sum(")
    stand_in.answers["/api/v1/query"] = (502, b"<html>bad gateway</html>")
    with pytest.raises(prometheus.QueryError, match="HTTP 502"):
        prometheus.query(stand_in.address, "up")
    stand_in.answers["/api/v1/query"] = ok({"resultType": "matrix", "result": []})
    with pytest.raises(prometheus.QueryError, match="use query_range"):
        prometheus.query(stand_in.address, "up[1m]")


def test_a_server_that_is_not_there_cannot_be_asked() -> None:
    with pytest.raises(
        prometheus.QueryError, match=r"prometheus at 127\.0\.0\.1:1 cannot be asked"
    ):
        prometheus.query("127.0.0.1:1", "up", timeout=1.0)
    assert not prometheus.is_ready("127.0.0.1:1")


def test_ready_is_a_200_from_the_ready_path(stand_in: StandIn) -> None:
    stand_in.answers["/-/ready"] = (503, b"Service Unavailable")
    assert not prometheus.is_ready(stand_in.address)
    stand_in.answers["/-/ready"] = (200, b"Prometheus Server is Ready.\n")
    assert prometheus.is_ready(stand_in.address)
    prometheus.wait_ready(stand_in.address, time.monotonic() + 5)


def test_waiting_fails_at_the_deadline_or_at_once_when_the_process_exits(tmp_path: Path) -> None:
    with pytest.raises(prometheus.PrometheusError, match="not ready in time; see"):
        prometheus.wait_ready("127.0.0.1:1", time.monotonic() + 0.3, log=tmp_path / "log")
    log = tmp_path / "prometheus.log"
    log.write_text("err: opening storage failed: lock DB directory: resource temporarily busy\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    try:
        start = time.monotonic()
        with pytest.raises(prometheus.PrometheusError) as err:
            prometheus.wait_ready("127.0.0.1:1", time.monotonic() + 60, proc=proc, log=log)
        assert time.monotonic() - start < 30  # not the deadline
        text = str(err.value)
        assert text.startswith("prometheus exited with code 1 while starting on 127.0.0.1:1")
        assert "lock DB directory" in text
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def test_stop_terminates_then_returns_the_exit_code() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert prometheus.stop(proc, timeout=10) == -15  # SIGTERM
    assert prometheus.stop(proc) == -15  # once stopped, it stays stopped


def test_jobs_are_written_in_the_order_given(tmp_path: Path) -> None:
    jobs = [ScrapeJob("b", (Target("h:2"),)), ScrapeJob("a", (Target("h:1"),))]
    text = prometheus.config_text(jobs, 5.0)
    assert [c["job_name"] for c in json.loads(text)["scrape_configs"]] == ["b", "a"]
