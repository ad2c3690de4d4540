"""A transactional producer's session streams with brokers (``Transaction.ProducerSession``).

The stream is how a broker finds a live producer of a group to check a transaction with: the
producer says who it is (``ProducerHello``: group, client id, heartbeat interval), then
heartbeats every ``heartbeat_interval``; the broker counts it among the group's producers while
the stream is open (and forgets it when the stream ends or heartbeats stop) and sends it the
group's checks on it (:class:`~apogee.client.producer.txn_checks.CheckRunner` answers them).

- :class:`ProducerSession` keeps one stream open to one broker. A stream that ends or fails is
  opened again after a pause that grows from 0.2 s to 5 s (with jitter, so that producers do
  not come back all at once), and starts again from 0.2 s after a stream that lived 5 s. A
  write that takes longer than the heartbeat interval ends the stream.
- :class:`ProducerSessions` keeps one session per broker name, and moves it when the broker's
  address changes. A stream to a broker that cannot be reached (``UNAVAILABLE``) may mean the
  broker moved (its replica group's leader changed): the routes through that broker are then
  asked for again at once, rather than at the next route refresh, so that the session follows
  the new leader within moments and a new leader's checks reach this producer.
- :class:`SessionKeeper` chooses the brokers: every broker a half was sent to (the producer
  opens those itself), and every broker of the producer's cached routes and of its ``topics``
  option, so that a producer restarted before it sends again can still be asked about the
  transactions it left open. It looks at start, then every 5 s (or every
  ``route_refresh_interval``, when that is shorter).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Sequence
from typing import Final

import grpc
import grpc.aio

from apogee.client._rpc import ChannelPool
from apogee.client.producer.routes import RouteCache
from apogee.client.producer.txn_checks import RateLimitedLog
from apogee.common.clock import SYSTEM_CLOCK, Clock
from apogee.common.errors import ApogeeError
from apogee.v1 import transaction_pb2, transaction_pb2_grpc

log = logging.getLogger("apogee.client.producer.transaction")

MIN_PAUSE: Final = 0.2
MAX_PAUSE: Final = 5.0
#: How often the keeper looks for brokers without a session (seconds).
KEEP_EVERY: Final = 5.0

#: ``on_check(broker_name, address, check)``
OnCheck = Callable[[str, str, transaction_pb2.TransactionCheckRequest], None]
_Call = grpc.aio.StreamStreamCall[
    transaction_pb2.ProducerSessionRequest, transaction_pb2.ProducerSessionEvent
]


class _WriterFailed(Exception):
    """The stream's writer failed, so the stream was cancelled under its reader."""


class ProducerSession:
    """Keeps one ``ProducerSession`` stream open to ``address`` until :meth:`stop`."""

    def __init__(
        self,
        broker_name: str,
        address: str,
        stub: transaction_pb2_grpc.TransactionAsyncStub,
        hello: transaction_pb2.ProducerHello,
        interval: float,
        on_check: OnCheck,
        clock: Clock = SYSTEM_CLOCK,
        rng: random.Random | None = None,
    ) -> None:
        self.broker_name = broker_name
        self.address = address
        self._stub = stub
        self._hello = hello
        self._interval = interval
        self._on_check = on_check
        self._clock = clock
        self._rng = rng or random.Random()
        self._task: asyncio.Task[None] | None = None
        self._call: _Call | None = None
        self._unsupported_logged = False
        self._stopping = False
        #: set while a stream is open and its hello was written
        self.connected = asyncio.Event()
        #: streams opened so far
        self.streams = 0
        #: called with the broker name when a stream could not reach the broker
        self.on_unreachable: Callable[[str], None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"apogee-producer-session-{self.broker_name}"
            )

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        pause = MIN_PAUSE
        while True:
            began = loop.time()
            try:
                await self._one_stream()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                self._log_end(exc)
                if exc.code() == grpc.StatusCode.UNAVAILABLE and self.on_unreachable is not None:
                    self.on_unreachable(self.broker_name)
            except _WriterFailed as exc:
                log.info("session with broker %s ended: %s", self.broker_name, exc)
            except Exception:
                log.exception("session with broker %s failed", self.broker_name)
            self.connected.clear()
            if self._stopping:
                return
            if loop.time() - began >= MAX_PAUSE:
                pause = MIN_PAUSE
            await asyncio.sleep(pause * (0.8 + 0.4 * self._rng.random()))
            pause = min(pause * 2, MAX_PAUSE)

    def _log_end(self, exc: grpc.aio.AioRpcError) -> None:
        code = exc.code()
        if code == grpc.StatusCode.UNIMPLEMENTED:
            if not self._unsupported_logged:
                self._unsupported_logged = True
                log.warning(
                    "broker %s at %s does not serve transactions (Transaction.ProducerSession): "
                    "its checks cannot reach this producer",
                    self.broker_name,
                    self.address,
                )
            return
        level = logging.DEBUG if code == grpc.StatusCode.UNAVAILABLE else logging.WARNING
        log.log(
            level,
            "session with broker %s at %s ended: %s %s",
            self.broker_name,
            self.address,
            code.name,
            exc.details(),
        )

    async def _one_stream(self) -> None:
        call: _Call = self._stub.ProducerSession()
        self._call = call
        self.streams += 1
        failure: list[BaseException] = []

        def writer_done(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and (exc := task.exception()) is not None:
                failure.append(exc)
                call.cancel()  # ends the read below

        writer = asyncio.get_running_loop().create_task(self._write(call))
        writer.add_done_callback(writer_done)
        try:
            while True:
                try:
                    event = await call.read()
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if failure and task is not None and not task.cancelling():
                        raise _WriterFailed(f"writing failed: {failure[0]!r}") from None
                    raise
                if event is grpc.aio.EOF:
                    break
                assert isinstance(event, transaction_pb2.ProducerSessionEvent)
                if event.HasField("check"):
                    try:
                        self._on_check(self.broker_name, self.address, event.check)
                    except Exception:
                        log.exception("taking a check from broker %s failed", self.broker_name)
            log.debug("broker %s closed the session; opening it again", self.broker_name)
        finally:
            self.connected.clear()
            call.cancel()  # first: a write waiting on the call ends with it
            writer.cancel()
            # wait() raises nothing of the writer's, but does raise this task's own cancellation
            await asyncio.wait({writer}, timeout=1.0)
            self._call = None

    async def _write(self, call: _Call) -> None:
        """The hello, then a heartbeat every interval; each write within the interval."""
        hello = transaction_pb2.ProducerSessionRequest(hello=self._hello)
        await asyncio.wait_for(call.write(hello), max(self._interval, 1.0))
        self.connected.set()
        log.debug("session with broker %s at %s open", self.broker_name, self.address)
        while True:
            await asyncio.sleep(self._interval)
            beat = transaction_pb2.ProducerSessionRequest(heartbeat_ms=self._clock.time_ms())
            await asyncio.wait_for(call.write(beat), max(self._interval, 1.0))

    async def stop(self, timeout: float = 2.0) -> None:
        """End the stream (the broker forgets this producer at once); at most ``timeout``."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        call = self._call
        if call is not None and self.connected.is_set():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(call.done_writing(), timeout / 2)
        # the call first: gRPC swallows a task's cancellation that arrives while the call is
        # being set up, and the read would then wait for the broker's next word
        if self._call is not None:
            self._call.cancel()
        task.cancel()
        await asyncio.wait({task}, timeout=timeout / 2)
        if not task.done():
            log.warning("the session with broker %s did not stop in time", self.broker_name)


class ProducerSessions:
    """One :class:`ProducerSession` per broker name."""

    def __init__(
        self,
        pool: ChannelPool,
        hello: transaction_pb2.ProducerHello,
        interval: float,
        on_check: OnCheck,
        clock: Clock = SYSTEM_CLOCK,
        rng: random.Random | None = None,
    ) -> None:
        self._pool = pool
        self._hello = hello
        self._interval = interval
        self._on_check = on_check
        self._clock = clock
        self._rng = rng or random.Random()
        self._by_name: dict[str, ProducerSession] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._closed = False
        #: called with a broker name whose session could not reach it
        self.on_unreachable: Callable[[str], None] | None = None

    def ensure(self, broker_name: str, address: str) -> None:
        """A session with ``broker_name`` at ``address`` (moved there if it was elsewhere)."""
        if self._closed:
            return
        old = self._by_name.get(broker_name)
        if old is not None:
            if old.address == address:
                return
            log.info("broker %s moved to %s: its session follows", broker_name, address)
            task = asyncio.get_running_loop().create_task(old.stop())
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        stub = transaction_pb2_grpc.TransactionStub(self._pool.channel(address))
        session = ProducerSession(
            broker_name,
            address,
            stub,
            self._hello,
            self._interval,
            self._on_check,
            self._clock,
            self._rng,
        )
        session.on_unreachable = self._unreachable
        self._by_name[broker_name] = session
        session.start()

    def _unreachable(self, broker_name: str) -> None:
        if self.on_unreachable is not None and not self._closed:
            self.on_unreachable(broker_name)

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def get(self, broker_name: str) -> ProducerSession | None:
        return self._by_name.get(broker_name)

    async def wait_connected(self, names: Sequence[str], timeout: float) -> bool:
        """Whether the sessions with ``names`` are all open within ``timeout`` seconds."""
        sessions = [self._by_name.get(n) for n in names]
        if any(s is None for s in sessions):
            return False
        waits = [s.connected.wait() for s in sessions if s is not None]
        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*waits)
        except TimeoutError:
            return False
        return True

    async def stop(self, timeout: float = 2.0) -> None:
        """End every session, together, at most ``timeout``."""
        self._closed = True
        sessions = list(self._by_name.values())
        self._by_name.clear()
        await asyncio.gather(*(s.stop(timeout) for s in sessions))
        retiring = list(self._retiring)
        if retiring:
            await asyncio.wait(retiring, timeout=timeout)


class SessionKeeper:
    """Opens sessions with the brokers of the cached routes and of ``topics``, and follows
    address changes, at start and then every ``interval`` seconds."""

    def __init__(
        self,
        routes: RouteCache,
        sessions: ProducerSessions,
        topics: Sequence[str],
        clock: Clock = SYSTEM_CLOCK,
        interval: float = KEEP_EVERY,
    ) -> None:
        self._routes = routes
        self._sessions = sessions
        self._topics = tuple(topics)
        self._interval = interval
        self._task: asyncio.Task[None] | None = None
        self._route_failed = RateLimitedLog(clock)
        self._moving: dict[str, asyncio.Task[None]] = {}

    def start(self) -> None:
        if self._task is None:
            self._sessions.on_unreachable = self.unreachable
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="apogee-producer-session-keeper"
            )

    def unreachable(self, broker_name: str) -> None:
        """``broker_name``'s session could not reach it: ask again for the routes through
        it, and move the session where they say (one look at a time per broker)."""
        if broker_name in self._moving or self._task is None:
            return
        task = asyncio.get_running_loop().create_task(self._follow(broker_name))
        self._moving[broker_name] = task
        task.add_done_callback(lambda _: self._moving.pop(broker_name, None))

    async def _follow(self, broker_name: str) -> None:
        routes = self._routes
        for topic in routes.topics():
            route = routes.cached(topic)
            if route is None or broker_name not in route.addresses:
                continue
            try:
                fresh = await routes.fetch(topic)
            except ApogeeError:
                continue  # no nameserver answers: the keeper's next look tries again
            at = fresh.addresses.get(broker_name)
            if at is not None:
                self._sessions.ensure(broker_name, at)
            return

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("keeping the producer's sessions failed")
            await asyncio.sleep(self._interval)

    async def step(self) -> None:
        routes = self._routes
        for topic in self._topics:
            if routes.cached(topic) is None:
                try:
                    await routes.fetch(topic)
                except ApogeeError as err:
                    self._route_failed.warning(
                        "the route of %s (a topic of this transactional producer) is not known: "
                        "%s; its brokers' checks cannot reach this producer yet",
                        topic,
                        err,
                    )
        for topic in routes.topics():
            route = routes.cached(topic)
            if route is not None:
                for name, at in route.addresses.items():
                    self._sessions.ensure(name, at)
        for name in self._sessions.names():
            address = routes.address_of(name)
            if address is not None:
                self._sessions.ensure(name, address)

    async def stop(self, timeout: float = 1.0) -> None:
        task, self._task = self._task, None
        moving = set(self._moving.values())
        for t in moving:
            t.cancel()
        if moving:
            await asyncio.wait(moving, timeout=timeout)
        if task is None:
            return
        task.cancel()
        await asyncio.wait({task}, timeout=timeout)
