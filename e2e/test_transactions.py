"""Transactional messages end to end: nameservers, brokers, the schedule service and the
transaction checker as real processes (:mod:`e2e.harness`), producers and consumers in the test
or in a process of their own (:mod:`e2e.txn_producer_proc`). The checker scans every second,
first checks a half 1 s after it is stored, and gives up after its default 15 checks.

1. a commit reaches a consumer once, as sent (id, body, tags, keys, properties); a rollback never
   does: a marker committed after it on the same queue arrives, the rolled-back message not;
2. an executor answers UNKNOWN: the checker's check reaches the check listener, which answers
   COMMIT, and the message is delivered once;
3. the producer is killed (SIGKILL) after its half, before its end; another producer of the group
   answers the check; the message is delivered once;
4. with no producer of the group alive, after 15 checks the transaction is given up (kept in
   TRANS_CHECK_MAX_TIME_TOPIC); ``apogee txn list`` shows it, ``apogee txn resolve ID --commit``
   delivers it once;
5. the checker is killed mid-scan of 300 halves (a low rate limit makes the scan last seconds)
   and started again: every transaction is checked once, none again once decided, and each is
   delivered once;
6. a broker is killed between a half and its end, and started again: a check resolves the
   transaction, which is delivered once;
7. two checkers share a lock file: one checks, the other waits; when the active one is killed,
   the other takes over within the lock poll time;
8. bad inputs get their error kind, code and sentence (:mod:`e2e.txn_bad_inputs`) through the
   SDK, raw ``SendHalf`` and ``EndTransaction`` calls, the admin client and the ``apogee txn``
   command; nothing is stored and the brokers keep serving.

Scenarios 1 to 4 and 8 share one cluster (each with a topic and producer group of its own); 5, 6
and 7 kill members and start clusters of their own.

"Delivered once" is shown with markers (:func:`e2e.txn_support.assert_delivered_once`): once the
transactions are delivered, a message is committed after them on each queue they came on. A
consumer reads a queue in order, so once the markers have come everything stored before them
has, and each transaction must be there at exactly one offset.
"""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from apogee.client import (
    AdminClient,
    EndOutcome,
    Message,
    TransactionDecision,
    TransactionProducer,
    TransactionResult,
)
from apogee.client.txn_admin import PendingTransaction
from apogee.common.errors import ApogeeError, NotFoundError
from apogee.rpc.server import check_health
from apogee.v1 import transaction_pb2, transaction_pb2_grpc
from e2e import txn_bad_inputs as bad
from e2e.harness import Cluster, ClusterFactory, wait_registered
from e2e.txn_support import (
    Checks,
    SecondChecker,
    apogee,
    assert_delivered_once,
    assert_kept_aside,
    commit,
    deciding,
    half_max_offsets,
    kind_of,
    log_text,
    make_topic,
    pending,
    reading,
    rounds,
    tail,
    wait,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
#: The checker of these tests: a round every second, a first check 1 s after a half is stored,
#: the default 15 checks before giving up; a standby tries the lock twice a second.
INTERVAL_S = 1.0
IMMUNITY_S = 1.0
MAX_CHECKS = 15
LOCK_POLL_S = 0.5
CHECKER_ENV = {
    "APOGEE_TXN_CHECKER_CHECK_INTERVAL_S": str(INTERVAL_S),
    "APOGEE_TXN_CHECKER_IMMUNITY_S": str(IMMUNITY_S),
    "APOGEE_TXN_CHECKER_LOCK_POLL_S": str(LOCK_POLL_S),
    "APOGEE_TXN_CHECKER_BROKER_REFRESH_S": "1",
}
#: Topics are created by the tests (an unknown topic must stay unknown).
BROKER_ENV = {"APOGEE_BROKER_AUTO_CREATE_TOPICS": "false"}
#: What a slow, shared machine may add to a wait the settings bound (a process's start, a probe).
SLACK_S = 2.0

COMMIT = TransactionDecision.COMMIT
ROLLBACK = TransactionDecision.ROLLBACK
UNKNOWN = TransactionDecision.UNKNOWN


@pytest.fixture(scope="module")
def txn_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster.start(
        tmp_path_factory.mktemp("txn-cluster"), broker_env=BROKER_ENV, txn_checker_env=CHECKER_ENV
    )
    try:
        yield cluster
    finally:
        cluster.close()


def start(factory: ClusterFactory, name: str, **checker: str) -> Cluster:
    return factory(name, broker_env=BROKER_ENV, txn_checker_env={**CHECKER_ENV, **checker})


# -- 1. commit and rollback ------------------------------------------------------------------------


async def test_a_commit_is_delivered_once_as_sent_and_a_rollback_never(
    txn_cluster: Cluster,
) -> None:
    topic, group = "TxnCommitRollback", "txn-e2e-commit"
    await make_topic(txn_cluster, topic)
    checks = Checks(ROLLBACK)
    props = {"order": "o-1", "region": "eu-west"}
    async with (
        reading(txn_cluster, topic, "txn-e2e-commit-readers") as got,
        TransactionProducer(txn_cluster.namesrv, group, check_listener=checks) as producer,
    ):
        sent = Message(topic, b"order 1", tags="placed", keys=["o-1", "c-9"], properties=props)
        done = await producer.send_in_transaction(sent, deciding(COMMIT))
        dropped = await producer.send_in_transaction(
            Message(topic, b"order 2", tags="placed", keys=["o-2"]), deciding(ROLLBACK)
        )
        assert (done.end_outcome, done.committed) == (EndOutcome.COMMITTED, True), done
        assert (dropped.end_outcome, dropped.pending) == (EndOutcome.ROLLED_BACK, False), dropped
        assert done.queue_offset >= 0
        # a rolled-back message stored anyway would be in its queue before the marker there
        dropped_queue = (dropped.broker_name, dropped.queue_id)
        await assert_delivered_once(
            txn_cluster, got, topic, [done.transaction_id], also=[dropped_queue]
        )
        assert await pending(txn_cluster, group) == {}

    [m] = got.by_id[done.transaction_id]
    assert (m.topic, m.body, m.tags, list(m.keys), dict(m.properties)) == (
        topic,
        b"order 1",
        "placed",
        ["o-1", "c-9"],
        props,
    )
    where = (m.broker_name, m.queue_id, m.queue_offset)
    assert where == (done.broker_name, done.queue_id, done.queue_offset)
    assert dropped.transaction_id not in got, got.by_id[dropped.transaction_id]
    assert not checks.calls, f"decided transactions were checked: {checks.summary()}"


# -- 2. UNKNOWN, then a check answered COMMIT ------------------------------------------------------


async def test_an_unknown_transaction_is_committed_by_the_checkers_check(
    txn_cluster: Cluster,
) -> None:
    topic, group = "TxnCheckCommit", "txn-e2e-check"
    await make_topic(txn_cluster, topic)
    checks = Checks(COMMIT)
    props = {"amount": "30"}
    async with (
        reading(txn_cluster, topic, "txn-e2e-check-readers") as got,
        TransactionProducer(txn_cluster.namesrv, group, check_listener=checks) as producer,
    ):
        sent = Message(topic, b"pay 30 EUR", tags="pay", keys=["p-1"], properties=props)
        r = await producer.send_in_transaction(sent, deciding(UNKNOWN))
        assert (r.end_outcome, r.pending, r.queue_offset) == (EndOutcome.NOT_ENDED, True, -1)
        uid = r.transaction_id
        await wait(
            lambda: uid in got,
            IMMUNITY_S + 2 * INTERVAL_S + 10,
            "the transaction committed by its check, delivered",
            lambda: f"{checks.summary()}; {got.summary()}",
        )
        await assert_delivered_once(txn_cluster, got, topic, [uid])
        assert await pending(txn_cluster, group) == {}
        stats = producer.check_stats()

    assert checks.times(uid) == [1], checks.summary()
    _, arrived, asked = checks.calls[uid][0]
    assert (asked.topic, asked.body, asked.tags, list(asked.keys), dict(asked.properties)) == (
        topic,
        b"pay 30 EUR",
        "pay",
        ["p-1"],
        props,
    )
    assert (asked.broker_name, asked.queue_id) == (r.broker_name, r.queue_id)
    # not before its immunity time (the broker's clock is this machine's)
    assert arrived >= r.store_timestamp_ms / 1000 + IMMUNITY_S - 0.01, arrived
    [m] = got.by_id[uid]
    assert (m.body, m.tags, list(m.keys), dict(m.properties)) == (
        b"pay 30 EUR",
        "pay",
        ["p-1"],
        props,
    )
    assert (stats.received, stats.answered, stats.answer_failures) == (1, 1, 0), stats


# -- 3. the producer dies mid-transaction ----------------------------------------------------------


async def test_a_producer_killed_mid_transaction_is_answered_for_by_another_of_its_group(
    txn_cluster: Cluster, tmp_path: Path
) -> None:
    topic, group = "TxnProducerKill", "txn-e2e-orphans"
    await make_topic(txn_cluster, topic)
    log = tmp_path / "txn-producer.log"
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "e2e.txn_producer_proc", "--namesrv", txn_cluster.namesrv),
            *("--group", group, "--topic", topic, "--body", "order 3", "--key", "o-3"),
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
        )
    try:
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 30.0)
        except TimeoutError:
            raise AssertionError(f"the producer printed no transaction:\n{tail(log)}") from None
        assert line.startswith(b"TXN "), (line, tail(log))
        uid = line.split()[1].decode()
        # its half is stored and nobody ended it
        assert uid in await pending(txn_cluster, group)
        proc.kill()  # SIGKILL, in the middle of the local transaction
        assert await asyncio.wait_for(proc.wait(), 10.0) == -signal.SIGKILL
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()

    checks = Checks(COMMIT)
    async with (
        reading(txn_cluster, topic, "txn-e2e-orphan-readers") as got,
        TransactionProducer(txn_cluster.namesrv, group, check_listener=checks, topics=[topic]),
    ):
        await wait(
            lambda: uid in got,
            IMMUNITY_S + 3 * INTERVAL_S + 15,
            "the dead producer's transaction answered by another of its group, delivered",
            lambda: f"{checks.summary()}; {got.summary()}\n{tail(log)}",
        )
        await assert_delivered_once(txn_cluster, got, topic, [uid])
        assert await pending(txn_cluster, group) == {}
    assert checks.count(uid) == 1, checks.summary()
    _, _, asked = checks.calls[uid][0]
    assert (asked.body, list(asked.keys)) == (b"order 3", ["o-3"])
    [m] = got.by_id[uid]
    assert (m.body, list(m.keys)) == (b"order 3", ["o-3"])


# -- 4. given up, listed, resolved by an operator --------------------------------------------------


async def test_with_no_producer_alive_a_transaction_is_given_up_then_resolved_by_an_operator(
    txn_cluster: Cluster,
) -> None:
    topic, group = "TxnGiveUp", "txn-e2e-abandoned"
    await make_topic(txn_cluster, topic)
    async with TransactionProducer(txn_cluster.namesrv, group) as producer:
        r = await producer.send_in_transaction(
            Message(topic, b"order 4", keys=["o-4"]), deciding(UNKNOWN)
        )
    # closed: no producer of the group is alive, every check finds none
    uid = r.transaction_id
    seen: dict[str, PendingTransaction] = {}

    async def given_up() -> bool:
        seen.update(await pending(txn_cluster, group))
        return uid in seen and not seen[uid].checking

    # 15 checks, each an interval after the copy the one before put back, after the immunity
    least = IMMUNITY_S + MAX_CHECKS * INTERVAL_S
    await wait(given_up, least + 15, "the transaction given up", lambda: repr(seen))
    took = time.time() - r.store_timestamp_ms / 1000
    print(f"given up {took:.1f}s after the half was stored (at least {least:.0f}s)")
    assert took >= least - 0.01, took
    p = seen[uid]
    assert (p.producer_group, p.topic, p.check_times, p.broker_name) == (
        group,
        topic,
        MAX_CHECKS,
        r.broker_name,
    )
    await assert_kept_aside(txn_cluster, r, MAX_CHECKS, b"order 4")

    listed = (await asyncio.to_thread(apogee, txn_cluster.namesrv, "txn", "list")).stdout
    header, *rows = listed.splitlines()
    assert header.split() == ["ID", "BROKER", "GROUP", "TOPIC", "AGE", "CHECKS", "STATE", "KEYS"]
    [row] = [line for line in rows if line.startswith(uid)]
    cells = row.split()
    assert cells[1:4] == [r.broker_name, group, topic], row
    age = re.fullmatch(r"(\d+)s", cells[4])
    assert age, row
    assert int(age[1]) >= int(least), row
    assert cells[5:] == [str(MAX_CHECKS), "gave", "up", "o-4"], row

    async with reading(txn_cluster, topic, "txn-e2e-abandoned-readers") as got:
        done = await asyncio.to_thread(
            apogee, txn_cluster.namesrv, "txn", "resolve", uid, "--commit"
        )
        await assert_delivered_once(txn_cluster, got, topic, [uid])
    [m] = got.by_id[uid]
    assert (m.body, list(m.keys)) == (b"order 4", ["o-4"])
    assert done.stdout == (
        f"committed {uid} on {r.broker_name}: {topic} queue {m.queue_id} offset {m.queue_offset}\n"
    )
    after = await asyncio.to_thread(apogee, txn_cluster.namesrv, "txn", "list", "--group", group)
    assert after.stdout == "no pending transaction\n"
    # resolving it again: it is pending nowhere
    again = await asyncio.to_thread(
        apogee, txn_cluster.namesrv, "txn", "resolve", uid, "--rollback", code=1
    )
    assert again.stderr == (
        f"apogee: transaction {uid} not found: no live broker holds it pending (it may be "
        "decided already, or unknown)\n"
    )


# -- 5. the checker dies mid-scan ------------------------------------------------------------------


async def test_a_checker_killed_mid_scan_checks_each_transaction_once(
    start_cluster: ClusterFactory,
) -> None:
    halves, rate = 300, 40  # checks a second to the group: the scan takes about 7 s
    cluster = await asyncio.to_thread(
        start,
        start_cluster,
        "checker-kill",
        APOGEE_TXN_CHECKER_CHECKS_PER_GROUP_PER_S=str(rate),
        APOGEE_TXN_CHECKER_CHECK_BURST="10",
    )
    topic, group = "TxnCheckerKill", "txn-e2e-many"
    await make_topic(cluster, topic)
    checks = Checks(COMMIT)
    async with (
        reading(cluster, topic, "txn-e2e-many-readers") as got,
        TransactionProducer(cluster.namesrv, group, check_listener=checks) as producer,
    ):
        room = asyncio.Semaphore(32)

        async def one(i: int) -> TransactionResult:
            async with room:
                m = Message(topic, f"item {i}".encode(), keys=[f"i-{i}"])
                return await producer.send_in_transaction(m, deciding(UNKNOWN))

        results = await asyncio.gather(*(one(i) for i in range(halves)))
        ids = {r.transaction_id for r in results}
        assert len(ids) == halves
        assert {r.end_outcome for r in results} == {EndOutcome.NOT_ENDED}

        await wait(lambda: len(checks.calls) >= halves // 5, 30.0, "checks begun", checks.summary)
        await asyncio.to_thread(cluster.kill, "txn-checker")
        at_kill = len(checks.calls)
        print(f"the checker was killed once {at_kill} of {halves} transactions were checked")
        assert at_kill < halves * 0.6, "the kill came too late to be mid-scan"
        log = cluster.member("txn-checker").log
        logged = len(log_text(log))
        await asyncio.to_thread(cluster.restart, "txn-checker")

        await wait(
            lambda: ids <= set(checks.calls),
            halves / rate + 30,
            f"all {halves} transactions checked",
            lambda: f"{checks.summary()}; {len(ids - set(checks.calls))} not checked",
        )
        await assert_delivered_once(cluster, got, topic, ids)
        assert await pending(cluster, group) == {}
        stats = producer.check_stats()

    # the restarted checker began where the killed one had committed its progress
    started = log_text(log)[logged:]
    assert re.search(r"\), progress half \d+, op \d+;", started), started
    # each was answered COMMIT at its first check: none was checked again
    again = {u: checks.times(u) for u in ids if checks.count(u) != 1}
    assert not again, f"checked again after the COMMIT answer: {again}"
    assert set(checks.calls) == ids
    assert (stats.answered, stats.answer_failures) == (halves, 0), stats


# -- 6. a broker dies between the half and the end ------------------------------------------------


async def test_a_broker_killed_between_half_and_end_is_resolved_by_a_check_after_restart(
    start_cluster: ClusterFactory,
) -> None:
    cluster = await asyncio.to_thread(start, start_cluster, "broker-kill")
    topic, group = "TxnBrokerKill", "txn-e2e-crash"
    await make_topic(cluster, topic)
    checks = Checks(COMMIT)
    async with (
        reading(cluster, topic, "txn-e2e-crash-readers") as got,
        TransactionProducer(cluster.namesrv, group, check_listener=checks) as producer,
    ):
        # first checked 3 s after it is stored: not before its broker is killed
        immune = {"CHECK_IMMUNITY_TIME_IN_SECONDS": "3"}
        sent = Message(topic, b"order 6", keys=["o-6"], properties=immune)
        r = await producer.send_in_transaction(sent, deciding(UNKNOWN))
        assert r.end_outcome is EndOutcome.NOT_ENDED
        uid, broker = r.transaction_id, r.broker_name
        await asyncio.to_thread(cluster.kill, broker)
        # nothing checked it before: a check now can only come from the broker restarted
        assert not checks.calls, checks.summary()
        await asyncio.to_thread(cluster.restart, broker)
        await wait_registered(cluster.nameservers, broker)
        await wait(
            lambda: uid in got,
            30.0,
            "the transaction resolved by a check after the restart, delivered",
            lambda: f"{checks.summary()}; {got.summary()}",
        )
        await assert_delivered_once(cluster, got, topic, [uid])
        assert await pending(cluster, group) == {}
        async with AdminClient(cluster.namesrv) as admin:
            recovery = {x.broker_name: x for x in await admin.last_recoveries()}[broker]
    assert not recovery.clean, recovery  # the half came back from a crashed broker's recovery
    assert checks.count(uid) == 1, checks.summary()
    _, _, asked = checks.calls[uid][0]
    assert (asked.broker_name, asked.body, dict(asked.properties)) == (broker, b"order 6", {})
    [m] = got.by_id[uid]
    assert (m.broker_name, m.queue_id, m.body) == (broker, r.queue_id, b"order 6")


# -- 7. two checkers -------------------------------------------------------------------------------


async def test_of_two_checkers_one_checks_and_the_other_takes_over_when_it_dies(
    start_cluster: ClusterFactory,
) -> None:
    cluster = await asyncio.to_thread(start, start_cluster, "two-checkers")
    topic, group = "TxnTwoCheckers", "txn-e2e-standby"
    await make_topic(cluster, topic)
    first = cluster.member("txn-checker")
    second = SecondChecker(cluster)
    checks = Checks(UNKNOWN)  # the transaction stays undecided: checked every interval

    def logs() -> str:
        return f"{checks.summary()}\n==> the second checker <==\n{tail(second.log)}"

    try:
        await wait(
            lambda: check_health(second.address, 1.0, "apogee.txn_checker.Process"),
            30.0,
            "the second checker running",
            logs,
        )
        await wait(lambda: "standby: " in log_text(second.log), 10.0, "a standby", logs)
        assert await check_health(first.address, 1.0)
        assert not await check_health(second.address, 1.0)  # NOT_SERVING: a standby

        async with TransactionProducer(cluster.namesrv, group, check_listener=checks) as producer:
            r = await producer.send_in_transaction(Message(topic, b"order 7"), deciding(UNKNOWN))
            uid = r.transaction_id
            await wait(lambda: checks.count(uid) >= 3, 15.0, "three checks", logs)
            # each check was the round of the active one; the standby ran none
            await wait(lambda: rounds(log_text(first.log)) >= 3, 5.0, "three rounds", logs)
            assert rounds(log_text(second.log)) == 0, tail(second.log)

            before = checks.count(uid)
            killed_at = await asyncio.to_thread(cluster.kill, "txn-checker")
            await wait(
                lambda: check_health(second.address, 0.5),
                LOCK_POLL_S + SLACK_S + 10,
                "the second checker active",
                logs,
            )
            took = time.monotonic() - killed_at
            await wait(lambda: checks.count(uid) > before, 15.0, "checks going on", logs)
            resumed = checks.calls[uid][before][0] - killed_at
            assert checks.times(uid) == list(range(1, checks.count(uid) + 1)), logs()
        print(
            f"takeover: the standby active {took:.2f}s after the kill (lock poll {LOCK_POLL_S}s), "
            f"the next check {resumed:.2f}s after it"
        )
        # the standby tries the lock every lock_poll_s; a slow machine may add to its start
        assert took <= LOCK_POLL_S + SLACK_S, took
        # then its first round checks the copy put back last, due an interval after it was
        assert resumed <= LOCK_POLL_S + INTERVAL_S + SLACK_S, resumed
        assert "active: holding the lock" in log_text(second.log), tail(second.log)
        # the round that checked it says so once it ends
        await wait(lambda: rounds(log_text(second.log)) >= 1, 5.0, "its round in its log", logs)
    finally:
        await asyncio.to_thread(second.stop)
    assert second.proc.returncode == 0, tail(second.log)


# -- 8. bad inputs ---------------------------------------------------------------------------------


async def test_bad_inputs_get_their_errors_and_the_brokers_keep_serving(
    txn_cluster: Cluster,
) -> None:
    group = "txn-e2e-bad"
    await make_topic(txn_cluster, bad.TOPIC)
    before = await half_max_offsets(txn_cluster)
    ran: list[str] = []
    async with TransactionProducer(txn_cluster.namesrv, group, retries=0) as producer:
        for case in bad.SDK_CASES:
            with pytest.raises(ApogeeError) as caught:
                await producer.send_in_transaction(case.message, deciding(COMMIT, ran))  # type: ignore[arg-type]
            err = caught.value
            assert (err.kind.name, err.kind.code, str(err)) == (case.kind, case.code, case.says)
        assert ran == [], "an executor ran for a refused message"
        assert await half_max_offsets(txn_cluster) == before, "a refused message left a half"
        good = await producer.send_in_transaction(Message(bad.TOPIC, b"good"), commit)
        assert good.committed, good

    unknown = "0A0B0C0D0E0F00000000000000000000"
    for broker in txn_cluster.brokers:
        async with grpc.aio.insecure_channel(broker.address) as channel:
            stub = transaction_pb2_grpc.TransactionStub(channel)
            for raw in bad.RAW_CASES:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.SendHalf(raw.request, timeout=5)
                e = refused.value
                assert (e.code(), kind_of(e)) == (raw.code, raw.kind), f"{raw.name}: {e}"
                assert (e.details() or "").startswith(raw.says), f"{raw.name}: {e.details()}"
            # ending a transaction this broker does not know
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.EndTransaction(
                    end(group, unknown, -1, transaction_pb2.COMMIT), timeout=5
                )
            e = refused.value
            assert (e.code(), kind_of(e)) == (grpc.StatusCode.NOT_FOUND, "NOT_FOUND")
            assert e.details() == (
                f"transaction {unknown!r} not found: broker {broker.name} holds no half "
                "message with this id (it may be on another broker, or removed by retention)"
            )
            if broker.name != good.broker_name:
                continue
            # ending a committed transaction the other way
            request = end(group, good.transaction_id, good.half_offset, transaction_pb2.ROLLBACK)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.EndTransaction(request, timeout=5)
            e = refused.value
            assert (e.code(), kind_of(e)) == (
                grpc.StatusCode.FAILED_PRECONDITION,
                "TRANSACTION_DECIDED",
            )
            assert re.fullmatch(
                f"transaction '{good.transaction_id}' was already committed at "
                r"\S+; it cannot be rolled back now",
                e.details() or "",
            ), e.details()
    assert await half_max_offsets(txn_cluster) == {
        b: n + (b == good.broker_name) for b, n in before.items()
    }, "a refused request left a half"

    # the admin client and the command: an id no broker holds pending, no id, no decision
    async with AdminClient(txn_cluster.namesrv) as admin:
        with pytest.raises(NotFoundError) as missing:
            await admin.resolve_transaction(unknown, commit=True)
        assert missing.value.kind.code == "NOT_FOUND"
        with pytest.raises(ApogeeError) as empty:
            await admin.resolve_transaction(" ", commit=True)
        assert (empty.value.kind.name, str(empty.value)) == (
            "INVALID_ARGUMENT",
            "transaction_id: must be a non-empty string",
        )
    cli = await asyncio.to_thread(
        apogee, txn_cluster.namesrv, "txn", "resolve", unknown, "--commit", code=1
    )
    assert (cli.stdout, cli.stderr) == (
        "",
        f"apogee: transaction {unknown} not found: no live broker holds it pending (it may be "
        "decided already, or unknown)\n",
    )
    usage = await asyncio.to_thread(apogee, txn_cluster.namesrv, "txn", "resolve", unknown, code=2)
    assert usage.stderr.endswith("error: one of the arguments --commit --rollback is required\n")
    bad_max = await asyncio.to_thread(
        apogee, txn_cluster.namesrv, "txn", "list", "--max", "0", code=2
    )
    assert bad_max.stderr.endswith("apogee: error: --max must be from 1 to 10000, got 0\n")

    # the brokers still serve: health, and a transaction committed and delivered once
    for b in txn_cluster.brokers:
        assert await check_health(b.address, 2.0), b.name
    async with (
        reading(txn_cluster, bad.TOPIC, "txn-e2e-bad-readers") as got,
        TransactionProducer(txn_cluster.namesrv, group) as producer,
    ):
        after = await producer.send_in_transaction(Message(bad.TOPIC, b"after"), commit)
        ids = [good.transaction_id, after.transaction_id]
        await assert_delivered_once(txn_cluster, got, bad.TOPIC, ids)
    assert [got.by_id[u][0].body for u in ids] == [b"good", b"after"]


def end(
    group: str, uid: str, half_offset: int, decision: transaction_pb2.TransactionDecision.ValueType
) -> transaction_pb2.EndTransactionRequest:
    return transaction_pb2.EndTransactionRequest(
        producer_group=group, unique_id=uid, half_offset=half_offset, decision=decision
    )
