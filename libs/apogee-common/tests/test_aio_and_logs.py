"""LoopBridge settles futures from other threads in bursts; logs are one line per record."""

from __future__ import annotations

import asyncio
import io
import logging
import threading

import pytest

from apogee.common.aio import LoopBridge, cancel_and_wait
from apogee.common.logs import OneLineFormatter

pytestmark = pytest.mark.unit


async def test_futures_settled_from_another_thread_in_one_burst() -> None:
    loop = asyncio.get_running_loop()
    bridge = LoopBridge(loop)
    futs = [loop.create_future() for _ in range(100)]
    wakeups = 0
    real_call = loop.call_soon_threadsafe

    def counting(cb, *args):  # type: ignore[no-untyped-def]
        nonlocal wakeups
        wakeups += 1
        return real_call(cb, *args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign,assignment]
    try:
        boom = ValueError("flush failed")

        def settle() -> None:
            for i, f in enumerate(futs):
                bridge.post(f, boom if i == 7 else None)

        t = threading.Thread(target=settle)
        t.start()
        t.join(10)
        done = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 10)
    finally:
        del loop.call_soon_threadsafe
    assert done[7] is boom
    assert all(r is None for i, r in enumerate(done) if i != 7)
    assert wakeups == 1  # the loop did not run while the thread posted: one drain for all


async def test_a_cancelled_future_is_left_alone() -> None:
    loop = asyncio.get_running_loop()
    bridge = LoopBridge(loop)
    fut: asyncio.Future[None] = loop.create_future()
    fut.cancel()
    bridge.post(fut, None)
    await asyncio.sleep(0)  # let the drain run; it must not raise InvalidStateError
    assert fut.cancelled()


def test_one_line_per_record_even_with_a_traceback() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(OneLineFormatter())
    logger = logging.getLogger("apogee.test.oneline")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        try:
            raise RuntimeError("bad\nthing")
        except RuntimeError:
            logger.exception("it failed")
    finally:
        logger.removeHandler(handler)
    text = out.getvalue()
    assert text.count("\n") == 1
    assert " ERROR apogee.test.oneline it failed\\nTraceback" in text
    assert text[:4].isdigit()
    assert text.split(" ", 1)[0].endswith("Z")


async def test_cancel_and_wait_ends_the_task_and_raises_nothing() -> None:
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    async def fails() -> None:
        raise ValueError("boom")

    running = asyncio.create_task(forever())
    await asyncio.wait_for(started.wait(), 5)
    await asyncio.wait_for(cancel_and_wait(running), 5)
    assert running.cancelled()
    failed = asyncio.create_task(fails())
    await asyncio.wait({failed}, timeout=5)
    await cancel_and_wait(failed)  # its error was its own to report
    assert isinstance(failed.exception(), ValueError)
    await cancel_and_wait(None)
