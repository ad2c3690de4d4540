"""The ``apogee`` command as a user runs it: a local cluster started and stopped by the command,
topics, sends, lookups, and errors that exit 1 with one line naming the problem."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from apogee.local import cluster as local_cluster
from e2e.harness import in_thread, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOPIC = "E2ECli"
ID_RE = re.compile(r"[0-9A-F]{32}")


class Apogee:
    """Runs ``python -m apogee.cli`` (the ``apogee`` console script) with ``--data``."""

    def __init__(self, data: Path, home: Path) -> None:
        self.data = data
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("APOGEE_")}
        self.env["APOGEE_HOME"] = str(home)

    def __call__(
        self, *args: str, stdin: str | None = None, code: int = 0, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "apogee.cli", "--data", str(self.data), *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            check=False,
        )
        assert done.returncode == code, (
            f"apogee {' '.join(args)} exited {done.returncode}, not {code}\n"
            f"stdout: {done.stdout}\nstderr: {done.stderr}"
        )
        return done

    def fails(self, *args: str, says: str, code: int = 1) -> str:
        """Run a command that must fail: exit ``code``, one line on stderr containing ``says``
        (usage errors print the usage first), nothing on stdout."""
        done = self(*args, code=code)
        lines = done.stderr.strip().splitlines()
        assert done.stdout == "", done.stdout
        assert lines, f"apogee {' '.join(args)} printed no error"
        assert says in lines[-1], done.stderr
        if code == 1:
            assert len(lines) == 1, done.stderr
            assert lines[0].startswith("apogee: "), done.stderr
        else:
            assert lines[0].startswith("usage: apogee"), done.stderr
            assert "error:" in lines[-1], done.stderr
        return lines[-1]


@pytest.fixture
def apogee(tmp_path: Path) -> Iterator[Apogee]:
    cli = Apogee(tmp_path / "cluster", tmp_path / "home")
    try:
        yield cli
    finally:  # whatever happened, stop what the command started
        state = local_cluster.ClusterState.load(cli.data.resolve())
        in_thread(lambda: local_cluster.down(cli.data))
        for p in state.all() if state else []:
            if local_cluster.pid_alive(p.pid):
                os.kill(p.pid, signal.SIGKILL)


def pids(output: str) -> list[int]:
    return [int(p) for p in re.findall(r" pid (\d+) ", output)]


def test_the_apogee_command_runs_a_local_cluster(apogee: Apogee) -> None:
    up = apogee("cluster", "up", "--brokers", "2", "--nameservers", "2")
    started = pids(up.stdout)
    assert len(started) == 7, up.stdout  # 2 nameservers, 2 brokers, schedule, txn-checker, console
    assert all(local_cluster.pid_alive(p) for p in started), up.stdout
    state = local_cluster.ClusterState.load(apogee.data.resolve())
    assert state is not None
    assert [p.pid for p in state.all()] == started
    assert f"namesrv: {state.namesrv}" in up.stdout
    [console] = state.console
    assert f"console: http://{console.address}/" in up.stdout

    status = apogee("cluster", "status")
    assert status.stdout.count("SERVING") == 7
    assert "NOT SERVING" not in status.stdout

    created = apogee("topic", "create", TOPIC, "--queues", "4").stdout
    for broker in ("broker-a", "broker-b"):
        assert f"created {TOPIC} on {broker}: 4 write / 4 read queues, perm rw" in created

    # one body: one id; lines of standard input: one id per line, in order
    [single] = apogee(
        "send", TOPIC, "hello from the cli", "--key", "k1", "--tag", "t1"
    ).stdout.split()
    assert ID_RE.fullmatch(single)
    many = apogee("send", TOPIC, "--key", "k2", stdin="line one\nline two\nline three\n").stdout
    ids = many.split()
    assert len(ids) == 3
    assert len(set(ids) | {single}) == 4
    assert all(ID_RE.fullmatch(i) for i in ids)

    got = apogee("message", "get", single).stdout
    assert f"id:          {single}" in got
    assert "body:        hello from the cli" in got
    assert f"topic:       {TOPIC}" in got
    assert "keys:        k1" in got
    assert "tags:        t1" in got
    for uid, line in zip(ids, ("line one", "line two", "line three"), strict=True):
        assert f"body:        {line}" in apogee("message", "get", uid).stdout

    query = apogee("message", "query", "--topic", TOPIC, "--key", "k2").stdout
    assert sorted(re.findall(r"^body: +(.*)$", query, re.M)) == [
        "line one",
        "line three",
        "line two",
    ]
    assert sorted(re.findall(r"^id: +(\w+)$", query, re.M)) == sorted(ids)
    # by time alone: every message stored in the window, newest first, with word of the rest
    window = apogee("message", "query", "--topic", TOPIC, "--begin", "0").stdout
    assert sorted(re.findall(r"^id: +(\w+)$", window, re.M)) == sorted([single, *ids])
    newest = apogee("message", "query", "--topic", TOPIC, "--max", "2").stdout
    assert len(re.findall(r"^id: +(\w+)$", newest, re.M)) == 2
    assert "the window holds more than 2 messages; these are the newest" in newest
    empty = apogee("message", "query", "--topic", TOPIC, "--end", "2001-01-01T00:00:00Z")
    assert f"no message of {TOPIC} stored in that window" in empty.stdout

    described = apogee("topic", "describe", TOPIC).stdout
    assert f"topic {TOPIC}: 4 messages" in described
    assert "broker-a (" in described
    assert "broker-b (" in described
    assert len(re.findall(r"^ +queue \d+ ", described, re.M)) == 8
    assert TOPIC in apogee("topic", "list").stdout.split()

    # a second `up` finds the cluster running and starts nothing
    again = apogee("cluster", "up", "--brokers", "2", "--nameservers", "2")
    assert pids(again.stdout) == started

    # errors: exit status 1 and one line naming the problem
    apogee.fails("message", "get", "0" * 32, says=f"message {'0' * 32} not found")
    apogee.fails("topic", "describe", "E2ENoSuchTopic", says="'E2ENoSuchTopic' is not on any")
    apogee.fails("send", "bad topic", "x", says="topic 'bad topic': has a character outside")
    apogee.fails("send", TOPIC, "", says="body: must not be empty")
    apogee.fails("topic", "create", "TBW102", says="topic 'TBW102': is a system topic")
    apogee.fails("topic", "create", "E2ECli2", "--queues", "0", says="queues: must be")
    apogee.fails("cluster", "up", "--brokers", "3", says="has another shape")
    apogee.fails("message", "query", "--key", "k1", code=2, says="--topic")  # usage: exit 2
    apogee.fails("message", "query", "--topic", TOPIC, "--max", "5000", says="max_messages")

    down = apogee("cluster", "down").stdout
    assert down.count("stopped") == 7, down
    assert "killed" not in down, down
    wait_until(lambda: not any(local_cluster.pid_alive(p) for p in started), 5, "members gone")
    # the data stays: both brokers' topics, the stored messages, the logs; the command knows
    # of no running cluster (which broker got the four messages depends on round robin)
    for broker in ("broker-a", "broker-b"):
        assert (apogee.data / broker / "topics.json").is_file()
    assert any((apogee.data / b / "commitlog").is_dir() for b in ("broker-a", "broker-b"))
    assert any(
        any((apogee.data / b / "commitlog").iterdir())
        for b in ("broker-a", "broker-b")
        if (apogee.data / b / "commitlog").is_dir()
    )
    assert (apogee.data / "logs" / "broker-a.log").stat().st_size > 0
    status = apogee("cluster", "status", code=1)
    assert "no local cluster recorded" in status.stdout
    apogee.fails("--namesrv", state.namesrv, "topic", "list", says="unavailable")

    # started again on the same data, the cluster still has the messages
    apogee("cluster", "up", "--brokers", "2", "--nameservers", "2")
    assert "body:        hello from the cli" in apogee("message", "get", single).stdout
    apogee("cluster", "down")
