"""The Grafana dashboards and Prometheus alert rules the chart ships (``charts/apogee/
dashboards/*.json``, ``charts/apogee/rules/``): promtool accepts the rules and passes their unit
tests, every alert is unit-tested firing and not firing and documented, every dashboard is a
well-formed Grafana dashboard whose queries are PromQL, and every metric a panel, a template
variable or a rule queries is exported by a running cluster (nameserver, broker, schedule
service, transaction checker), scraped after traffic that makes its labelled series exist.

promtool comes with Debian's ``prometheus`` package: ``scripts/system_packages.sh`` installs it
(``scripts/check.sh`` runs it first)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from apogee.client import (
    AdminClient,
    Message,
    Producer,
    PullConsumer,
    ReceivedMessage,
    TransactionCheckMessage,
    TransactionDecision,
    TransactionMessage,
    TransactionProducer,
)
from apogee.common.errors import MessageTooLargeError
from apogee.common.metrics import scrape
from apogee.testkit.promql_names import metric_names, template_query_names
from e2e.harness import Cluster, ClusterFactory, KiB, wait_for_route
from e2e.replication_support import ReplicaGroup

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "apogee"
RULES = CHART / "rules" / "apogee-alerts.yaml"
RULE_TESTS = sorted((CHART / "rules" / "tests").glob("*.yaml"))
DASHBOARD_DIR = CHART / "dashboards"
DASHBOARDS = sorted(DASHBOARD_DIR.glob("*.json"))
DOCS = ROOT / "docs" / "observability.md"

#: The dashboards the chart ships, with the template variables each must offer.
EXPECTED_DASHBOARDS = {
    "cluster-overview.json": set(),
    "topic.json": {"topic"},
    "consumer-group.json": {"group"},
    "broker-storage.json": set(),
    "schedule-transactions.json": set(),
}
#: The data source every query goes through: a template variable, so the files import as they are.
DATASOURCE_VAR = "DS_PROMETHEUS"
DATASOURCE_UID = "${DS_PROMETHEUS}"
SEVERITIES = {"critical", "warning", "info"}
ANNOTATIONS = ("summary", "description", "runbook")
#: Grafana's variables, as promtool must see them: intervals become durations, the rest (label
#: values, always inside a matcher's string) a plain value.
GRAFANA_INTERVALS = {"__rate_interval": "5m", "__interval": "1m", "__range": "3h"}
RANGE_FUNCTIONS_RE = re.compile(r"\b(rate|irate|increase)\s*\(")

#: How long the scraped cluster may take to show every series after the traffic.
SERIES_TIMEOUT = 30.0

pytestmark = [pytest.mark.e2e]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not installed: run scripts/system_packages.sh (it installs Debian's "
            "prometheus package, which provides promtool)"
        )
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], capture_output=True, text=True, timeout=120, check=False, cwd=ROOT
    )


def load_rules() -> list[dict[str, Any]]:
    """The alerting rules of :data:`RULES`, each with its group's name under ``group``."""
    doc = yaml.safe_load(RULES.read_text())
    out = []
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                out.append({**rule, "group": group["name"]})
    return out


def load_dashboard(path: Path) -> dict[str, Any]:
    board = json.loads(path.read_text())
    assert isinstance(board, dict), f"{path.name}: not a JSON object"
    return board


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    for p in board.get("panels", []):
        yield p
        yield from p.get("panels", [])


def variable_query(var: dict[str, Any]) -> str:
    """The Prometheus query of a ``query`` template variable (a string, or an object)."""
    q = var.get("query", "")
    return str(q.get("query", "") if isinstance(q, dict) else q)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# -- the alert rules ---------------------------------------------------------------


def test_promtool_accepts_the_rules() -> None:
    done = run_promtool("check", "rules", str(RULES))
    assert done.returncode == 0, f"promtool check rules {rel(RULES)}:\n{done.stdout}{done.stderr}"
    assert "SUCCESS" in done.stdout, done.stdout


@pytest.mark.parametrize("path", RULE_TESTS, ids=lambda p: p.name)
def test_the_rules_pass_their_unit_tests(path: Path) -> None:
    done = run_promtool("test", "rules", str(path))
    assert done.returncode == 0, f"promtool test rules {rel(path)}:\n{done.stdout}{done.stderr}"


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    assert RULE_TESTS, "no unit tests in charts/apogee/rules/tests/"
    firing: dict[str, list[str]] = {}
    quiet: dict[str, list[str]] = {}
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        files = [(path.parent / f).resolve() for f in doc.get("rule_files", [])]
        assert RULES.resolve() in files, f"{path.name} does not test {rel(RULES)}: {files}"
        for test in doc["tests"]:
            for case in test.get("alert_rule_test", []):
                seen = firing if case.get("exp_alerts") else quiet
                seen.setdefault(case["alertname"], []).append(path.name)
    alerts = [r["alert"] for r in load_rules()]
    assert len(alerts) == len(set(alerts)), f"alerts named twice: {alerts}"
    missing = [f"{a}: never firing" for a in alerts if a not in firing]
    missing += [f"{a}: never quiet" for a in alerts if a not in quiet]
    unknown = sorted((firing.keys() | quiet.keys()) - set(alerts))
    assert not missing, f"alerts without a unit test in rules/tests/: {missing}"
    assert not unknown, f"unit tests of alerts the rules do not have: {unknown}"


def test_every_alert_says_what_it_means_and_what_to_do() -> None:
    docs = DOCS.read_text()
    for rule in load_rules():
        name = rule["alert"]
        assert rule.get("for"), f"{name}: no `for:`"
        assert rule.get("labels", {}).get("severity") in SEVERITIES, f"{name}: severity"
        notes = rule.get("annotations", {})
        for key in ANNOTATIONS:
            assert str(notes.get(key, "")).strip(), f"{name}: no {key} annotation"
        assert f"### {name}\n" in docs, f"{name} has no section in {rel(DOCS)}"
        section = docs.split(f"### {name}\n", 1)[1].split("\n### ", 1)[0]
        assert rule["expr"].strip() in section, f"{rel(DOCS)} shows another query of {name}"


# -- the dashboards --------------------------------------------------------------------


def test_the_expected_dashboards_are_there() -> None:
    assert {p.name for p in DASHBOARDS} == set(EXPECTED_DASHBOARDS)
    uids = [load_dashboard(p)["uid"] for p in DASHBOARDS]
    assert len(uids) == len(set(uids)), f"dashboard uids used twice: {uids}"
    docs = DOCS.read_text()
    for p in DASHBOARDS:
        assert f"`{p.name}`" in docs, f"{p.name} is not described in {rel(DOCS)}"
        for panel in panels(load_dashboard(p)):
            for t in panel.get("targets", []):
                assert f"`{t['expr']}`" in docs, (
                    f"{rel(DOCS)} does not show the query of {p.name}'s panel "
                    f"{panel['title']!r}: {t['expr']}"
                )


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_a_dashboard_is_well_formed(path: Path) -> None:
    board = load_dashboard(path)
    name = path.name
    assert board.get("title", "").startswith("Apogee / "), f"{name}: title {board.get('title')}"
    assert 36 <= board.get("schemaVersion", 0) <= 41, f"{name}: schemaVersion"
    assert board.get("id") is None, f"{name}: a fixed id keeps it from importing elsewhere"
    variables = {v["name"]: v for v in board.get("templating", {}).get("list", [])}
    ds = variables.get(DATASOURCE_VAR)
    assert ds is not None, f"{name}: no data source variable {DATASOURCE_VAR}"
    assert (ds["type"], ds["query"]) == ("datasource", "prometheus"), f"{name}: {ds}"
    assert EXPECTED_DASHBOARDS[name] <= variables.keys(), f"{name}: variables {list(variables)}"
    for var in variables.values():
        if var["type"] == "query":
            assert var["datasource"]["uid"] == DATASOURCE_UID, f"{name}: variable {var['name']}"
            assert variable_query(var), f"{name}: variable {var['name']} has no query"
    # every data source named anywhere is the variable (or Grafana's own, for annotations)
    for found in _datasources(board):
        assert found.get("uid") in (DATASOURCE_UID, "-- Grafana --"), f"{name}: {found}"

    ids = [p.get("id") for p in panels(board)]
    assert all(isinstance(i, int) for i in ids), f"{name}: panels without an id: {ids}"
    twice = {i for i in ids if ids.count(i) > 1}
    assert not twice, f"{name}: panel ids used twice: {twice}"
    for p in panels(board):
        title = p.get("title", "")
        assert title, f"{name}: panel {p['id']} has no title"
        assert p.get("description"), f"{name}: panel {title!r} has no description"
        if p.get("type") == "row":
            continue
        targets = p.get("targets", [])
        assert targets, f"{name}: panel {title!r} has no query"
        for t in targets:
            expr = t.get("expr", "")
            assert expr.strip(), f"{name}: panel {title!r} target {t.get('refId')}: no PromQL"
            assert t.get("datasource", p.get("datasource", {})).get("uid") == DATASOURCE_UID
            for m in RANGE_FUNCTIONS_RE.finditer(expr):
                window = _window_after(expr, m.end())
                allowed = {"$__rate_interval"} | ({"$__range"} if m[1] == "increase" else set())
                assert window in allowed, (
                    f"{name}: panel {title!r}: {m[1]}(...[{window}]) - use [$__rate_interval]"
                )


def test_every_dashboard_query_is_promql(tmp_path: Path) -> None:
    """promtool parses every panel's and variable's query (Grafana's variables replaced by
    values), written as recording rules of a rules file of its own."""
    rules: list[dict[str, str]] = []
    for path in DASHBOARDS:
        board = load_dashboard(path)
        for p in panels(board):
            for t in p.get("targets", []):
                rules.append({"record": f"panel_{len(rules)}", "expr": _as_promql(t["expr"])})
        for var in board.get("templating", {}).get("list", []):
            if var["type"] == "query":
                for name in template_query_names(variable_query(var)):
                    rules.append({"record": f"variable_{len(rules)}", "expr": name})
    out = tmp_path / "dashboard-queries.yaml"
    out.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    done = run_promtool("check", "rules", str(out))
    assert done.returncode == 0, f"a dashboard query is not PromQL:\n{done.stdout}{done.stderr}"


def _datasources(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        ds = node.get("datasource")
        if isinstance(ds, dict):
            yield ds
        for v in node.values():
            yield from _datasources(v)
    elif isinstance(node, list):
        for v in node:
            yield from _datasources(v)


def _window_after(expr: str, start: int) -> str:
    """The range (``[...]``) of the call whose arguments start at ``start``."""
    depth = 0
    for i in range(start, len(expr)):
        c = expr[i]
        if c == "(":
            depth += 1
        elif c == ")":
            if depth == 0:
                break
            depth -= 1
        elif c == "[" and depth == 0:
            return expr[i + 1 : expr.index("]", i)]
    return ""


def _as_promql(expr: str) -> str:
    def value(m: re.Match[str]) -> str:
        name = m[1] or m[2]
        return GRAFANA_INTERVALS.get(name, "x")

    return re.sub(r"\$\{(\w+)[^}]*\}|\$(\w+)", value, expr)


# -- every metric queried is exported -------------------------------------------------


def queried_names() -> dict[str, set[str]]:
    """Every metric name the dashboards (panels and template variables) and the rules query,
    with the files that query it."""
    used: dict[str, set[str]] = {}
    for path in DASHBOARDS:
        board = load_dashboard(path)
        exprs = [t["expr"] for p in panels(board) for t in p.get("targets", [])]
        names = [n for e in exprs for n in metric_names(e)]
        for var in board.get("templating", {}).get("list", []):
            if var["type"] == "query":
                names += template_query_names(variable_query(var))
        for n in names:
            used.setdefault(n, set()).add(rel(path))
    for rule in load_rules():
        for n in metric_names(rule["expr"]):
            used.setdefault(n, set()).add(rel(RULES))
    return used


TOPIC = "MonitoringOrders"
GROUP = "monitoring-readers"
TXN_GROUP = "monitoring-payments"
#: The cluster's brokers take bodies up to this size, so that a larger one is refused cheaply.
MAX_BODY = 64 * KiB
#: Checks come every second and never run out, so the undecided transaction stays pending.
CHECKER_ENV = {
    "APOGEE_TXN_CHECKER_CHECK_INTERVAL_S": "1",
    "APOGEE_TXN_CHECKER_IMMUNITY_S": "0",
    "APOGEE_TXN_CHECKER_MAX_CHECK_TIMES": "10000",
    "APOGEE_TXN_CHECKER_BROKER_REFRESH_S": "1",
}


@pytest.mark.slow
async def test_every_metric_the_dashboards_and_rules_query_is_exported(
    start_cluster: ClusterFactory, tmp_path: Path
) -> None:
    used = queried_names()
    cluster = await asyncio.to_thread(
        start_cluster,
        "monitoring",
        brokers=1,
        nameservers=1,
        broker_env={"APOGEE_BROKER_MAX_MESSAGE_SIZE": str(MAX_BODY)},
        txn_checker_env=CHECKER_ENV,
    )
    members = cluster.state.all()
    assert {p.role for p in members} == {"nameserver", "broker", "schedule", "txn-checker"}
    assert all(p.metrics for p in members), [(p.name, p.metrics) for p in members]

    def exported() -> set[str]:
        names: set[str] = set()
        for p in members:
            names |= scrape(p.metrics).names()
        return names

    # the replication series come from a replica group (docs/replication.md)
    group = ReplicaGroup(tmp_path / "group")
    async with group, traffic(cluster):
        async with Producer(group.namesrv) as producer:
            await producer.send(Message("Replicated", b"copied"))
        deadline = time.monotonic() + SERIES_TIMEOUT
        while True:
            have = await asyncio.to_thread(exported)
            have |= await asyncio.to_thread(
                lambda: {n for r in group.replicas if r.metrics for n in scrape(r.metrics).names()}
            )
            if used.keys() <= have or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)  # polling other processes, with a deadline
    missing = sorted(used.keys() - have)
    assert not missing, "metrics queried but not exported by a running cluster:\n" + "\n".join(
        f"  {n} (used in {', '.join(sorted(used[n]))})" for n in missing
    )


@contextlib.asynccontextmanager
async def traffic(cluster: Cluster) -> AsyncIterator[None]:
    """Sends, consumes, dead-letters, delays and transacts on ``cluster``, so that the labelled
    series exist; keeps a consumer connected and a transaction undecided while in use."""
    c = cluster
    async with AdminClient(c.namesrv) as admin:
        await admin.create_or_update_topic(TOPIC, queues=2)
    await wait_for_route(c.nameservers, TOPIC, {b.name for b in c.brokers})
    async with Producer(c.namesrv, group="monitoring-senders") as producer:
        for i in range(5):
            await producer.send(Message(TOPIC, f"order-{i}".encode(), keys=f"o-{i}"))
        await producer.send(Message(TOPIC, b"in a second", delay_level=1))
        with pytest.raises(MessageTooLargeError):  # counted under send errors
            await producer.send(Message(TOPIC, os.urandom(MAX_BODY + KiB)))
    async with (
        PullConsumer(
            c.namesrv,
            GROUP,
            consume_from="earliest",
            rebalance_interval=1.0,
            long_poll_timeout=1.0,
            max_reconsume_times=0,  # the first send-back dead-letters
            auto_commit=False,
        ) as consumer,
        TransactionProducer(c.namesrv, TXN_GROUP, check_listener=undecided) as txn,
    ):
        consumer.subscribe(TOPIC)
        await consumer.start()
        got: list[ReceivedMessage] = []
        deadline = time.monotonic() + SERIES_TIMEOUT
        while len(got) < 6:  # the five, and the delayed one a second later
            assert time.monotonic() < deadline, f"{len(got)} of 6 messages consumed"
            got += await consumer.poll(timeout=0.5)
        await consumer.send_back(got[0], reason="dead-lettered on purpose")
        await consumer.commit()
        for decision in (TransactionDecision.COMMIT, TransactionDecision.UNKNOWN):
            await txn.send_in_transaction(Message(TOPIC, b"txn"), deciding(decision))
        yield


async def undecided(m: TransactionCheckMessage) -> TransactionDecision:
    return TransactionDecision.UNKNOWN


def deciding(
    decision: TransactionDecision,
) -> Callable[[TransactionMessage, object], Awaitable[TransactionDecision]]:
    async def executor(m: TransactionMessage, arg: object) -> TransactionDecision:
        return decision

    return executor
