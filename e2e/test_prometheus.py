"""Local monitoring with real processes: ``apogee cluster up --monitoring`` runs a real Prometheus
(Debian's ``prometheus`` program) that scrapes every member; traffic at a known rate shows in
PromQL as that rate, a consumer group left behind by a known number of messages as that lag, and
``apogee top --once`` shows the same topic, group and lag from the services' own endpoints.

The traffic: 200 messages a second for 10 s (10 every 50 ms, on a fixed schedule) to a topic
with 4 queues on each of two brokers, consumed as it comes by two groups; then one group stops
(every message consumed and committed) and 500 more are sent, which the other group consumes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from apogee.client import (
    AdminClient,
    ConsumerOptions,
    Message,
    Producer,
    PushConsumer,
    ReceivedMessage,
)
from apogee.local import cluster as local_cluster
from apogee.local import prometheus
from apogee.local.cluster import ClusterState
from e2e.harness import (
    BROKER_ENV,
    NAMESERVER_ENV,
    SCHEDULE_ENV,
    Cluster,
    eventually,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOPIC = "E2EPromOrders"
LIVE = "e2e-prom-live"
BEHIND = "e2e-prom-behind"
#: messages a second, for SECONDS, in ticks of TICK seconds
RATE = 200
SECONDS = 10
TICK = 0.05
PER_TICK = round(RATE * TICK)
SENT_FIRST = RATE * SECONDS
#: sent once BEHIND has stopped: its lag, exactly
BEHIND_BY = 500
#: Prometheus scrapes every second; rates are taken over 5 s (about 5 samples)
SCRAPE_S = 1
WINDOW = "5s"
#: how far the rates may be from the rate sent, as a share (why: where the rates are checked)
IN_TOLERANCE = 0.10
OUT_TOLERANCE = 0.15
SHAPE = ["--brokers", "2", "--nameservers", "1", "--no-console"]
#: the series the test asks Prometheus about
IN = f'apogee_broker_messages_in_total{{topic="{TOPIC}"}}'
OUT = f'apogee_broker_messages_out_total{{topic="{TOPIC}"}}'
LAG = f'sum by (group) (apogee_broker_group_lag_messages{{topic="{TOPIC}"}})'
LAG_SECONDS = f'apogee_broker_group_lag_seconds{{topic="{TOPIC}",group="{BEHIND}"}}'
MONITORING = ["--monitoring", "--scrape-interval", str(SCRAPE_S)]
CONSUMER_OPTIONS: ConsumerOptions = {
    "consume_from": "earliest",
    "rebalance_interval": 1.0,
    "offset_persist_interval": 0.2,
    "long_poll_timeout": 2.0,
}


class Apogee:
    """Runs the ``apogee`` command (``python -m apogee.cli --data DIR``) with the test
    settings of the members in its environment (the members it starts inherit them)."""

    def __init__(self, data: Path, home: Path) -> None:
        self.data = data
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("APOGEE_")}
        self.env.update({**NAMESERVER_ENV, **BROKER_ENV, **SCHEDULE_ENV})
        self.env["APOGEE_HOME"] = str(home)

    def __call__(self, *args: str, code: int = 0) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "apogee.cli", "--data", str(self.data), *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=120,
            check=False,
        )
        assert done.returncode == code, (
            f"apogee {' '.join(args)} exited {done.returncode}, not {code}\n"
            f"stdout: {done.stdout}\nstderr: {done.stderr}"
        )
        return done.stdout

    def state(self) -> ClusterState:
        state = ClusterState.load(self.data.resolve())
        assert state is not None, f"no cluster.json in {self.data}"
        return state


@pytest.fixture
def apogee(tmp_path: Path) -> Apogee:
    return Apogee(tmp_path / "cluster", tmp_path / "home")


@pytest.fixture
def monitored(apogee: Apogee) -> Iterator[Cluster]:
    """The cluster ``apogee cluster up --monitoring`` started; stopped at the end (gracefully,
    checked), and whatever happened (a failed or timed-out start too) nothing of it keeps
    running."""
    cluster: Cluster | None = None
    try:
        apogee("cluster", "up", *SHAPE, *MONITORING)
        cluster = Cluster(apogee.state())
        yield cluster
    finally:
        recorded = ClusterState.load(apogee.data.resolve())  # a member started again too
        try:
            if cluster is not None:
                cluster.close()
        finally:
            for p in recorded.all() if recorded else []:
                if local_cluster.pid_alive(p.pid):
                    os.kill(p.pid, signal.SIGKILL)


def pids(output: str) -> list[int]:
    return [
        int(line.split(" pid ")[1].split()[0]) for line in output.splitlines() if " pid " in line
    ]


async def ask(address: str, promql: str, at: float | None = None) -> dict[str, float]:
    """An instant query's answer as {the value of its one label (or ""): value}."""
    got = await asyncio.to_thread(prometheus.query, address, promql, at)
    return {next(iter(s.labels.values()), ""): s.value for s in got}


async def send_paced(namesrv: str) -> tuple[float, list[str]]:
    """RATE messages a second for SECONDS: PER_TICK every TICK seconds, each tick at its fixed
    time from the start (a late tick is followed by the next on time, so the rate over any few
    seconds holds). Returns the wall time of the first tick and the ids."""
    loop = asyncio.get_running_loop()
    async with Producer(namesrv) as producer:
        await producer.send(Message(TOPIC, b"warm-up: routes and streams"))
        start, wall = loop.time(), time.time()
        pending = []
        for tick in range(round(SECONDS / TICK)):
            await asyncio.sleep(max(0.0, start + tick * TICK - loop.time()))  # the pace
            pending += [
                producer.send_nowait(Message(TOPIC, f"{tick}-{i}".encode()))
                for i in range(PER_TICK)
            ]
        results = await asyncio.gather(*pending)
    return wall, [r.message_id for r in results]


async def test_rates_and_lag_in_prometheus_and_apogee_top(
    apogee: Apogee, monitored: Cluster
) -> None:
    prom = monitored.state.prometheus[0]
    members = [p for p in monitored.state.all() if p.role != "prometheus"]

    # -- Prometheus runs as a member of its own, and scrapes every other member ---------------
    status = await asyncio.to_thread(apogee, "cluster", "status")
    # nameserver, 2 brokers, schedule, txn-checker, Prometheus (and the console, when it runs)
    assert status.count("SERVING") == len(monitored.state.all()), status
    assert _member_line(prom, "SERVING") in status
    assert f"prometheus http://{prom.address}" in status
    data = Path(apogee.state().data_dir)
    assert prom.data_dir == str(data / "prometheus")
    config = json.loads((data / "prometheus" / "prometheus.yml").read_text())
    assert config["global"]["scrape_interval"] == "1s"

    async def all_up() -> bool:
        found = await asyncio.to_thread(prometheus.targets, prom.address)
        return sorted((t.job, t.address) for t in found if t.health == "up") == sorted(
            (p.role, p.metrics) for p in members
        )

    await eventually(all_up, 30, "Prometheus scraping every member")  # targets load every 5 s
    jobs = await ask(prom.address, "count by (job) (up == 1)")
    expected_jobs = {"nameserver": 1, "broker": 2, "schedule": 1, "txn-checker": 1}
    if any(p.role == "console" for p in members):
        expected_jobs["console"] = 1
    assert jobs == expected_jobs

    # -- traffic: two groups consume as it comes -----------------------------------------------
    async with AdminClient(monitored.namesrv) as admin:
        await admin.create_or_update_topic(TOPIC, queues=4)
    got: dict[str, set[str]] = {LIVE: set(), BEHIND: set()}

    def listener(group: str) -> Callable[[list[ReceivedMessage]], Awaitable[None]]:
        async def handle(msgs: list[ReceivedMessage]) -> None:
            got[group].update(m.unique_id for m in msgs)

        return handle

    live = PushConsumer(monitored.namesrv, LIVE, listener(LIVE), **CONSUMER_OPTIONS)
    behind = PushConsumer(monitored.namesrv, BEHIND, listener(BEHIND), **CONSUMER_OPTIONS)
    async with live, behind:
        for c in (live, behind):
            c.subscribe(TOPIC)
            await c.start()
        started_at, ids = await send_paced(monitored.namesrv)
        first = set(ids)
        assert len(first) == SENT_FIRST

        async def both_consumed() -> bool:
            return all(first <= seen for seen in got.values())

        await eventually(both_consumed, 30, "both groups consumed the 2000 messages")

        async def caught_up() -> bool:
            return await ask(prom.address, LAG) == {LIVE: 0, BEHIND: 0}

        await eventually(caught_up, 30, "Prometheus showing both groups caught up")
        await behind.close()  # BEHIND stops here, everything committed

        async with Producer(monitored.namesrv) as producer:
            later = await asyncio.gather(
                *(producer.send_nowait(Message(TOPIC, b"later")) for _ in range(BEHIND_BY))
            )
        later_ids = {r.message_id for r in later}

        # -- the lag: the 500 sent since BEHIND stopped, exactly ------------------------------
        seen: list[dict[str, float]] = [{}]

        async def lag_settled() -> bool:
            seen[0] = await ask(prom.address, LAG)
            return seen[0] == {LIVE: 0, BEHIND: BEHIND_BY}

        try:
            await eventually(lag_settled, 30, f"lag {BEHIND_BY} for {BEHIND} and 0 for {LIVE}")
        except AssertionError as err:
            stored = await ask(prom.address, f"sum({IN})")
            async with AdminClient(monitored.namesrv) as admin:
                described = (await admin.describe_group(BEHIND)).lag_messages
            raise AssertionError(
                f"{err}; Prometheus said last {seen[0]}, messages stored {stored}, "
                f"the brokers describe {BEHIND}'s lag as {described}"
            ) from err
        async with AdminClient(monitored.namesrv) as admin:
            described = (await admin.describe_group(BEHIND)).lag_messages
        assert described == seen[0][BEHIND]  # the metric is the brokers' own figure
        assert later_ids <= got[LIVE]
        assert not later_ids & got[BEHIND]
        age = await ask(prom.address, f"max by (group) ({LAG_SECONDS})")
        assert age[BEHIND] > 0, age

        # every message stored, counted once: 1 warm-up, 2000 paced, 500 later
        async def all_counted() -> bool:
            return await ask(prom.address, f"sum({IN})") == {"": 1 + SENT_FIRST + BEHIND_BY}

        await eventually(all_counted, 10, "Prometheus counting every message stored")

        # -- the rates ---------------------------------------------------------------------------
        # Over a 5 s window well inside the 10 s of paced traffic (from 3 s to 8 s after its
        # start: past the first second's ramp, before the last). rate() divides the growth
        # between the window's first and last samples (about 4 s apart at 1 s scrapes) by their
        # distance and extrapolates to the window. What can move it off 200/s:
        #   - messages go in blocks of 10 every 50 ms: at most one block at each end, 20 of
        #     about 800 messages, 2.5 %;
        #   - Prometheus stamps a sample when the scrape starts, the broker reads its counter a
        #     little later: up to ~50 ms at each end on a busy 2-core machine, 2.5 %;
        #   - the producer keeps a fixed schedule but a tick can leave up to ~100 ms late when
        #     the machine is busy (the next ones catch up), 2.5 %.
        # Together 7.5 %: 10 % leaves a margin. What consumers get (both groups: 400/s) is
        # counted when the broker hands it over, after the dispatcher indexed it and in blocks
        # of what arrived meanwhile: up to ~100 ms more at each end, 5 % more: 15 %.
        at = started_at + 8.0
        in_rate = await ask(prom.address, f"sum(rate({IN}[{WINDOW}]))", at)
        out_rate = await ask(prom.address, f"sum(rate({OUT}[{WINDOW}]))", at)
        assert in_rate[""] == pytest.approx(RATE, rel=IN_TOLERANCE), in_rate
        assert out_rate[""] == pytest.approx(2 * RATE, rel=OUT_TOLERANCE), out_rate
        per_broker = await ask(prom.address, f"sum by (member) (rate({IN}[{WINDOW}]))", at)
        assert sorted(per_broker) == ["broker-a", "broker-b"], per_broker  # both took a share
        assert sum(per_broker.values()) == pytest.approx(in_rate[""])

        # -- apogee top, from the services' own endpoints ----------------------------------------
        frame = await asyncio.to_thread(apogee, "top", "--once", "--interval", "1")
        assert _cells(frame, TOPIC), frame
        assert _cells(frame, BEHIND, TOPIC)[0] == str(BEHIND_BY), frame
        assert _cells(frame, LIVE, TOPIC)[0] == "0", frame
        n = len(members)
        assert f"{n} of {n} endpoints answered" in frame  # cluster.json: all but Prometheus
        brokers = [a for p in monitored.brokers for a in ("--metrics", p.metrics)]
        frame = await asyncio.to_thread(apogee, "top", "--once", "--interval", "0.5", *brokers)
        assert _cells(frame, BEHIND, TOPIC)[0] == str(BEHIND_BY), frame
        assert "2 of 2 endpoints answered" in frame

    # -- up again, Prometheus killed and started again, down -----------------------------------
    before_kill = time.time()
    again = await asyncio.to_thread(apogee, "cluster", "up", *SHAPE, *MONITORING)
    assert pids(again) == [p.pid for p in monitored.state.all()], again  # all kept running
    os.kill(prom.pid, signal.SIGKILL)
    await asyncio.to_thread(
        wait_until, lambda: not local_cluster.pid_alive(prom.pid), 10, "Prometheus gone"
    )
    status = await asyncio.to_thread(apogee, "cluster", "status", code=1)
    assert _member_line(prom, "STOPPED") in status

    again = await asyncio.to_thread(apogee, "cluster", "up", *SHAPE, *MONITORING)
    monitored.state = apogee.state()  # its new pid, for the cleanup
    restarted = monitored.state.prometheus[0]
    assert restarted.pid != prom.pid
    assert pids(again)[:-1] == [p.pid for p in members]  # only Prometheus started again
    # its data is kept under the cluster's folder: what was scraped before the kill is there
    kept = await ask(restarted.address, f"sum({IN})", before_kill)
    assert kept == {"": 1 + SENT_FIRST + BEHIND_BY}

    down = await asyncio.to_thread(apogee, "cluster", "down")
    assert "prometheus  prometheus     stopped" in down, down
    assert down.count(" stopped") == len(members) + 1, down  # and Prometheus
    assert "killed" not in down, down
    assert not local_cluster.pid_alive(restarted.pid)


def _member_line(p: local_cluster.Process, word: str) -> str:
    """``p``'s line in ``apogee cluster status``."""
    return f"{p.role:<11} {p.name:<14} {p.address:<18} pid {p.pid:<8} {word}"


def _cells(text: str, *first: str) -> list[str]:
    """The cells after ``first`` of the line of a frame that starts with those cells."""
    for line in text.splitlines():
        cells = line.split()
        if cells[: len(first)] == list(first):
            return cells[len(first) :]
    raise AssertionError(f"no row {first} in:\n{text}")
