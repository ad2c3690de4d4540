"""The gRPC side of registration: a channel per nameserver; RegisterBroker, UnregisterBroker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from apogee.common.errors import ApogeeError, UnknownTopicError
from apogee.rpc.errors import call
from apogee.rpc.security import PLAIN, ClientSecurity
from apogee.rpc.server import CLIENT_OPTIONS
from apogee.v1 import common_pb2, nameserver_pb2, nameserver_pb2_grpc
from apogee_broker.core.registration import RegistrationReply
from apogee_broker.core.topics import TopicConfig


@dataclass(frozen=True, slots=True)
class BrokerIdentity:
    """Who registers: what every RegisterBroker and UnregisterBroker carries."""

    cluster: str
    broker_name: str
    address: str
    heartbeat_interval_s: float
    auto_create_topics: bool
    #: the replica group's epoch when this broker leads a group; 0 for a lone broker
    epoch: int = 0


def topic_to_pb(topic: TopicConfig) -> common_pb2.TopicConfig:
    return common_pb2.TopicConfig(
        name=topic.name,
        read_queues=topic.read_queues,
        write_queues=topic.write_queues,
        perm=topic.perm,
        system=topic.system,
        message_type=topic.message_type.value,
    )


class GrpcNameServerLink:
    """A :class:`~apogee_broker.core.registration.NameServerLink` over gRPC (over TLS and signed
    as ``security`` says)."""

    def __init__(
        self, address: str, identity: BrokerIdentity, security: ClientSecurity = PLAIN
    ) -> None:
        self._address = address
        self.identity = identity
        self._channel = security.channel(address, CLIENT_OPTIONS)
        self._stub = nameserver_pb2_grpc.NameServerStub(self._channel)

    @property
    def address(self) -> str:
        return self._address

    async def register(
        self, topics: Sequence[TopicConfig] | None, version: int, timeout: float
    ) -> RegistrationReply:
        me = self.identity
        request = nameserver_pb2.RegisterBrokerRequest(
            cluster=me.cluster,
            broker_name=me.broker_name,
            address=me.address,
            topics=[] if topics is None else [topic_to_pb(t) for t in topics],
            heartbeat_interval_ms=int(me.heartbeat_interval_s * 1000),
            auto_create_topics=me.auto_create_topics,
            epoch=me.epoch,
            topics_unchanged=topics is None,
            topics_version=version,
        )
        reply: nameserver_pb2.RegisterBrokerResponse = await call(
            f"nameserver {self._address}", self._stub.RegisterBroker(request, timeout=timeout)
        )
        return RegistrationReply(reply.knows_topics_unchanged, reply.topics_needed)

    async def held_version(self, timeout: float) -> int:
        me = self.identity
        info: nameserver_pb2.GetClusterInfoResponse = await call(
            f"nameserver {self._address}",
            self._stub.GetClusterInfo(nameserver_pb2.GetClusterInfoRequest(), timeout=timeout),
        )
        for b in info.brokers:
            if (b.broker_name, b.cluster, b.address, b.epoch) == (
                me.broker_name,
                me.cluster,
                me.address,
                me.epoch,
            ):
                return b.topics_version
        return 0

    async def unregister(self, timeout: float) -> None:
        me = self.identity
        request = nameserver_pb2.UnregisterBrokerRequest(
            cluster=me.cluster, broker_name=me.broker_name, address=me.address, epoch=me.epoch
        )
        await call(
            f"nameserver {self._address}", self._stub.UnregisterBroker(request, timeout=timeout)
        )

    async def close(self) -> None:
        await self._channel.close()


class RouteLookup:
    """Routes from the nameservers (the first that answers), for the v2 protocol's QueryRoute
    and QueryAssignment: any broker answers for the whole cluster."""

    def __init__(self, addresses: Sequence[str], security: ClientSecurity = PLAIN) -> None:
        self._channels = [security.channel(a, CLIENT_OPTIONS) for a in addresses]
        self._links = [
            (a, nameserver_pb2_grpc.NameServerStub(ch))
            for a, ch in zip(addresses, self._channels, strict=True)
        ]

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()

    async def route(self, topic: str, timeout: float) -> nameserver_pb2.GetRouteResponse:
        """The topic's route; the last nameserver's error when none answers (an unknown topic
        is :class:`~apogee.common.errors.UnknownTopicError`, as the nameserver says)."""
        last: Exception | None = None
        for address, stub in self._links:
            try:
                response: nameserver_pb2.GetRouteResponse = await call(
                    f"nameserver {address}",
                    stub.GetRoute(nameserver_pb2.GetRouteRequest(topic=topic), timeout=timeout),
                )
                return response
            except UnknownTopicError:
                raise
            except ApogeeError as exc:  # try the next nameserver
                last = exc
        if last is None:
            raise RuntimeError("no nameserver is configured")
        raise last
