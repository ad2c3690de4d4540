"""The load the benchmarks put on a cluster, written once: :func:`create_topics` (created, and
known to the nameserver before the run starts) and :func:`windowed_sends` (``send_nowait`` in a
loop with at most a window of sends unsettled, timed until every send has its result)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from apogee.client import AdminClient, Message, Producer, SendResult
from apogee.rpc.security import ClientSecurity
from apogee.testkit.waiting import eventually

#: how long the nameserver may take to learn new topics
TOPICS_TIMEOUT_S = 15.0


async def create_topics(
    namesrv: str,
    topics: Iterable[str],
    queues: int = 8,
    security: ClientSecurity | None = None,
    timeout: float = TOPICS_TIMEOUT_S,
) -> None:
    """Create ``topics`` with ``queues`` queues each; return once the nameserver lists them all
    (the broker registers a new topic with it right away)."""
    wanted = set(topics)
    async with AdminClient(namesrv, security=security) as admin:
        for topic in sorted(wanted):
            await admin.create_or_update_topic(topic, queues=queues)

        async def known() -> bool:
            return wanted <= set(await admin.list_topics())

        await eventually(known, timeout, f"the nameserver lists {sorted(wanted)}", every=0.05)


@dataclass
class Sends:
    """What :func:`windowed_sends` measured."""

    seconds: float
    #: seconds from ``send_nowait`` to the result, of one send in ``sample``
    latencies: list[float]
    errors: int
    #: this process's CPU seconds
    cpu_s: float


async def windowed_sends(
    producer: Producer,
    msg: Message,
    count: int,
    window: int,
    sample: int = 0,
    settle_timeout_s: float = 120.0,
) -> Sends:
    """``count`` sends of ``msg`` with ``send_nowait``, at most ``window`` unsettled (the loop
    goes on once a quarter of the window has settled), timed until every send has its result.
    With ``sample``, the latency of one send in ``sample`` is measured: a closure per send would
    cost more than the measurement is worth."""
    latencies: list[float] = []
    unsettled = errors = 0
    room = asyncio.Event()
    all_settled = asyncio.Event()
    low = window * 3 // 4
    perf = time.perf_counter

    def settled(result: SendResult | None, error: BaseException | None) -> None:
        nonlocal unsettled, errors
        unsettled -= 1
        if error is not None:
            errors += 1
        if unsettled <= low:
            room.set()
            if unsettled == 0:
                all_settled.set()

    def timed(t: float) -> Callable[[SendResult | None, BaseException | None], None]:
        def callback(result: SendResult | None, error: BaseException | None) -> None:
            latencies.append(perf() - t)
            settled(result, error)

        return callback

    cpu0 = time.process_time()
    t0 = perf()
    for i in range(count):
        if unsettled >= window:
            room.clear()
            await room.wait()
        producer.send_nowait(msg, timed(perf()) if sample and i % sample == 0 else settled)
        unsettled += 1
    if unsettled:
        all_settled.clear()
        await asyncio.wait_for(all_settled.wait(), settle_timeout_s)
    return Sends(perf() - t0, latencies, errors, time.process_time() - cpu0)
