"""The official RocketMQ 5 Node.js client (``rocketmq-client-nodejs``, pinned in
``e2e/rocketmq_nodejs/package.json``) against real Apogee processes: a second official client,
written apart from the Python one, so that Apogee follows the protocol rather than one client's
habits (the Node.js client sends delays as a delivery time in milliseconds, reads every field
of a delivery through its own decoder, and recalls through the access point).

One run of ``e2e/rocketmq_nodejs/scenario.mjs`` against a cluster of two brokers, whose
txn-checker checks every second: normal sends with tags, keys and properties received through a
SimpleConsumer with the filter ``a || b``; two FIFO message groups received in order; a delay
message not before its time, and one recalled (by a broker that may not hold it) never; a
transaction committed, one rolled back, one committed by the client's checker over Telemetry;
a PushConsumer whose listener fails a message, which comes back with delivery attempt 2.

``scripts/node_clients.sh`` (run by ``scripts/check.sh``) installs the client with ``npm ci``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from apogee.client import AdminClient
from e2e.harness import ClusterFactory

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HERE = Path(__file__).resolve().parent / "rocketmq_nodejs"
TOPICS = {
    "normal": ("NodeNormal", "NORMAL"),
    "fifo": ("NodeFifo", "FIFO"),
    "delay": ("NodeDelay", "DELAY"),
    "txn": ("NodeTxn", "TRANSACTION"),
}


def _node() -> str:
    node = shutil.which("node")
    if node is None or not (HERE / "node_modules" / "rocketmq-client-nodejs").is_dir():
        pytest.fail(
            "the Node.js client is not installed: run scripts/node_clients.sh (scripts/check.sh "
            "does), which needs node and npm"
        )
    return node


async def _create_topics(namesrv: str) -> None:
    async with AdminClient(namesrv) as admin:
        for name, kind in TOPICS.values():
            await admin.create_or_update_topic(name, queues=2, message_type=kind)


def test_the_nodejs_client_sends_receives_recalls_and_ends_transactions(
    start_cluster: ClusterFactory, tmp_path: Path
) -> None:
    node = _node()
    cluster = start_cluster(
        "nodejs",
        brokers=2,
        nameservers=1,
        txn_checker_env={
            "APOGEE_TXN_CHECKER_CHECK_INTERVAL_S": "1",
            "APOGEE_TXN_CHECKER_IMMUNITY_S": "1",
        },
    )
    asyncio.run(_create_topics(cluster.namesrv))
    config = {
        "endpoints": cluster.brokers[0].address,
        "topics": {k: name for k, (name, _) in TOPICS.items()},
        "groups": {"simple": "node-simple", "push": "node-push"},
    }
    home = tmp_path / "home"  # the client logs under ~/logs/rocketmq
    home.mkdir()
    done = subprocess.run(
        [node, "scenario.mjs", json.dumps(config)],
        cwd=HERE,
        env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    said: dict[str, dict[str, Any]] = {x["what"]: x for x in lines}
    assert "done" in said, f"scenario failed ({done.returncode}): {done.stderr[-3000:]}"

    got = said["received"]["messages"]
    by_topic: dict[str, list[dict[str, Any]]] = {}
    for m in got:
        by_topic.setdefault(m["topic"], []).append(m)
    normal = sorted(by_topic["NodeNormal"], key=lambda m: m["body"])
    assert [(m["body"], m["tag"], m["keys"]) for m in normal] == [
        ("normal 0", "a", ["k0"]),
        ("normal 1", "b", ["k1"]),
    ]  # the filter 'a || b' passed a and b, not c
    assert all(m["properties"] == {"color": "blue"} and m["attempt"] == 1 for m in normal)
    sent_ids = sorted(x["id"] for x in lines if x["what"] == "sent")
    assert {m["id"] for m in normal} <= set(sent_ids)

    for group in ("g1", "g2"):
        bodies = [m["body"] for m in by_topic["NodeFifo"] if m["group"] == group]
        assert bodies == [f"{group}-{i}" for i in range(5)], bodies

    recall = said["recalled"]
    assert recall["id"] == recall["sent"]
    delayed = by_topic["NodeDelay"]
    assert [m["body"] for m in delayed] == ["kept"]
    assert delayed[0]["at"] >= recall["sentAt"] + 2000 - 50  # not before its time
    assert said["after"]["messages"] == []  # the recalled one never came

    assert sorted(m["body"] for m in by_topic["NodeTxn"]) == ["tx-check", "tx-commit"]
    assert said["after"]["checked"] == ["tx-check"]

    seen = said["pushed"]["seen"]
    assert {"body": "normal 1", "attempt": 2} in seen, seen
