"""For the unit tests, test doubles: virtual time, and an in-memory implementation of the
checker's own seam (:class:`apogee_txn_checker.core.client.TransactionCheckClient`) that keeps a
half queue and an op queue as a broker's TransactionCheck service describes them
(``proto/apogee/v1/transaction.proto``), driven by the test.

For the integration tests, real servers: a nameserver and a broker in-process
(:class:`Cluster`), producers' session streams opened with the generated stubs, and checker
apps.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc.aio
import pytest

from apogee.codec import StoredMessage
from apogee.common.errors import ApogeeError, UnavailableError
from apogee.testkit.broker import decode_records, pull, small_settings
from apogee.testkit.processes import quick_leader_settings
from apogee.testkit.waiting import eventually
from apogee.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    common_pb2,
    consumer_pb2,
    transaction_pb2,
    transaction_pb2_grpc,
)
from apogee_broker.app import BrokerApp
from apogee_nameserver.app import NameServerApp
from apogee_nameserver.settings import NameServerSettings
from apogee_txn_checker.app import TxnCheckerApp
from apogee_txn_checker.core.model import (
    CheckOutcome,
    CheckResult,
    Decision,
    HalfEntry,
    HalfScan,
    OpEntry,
    OpScan,
    TransactionState,
)
from apogee_txn_checker.core.ratelimit import GroupLimiter
from apogee_txn_checker.core.rounds import CheckRound, RoundReport
from apogee_txn_checker.core.stats import CheckerStats
from apogee_txn_checker.settings import TxnCheckerSettings

T = TypeVar("T")
T0 = 1_700_000_000_000


class VirtualClock:
    """A :class:`~apogee.common.clock.Clock` that moves only when :class:`VirtualTime` says."""

    def __init__(self, start_ms: int = T0) -> None:
        self.start_ms = start_ms
        self.mono = 0.0

    def time_ms(self) -> int:
        return self.start_ms + round(self.mono * 1000)

    def monotonic(self) -> float:
        return self.mono


class VirtualTime:
    """A clock and a ``sleep`` on it: time moves only in :meth:`run` and :meth:`advance`, to
    the next sleeper's wake-up, once every task is blocked."""

    def __init__(self) -> None:
        self.clock = VirtualClock()
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    @property
    def now(self) -> float:
        return self.clock.mono

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.clock.mono + seconds, next(self._seq), fut))
        try:
            await fut
        finally:
            fut.cancel()

    @staticmethod
    async def settle() -> None:
        for _ in range(200):
            await asyncio.sleep(0)

    def _next_wake(self) -> float | None:
        while self._sleepers and self._sleepers[0][2].done():
            heapq.heappop(self._sleepers)
        return self._sleepers[0][0] if self._sleepers else None

    def _wake_first(self) -> None:
        at, _, fut = heapq.heappop(self._sleepers)
        self.clock.mono = max(self.clock.mono, at)
        fut.set_result(None)

    async def run(self, aw: Awaitable[T], limit_s: float = 3600.0) -> T:
        """Await ``aw``, moving time on whenever everything waits on it."""
        task = asyncio.ensure_future(aw)
        end = self.clock.mono + limit_s
        try:
            while True:
                await self.settle()
                if task.done():
                    return task.result()
                at = self._next_wake()
                if at is None:
                    raise AssertionError("stuck: the task waits on nothing that time brings")
                if at > end:
                    raise AssertionError(f"not done within {limit_s}s of virtual time")
                self._wake_first()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})

    async def advance(self, seconds: float) -> None:
        """Let ``seconds`` of virtual time pass, waking sleepers in order."""
        target = self.clock.mono + seconds
        while True:
            await self.settle()
            at = self._next_wake()
            if at is None or at > target:
                break
            self._wake_first()
        self.clock.mono = target
        await self.settle()


@dataclass(frozen=True, slots=True)
class Call:
    """One CheckHalf the fake answered: the copy, when (broker ms), and the outcome."""

    half_offset: int
    at_ms: int
    outcome: CheckOutcome


class FakeBroker:
    """A broker's half and op queues in memory, answering the checker's seam.

    ``producers``: groups with a producer connected (their checks are CHECK_SENT, the others
    NO_PRODUCER). ``fail``: method name -> an error its next call raises. ``before_check``:
    called with the half offset at the start of each CheckHalf. ``gate``: when set, CheckHalf
    does its work and then waits on it before answering (a check in flight)."""

    def __init__(self, vt: VirtualTime, name: str = "broker-a") -> None:
        self.vt = vt
        self.address = f"fake:{name}"
        self.name = name
        self.halves: list[HalfEntry] = []
        self.half_min = 0
        self.ops: list[OpEntry] = []
        self.op_min = 0
        self.decisions: dict[str, Decision] = {}
        self.has_op: set[int] = set()
        self.producers: set[str] = {"G"}
        self.progress = (-1, -1)
        self.commits: list[tuple[int, int]] = []
        self.calls: list[Call] = []
        self.moved: list[HalfEntry] = []
        self.fail: dict[str, ApogeeError] = {}
        self.before_check: Callable[[int], None] | None = None
        self.gate: asyncio.Event | None = None
        self.closed = False
        self.state_calls = 0
        #: GetTransactionState calls still to fail with UNAVAILABLE (a broker that is down)
        self.down = 0

    def now_ms(self) -> int:
        return self.vt.clock.time_ms()

    # -- what producers and the test do ----------------------------------------------------

    def send_half(
        self,
        uid: str,
        group: str = "G",
        *,
        immunity_ms: int = 0,
        check_times: int = 0,
        stored_ms: int | None = None,
    ) -> int:
        at = self.now_ms() if stored_ms is None else stored_ms
        offset = len(self.halves)
        self.halves.append(
            HalfEntry(
                queue_offset=offset,
                unique_id=uid,
                producer_group=group,
                topic="Orders",
                store_timestamp_ms=at,
                check_times=check_times,
                immunity_ms=immunity_ms,
                first_stored_ms=at,
            )
        )
        return offset

    def end(self, uid: str, decision: Decision = Decision.COMMIT) -> None:
        """EndTransaction naming the newest copy: the decision kept, that copy's op record."""
        self.decisions[uid] = decision
        newest = max(h.queue_offset for h in self.halves if h.unique_id == uid)
        if newest not in self.has_op:
            self._op(newest, uid, decision)

    def _op(self, half_offset: int, uid: str, decision: Decision) -> None:
        self.ops.append(OpEntry(len(self.ops), half_offset, uid, decision))
        self.has_op.add(half_offset)

    def checked(self) -> list[int]:
        return [c.half_offset for c in self.calls]

    def _maybe_fail(self, method: str) -> None:
        err = self.fail.pop(method, None)
        if err is not None:
            raise err

    # -- the seam ----------------------------------------------------------------------------

    async def get_state(self) -> TransactionState:
        await asyncio.sleep(0)
        self._maybe_fail("get_state")
        self.state_calls += 1
        if self.down > 0:
            self.down -= 1
            raise UnavailableError(what=f"broker {self.name}", detail="it is down")
        return TransactionState(
            broker_name=self.name,
            half_min_offset=self.half_min,
            half_max_offset=len(self.halves),
            op_min_offset=self.op_min,
            op_max_offset=len(self.ops),
            half_progress=self.progress[0],
            op_progress=self.progress[1],
            now_ms=self.now_ms(),
            producers={g: ("client-1",) for g in self.producers},
        )

    async def scan_half(self, offset: int, max_entries: int) -> HalfScan:
        await asyncio.sleep(0)
        self._maybe_fail("scan_half")
        start = max(offset, self.half_min)
        entries = [
            replace(h, decided=self.decisions.get(h.unique_id, Decision.NONE))
            for h in self.halves[start : start + max_entries]
        ]
        return HalfScan(entries, start + len(entries), len(self.halves))

    async def scan_ops(self, offset: int, max_entries: int) -> OpScan:
        await asyncio.sleep(0)
        self._maybe_fail("scan_ops")
        start = max(offset, self.op_min)
        entries = self.ops[start : start + max_entries]
        return OpScan(list(entries), start + len(entries), len(self.ops))

    async def check_half(self, half_offset: int, max_check_times: int) -> CheckResult:
        await asyncio.sleep(0)
        if self.before_check is not None:
            self.before_check(half_offset)
        self._maybe_fail("check_half")
        result = self._check(half_offset, max_check_times)
        self.calls.append(Call(half_offset, self.now_ms(), result.outcome))
        if self.gate is not None:
            await self.gate.wait()
        return result

    def _check(self, offset: int, max_check_times: int) -> CheckResult:
        if offset in self.has_op:
            return CheckResult(CheckOutcome.CLOSED)
        h = self.halves[offset]
        decision = self.decisions.get(h.unique_id, Decision.NONE)
        if decision in (Decision.COMMIT, Decision.ROLLBACK):
            self._op(offset, h.unique_id, decision)
            return CheckResult(CheckOutcome.DECIDED)
        if h.check_times >= max_check_times:
            self._op(offset, h.unique_id, Decision.NONE)
            self.moved.append(h)
            return CheckResult(CheckOutcome.GAVE_UP, check_times=h.check_times)
        copy = replace(
            h,
            queue_offset=len(self.halves),
            store_timestamp_ms=self.now_ms(),
            check_times=h.check_times + 1,
        )
        self.halves.append(copy)
        self._op(offset, h.unique_id, Decision.NONE)
        sent = h.producer_group in self.producers
        return CheckResult(
            CheckOutcome.CHECK_SENT if sent else CheckOutcome.NO_PRODUCER,
            copy.queue_offset,
            "client-1" if sent else "",
            copy.check_times,
        )

    async def commit_progress(self, half_progress: int, op_progress: int) -> None:
        await asyncio.sleep(0)
        self._maybe_fail("commit_progress")
        self.progress = (half_progress, op_progress)
        self.commits.append(self.progress)

    async def close(self) -> None:
        self.closed = True


def checker_settings(**overrides: Any) -> TxnCheckerSettings:
    values: dict[str, Any] = {
        "check_interval_s": 10.0,
        "immunity_s": 6.0,
        "max_check_times": 15,
        "checks_per_group_per_s": 100.0,
        "check_burst": 200,
        "jitter_ms": 0,
    }
    values.update(overrides)
    return TxnCheckerSettings(**values)


class Rounds:
    """A fake broker, virtual time, and rounds run on them one at a time."""

    def __init__(self) -> None:
        self.vt = VirtualTime()
        self.broker = FakeBroker(self.vt)
        self.stats = CheckerStats()
        self.configure()

    def configure(self, **overrides: Any) -> None:
        """New settings (and a new rate limiter)."""
        self.settings = checker_settings(**overrides)
        self.limiter = GroupLimiter(
            self.settings.checks_per_group_per_s,
            self.settings.check_burst,
            self.vt.clock,
            random.Random(7),
            jitter_s=self.settings.jitter_ms / 1000,
            sleep=self.vt.sleep,
        )

    def new_round(self) -> CheckRound:
        return CheckRound(
            "cluster/broker-a",
            self.broker,
            self.settings,
            self.vt.clock,
            self.stats,
            self.limiter,
            deadline=self.vt.now + self.settings.check_interval_s,
            sleep=self.vt.sleep,
        )

    async def round(self) -> RoundReport:
        return await self.vt.run(self.new_round().run())


@pytest.fixture
def rounds() -> Rounds:
    return Rounds()


@pytest.fixture
def vt() -> VirtualTime:
    return VirtualTime()


# -- integration: real servers --------------------------------------------------------------------

TOPIC = "Orders"
GROUP = "order-service"
pb = transaction_pb2


class Producer:
    """A producer's session stream (the generated stub), fed from a queue."""

    def __init__(self, channel: grpc.aio.Channel, client_id: str, group: str = GROUP) -> None:
        self.client_id = client_id
        self.group = group
        self._outbox: asyncio.Queue[pb.ProducerSessionRequest | None] = asyncio.Queue()
        self._outbox.put_nowait(
            pb.ProducerSessionRequest(
                hello=pb.ProducerHello(producer_group=group, client_id=client_id)
            )
        )
        self.call = transaction_pb2_grpc.TransactionStub(channel).ProducerSession(self._requests())

    async def _requests(self) -> AsyncIterator[pb.ProducerSessionRequest]:
        while (r := await self._outbox.get()) is not None:
            yield r

    async def next_check(self, timeout: float) -> pb.TransactionCheckRequest:
        event = await asyncio.wait_for(self.call.read(), timeout)
        assert isinstance(event, pb.ProducerSessionEvent), event
        return event.check

    def close(self) -> None:
        self._outbox.put_nowait(None)


class Cluster:
    """A nameserver and a broker (registered with it), a topic, and what tests do with them:
    send halves, end transactions, open producer sessions, read the broker's state, run
    checker apps."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.nameserver = NameServerApp(
            NameServerSettings(listen="127.0.0.1:0", metrics_listen="127.0.0.1:0")
        )
        self.namesrv = ""
        self.broker: BrokerApp | None = None
        self.channel: grpc.aio.Channel | None = None
        self.checkers: list[TxnCheckerApp] = []
        self.producers: list[Producer] = []

    async def start(self) -> None:
        port = await self.nameserver.start()
        self.namesrv = f"127.0.0.1:{port}"
        self.broker = BrokerApp(
            small_settings(self.tmp_path / "broker", broker_name="broker-a", namesrv=self.namesrv)
        )
        await self.broker.start()
        self.channel = grpc.aio.insecure_channel(self.broker.address)
        await broker_pb2_grpc.BrokerAdminStub(self.channel).PutTopic(
            broker_pb2.PutTopicRequest(
                topic=common_pb2.TopicConfig(name=TOPIC, read_queues=1, write_queues=1, perm=6)
            ),
            timeout=5,
        )

    @property
    def ch(self) -> grpc.aio.Channel:
        assert self.channel is not None
        return self.channel

    def checker_settings(self, **overrides: Any) -> TxnCheckerSettings:
        values = {
            **quick_leader_settings(self.namesrv, self.tmp_path / "txn-checker.lock"),
            "check_interval_s": 1.0,
            "immunity_s": 2.0,
            "jitter_ms": 20,
            **overrides,
        }
        return TxnCheckerSettings(**values)

    async def start_checker(self, **overrides: Any) -> TxnCheckerApp:
        app = TxnCheckerApp(self.checker_settings(**overrides))
        self.checkers.append(app)
        await app.start()
        return app

    async def send_half(self, body: str, **properties: str) -> pb.SendHalfResponse:
        msg = common_pb2.Message(
            topic=TOPIC, body=body.encode(), queue_id=-1, keys=[body], properties=properties
        )
        return await transaction_pb2_grpc.TransactionStub(self.ch).SendHalf(
            pb.SendHalfRequest(producer_group=GROUP, message=msg), timeout=5
        )

    async def end(
        self, check: pb.TransactionCheckRequest, decision: pb.TransactionDecision.ValueType
    ) -> pb.EndTransactionResponse:
        return await transaction_pb2_grpc.TransactionStub(self.ch).EndTransaction(
            pb.EndTransactionRequest(
                producer_group=GROUP,
                unique_id=check.unique_id,
                half_offset=check.half_offset,
                decision=decision,
                source=pb.CHECK,
                client_id="producer-1",
            ),
            timeout=5,
        )

    async def state(self) -> pb.GetTransactionStateResponse:
        return await transaction_pb2_grpc.TransactionCheckStub(self.ch).GetTransactionState(
            pb.GetTransactionStateRequest(), timeout=5
        )

    async def pending(self) -> list[pb.PendingTransaction]:
        got = await transaction_pb2_grpc.TransactionCheckStub(self.ch).ListPending(
            pb.ListPendingRequest(), timeout=5
        )
        return list(got.pending)

    async def connect(self, client_id: str) -> Producer:
        """A producer session of GROUP, once the broker lists it."""
        p = Producer(self.ch, client_id)
        self.producers.append(p)

        async def listed() -> bool:
            st = await self.state()
            return any(client_id in g.client_ids for g in st.producers)

        await eventually(listed, 5, f"producer {client_id} connected")
        return p

    async def delivered(self) -> list[StoredMessage]:
        """The messages of TOPIC, read from the start."""
        out: list[StoredMessage] = []
        offset = 0
        while True:
            reply = await pull(
                self.ch,
                consumer_pb2.PullRequest(
                    group="reader", client_id="t", topic=TOPIC, queue_id=0, offset=offset
                ),
            )
            got = decode_records(reply.records)
            if not got:
                return out
            out.extend(got)
            offset = reply.next_offset

    async def close(self) -> None:
        for p in self.producers:
            p.close()
            p.call.cancel()
        for app in reversed(self.checkers):
            with contextlib.suppress(Exception):
                await app.stop()
        if self.channel is not None:
            await self.channel.close()
        if self.broker is not None:
            await self.broker.stop()
        await self.nameserver.stop()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        await c.start()
        yield c
    finally:
        await c.close()
