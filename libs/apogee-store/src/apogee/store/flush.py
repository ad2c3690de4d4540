"""Background flushing: group commit for synchronous flush, a periodic loop for the rest.

:class:`GroupCommit` (flush mode ``SYNC``): an append that must be durable calls :meth:`wait`
with its end offset; one waiter at a time fdatasyncs everything written so far and wakes every
waiter the sync covered. Appends that arrive during an fdatasync share the next one, so N
concurrent writers cost far fewer than N fsyncs.

:class:`PeriodicFlush`: every ``interval`` it flushes the CommitLog (in ``ASYNC`` mode), the
ConsumeQueues and the index, then records both flush points in the checkpoint. It runs in both
modes; in ``SYNC`` mode the CommitLog part is already durable.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial

from apogee.common.errors import FlushTimeoutError, StoreClosedError, StoreFailedError

log = logging.getLogger(__name__)


class GroupCommit:
    """Leader-based group commit: no thread of its own. The first appender that needs a flush
    while none is running becomes the leader and runs it for everyone; appenders that arrive
    meanwhile wait, and are covered by that flush or lead the next one. A lone writer so pays
    one fdatasync and no thread hand-off; N concurrent writers share each fdatasync."""

    def __init__(
        self,
        flush: Callable[[], int],
        durable: int,
        callback_timeout: float,
        linger: float = 0.0005,
        name: str = "",
    ) -> None:
        self._name = name
        self._flush = flush
        self._linger = linger
        self.durable = durable
        self._flushing = False
        self._cond = threading.Condition()
        self._stopping = False
        self._failure: BaseException | None = None
        self.flushes = 0
        self._callbacks: list[tuple[int, Callable[[BaseException | None], None]]] = []
        self._callback_timeout = callback_timeout
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread that serves :meth:`when_durable` callbacks."""
        self._thread = threading.Thread(
            target=self._serve_callbacks, name="apogee-store-group-commit", daemon=True
        )
        self._thread.start()

    def when_durable(self, offset: int, callback: Callable[[BaseException | None], None]) -> None:
        """Call ``callback(None)`` once the log is durable up to ``offset`` (from the flush
        thread, or here if it already is), or ``callback(error)`` if the flush fails or the
        store stops first. For event loops, which must not block in :meth:`wait`."""
        with self._cond:
            if self.durable < offset and self._failure is None and not self._stopping:
                self._callbacks.append((offset, callback))
                self._cond.notify_all()
                return
            error = self._error_for(offset)
        callback(error)

    def _has_callbacks(self, count: int) -> bool:
        return len(self._callbacks) >= count

    def _serve_callbacks(self) -> None:
        last_group = 0
        while True:
            with self._cond:
                while not self._callbacks and not self._stopping:
                    self._cond.wait()
                if not self._callbacks:
                    return
                if last_group > 1 and self._linger > 0:
                    # Concurrent writers answered by the last flush are appending again: give
                    # them a moment to land in this flush, else groups stay as small as they
                    # started (each flush covering only the writers woken by the one before).
                    self._cond.wait_for(partial(self._has_callbacks, last_group), self._linger)
                target = max(off for off, _ in self._callbacks)
            error: BaseException | None = None
            try:
                self.wait(target, self._callback_timeout)
            except BaseException as exc:
                error = exc
            with self._cond:
                ready = [cb for off, cb in self._callbacks if off <= self.durable or error]
                self._callbacks = [
                    (off, cb) for off, cb in self._callbacks if not (off <= self.durable or error)
                ]
            last_group = len(ready)
            for cb in ready:
                try:
                    cb(None if error is None else error)
                except Exception:
                    log.exception("durability callback failed")

    def wait(self, offset: int, timeout: float) -> None:
        """Return once the log is durable up to ``offset``; raises
        :class:`FlushTimeoutError` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.durable < offset:
                if self._failure is not None:
                    raise StoreFailedError(
                        path=self._name, reason=f"flush failed: {self._failure!r}"
                    )
                if not self._flushing:
                    self._flushing = True
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FlushTimeoutError(timeout_s=timeout, offset=offset)
                self._cond.wait(left)
            else:
                return
        # this thread leads: flush everything written so far, outside the lock
        try:
            done = self._flush()
        except BaseException as exc:
            log.exception("group commit flush failed")
            with self._cond:
                self._failure = exc
                self._flushing = False
                self._cond.notify_all()
            raise StoreFailedError(path=self._name, reason=f"flush failed: {exc!r}") from exc
        with self._cond:
            self.flushes += 1
            self.durable = max(self.durable, done)
            self._flushing = False
            self._cond.notify_all()
        if done < offset:  # cannot happen: the flush covers what this thread wrote
            raise FlushTimeoutError(timeout_s=timeout, offset=offset)

    def stop(self, timeout: float = 30.0) -> None:
        """Serve the callbacks still waiting, then stop (bounded by ``timeout``)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._cond:
            self._cond.wait_for(lambda: not self._flushing, timeout)
            left, self._callbacks = self._callbacks, []
        for _, cb in left:
            cb(StoreClosedError(path=self._name))

    def _error_for(self, offset: int) -> BaseException | None:
        if self.durable >= offset:
            return None
        if self._failure is not None:
            return StoreFailedError(path=self._name, reason=f"flush failed: {self._failure!r}")
        return StoreClosedError(path=self._name)


class PeriodicFlush:
    """Runs ``step`` every ``interval`` seconds until stopped; a last run happens at stop."""

    def __init__(self, step: Callable[[], object], interval: float, name: str) -> None:
        self._step = step
        self._interval = interval
        self._name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._step()
            except Exception:
                log.exception("%s failed; retrying in %.1fs", self._name, self._interval)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("%s did not stop within %.1fs", self._name, timeout)
            self._thread = None
