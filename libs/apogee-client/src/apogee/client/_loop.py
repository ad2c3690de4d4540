"""An asyncio event loop on its own thread: what the synchronous facades run their core on.

The facades never duplicate logic: each method hands a coroutine of the asyncio client to this
loop and waits for its result (:meth:`LoopThread.run`), or hands work over without waiting
(:meth:`LoopThread.call_soon`). Calling :meth:`run` from the loop thread itself (from a send
callback, say) would wait forever for a loop that is busy waiting; it raises instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from apogee.common.errors import DeadlineExceededError

log = logging.getLogger(__name__)

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str, start_timeout: float = 10.0) -> None:
        self.name = name
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout):
            raise RuntimeError(f"{name}: the event loop thread did not start")

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None
        return self._loop

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._ready.set()
        try:
            loop.run_forever()
            tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.wait(tasks, timeout=1.0))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def running(self) -> bool:
        return self._thread.is_alive() and self._loop is not None and not self._loop.is_closed()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; its outcome arrives in the returned future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, what: str = "the call") -> T:
        """Run ``coro`` on the loop and wait at most ``timeout`` seconds for its result."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError(
                f"{self.name}: a blocking call from the client's own event loop thread "
                "(inside a callback or hook) would wait forever; use the async client there"
            )
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise DeadlineExceededError(what=what, timeout_s=timeout) from None

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop (tasks still running are cancelled) and join the thread."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed meanwhile
                loop.call_soon_threadsafe(loop.stop)
        if not self.in_loop_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning(
                    "%s: the event loop thread did not stop within %.1fs", self.name, timeout
                )
