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
    UnsupportedError,
)
from apogee.rpc.errors import call
from apogee.rpc.mux import MuxClient, MuxPool, ResponseEnvelope
from apogee.rpc.protowire import split_field
from apogee.rpc.security import ClientSecurity
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
SEND_STREAM: Final = "/apogee.v1.Broker/SendStream"
PULL_STREAM: Final = "/apogee.v1.Consumer/PullStream"
#: Pull answers at least this large keep their records where they arrived (see PullAnswer).
IN_PLACE_FROM: Final = 64 * 1024
_RESPONSE_FIELD: Final = consumer_pb2.PullStreamResponse.DESCRIPTOR.fields_by_name[
    "response"
].number
_RECORDS_FIELD: Final = consumer_pb2.PullResponse.DESCRIPTOR.fields_by_name["records"].number


class PullAnswer:
    """A pull's response, with its records as ``records[start:end]``.

    A large answer's records are not copied out of the bytes they arrived in: protobuf would
    copy them twice (into its arena, then out as ``bytes``), a megabyte per pull of 1,024
    messages of 1 KiB. ``response`` holds every other field (its own ``records`` is then
    empty); ``records`` is the whole answer's bytes."""

    __slots__ = ("end", "records", "response", "start")

    def __init__(
        self, response: consumer_pb2.PullResponse, records: bytes, start: int, end: int
    ) -> None:
        self.response = response
        self.records = records
        self.start = start
        self.end = end

    @classmethod
    def of(cls, response: consumer_pb2.PullResponse) -> PullAnswer:
        records = response.records
        return cls(response, records, 0, len(records))


class _PullEnvelope:
    """A ``PullStreamResponse`` as :class:`~apogee.rpc.mux.MuxClient` reads it."""

    __slots__ = ("id", "response", "status")

    def __init__(self, id: int, response: PullAnswer, status: Any) -> None:
        self.id = id
        self.response = response
        self.status = status

    def HasField(self, field_name: Any) -> bool:
        return field_name == "status" and self.status is not None


def read_pull_envelope(raw: bytes) -> _PullEnvelope:
    """The deserializer of ``PullStream`` answers."""
    at = -1
    if len(raw) < IN_PLACE_FROM:
        env = consumer_pb2.PullStreamResponse.FromString(raw)
    else:
        rest, at, end = split_field(raw, 0, len(raw), _RESPONSE_FIELD)
        env = consumer_pb2.PullStreamResponse.FromString(rest)
    if at < 0:  # small, or no response at all
        answer = PullAnswer.of(env.response)
    else:
        fields, start, end = split_field(raw, at, end, _RECORDS_FIELD)
        response = consumer_pb2.PullResponse.FromString(fields)
        answer = PullAnswer(response, raw, start, end) if start >= 0 else PullAnswer.of(response)
    return _PullEnvelope(env.id, answer, env.status if env.HasField("status") else None)


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
    """One channel per address, one multiplexed stream per address and stream method, and a
    pool of send streams per broker (:mod:`apogee.rpc.mux`); :meth:`close` closes them all."""

    def __init__(self, security: ClientSecurity | None = None) -> None:
        #: TLS and the access key every channel uses; None: what the environment sets
        #: (:meth:`ClientSecurity.from_env`: nothing set, plaintext and unsigned)
        self.security = security if security is not None else ClientSecurity.from_env()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[str, Any], Any] = {}
        self._muxes: dict[tuple[str, str], MuxClient[Any]] = {}
        self._send_pools: dict[str, MuxPool[broker_pb2.SendMessagesResponse]] = {}

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
        self, address: str, request: bytes, timeout: float, what: str, streams: int = 1
    ) -> broker_pb2.SendMessagesResponse:
        """One ``SendMessagesRequest`` (serialized) on one of up to ``streams`` of the broker's
        SendStream streams (:class:`~apogee.rpc.mux.MuxPool`)."""
        pool = self._send_pools.get(address)
        if pool is None:
            pool = self._send_pools[address] = MuxPool(
                self.channel(address),
                SEND_STREAM,
                broker_pb2.SendStreamResponse.FromString,
                what,
                streams,
            )
        return await pool.call(request, timeout)

    async def pull(
        self, address: str, request: consumer_pb2.PullRequest, timeout: float, what: str
    ) -> PullAnswer:
        """One pull on the broker's PullStream (random-access reads by offset; consumers
        take what brokers push on ``Consumer.Deliver``)."""
        mux = self.mux(address, PULL_STREAM, read_pull_envelope, what)

        async def no_unary() -> PullAnswer:
            raise UnsupportedError(what=what, detail="does not serve Consumer.PullStream")

        return await mux.call(request.SerializeToString(), timeout, no_unary)

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self.security.channel(address, CHANNEL_OPTIONS)
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
        pools = list(self._send_pools.values())
        self._send_pools.clear()
        for pool in pools:
            await pool.close()
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
