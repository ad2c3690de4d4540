"""LoopBridge settles futures from other threads in bursts; logs are one line per record."""

from __future__ import annotations

import asyncio
import io
import logging
import threading

import pytest

from apogee.common.aio import LoopBridge
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
