"""The dispatcher: turns appended records into ConsumeQueue and index entries, and wakes waiters.

Appends hand each batch's :class:`AppendResult` tuples to :meth:`Dispatcher.submit` in log order
(under the CommitLog's append lock); a background thread applies them in that order, except
that a batch of at most ``inline_max`` records that finds the dispatcher idle is applied at once
by the appending thread itself (a broker's event loop): a lone message is then readable, and a
pull held for it woken, without waiting for another thread to get the GIL. Recovery
feeds the same :meth:`Dispatcher.apply` with tuples decoded from the CommitLog, so the live path
and the rebuild path are one code path. A backlog of more than ``backlog_max`` batches makes
``submit`` wait: appends slow down rather than memory growing without bound.

:class:`ArrivalNotifier` lets a caller wait until a queue has an entry at offset >= N, with a
timeout (:meth:`wait_for`, blocking), or be called back when it does (:meth:`watch`, for event
loops, which bridge with ``call_soon_threadsafe``). Long polling stands on it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable

from apogee.common.errors import StoreFailedError
from apogee.store.commitlog import AppendResult
from apogee.store.consumequeue import ConsumeQueueTable
from apogee.store.indexfile import IndexService

log = logging.getLogger(__name__)


class Watch:
    __slots__ = ("callback", "done", "key", "offset")

    def __init__(self, key: tuple[str, int], offset: int, callback: Callable[[], None]) -> None:
        self.key = key
        self.offset = offset
        self.callback = callback
        self.done = False


class ArrivalNotifier:
    def __init__(self, cqs: ConsumeQueueTable) -> None:
        self._cqs = cqs
        self._lock = threading.Lock()
        self._watches: dict[tuple[str, int], list[Watch]] = {}

    def _visible(self, key: tuple[str, int]) -> int:
        cq = self._cqs.get(*key)
        return cq.max_offset if cq is not None else 0

    def watch(self, topic: str, queue_id: int, offset: int, callback: Callable[[], None]) -> Watch:
        """Call ``callback`` once (from the thread that indexed the entry: the dispatcher's, or
        the appending thread for a small batch; or right here if already true) when the queue
        has an entry at ``offset`` or beyond. Cancel with :meth:`cancel`."""
        key = (topic, queue_id)
        w = Watch(key, offset, callback)
        with self._lock:
            if self._visible(key) <= offset:
                self._watches.setdefault(key, []).append(w)
                return w
            w.done = True
        callback()
        return w

    def cancel(self, w: Watch) -> None:
        with self._lock:
            if not w.done:
                w.done = True
                lst = self._watches.get(w.key)
                if lst is not None and w in lst:
                    lst.remove(w)
                    if not lst:
                        del self._watches[w.key]

    def wait_for(self, topic: str, queue_id: int, offset: int, timeout: float) -> bool:
        """Block until the queue has an entry at ``offset`` or beyond; False on timeout."""
        event = threading.Event()
        w = self.watch(topic, queue_id, offset, event.set)
        if event.wait(timeout):
            return True
        self.cancel(w)
        return event.is_set()

    def notify(self, keys: Iterable[tuple[str, int]]) -> None:
        fire: list[Watch] = []
        with self._lock:
            if not self._watches:
                return
            for key in keys:
                lst = self._watches.get(key)
                if not lst:
                    continue
                visible = self._visible(key)
                keep = [w for w in lst if w.offset >= visible]
                for w in lst:
                    if w.offset < visible:
                        w.done = True
                        fire.append(w)
                if keep:
                    self._watches[key] = keep
                else:
                    del self._watches[key]
        for w in fire:
            try:
                w.callback()
            except Exception:
                log.exception("arrival callback for %s failed", w.key)

    def pending(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._watches.values())


class Dispatcher:
    def __init__(
        self,
        cqs: ConsumeQueueTable,
        index: IndexService,
        notifier: ArrivalNotifier,
        backlog_max: int,
        start_offset: int,
        name: str = "",
        inline_max: int = 0,
    ) -> None:
        self.name = name
        #: batches of at most this many records may be applied by the appending thread
        self.inline_max = inline_max
        self._applying = False
        self.cqs = cqs
        self.index = index
        self.notifier = notifier
        self.backlog_max = backlog_max
        #: CommitLog offset below which everything is in the ConsumeQueues and the index
        self.dispatched = start_offset
        self._pending: deque[tuple[list[AppendResult], int]] = deque()
        lock = threading.Lock()
        #: the thread waits on ``_work`` for batches (or the stop); appends held back by a
        #: full backlog and :meth:`wait_dispatched` wait on ``_progress``. Two conditions on one
        #: lock, so that a batch applied inline wakes nobody when nobody waits for it.
        self._work = threading.Condition(lock)
        self._progress = threading.Condition(lock)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None

    # -- the work -------------------------------------------------------------------------------

    def apply(self, batch: list[AppendResult]) -> None:
        """Write the ConsumeQueue and index entries of ``batch`` (in log order)."""
        runs: dict[tuple[str, int], tuple[int, list[int]]] = {}
        items: list[tuple[str, int, int]] = []
        put = self.cqs.get_or_create
        for r in batch:
            topic, qid, qoff, phys, size, tagc, keys, uid, ts = r
            key = (topic, qid)
            run = runs.get(key)
            if run is None:
                runs[key] = (qoff, [phys, size, tagc])
            elif run[0] + len(run[1]) // 3 == qoff:
                run[1].extend((phys, size, tagc))
            else:  # not contiguous (only seen when recovery replays over a gap): write and restart
                put(*key).put(run[0], run[1])
                runs[key] = (qoff, [phys, size, tagc])
            items.append((uid, phys, ts))
            if keys:
                for k in keys:
                    items.append((f"{topic}#{k}", phys, ts))
        self.index.add(items)
        for key, (first, flat) in runs.items():
            put(*key).put(first, flat)
        self.notifier.notify(runs.keys())

    # -- the live path --------------------------------------------------------------------------

    def submit(self, batch: list[AppendResult], end: int) -> None:
        """Queue an appended batch. Called in log order under the CommitLog append lock."""
        with self._work:
            while True:
                if self.failure is not None:
                    # the batch is in the log: recovery dispatches it at the next open
                    raise StoreFailedError(
                        path=self.name, reason=f"dispatch failed: {self.failure!r}"
                    )
                if len(self._pending) < self.backlog_max or self._stopping:
                    break
                self._progress.wait(1.0)
            inline = len(batch) <= self.inline_max and not self._pending and not self._applying
            if not inline:
                self._pending.append((batch, end))
                if len(self._pending) == 1:
                    self._work.notify()
                return
            self._applying = True
        # Nothing is queued or being applied, and no other append can come before this one
        # returns (the append lock): applying here keeps log order.
        try:
            self.apply(batch)
            self.dispatched = end
        except BaseException as exc:  # as on the thread: the batch is in the log, recovery has it
            log.exception("dispatcher stopped")
            with self._work:
                self.failure = exc
        finally:
            with self._work:
                self._applying = False
                self._progress.notify_all()
                if self._stopping or self._pending:
                    self._work.notify()  # the thread waits while a batch is applied here

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="apogee-store-dispatch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._work:
                # the appending thread's batch comes first, even when stopping
                while self._applying or (not self._pending and not self._stopping):
                    self._work.wait()
                if not self._pending:
                    return
                work = list(self._pending)
                self._pending.clear()
                self._applying = True
                self._progress.notify_all()  # room in the backlog
            try:
                for batch, end in work:
                    self.apply(batch)
                    self.dispatched = end
            except BaseException as exc:  # a full disk while growing a queue, a closed map
                log.exception("dispatcher stopped")
                with self._work:
                    self.failure = exc
                    self._applying = False
                    self._progress.notify_all()
                return
            with self._work:
                self._applying = False
                self._progress.notify_all()

    def wait_dispatched(self, offset: int, timeout: float) -> bool:
        """Block until everything below log ``offset`` is dispatched; False on timeout."""
        with self._progress:
            return (
                self._progress.wait_for(
                    lambda: self.dispatched >= offset or self.failure is not None, timeout
                )
                and self.dispatched >= offset
            )

    def stop(self, timeout: float = 30.0) -> None:
        """Apply what is queued, then stop the thread (bounded by ``timeout``)."""
        with self._work:
            self._stopping = True
            self._work.notify_all()
            self._progress.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("dispatcher did not stop within %.1fs", timeout)
            self._thread = None
