"""Polls with a deadline: how a test waits for something another thread, task or process does.

:func:`wait_until` polls a plain function; :func:`eventually` is the same for the event loop and
takes a plain function or a coroutine function. Both return the seconds the wait took and fail
with :class:`AssertionError` naming ``what`` (and adding ``detail()``, a process's log say) once
``timeout`` seconds have passed::

    took = await eventually(lambda: len(received) == 3, 5, "three messages received")
    wait_until(lambda: path.exists(), 10, f"{path} written", detail=process.output)

The check runs once more after the deadline before the wait fails, so a check that holds at
the deadline passes however slowly the machine ran. A check may raise to fail at once (a
process that exited, say).

A wait that "nothing happens" within a time passes vacuously on a slow machine: wait instead
for a later event that must come after the one that should not (a later message, a renewal
after the bound), then check.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

__all__ = ["eventually", "wait_until"]


def _failure(timeout: float, what: str, detail: Callable[[], str] | None) -> AssertionError:
    text = f"not within {timeout:g}s: {what}"
    if detail is not None:
        text += "\n" + detail()
    return AssertionError(text)


def wait_until(
    check: Callable[[], object],
    timeout: float = 5.0,
    what: str = "the condition",
    *,
    every: float = 0.02,
    detail: Callable[[], str] | None = None,
) -> float:
    """Poll ``check`` every ``every`` seconds until it returns something true; the seconds it
    took. :class:`AssertionError` naming ``what`` (and ``detail()``) after ``timeout`` seconds."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        past = time.monotonic() > deadline  # read before the check: a last one after the bound
        result = check()
        if inspect.isawaitable(result):
            if inspect.iscoroutine(result):
                result.close()
            raise TypeError(f"{what}: an async check needs eventually(), not wait_until()")
        if result:
            return time.monotonic() - start
        if past:
            raise _failure(timeout, what, detail)
        time.sleep(every)  # polling with a deadline


async def eventually(
    check: Callable[[], object | Awaitable[object]],
    timeout: float = 5.0,
    what: str = "the condition",
    *,
    every: float = 0.02,
    detail: Callable[[], str] | None = None,
) -> float:
    """:func:`wait_until` on the event loop: ``check`` may be a plain function or a coroutine
    function."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + timeout
    while True:
        past = loop.time() > deadline  # read before the check: a last one after the bound
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return loop.time() - start
        if past:
            raise _failure(timeout, what, detail)
        await asyncio.sleep(every)  # polling with a deadline
