"""What keeps each change of a transaction whole: its lock, and running to the end once begun.

Every change of one transaction (an end, a check) runs under that transaction's lock
(:class:`KeyedLocks`, keyed by the transaction id; for a copy that cannot be read, by its offset:
:func:`~.records.copy_key`), so two commits of one transaction never both store; and it runs to
its end once begun, even when its call is cut off (:func:`to_the_end`), so that what it wrote is
remembered.

A task holds one such lock, or several taken together by :meth:`KeyedLocks.hold_many` (the ends
of one EndTransactions request, in the order of their keys), and takes no other while it holds
some; the checker's progress lock is never taken with one held (docs/locking.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class KeyedLocks:
    """One asyncio lock per key, made on first use and dropped once no task holds or waits."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = (asyncio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0 and self._locks.get(key) is entry:
                del self._locks[key]

    @contextlib.asynccontextmanager
    async def hold_many(self, keys: Iterable[str]) -> AsyncIterator[None]:
        """The locks of every key of ``keys``, taken in the order of the keys (so two tasks
        taking several never wait for each other in a circle)."""
        async with contextlib.AsyncExitStack() as stack:
            for key in sorted(set(keys)):
                await stack.enter_async_context(self.hold(key))
            yield


async def to_the_end(work: Coroutine[Any, Any, T], what: str) -> T:
    """Await ``work`` in a task of its own that a cancellation of the caller does not stop.

    An end or a check writes its records and then, with ``flush_mode = sync``, waits for them
    to be durable before it notes what it wrote (the decision, the closed copies). A call cut
    off meanwhile (its deadline passed, its caller went away) cancels the handler: cancelled
    there, the records would be stored but not remembered, and the same commit asked again
    would be stored again. So the caller gets its cancellation at once while ``work`` goes on
    to its end (its failure, if any, is logged), holding the transaction's lock until then."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            task.add_done_callback(lambda t: _finished_alone(t, what))
        raise


async def run_all(work: list[Coroutine[Any, Any, None]]) -> None:
    """Run ``work`` concurrently to its end (each takes its own failures)."""
    if len(work) == 1:
        await work[0]
    else:
        await asyncio.gather(*work)


def _finished_alone(task: asyncio.Task[Any], what: str) -> None:
    if task.cancelled():
        return
    err = task.exception()
    if err is not None:
        log.warning("%s, left to finish after its call was cut off, failed: %s", what, err)
