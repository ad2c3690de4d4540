"""Answering a broker's checks of the producer group's transactions.

A broker asks, over a producer's session stream (:mod:`~apogee.client.producer.txn_session`),
what became of a transaction whose half was not ended in time. :class:`CheckRunner` hands the
half to the producer's check listener and, when the listener answers COMMIT or ROLLBACK, ends
the transaction at that broker (``EndTransaction``, source CHECK, naming the copy of the half
that the check was about). UNKNOWN is not answered: the broker asks again later.

- Each check runs as a task; at most ``max_concurrent_checks`` listener calls run at once. A
  check waits for its turn at most ``check_timeout``, and the listener gets ``check_timeout``
  (an async one is then cancelled; a plain one's late answer is ignored).
- A check of a transaction already being checked (same broker, same id) is dropped, and so is
  any check beyond :data:`MAX_WAITING` unfinished ones: the broker asks again.
- A plain-function listener runs on a thread pool of ``max_concurrent_checks`` threads (it may
  block, say on a database lookup); an async one runs on the event loop.
- A listener that raises, runs late or returns anything but a
  :class:`~apogee.client.TransactionDecision` counts as UNKNOWN, logged. Without a listener
  every check is UNKNOWN, logged at most once a minute.
- :meth:`CheckRunner.close` cancels the checks still running and waits for them (bounded).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from apogee.client.producer.txn_model import (
    CheckListener,
    TransactionDecision,
    await_decision,
    checked_message,
    decision_of,
    end_request,
    error_text,
    failed,
)
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import ApogeeError
from apogee.v1 import transaction_pb2

log = logging.getLogger("apogee.client.producer.transaction")

#: Most checks started and not finished; more are dropped (the broker asks again).
MAX_WAITING: Final = 1024
_WHO: Final = "the check listener"

#: ``end(broker_name, address, request, timeout)``: one EndTransaction call
EndCall = Callable[
    [str, str, transaction_pb2.EndTransactionRequest, float],
    Awaitable[transaction_pb2.EndTransactionResponse],
]


class RateLimitedLog:
    """A warning logged at most once per ``every`` seconds; the next one says how many were
    left out meanwhile."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK, every: float = 60.0) -> None:
        self._clock = clock
        self._every = every
        self._last: float | None = None
        self.suppressed = 0

    def warning(self, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless one was logged within ``every`` seconds; whether it was."""
        now = self._clock.monotonic()
        if self._last is not None and now - self._last < self._every:
            self.suppressed += 1
            return False
        self._last = now
        if self.suppressed:
            msg += " (%d more like it in the last %.0f s)"
            args = (*args, self.suppressed, self._every)
            self.suppressed = 0
        log.warning(msg, *args)
        return True


@dataclass(slots=True)
class CheckStats:
    """Checks received, answered (COMMIT or ROLLBACK sent), left UNKNOWN, dropped, and answers
    that failed to reach the broker."""

    received: int = 0
    answered: int = 0
    unknown: int = 0
    dropped: int = 0
    answer_failures: int = 0


class CheckRunner:
    """Runs the check listener for each check that arrives (:meth:`submit`) and answers."""

    def __init__(
        self,
        listener: CheckListener | None,
        group: str,
        client_id: str,
        end: EndCall,
        *,
        max_concurrent: int,
        timeout: float,
        end_timeout: float,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._listener = listener
        self._is_async = listener is not None and (
            inspect.iscoroutinefunction(listener)
            or inspect.iscoroutinefunction(getattr(listener, "__call__", None))  # noqa: B004
        )
        self._group = group
        self._client_id = client_id
        self._end = end
        self._max_concurrent = max_concurrent
        self._timeout = timeout
        self._end_timeout = end_timeout
        self._slots = asyncio.Semaphore(max_concurrent)
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._checking: set[tuple[str, str]] = set()
        self._no_listener = RateLimitedLog(clock)
        self._too_many = RateLimitedLog(clock)
        self._closed = False
        self.stats = CheckStats()

    @property
    def running(self) -> int:
        """Checks started and not finished."""
        return len(self._tasks)

    def submit(
        self, broker_name: str, address: str, check: transaction_pb2.TransactionCheckRequest
    ) -> None:
        """Start checking ``check`` (from ``broker_name`` at ``address``); returns at once."""
        if self._closed:
            return
        self.stats.received += 1
        key = (broker_name, check.unique_id)
        if key in self._checking:
            self.stats.dropped += 1
            log.debug(
                "transaction %s is being checked already; broker %s will ask again",
                check.unique_id,
                broker_name,
            )
            return
        if len(self._tasks) >= MAX_WAITING:
            self.stats.dropped += 1
            self._too_many.warning(
                "%d transaction checks are running; a check of %s from broker %s is dropped "
                "(the broker asks again)",
                len(self._tasks),
                check.unique_id,
                broker_name,
            )
            return
        self._checking.add(key)
        task = asyncio.get_running_loop().create_task(
            self._check(broker_name, address, check), name=f"apogee-txn-check-{check.unique_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: self._checking.discard(key))

    async def _check(
        self, broker_name: str, address: str, check: transaction_pb2.TransactionCheckRequest
    ) -> None:
        uid = check.unique_id
        try:
            async with asyncio.timeout(self._timeout):
                await self._slots.acquire()
        except TimeoutError:
            self.stats.dropped += 1
            log.warning(
                "the check of transaction %s from broker %s waited %.0f s for one of %d "
                "listener slots; dropped (the broker asks again)",
                uid,
                broker_name,
                self._timeout,
                self._max_concurrent,
            )
            return
        try:
            decision = await self._decide(broker_name, check)
        finally:
            self._slots.release()
        if decision is TransactionDecision.UNKNOWN:
            self.stats.unknown += 1
            log.debug("transaction %s from broker %s is still UNKNOWN", uid, broker_name)
            return
        request = end_request(
            self._group,
            uid,
            check.half_offset,
            decision,
            transaction_pb2.CHECK,
            self._client_id,
        )
        try:
            resp = await self._end(broker_name, address, request, self._end_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.stats.answer_failures += 1
            log.warning(
                "answering the check of transaction %s from broker %s with %s failed: %s; the "
                "broker asks again",
                uid,
                broker_name,
                decision.value,
                error_text(exc),
                exc_info=not isinstance(exc, ApogeeError),
            )
            return
        self.stats.answered += 1
        log.info(
            "transaction %s (check %d from broker %s): %s, %s",
            uid,
            check.check_times,
            broker_name,
            decision.value,
            transaction_pb2.EndOutcome.Name(resp.outcome),
        )

    async def _decide(
        self, broker_name: str, check: transaction_pb2.TransactionCheckRequest
    ) -> TransactionDecision:
        """The listener's answer for ``check``; UNKNOWN (logged) when there is none."""
        uid = check.unique_id
        listener = self._listener
        if listener is None:
            self._no_listener.warning(
                "broker %s checks transaction %s of group %s, but this producer has no "
                "check_listener: the answer is UNKNOWN (the broker asks again later)",
                broker_name,
                uid,
                self._group,
            )
            return TransactionDecision.UNKNOWN
        try:
            msg = checked_message(check, broker_name)
        except Exception as exc:
            return failed(exc, "reading the half of a check", uid)[0]
        if self._is_async:
            try:
                value = listener(msg)
            except Exception as exc:
                return failed(exc, _WHO, uid)[0]
            if inspect.isawaitable(value):
                return (await await_decision(value, self._timeout, _WHO, uid))[0]
            return decision_of(value, _WHO, uid)[0]
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(
                self._max_concurrent, thread_name_prefix=f"apogee-txn-check-{self._group}"
            )
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._timeout) as scope:
                value = await loop.run_in_executor(self._threads, listener, msg)
        except TimeoutError as exc:
            if not scope.expired():
                return failed(exc, _WHO, uid)[0]
            log.warning(
                "%s ran past check_timeout (%.0f s) on transaction %s; it counts as UNKNOWN "
                "(the broker asks again)",
                _WHO,
                self._timeout,
                uid,
            )
            return TransactionDecision.UNKNOWN
        except Exception as exc:
            return failed(exc, _WHO, uid)[0]
        if inspect.isawaitable(value):
            return (await await_decision(value, self._timeout, _WHO, uid))[0]
        return decision_of(value, _WHO, uid)[0]

    async def close(self, timeout: float = 2.0) -> None:
        """Take no more checks; cancel those running and wait for them at most ``timeout``."""
        self._closed = True
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            if pending:
                log.warning(
                    "%d transaction checks did not stop within %.1fs", len(pending), timeout
                )
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None
