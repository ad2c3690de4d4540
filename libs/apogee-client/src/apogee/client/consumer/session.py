"""A consumer's ``Session`` stream with each broker of its topics.

The stream is the consumer's membership: the broker counts the consumer in its group while the
stream is open (and heartbeats arrive at least every 120 s), drops it at once when the stream
ends, and tells it of changes to the group's members and of offset resets. A stream that fails
is opened again with a growing pause (0.2 s to 5 s); every new stream counts as a change, so the
consumer rebalances after a broker restart. :class:`Sessions` keeps one per broker of the
consumer's routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable

import grpc
import grpc.aio

from apogee.client._rpc import ChannelPool
from apogee.v1 import consumer_pb2

log = logging.getLogger(__name__)

OnEvent = Callable[[str, consumer_pb2.SessionEvent], None]

_MIN_PAUSE = 0.2
_MAX_PAUSE = 5.0


class BrokerSession:
    """Keeps one ``Session`` stream open to ``address`` until :meth:`stop`."""

    def __init__(
        self,
        address: str,
        pool: ChannelPool,
        heartbeat: Callable[[], consumer_pb2.Heartbeat],
        interval: float,
        on_event: OnEvent,
        on_end: Callable[[str], None] = lambda address: None,
    ) -> None:
        """``on_event``: each event of the stream, with this broker's address; ``on_end``:
        the stream ended (what it told may be outdated until the next one's events)."""
        self.address = address
        self._pool = pool
        self._heartbeat = heartbeat
        self._interval = interval
        self._on_event = on_event
        self._on_end = on_end
        self._task: asyncio.Task[None] | None = None
        self._call: (
            grpc.aio.StreamStreamCall[consumer_pb2.SessionRequest, consumer_pb2.SessionEvent] | None
        ) = None
        self._poke = asyncio.Event()
        self.connected = asyncio.Event()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"apogee-session-{self.address}"
            )

    def poke(self) -> None:
        """Send a heartbeat now (subscriptions changed, say)."""
        self._poke.set()

    async def _run(self) -> None:
        pause = _MIN_PAUSE
        while True:
            try:
                await self._one_stream()
                pause = _MIN_PAUSE
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                level = (
                    logging.DEBUG if exc.code() == grpc.StatusCode.UNAVAILABLE else logging.WARNING
                )
                log.log(
                    level,
                    "session with broker %s ended: %s %s",
                    self.address,
                    exc.code().name,
                    exc.details(),
                )
            except Exception:
                log.exception("session with broker %s failed", self.address)
            finally:
                self.connected.clear()
                self._on_end(self.address)
            await asyncio.sleep(pause)
            pause = min(pause * 2, _MAX_PAUSE)

    async def _one_stream(self) -> None:
        stub = self._pool.consumer(self.address)
        call = stub.Session()
        self._call = call
        writer = asyncio.get_running_loop().create_task(self._write(call))
        try:
            while True:
                event = await call.read()
                if event is grpc.aio.EOF:
                    break
                assert isinstance(event, consumer_pb2.SessionEvent)
                self.connected.set()
                try:
                    self._on_event(self.address, event)
                except Exception:
                    log.exception("handling an event from broker %s failed", self.address)
            log.debug("broker %s closed the session; opening it again", self.address)
        finally:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer
            call.cancel()
            self._call = None

    async def _write(
        self,
        call: grpc.aio.StreamStreamCall[consumer_pb2.SessionRequest, consumer_pb2.SessionEvent],
    ) -> None:
        while True:
            await call.write(consumer_pb2.SessionRequest(heartbeat=self._heartbeat()))
            self._poke.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), self._interval)

    async def stop(self, timeout: float = 2.0) -> None:
        """End the stream (the broker drops this consumer from its group at once)."""
        task, self._task = self._task, None
        if task is None:
            return
        call = self._call
        if call is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(call.done_writing(), timeout)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, timeout)


class Sessions:
    """A consumer's sessions, one per broker it has seen in its routes."""

    def __init__(
        self,
        pool: ChannelPool,
        heartbeat: Callable[[], consumer_pb2.Heartbeat],
        interval: float,
        on_event: OnEvent,
        on_end: Callable[[str], None] = lambda address: None,
    ) -> None:
        self._pool = pool
        self._heartbeat = heartbeat
        self._interval = interval
        self._on_event = on_event
        self._on_end = on_end
        self._by_address: dict[str, BrokerSession] = {}

    def open(self, addresses: Iterable[str]) -> None:
        """Open a session with each of ``addresses`` that has none yet."""
        for address in sorted(set(addresses) - set(self._by_address)):
            s = BrokerSession(
                address, self._pool, self._heartbeat, self._interval, self._on_event, self._on_end
            )
            self._by_address[address] = s
            s.start()

    def poke(self) -> None:
        """Send a heartbeat on every session now (subscriptions changed)."""
        for s in self._by_address.values():
            s.poke()

    async def wait_connected(self, timeout: float) -> None:
        """Wait (at most ``timeout``) until every broker has answered a heartbeat."""
        waits = [s.connected.wait() for s in self._by_address.values()]
        if waits:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await asyncio.gather(*waits)

    async def stop(self) -> None:
        """End every session (the brokers drop this consumer from its group at once)."""
        await asyncio.gather(*(s.stop() for s in self._by_address.values()))
        self._by_address.clear()
