"""What the parts of ``apache.rocketmq.v2.MessagingService`` share (:mod:`.messaging`): the
broker's settings for it, the checks of names and of every request, the route lookup, the
channels to the other brokers, and the metrics decorator of the unary RPCs."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

import grpc.aio
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from apogee.common.errors import InvalidArgumentError, UnknownTopicError
from apogee.common.filtering import Selection, parse_selection
from apogee.common.topics import is_system_topic, validate_topic
from apogee.rocketmq.v2 import definition_pb2 as d
from apogee.rocketmq.v2 import service_pb2 as s
from apogee.rocketmq.v2 import service_pb2_grpc as sg
from apogee.rpc.security import ClientSecurity
from apogee.rpc.server import CLIENT_OPTIONS
from apogee.service.rights import (
    may_topic,
    require_group,
    require_signed,
    require_topic,
)
from apogee.v1 import (
    nameserver_pb2,
)
from apogee_broker.core.checks import validate_group
from apogee_broker.core.clients.official import OfficialClient, OfficialClients
from apogee_broker.core.clients.producers import ProducerRegistry
from apogee_broker.core.pop.renewals import Renewals
from apogee_broker.core.pop.service import PopService
from apogee_broker.core.schedule.service import ScheduleService
from apogee_broker.core.send.service import SendService
from apogee_broker.core.topics import TopicManager
from apogee_broker.core.txn.ends import TransactionEnds
from apogee_broker.core.txn.halves import HalfIntake
from apogee_broker.metrics import BrokerMetrics
from apogee_broker.servicers.broker import peer_host
from apogee_broker.servicers.v2.status import V2Error

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]
RouteOf = Callable[[str, float], Awaitable[nameserver_pb2.GetRouteResponse]]

#: Long polling: the client's wish clamped to this range (upstream's).
MIN_POLL_S: Final = 5.0
MAX_POLL_S: Final = 20.0
#: An answer leaves this much of the call's deadline for its trip back.
DEADLINE_MARGIN_S: Final = 0.5
#: Invisible time of a receive that gives none and does not ask for renewal.
DEFAULT_INVISIBLE_MS: Final = 60_000
#: Retry back-off announced to consumers (RocketMQ's 16 levels after the first delivery).
RETRY_BACKOFF_S: Final = (
    1,
    5,
    10,
    30,
    60,
    120,
    180,
    240,
    300,
    360,
    420,
    480,
    540,
    600,
    1200,
    1800,
    3600,
    7200,
)
#: How long a route lookup at the nameserver may take.
ROUTE_TIMEOUT_S: Final = 3.0


@dataclass(frozen=True, slots=True)
class V2Config:
    broker_name: str
    address: str
    max_body_size: int
    max_attempts: int


def offer(outbox: asyncio.Queue[Any], command: s.TelemetryCommand) -> None:
    with contextlib.suppress(asyncio.QueueFull):
        outbox.put_nowait(command)


def metadata_of(context: Context) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in context.invocation_metadata() or ():
        out[k] = v if isinstance(v, str) else v.decode(errors="replace")
    return out


def duration_ms(dur: Duration) -> int:
    return dur.seconds * 1000 + dur.nanos // 1_000_000


def now_timestamp() -> Timestamp:
    t = Timestamp()
    t.FromMilliseconds(int(time.time() * 1000))
    return t


def _check_namespace(resource: d.Resource, field: str) -> str:
    if resource.resource_namespace:
        raise V2Error(
            d.BAD_REQUEST,
            f"{field}.resource_namespace {resource.resource_namespace!r}: namespaces are not "
            "supported by Apogee; leave it empty",
        )
    return resource.name


def topic_of(resource: d.Resource, field: str = "topic") -> str:
    name = _check_namespace(resource, field)
    validate_topic(name)
    if is_system_topic(name):  # upstream's proxy refuses them the same way
        raise V2Error(
            d.ILLEGAL_TOPIC,
            f"{field} {name!r}: is a system topic of the brokers; clients cannot use it",
        )
    return name


def group_of(resource: d.Resource, field: str = "group") -> str:
    name = _check_namespace(resource, field)
    try:
        return validate_group(name, field)
    except InvalidArgumentError as exc:
        raise V2Error(d.ILLEGAL_CONSUMER_GROUP, str(exc)) from None


def selection_of(expr: d.FilterExpression) -> Selection:
    if expr.type == d.SQL:
        return parse_selection("", expr.expression or "TRUE", "filter_expression.")
    text = expr.expression.strip()
    return parse_selection("" if text in ("", "*") else text, "", "filter_expression.")


class _Answer(Protocol):
    @property
    def status(self) -> d.Status: ...


Req = TypeVar("Req")
Resp = TypeVar("Resp", bound=_Answer)
Part = TypeVar("Part", bound="ServicerBase")


def measured(
    fn: Callable[[Part, Req, Context], Awaitable[Resp]],
) -> Callable[[Part, Req, Context], Awaitable[Resp]]:
    """Count a unary RPC's answers by code, and time them."""
    rpc = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self: Part, request: Req, context: Context) -> Resp:
        started = time.perf_counter()
        answer = await fn(self, request, context)
        self.metrics.v2_request(rpc, d.Code.Name(answer.status.code), time.perf_counter() - started)
        return answer

    return wrapper


def route_topic(resource: d.Resource) -> str:
    """The topic a QueryRoute names, once the caller may send to it or receive from it (a
    route serves both alike)."""
    require_signed()
    name = topic_of(resource)
    if not may_topic(name, "PUB"):
        require_topic(name, "SUB")
    return name


class PeerChannels:
    """Channels to other brokers, one per address, made on first use; :meth:`close` closes
    them all."""

    def __init__(self, security: ClientSecurity) -> None:
        self._security = security
        self._channels: dict[str, grpc.aio.Channel] = {}

    def owner(
        self, route: nameserver_pb2.GetRouteResponse, topic: str, broker: str
    ) -> grpc.aio.Channel:
        """A channel to ``broker``, found in ``topic``'s ``route`` (for what another broker
        owns)."""
        address = next((b.address for b in route.brokers if b.broker_name == broker), "")
        if not address:
            raise V2Error(
                d.NOT_FOUND,
                f"broker {broker} holds it, but is not in the route of topic {topic!r} now "
                "(down, or the topic was deleted there)",
            )
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self._security.channel(address, CLIENT_OPTIONS)
        return ch

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


class ServicerBase(sg.MessagingServiceServicer):
    """What the parts of the v2 service share: the broker's core, the clients, the channels to
    the other brokers, and the checks of every request (signature, client id, route)."""

    def __init__(
        self,
        config: V2Config,
        topics: TopicManager,
        sending: SendService,
        pop: PopService,
        halves: HalfIntake,
        ends: TransactionEnds,
        producers: ProducerRegistry,
        route_of: RouteOf,
        clients: OfficialClients,
        renewals: Renewals,
        schedule: ScheduleService,
        peers: ClientSecurity,
        check_receive: Callable[[str], None],
        metrics: BrokerMetrics,
    ) -> None:
        self.config = config
        self.topics = topics
        self.sending = sending
        self.pop = pop
        self.halves = halves
        self.ends = ends
        self.producers = producers
        self.route_of = route_of
        self.clients = clients
        self.renewals = renewals
        self.schedule = schedule
        #: refuses a group that Apogee SDK members consume by queue offsets
        self.check_receive = check_receive
        self.metrics = metrics
        self._peers = PeerChannels(peers)
        self._turns = itertools.count()
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()

    def stop(self) -> None:
        """The broker stops: end the Telemetry streams and held receives."""
        self._stopping = True
        self.clients.end_streams()
        self.pop.stop()

    async def close(self) -> None:
        """Close the channels to the other brokers."""
        await self._peers.close()

    async def _owner(self, topic: str, broker: str) -> grpc.aio.Channel:
        """A channel to ``broker``, found in ``topic``'s route (for what another broker owns)."""
        return self._peers.owner(await self._route(topic), topic, broker)

    def _alive(self, client: OfficialClient) -> None:
        """The client was heard of: it and its producer sessions live on."""
        client.last_seen = self.clients.clock.monotonic()
        for session in client.sessions:
            self.producers.heartbeat(session)

    def _client(self, context: Context) -> OfficialClient:
        require_signed()  # an unsigned or badly signed call: UNAUTHORIZED
        md = metadata_of(context)
        cid = md.get("x-mq-client-id", "")
        if not cid:
            raise V2Error(d.CLIENT_ID_REQUIRED, "the x-mq-client-id header is required")
        c = self.clients.seen(cid, peer_host(context.peer()))
        if md.get("x-mq-language"):
            c.language = md["x-mq-language"]
        if md.get("x-mq-client-version"):
            c.version = md["x-mq-client-version"]
        return c

    def _subscriber(
        self,
        context: Context,
        group: d.Resource,
        topic: d.Resource,
        topic_field: str = "topic",
    ) -> tuple[OfficialClient, str, str]:
        """The client, group and topic of a consuming request, each checked (names, and the
        caller's right to the group and to read the topic)."""
        client = self._client(context)
        group_name = group_of(group)
        name = topic_of(topic, topic_field)
        require_group(group_name)
        require_topic(name, "SUB")
        return client, group_name, name

    # -- routes -------------------------------------------------------------------------------

    async def _route(self, topic: str) -> nameserver_pb2.GetRouteResponse:
        try:
            return await self.route_of(topic, ROUTE_TIMEOUT_S)
        except RuntimeError:  # the lookup's "no nameserver is configured": a broker on its own
            return self._own_route(topic)

    def _own_route(self, topic: str) -> nameserver_pb2.GetRouteResponse:
        """The route of a broker that registers with no nameserver: it is the whole cluster."""
        config = self.topics.get(topic)
        name = self.config.broker_name
        if config is None:
            raise UnknownTopicError(
                topic=topic, detail=f"does not exist on broker {name} (it has no nameserver)"
            )
        return nameserver_pb2.GetRouteResponse(
            topic=topic,
            queues=[
                nameserver_pb2.QueueData(
                    broker_name=name,
                    read_queues=config.read_queues,
                    write_queues=config.write_queues,
                    perm=int(config.perm),
                    message_type=config.message_type.value,
                )
            ],
            brokers=[nameserver_pb2.BrokerData(broker_name=name, address=self.config.address)],
        )


def enum_name(enum: Any, number: int) -> str:
    """The name of ``number`` in ``enum``, or the number (an open enum takes any)."""
    try:
        return str(enum.Name(number))
    except ValueError:
        return str(number)


_PULL_REFUSED: Final = (
    "{rpc}: consuming by queue offset is not served over apache.rocketmq.v2; use a "
    "SimpleConsumer or PushConsumer (POP), or Apogee's SDK for offsets"
)


def not_implemented(rpc: str) -> d.Status:
    return d.Status(code=d.NOT_IMPLEMENTED, message=_PULL_REFUSED.format(rpc=rpc))


def transaction_id_parts(text: str) -> tuple[str, int, str]:
    """``broker|half offset|unique id``, as SendMessage gave it."""
    try:
        broker, offset, uid = text.split("|", 2)
        if not broker or not uid or not 0 <= int(offset) < 2**63:
            raise ValueError(text)
        return broker, int(offset), uid
    except ValueError:
        raise V2Error(
            d.INVALID_TRANSACTION_ID,
            f"transaction_id {text[:80]!r}: not a transaction id this cluster gave",
        ) from None
