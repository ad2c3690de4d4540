"""``python -m apogee_txn_checker`` as real processes: an active one and a standby on one lock
file; ``kill -9`` of the active one hands over to the standby, which goes on checking; SIGTERM
stops cleanly; bad settings and a taken port exit with their codes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from apogee.testkit.processes import LeaderReplicas, run_module, taken_address
from apogee_txn_checker.__main__ import main
from apogee_txn_checker.app import PROCESS_HEALTH


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[LeaderReplicas]:
    env = {
        "APOGEE_TXN_CHECKER_LOCK_POLL_S": "0.1",
        "APOGEE_TXN_CHECKER_CHECK_INTERVAL_S": "1",
        "APOGEE_TXN_CHECKER_IMMUNITY_S": "0.5",
        "APOGEE_TXN_CHECKER_MAX_CHECK_TIMES": "1000",
        "APOGEE_TXN_CHECKER_JITTER_MS": "20",
        "APOGEE_TXN_CHECKER_BROKER_REFRESH_S": "0.2",
    }
    started = LeaderReplicas("apogee_txn_checker", tmp_path, "txn-checker.lock", env)
    yield started
    started.kill()


@pytest.mark.integration
@pytest.mark.slow
async def test_kill_9_of_the_active_replica_hands_over_to_the_standby(
    cluster: Any, replicas: LeaderReplicas
) -> None:
    first, second = await replicas.active_and_standby(cluster.namesrv, PROCESS_HEALTH)

    sent = await cluster.send_half("order-9")  # no producer: checked every second

    async def checks(at_least: int) -> bool:
        return any(
            p.unique_id == sent.unique_id and p.check_times >= at_least
            for p in await cluster.pending()
        )

    await first.wait(lambda: checks(2), "two checks by the first replica")
    first.proc.kill()  # kill -9: its lock goes with it
    [p] = await cluster.pending()
    before = p.check_times

    await second.wait_serving("the second replica, after the first died,")
    await second.wait(lambda: checks(before + 2), "two more checks by the second replica")

    assert await second.terminate() == 0
    lines = second.output().splitlines()
    assert all(line[:4].isdigit() and line[10] == "T" for line in lines), lines
    assert any(" INFO apogee.service.leadership active: holding the lock " in x for x in lines)
    assert " INFO apogee_txn_checker.app txn-checker stopped: " in lines[-1]
    # the copies the killed replica had checked have op records: the standby passes them by
    # the remove map and never meets one already closed
    assert lines[-1].endswith(" 0 closed, 0 errors"), lines[-1]


@pytest.mark.unit
def test_bad_settings_exit_with_2_naming_the_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--namesrv", "nowhere"]) == 2
    assert capsys.readouterr().err == (
        "apogee-txn-checker: namesrv: 'nowhere' is not host:port (port 1 to 65535)\n"
    )


@pytest.mark.integration
def test_a_taken_port_exits_with_1_and_says_why(tmp_path: Path) -> None:
    with taken_address() as address:
        lock = str(tmp_path / "l.lock")
        done = run_module("apogee_txn_checker", "--listen", address, "--lock-file", lock)
    assert done.returncode == 1
    assert f"txn-checker could not start: txn-checker cannot listen on {address}" in (
        done.stdout.decode()
    )
