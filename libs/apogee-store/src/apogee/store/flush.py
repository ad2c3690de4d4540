"""Background flushing: group commit for synchronous flush, a periodic loop for the rest.

:class:`GroupCommit` (flush mode ``SYNC``): an append that must be durable calls :meth:`wait`
with its end offset; the flusher thread fdatasyncs everything written so far and wakes every
waiter the sync covered. Appends that arrive during an fdatasync share the next one, so N
concurrent writers cost far fewer than N fsyncs.

:class:`PeriodicFlush`: every ``interval`` it flushes the CommitLog (in ``ASYNC`` mode), the
ConsumeQueues and the index, then records both flush points in the checkpoint. It runs in both
modes; in ``SYNC`` mode the CommitLog part is already durable.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from apogee.common.errors import FlushTimeoutError, StoreClosedError

log = logging.getLogger(__name__)


class GroupCommit:
    def __init__(self, flush: Callable[[], int], durable: int) -> None:
        self._flush = flush
        self.durable = durable
        self._wanted = durable
        self._cond = threading.Condition()
        self._stopping = False
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="apogee-store-group-commit", daemon=True)
        self._thread.start()

    def wait(self, offset: int, timeout: float) -> None:
        """Return once the log is durable up to ``offset``; raises
        :class:`FlushTimeoutError` after ``timeout`` seconds."""
        with self._cond:
            if self.durable >= offset:
                return
            if offset > self._wanted:
                self._wanted = offset
                self._cond.notify_all()
            ok = self._cond.wait_for(
                lambda: self.durable >= offset or self._failure is not None or self._stopping,
                timeout,
            )
            if self.durable >= offset:
                return
            if self._failure is not None:
                raise StoreClosedError(path=f"flush failed: {self._failure!r}")
            if not ok or self._stopping:
                raise FlushTimeoutError(timeout_s=timeout, offset=offset)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._wanted <= self.durable and not self._stopping:
                    self._cond.wait()
                if self._stopping and self._wanted <= self.durable:
                    return
            try:
                done = self._flush()
            except BaseException as exc:
                log.exception("group commit flush failed")
                with self._cond:
                    self._failure = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self.durable = max(self.durable, done)
                self._cond.notify_all()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None


class PeriodicFlush:
    """Runs ``step`` every ``interval`` seconds until stopped; a last run happens at stop."""

    def __init__(self, step: Callable[[], None], interval: float, name: str) -> None:
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
