"""The traffic ``scripts/render_dashboards.py`` drives through a local cluster, with the SDK,
so that every dashboard has something to show; and the settings of the cluster it runs on.

Over ``seconds`` (shares of the run in brackets):

- producer group ``shop`` sends 30 messages a second to ``Orders`` (one in 300 keyed
  ``poison-*``, one in 50 ``flaky-*``) and 60 a second to ``Clicks`` in bursts of 30; every 2 s
  a delayed message to ``Orders`` (levels 1 to 5: 1 s to 1 min), every 6 s a timer message 20 to
  100 s ahead (the brokers' timer wheel has 1 s slots over a 60 s span, so those further ahead
  are parked once); every 20 s a body larger than the brokers take (refused,
  ``MESSAGE_TOO_LARGE``);
- ``payments-tx`` runs 3 transactions a second on ``Payments``: per 20, 14 committed and 2
  rolled back at once, 4 left UNKNOWN, of which the check-backs commit 2, roll back 1 and leave
  1 undecided until the checker gives up (5 checks, 5 s apart); at (0.3) ``refunds-tx`` leaves 6
  transactions UNKNOWN and exits (checks find no producer); at (0.85) an operator commits up to
  3 given-up payments;
- consumer group ``billing`` (push) reads ``Orders`` and keeps up; ``analytics`` (push) reads
  ``Orders`` and ``Clicks`` at 150 messages a second per consumer, 20 while its work is slow
  (0.25 to 0.55): it falls behind, gets a second consumer (0.45 to 0.8) and catches up; it fails
  poison messages at every delivery (2 retries, then the dead-letter topic) and flaky ones once;
  ``ledger`` (pull) reads ``Payments``;
- a reader reads the latest 20 messages of each ``Orders`` queue every 5 s (pulls);
- at the end every send is answered, and the clients close.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

from apogee.client import (
    AdminClient,
    ConsumeResult,
    Message,
    Producer,
    PullConsumer,
    PushConsumer,
    QueueReader,
    ReceivedMessage,
    TransactionCheckMessage,
    TransactionDecision,
    TransactionMessage,
    TransactionProducer,
)
from apogee.common.errors import ApogeeError

KiB: Final = 1024
TOPICS: Final = {"Orders": 4, "Clicks": 4, "Payments": 2}
ORDERS_PER_TICK, ORDERS_TICK_S = 3, 0.1
CLICKS_PER_TICK, CLICKS_TICK_S = 30, 0.5
PAYMENT_TICK_S: Final = 1 / 3
POISON_EVERY, FLAKY_EVERY = 300, 50
#: messages a second one analytics consumer gets through, while its work is slow and else
SLOW_PER_S, FAST_PER_S = 20.0, 150.0
#: shares of the run (see the module docstring)
SLOW: Final = (0.25, 0.55)
JOIN, LEAVE = 0.45, 0.8
REFUNDS_AT, OPERATOR_AT = 0.3, 0.85
#: the brokers refuse larger bodies
MAX_BODY: Final = 256 * KiB
BROKER_ENV: Final = {
    "APOGEE_BROKER_MAX_MESSAGE_SIZE": str(MAX_BODY),
    "APOGEE_BROKER_TIMER_SLOT_MS": "1000",
    "APOGEE_BROKER_TIMER_SLOTS": "64",
}
SCHEDULE_ENV: Final = {"APOGEE_SCHEDULE_BROKER_REFRESH_S": "1"}
CHECKER_ENV: Final = {
    "APOGEE_TXN_CHECKER_CHECK_INTERVAL_S": "5",
    "APOGEE_TXN_CHECKER_IMMUNITY_S": "5",
    "APOGEE_TXN_CHECKER_MAX_CHECK_TIMES": "5",
    "APOGEE_TXN_CHECKER_BROKER_REFRESH_S": "1",
}
CONSUMER: Final[dict[str, Any]] = {
    "consume_from": "earliest",
    "rebalance_interval": 2.0,
    "offset_persist_interval": 1.0,
}
ANALYTICS: Final[dict[str, Any]] = {
    **CONSUMER,
    "consume_concurrency": 8,
    "max_reconsume_times": 2,
    "first_retry_delay_level": 1,
}
PAY_GROUP: Final = "payments-tx"


@dataclass
class Timeline:
    """What the traffic did and when (epoch seconds), and how many of each thing."""

    start: float = 0.0
    end: float = 0.0
    events: list[tuple[float, str]] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    pending: set[asyncio.Future[Any]] = field(default_factory=set)

    def mark(self, what: str) -> None:
        self.events.append((time.time(), what))

    def track(self, fut: asyncio.Future[Any], what: str) -> None:
        """Count ``fut``'s outcome under ``what`` (``what failed`` when it raised)."""

        def done(f: asyncio.Future[Any]) -> None:
            self.pending.discard(f)
            if not f.cancelled():
                self.counts[what + (" failed" if f.exception() else "")] += 1

        self.pending.add(fut)
        fut.add_done_callback(done)

    async def settled(self) -> None:
        """Until every tracked send is answered."""
        await asyncio.gather(*self.pending, return_exceptions=True)


class Downstream:
    """An analytics consumer's work: :data:`FAST_PER_S` messages a second, :data:`SLOW_PER_S`
    between loop times ``slow`` (never unless given); poison messages fail every time, flaky ones
    the first time."""

    def __init__(self, slow: tuple[float, float] = (math.inf, math.inf)) -> None:
        self.slow = slow
        self.free_at = 0.0

    async def __call__(self, msgs: list[ReceivedMessage]) -> ConsumeResult:
        now = asyncio.get_running_loop().time()
        rate = SLOW_PER_S if self.slow[0] <= now < self.slow[1] else FAST_PER_S
        self.free_at = max(self.free_at, now) + len(msgs) / rate
        await asyncio.sleep(self.free_at - now)  # the work itself
        for m in msgs:
            key = m.keys[0] if m.keys else ""
            if key.startswith("poison") or (key.startswith("flaky") and not m.reconsume_times):
                return ConsumeResult.RETRY_LATER
        return ConsumeResult.SUCCESS


async def keep_up(msgs: list[ReceivedMessage]) -> None:
    """The billing group's work: next to nothing."""


def order_key(n: int) -> str:
    if n % POISON_EVERY == POISON_EVERY // 2:
        return f"poison-{n}"
    return f"flaky-{n}" if n % FLAKY_EVERY == FLAKY_EVERY // 2 else f"order-{n}"


async def pay(m: TransactionMessage, n: object) -> TransactionDecision:
    """Payment ``n``'s local transaction: see the module docstring."""
    k = int(str(n)) % 10
    if k < 7:
        return TransactionDecision.COMMIT
    return TransactionDecision.ROLLBACK if k == 7 else TransactionDecision.UNKNOWN


async def check_payment(m: TransactionCheckMessage) -> TransactionDecision:
    n = int(m.keys[0].rpartition("-")[2]) if m.keys else 0
    if n % 10 == 8:
        return TransactionDecision.COMMIT
    return TransactionDecision.ROLLBACK if n % 20 == 9 else TransactionDecision.UNKNOWN


async def undecided(m: TransactionMessage, arg: object) -> TransactionDecision:
    return TransactionDecision.UNKNOWN


async def every(period: float, until: float, step: Callable[[int], Awaitable[None]]) -> None:
    """``step(k)`` every ``period`` seconds on a fixed schedule, until loop time ``until``."""
    loop = asyncio.get_running_loop()
    t0, k = loop.time(), 0
    while (t := t0 + k * period) < until:
        await asyncio.sleep(max(0.0, t - loop.time()))  # the pace
        await step(k)
        k += 1


async def at(when: float) -> None:
    await asyncio.sleep(max(0.0, when - asyncio.get_running_loop().time()))  # the schedule


async def create_topics(namesrv: str) -> None:
    async with AdminClient(namesrv) as admin:
        for topic, queues in TOPICS.items():
            await admin.create_or_update_topic(topic, queues=queues)
        deadline = time.monotonic() + 30
        while not set(TOPICS) <= set(await admin.list_topics()):
            if time.monotonic() > deadline:
                raise RuntimeError("the nameserver did not learn the topics within 30 s")
            await asyncio.sleep(0.1)  # polling the nameserver, with a deadline


async def traffic(namesrv: str, seconds: float) -> Timeline:
    """``seconds`` of traffic (see the module docstring); returns what happened when."""
    await create_topics(namesrv)
    tl = Timeline()
    loop = asyncio.get_running_loop()
    work = Downstream()
    async with contextlib.AsyncExitStack() as stack:

        async def opened(client: Any) -> Any:
            return await stack.enter_async_context(client)

        shop: Producer = await opened(Producer(namesrv, group="shop"))
        payments: TransactionProducer = await opened(
            TransactionProducer(namesrv, PAY_GROUP, check_listener=check_payment)
        )
        reader: QueueReader = await opened(QueueReader(namesrv))
        billing: PushConsumer = await opened(PushConsumer(namesrv, "billing", keep_up, **CONSUMER))
        analytics: PushConsumer = await opened(
            PushConsumer(namesrv, "analytics", work, **ANALYTICS)
        )
        ledger: PullConsumer = await opened(PullConsumer(namesrv, "ledger", **CONSUMER))
        billing.subscribe("Orders")
        analytics.subscribe("Orders")
        analytics.subscribe("Clicks")
        ledger.subscribe("Payments")
        for c in (billing, analytics, ledger):
            await c.start()
        t0, tl.start = loop.time(), time.time()
        end = t0 + seconds

        def share(s: float) -> float:
            return t0 + s * seconds

        slow = work.slow = (share(SLOW[0]), share(SLOW[1]))
        tl.mark("sends start; billing, analytics (one consumer) and ledger consume")

        async def orders(k: int) -> None:
            for i in range(ORDERS_PER_TICK):
                n = k * ORDERS_PER_TICK + i
                body = json.dumps({"order": n, "lines": list(range(n % 40))}).encode()
                msg = Message("Orders", body, tags="created", keys=order_key(n))
                tl.track(shop.send_nowait(msg), "Orders sent")

        async def clicks(k: int) -> None:
            for i in range(CLICKS_PER_TICK):
                body = json.dumps({"click": k, "element": i}).encode()
                tl.track(shop.send_nowait(Message("Clicks", body)), "Clicks sent")

        async def transact(k: int) -> None:
            msg = Message("Payments", json.dumps({"payment": k}).encode(), keys=f"pay-{k}")
            tl.track(asyncio.ensure_future(payments.send_in_transaction(msg, pay, k)), "payments")

        async def delayed(k: int) -> None:
            level = 1 + k % 5
            msg = Message("Orders", b'{"remind": 1}', tags="reminder", delay_level=level)
            tl.track(shop.send_nowait(msg), "delayed sent")
            ahead = 20 + (k * 37) % 81
            if k % 3 == 0 and loop.time() + ahead < end:
                due = time.time() + ahead
                msg = Message("Orders", b'{"timer": 1}', tags="timer", deliver_at=due)
                tl.track(shop.send_nowait(msg), "timers sent")

        async def too_large(k: int) -> None:
            # random bytes: a body that compresses would be refused as INVALID_ARGUMENT (it
            # inflates past max_message_size), not as MESSAGE_TOO_LARGE
            with contextlib.suppress(ApogeeError):
                await shop.send(Message("Orders", os.urandom(MAX_BODY + 16 * KiB)))
            tl.counts["too large, refused"] += 1

        async def audit(k: int) -> None:
            for q in await reader.queues("Orders"):
                bounds = await reader.offsets(q)
                await reader.read_batch(q, max(bounds.min_offset, bounds.max_offset - 20), 20)
                tl.counts["reader pulls"] += 1

        async def ledger_loop() -> None:
            while loop.time() < end:
                tl.counts["ledger polled"] += len(await ledger.poll(timeout=0.5))
                await ledger.commit()

        async def second_analytics() -> None:
            await at(share(JOIN))
            async with PushConsumer(namesrv, "analytics", Downstream(slow), **ANALYTICS) as c:
                c.subscribe("Orders")
                c.subscribe("Clicks")
                await c.start()
                tl.mark("a second analytics consumer joins")
                await at(share(LEAVE))
            tl.mark("the second analytics consumer leaves")

        async def refunds() -> None:
            await at(share(REFUNDS_AT))
            async with TransactionProducer(namesrv, "refunds-tx") as p:
                for i in range(6):
                    msg = Message("Payments", b'{"refund": 1}', keys=f"refund-{i}")
                    await p.send_in_transaction(msg, undecided)
            tl.mark("refunds-tx leaves 6 transactions UNKNOWN and exits")

        async def operator() -> None:
            await at(share(OPERATOR_AT))
            async with AdminClient(namesrv) as admin:
                pending = await admin.list_pending_transactions(group=PAY_GROUP)
                for p in [p for p in pending if not p.checking][:3]:
                    await admin.resolve_transaction(p.transaction_id, commit=True, operator="ops")
                    tl.counts["committed by an operator"] += 1
            tl.mark("an operator commits given-up payments")

        async def slow_marks() -> None:
            await at(slow[0])
            tl.mark("analytics' work becomes slow")
            await at(slow[1])
            tl.mark("analytics' work is fast again")

        await asyncio.gather(
            every(ORDERS_TICK_S, end, orders),
            every(CLICKS_TICK_S, end, clicks),
            every(PAYMENT_TICK_S, end, transact),
            every(2.0, end, delayed),
            every(20.0, end, too_large),
            every(5.0, end, audit),
            ledger_loop(),
            second_analytics(),
            refunds(),
            operator(),
            slow_marks(),
        )
        await tl.settled()
        tl.end = time.time()
        tl.mark("sends stop")
    return tl
