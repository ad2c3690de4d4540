"""Channels, nameserver calls and address lists shared by the producer and the admin client.

:class:`ChannelPool` keeps one ``grpc.aio`` channel per address (created on first use, inside
the event loop that uses it). :class:`NameServerClient` asks the nameservers in order, starting
from the last one that answered, and moves on to the next when one is unreachable; a route
lookup also moves on when a nameserver does not know the topic (a broker may not have
registered with it yet), and only when none knows it is the topic unknown.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, TypeVar

import grpc
import grpc.aio

from apogee.common.errors import (
    ApogeeError,
    InvalidArgumentError,
    UnavailableError,
    UnknownTopicError,
)
from apogee.rpc.errors import call
from apogee.rpc.mux import MuxClient, ResponseEnvelope
from apogee.rpc.server import CLIENT_OPTIONS
from apogee.v1 import (
    broker_pb2,
    broker_pb2_grpc,
    consumer_pb2,
    consumer_pb2_grpc,
    nameserver_pb2,
    nameserver_pb2_grpc,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
CHANNEL_OPTIONS: Final = CLIENT_OPTIONS
SEND_METHOD: Final = "/apogee.v1.Broker/SendMessages"
SEND_STREAM: Final = "/apogee.v1.Broker/SendStream"
PULL_STREAM: Final = "/apogee.v1.Consumer/PullStream"


def parse_addresses(value: str | Sequence[str], field: str = "namesrv") -> tuple[str, ...]:
    """``"h1:9876;h2:9876"`` (``;`` or ``,`` separated) or a list, as a tuple of host:port."""
    parts = value.replace(",", ";").split(";") if isinstance(value, str) else list(value)
    out: list[str] = []
    for raw in parts:
        part = raw.strip() if isinstance(raw, str) else raw
        if part == "":
            continue
        if not isinstance(part, str):
            raise InvalidArgumentError(field=field, rule=f"{part!r} is not host:port")
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgumentError(field=field, rule=f"{part!r} is not host:port")
        out.append(part)
    if not out:
        raise InvalidArgumentError(field=field, rule="must name at least one host:port")
    return tuple(out)


class ChannelPool:
    """One channel per address, and one multiplexed stream per address and stream method
    (:mod:`apogee.rpc.mux`); :meth:`close` closes them all."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[str, Any], Any] = {}
        self._muxes: dict[tuple[str, str], MuxClient[Any]] = {}

    def mux(
        self,
        address: str,
        method: str,
        response_type: Callable[[bytes], ResponseEnvelope[T]],
        what: str,
    ) -> MuxClient[T]:
        key = (address, method)
        mux = self._muxes.get(key)
        if mux is None:
            mux = self._muxes[key] = MuxClient(self.channel(address), method, response_type, what)
        return mux

    async def send(
        self, address: str, request: bytes, timeout: float, what: str
    ) -> broker_pb2.SendMessagesResponse:
        """One ``SendMessagesRequest`` (serialized) on the broker's SendStream."""
        mux = self.mux(address, SEND_STREAM, broker_pb2.SendStreamResponse.FromString, what)

        async def unary() -> broker_pb2.SendMessagesResponse:
            call: grpc.aio.UnaryUnaryMultiCallable[bytes, broker_pb2.SendMessagesResponse]
            call = self.channel(address).unary_unary(
                SEND_METHOD,
                request_serializer=None,
                response_deserializer=broker_pb2.SendMessagesResponse.FromString,
            )
            return await rpc(what, call(request, timeout=timeout))

        return await mux.call(request, timeout, unary)

    async def pull(
        self, address: str, request: consumer_pb2.PullRequest, timeout: float, what: str
    ) -> consumer_pb2.PullResponse:
        """One pull on the broker's PullStream."""
        mux = self.mux(address, PULL_STREAM, consumer_pb2.PullStreamResponse.FromString, what)

        async def unary() -> consumer_pb2.PullResponse:
            return await rpc(what, self.consumer(address).Pull(request, timeout=timeout))

        return await mux.call(request.SerializeToString(), timeout, unary)

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = ch
        return ch

    def _stub(self, address: str, cls: Any) -> Any:
        key = (address, cls)
        stub = self._stubs.get(key)
        if stub is None:
            stub = self._stubs[key] = cls(self.channel(address))
        return stub

    def nameserver(self, address: str) -> nameserver_pb2_grpc.NameServerAsyncStub:
        return self._stub(address, nameserver_pb2_grpc.NameServerStub)  # type: ignore[no-any-return]

    def broker(self, address: str) -> broker_pb2_grpc.BrokerAsyncStub:
        return self._stub(address, broker_pb2_grpc.BrokerStub)  # type: ignore[no-any-return]

    def broker_admin(self, address: str) -> broker_pb2_grpc.BrokerAdminAsyncStub:
        return self._stub(address, broker_pb2_grpc.BrokerAdminStub)  # type: ignore[no-any-return]

    def consumer(self, address: str) -> consumer_pb2_grpc.ConsumerAsyncStub:
        return self._stub(address, consumer_pb2_grpc.ConsumerStub)  # type: ignore[no-any-return]

    def consumer_admin(self, address: str) -> consumer_pb2_grpc.ConsumerAdminAsyncStub:
        return self._stub(address, consumer_pb2_grpc.ConsumerAdminStub)  # type: ignore[no-any-return]

    async def close(self) -> None:
        muxes = list(self._muxes.values())
        self._muxes.clear()
        for mux in muxes:
            await mux.close()
        channels = list(self._channels.values())
        self._channels.clear()
        self._stubs.clear()
        for ch in channels:
            await ch.close(grace=None)


#: ``await rpc(what, stub.Call(...))``: failures become Apogee errors (``what`` names the peer)
rpc = call


NsCall = Callable[["nameserver_pb2_grpc.NameServerAsyncStub"], Awaitable[T]]


class NameServerClient:
    """Calls to any reachable nameserver, in order, rotating past unreachable ones."""

    def __init__(self, addresses: Sequence[str], pool: ChannelPool, timeout: float) -> None:
        self.addresses = tuple(addresses)
        self._pool = pool
        self.timeout = timeout
        self._index = 0

    def _order(self) -> list[str]:
        n = len(self.addresses)
        return [self.addresses[(self._index + i) % n] for i in range(n)]

    def _rotate_past(self, address: str) -> None:
        if self.addresses[self._index % len(self.addresses)] == address:
            self._index = (self._index + 1) % len(self.addresses)

    def _stub(self, address: str) -> nameserver_pb2_grpc.NameServerAsyncStub:
        return self._pool.nameserver(address)

    async def call(self, what: str, fn: NsCall[T]) -> T:
        """``fn(stub)`` on the first nameserver that answers; non-retriable errors are raised
        at once, an :class:`UnavailableError` when none answers."""
        last: ApogeeError | None = None
        for address in self._order():
            try:
                return await rpc(f"nameserver {address}", fn(self._stub(address)))
            except ApogeeError as err:
                if not err.retriable:
                    raise
                log.debug("nameserver %s failed %s: %s", address, what, err)
                last = err
                self._rotate_past(address)
        raise UnavailableError(
            what=f"every nameserver ({';'.join(self.addresses)})", detail=f"{what}: {last}"
        )

    async def get_route(self, topic: str) -> nameserver_pb2.GetRouteResponse:
        """The topic's route from the first nameserver that knows it.
        :class:`UnknownTopicError` when every nameserver that answered says NOT_FOUND."""
        not_found: list[str] = []
        failed: list[str] = []
        last: ApogeeError | None = None
        request = nameserver_pb2.GetRouteRequest(topic=topic)
        for address in self._order():
            try:
                return await rpc(
                    f"nameserver {address}",
                    self._stub(address).GetRoute(request, timeout=self.timeout),
                )
            except ApogeeError as err:
                if err.kind.code == "NOT_FOUND":
                    not_found.append(address)
                    continue
                if not err.retriable:
                    raise
                last = err
                failed.append(address)
                self._rotate_past(address)
        if not_found:
            detail = "has no route: no live broker has it and none creates topics automatically"
            if failed:
                detail += f" (nameservers {', '.join(failed)} did not answer)"
            raise UnknownTopicError(topic=topic, detail=detail)
        raise UnavailableError(
            what=f"every nameserver ({';'.join(self.addresses)})",
            detail=f"route of topic {topic!r}: {last}",
        )
