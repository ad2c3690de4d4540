"""Routes and clients over v2: QueryRoute and QueryAssignment (the whole cluster's, from any
broker), Heartbeat, NotifyClientTermination, and the Telemetry stream each client keeps open
(Settings answered, transaction checks sent)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, Final

from google.protobuf.duration_pb2 import Duration

from apogee.common.errors import ApogeeError
from apogee.common.topics import MessageType
from apogee.rocketmq.v2 import definition_pb2 as d
from apogee.rocketmq.v2 import service_pb2 as s
from apogee.service.rights import (
    require_group,
    require_topic,
)
from apogee.v1 import nameserver_pb2
from apogee_broker.core.clients.official import OfficialClient
from apogee_broker.core.clients.producers import Hello
from apogee_broker.servicers.v2.base import (
    MAX_POLL_S,
    MIN_POLL_S,
    RETRY_BACKOFF_S,
    Context,
    ServicerBase,
    duration_ms,
    enum_name,
    group_of,
    measured,
    metadata_of,
    offer,
    route_topic,
    topic_of,
)
from apogee_broker.servicers.v2.convert import (
    accepted_types,
    endpoints_of,
    to_wire,
)
from apogee_broker.servicers.v2.status import V2Error, ok, status_of

log = logging.getLogger(__name__)

#: The first Settings answer of a Telemetry stream is said again this much later.
SETTINGS_REPEAT_S: Final = 1.0


class ClientsPart(ServicerBase):
    """QueryRoute, QueryAssignment, Heartbeat, NotifyClientTermination, Telemetry."""

    @measured
    async def QueryRoute(
        self, request: s.QueryRouteRequest, context: Context
    ) -> s.QueryRouteResponse:
        try:
            name = route_topic(request.topic)
            route = await self._route(name)
            queues = route_queues(request.topic, route)
            return s.QueryRouteResponse(status=ok(), message_queues=queues)
        except (ApogeeError, V2Error) as exc:
            return s.QueryRouteResponse(status=status_of(exc))

    @measured
    async def QueryAssignment(
        self, request: s.QueryAssignmentRequest, context: Context
    ) -> s.QueryAssignmentResponse:
        try:
            self._client(context)
            name = topic_of(request.topic)
            require_group(group_of(request.group))
            require_topic(name, "SUB")
            route = await self._route(name)
            addresses = {b.broker_name: b.address for b in route.brokers}
            out = []
            for qd in route.queues:
                address = addresses.get(qd.broker_name)
                if not address or not qd.perm & 4 or qd.read_queues == 0:
                    continue
                broker = d.Broker(name=qd.broker_name, id=0, endpoints=endpoints_of(address))
                out.append(
                    d.Assignment(
                        message_queue=d.MessageQueue(
                            topic=request.topic,
                            id=-1,
                            permission=d.READ,
                            broker=broker,
                            accept_message_types=accepted_types(qd.message_type),  # type: ignore[arg-type]
                        )
                    )
                )
            return s.QueryAssignmentResponse(status=ok(), assignments=out)
        except (ApogeeError, V2Error) as exc:
            return s.QueryAssignmentResponse(status=status_of(exc))

    # -- clients ------------------------------------------------------------------------------

    @measured
    async def Heartbeat(self, request: s.HeartbeatRequest, context: Context) -> s.HeartbeatResponse:
        try:
            c = self._client(context)
            self._alive(c)
            if request.HasField("group") and request.group.name:
                c.group = group_of(request.group)
                require_group(c.group)
            return s.HeartbeatResponse(status=ok())
        except (ApogeeError, V2Error) as exc:
            return s.HeartbeatResponse(status=status_of(exc))

    @measured
    async def NotifyClientTermination(
        self, request: s.NotifyClientTerminationRequest, context: Context
    ) -> s.NotifyClientTerminationResponse:
        try:
            cid = metadata_of(context).get("x-mq-client-id", "")
            c = self.clients.forget(cid)
            if c is not None:
                log.info("client %s (%.40r %.40r) left", cid, c.language, c.version)
            return s.NotifyClientTerminationResponse(status=ok())
        except (ApogeeError, V2Error) as exc:
            return s.NotifyClientTerminationResponse(status=status_of(exc))

    async def Telemetry(
        self, request_iterator: AsyncIterator[s.TelemetryCommand], context: Context
    ) -> AsyncIterator[s.TelemetryCommand]:
        try:
            client = self._client(context)
        except V2Error as exc:
            yield s.TelemetryCommand(status=status_of(exc))
            return
        client.streams += 1
        sessions = client.sessions
        reader = asyncio.create_task(self._read_telemetry(request_iterator, client, sessions))
        get: asyncio.Future[Any] | None = None
        try:
            while not self._stopping:
                get = asyncio.ensure_future(client.outbox.get())
                done, _ = await asyncio.wait({get, reader}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:  # the client wrote its last: it still gets what is queued
                    get.cancel()
                    while not client.outbox.empty() and (left := client.outbox.get_nowait()):
                        yield left
                    break
                command = get.result()
                if command is None:
                    break
                yield command
        finally:
            if get is not None:  # a stream that ended waiting takes nothing from the next one
                get.cancel()
            client.streams -= 1
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            if client.streams == 0:
                for session in sessions:
                    self.producers.close(session)
                sessions.clear()

    async def _read_telemetry(
        self,
        request_iterator: AsyncIterator[s.TelemetryCommand],
        client: OfficialClient,
        sessions: list[Any],
    ) -> None:
        first = True
        repeat: asyncio.TimerHandle | None = None
        try:
            async for command in request_iterator:
                self._alive(client)
                if not command.HasField("settings"):
                    continue  # thread stack traces, verify results: nothing Apogee asks for
                try:
                    reply = self._settings(command.settings, client, sessions)
                    answer = s.TelemetryCommand(status=ok(), settings=reply)
                except (ApogeeError, V2Error) as exc:
                    answer = s.TelemetryCommand(status=status_of(exc), settings=command.settings)
                except Exception as exc:  # a bug: answered and logged, the stream lives on
                    log.exception("Settings of client %s not taken", client.client_id)
                    answer = s.TelemetryCommand(status=status_of(exc), settings=command.settings)
                await client.outbox.put(answer)
                if first:
                    # Said once more a second later: a client that starts waiting for its first
                    # answer only after its route lookups (the Node.js client 1.0.8) misses an
                    # answer that came sooner, and would wait for its next sync (5 minutes).
                    first = False
                    repeat = asyncio.get_running_loop().call_later(
                        SETTINGS_REPEAT_S, offer, client.outbox, answer
                    )
        finally:
            if repeat is not None:
                repeat.cancel()

    def _settings(
        self, settings: d.Settings, client: OfficialClient, sessions: list[Any]
    ) -> d.Settings:
        reply = d.Settings()
        reply.CopyFrom(settings)
        client.client_type = enum_name(d.ClientType, settings.client_type)
        if settings.HasField("user_agent"):
            client.language = enum_name(d.Language, settings.user_agent.language)
            client.version = settings.user_agent.version
        reply.metric.CopyFrom(d.Metric(on=False))
        if settings.HasField("publishing"):
            topics = tuple(
                topic_of(t, "settings.publishing.topics") for t in settings.publishing.topics
            )
            for topic in topics:
                require_topic(topic, "PUB")
            client.topics = topics
            reply.publishing.max_body_size = self.config.max_body_size
            reply.publishing.validate_message_type = True
            reply.backoff_policy.CopyFrom(
                d.RetryPolicy(
                    max_attempts=3,
                    exponential_backoff=d.ExponentialBackoff(
                        initial=Duration(nanos=10_000_000), max=Duration(seconds=1), multiplier=2
                    ),
                )
            )
            self._register_producer(client, topics, sessions)
        elif settings.HasField("subscription"):
            sub = settings.subscription
            group = group_of(sub.group, "settings.subscription.group")
            require_group(group)
            client.group = group
            names = []
            fifo = False
            for i, entry in enumerate(sub.subscriptions):
                name = topic_of(entry.topic, f"settings.subscription.subscriptions[{i}].topic")
                require_topic(name, "SUB")
                names.append(name)
                config = self.topics.get(name)
                if config is not None:
                    fifo = fifo or config.message_type is MessageType.FIFO
                    self.pop.touch(group, name)  # first contact decides where it starts
            client.topics = tuple(names)
            reply.subscription.fifo = fifo
            reply.subscription.receive_batch_size = 32
            wish = (
                duration_ms(sub.long_polling_timeout) / 1000
                if sub.HasField("long_polling_timeout")
                else MAX_POLL_S
            )
            poll = min(max(wish, MIN_POLL_S), MAX_POLL_S)
            reply.subscription.long_polling_timeout.CopyFrom(Duration(seconds=int(poll)))
            reply.backoff_policy.CopyFrom(
                d.RetryPolicy(
                    max_attempts=self.config.max_attempts,
                    customized_backoff=d.CustomizedBackoff(
                        next=[Duration(seconds=x) for x in RETRY_BACKOFF_S]
                    ),
                )
            )
        return reply

    def _register_producer(
        self, client: OfficialClient, topics: tuple[str, ...], sessions: list[Any]
    ) -> None:
        """A producer of ``topics`` is asked about their transactions (its producer group is
        the topic's name, as RocketMQ 5's proxy has it)."""
        have = {getattr(x, "group", None) for x in sessions}
        for topic in topics:
            if topic in have:
                continue
            session = self.producers.open(client.host)
            self.producers.hello(session, Hello(topic, client.client_id))
            sessions.append(session)
            task = asyncio.create_task(self._forward_checks(client, session))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _forward_checks(self, client: OfficialClient, session: Any) -> None:
        async for event in session.events():
            try:
                message = to_wire(event.half, topic=event.topic)
                message.system_properties.message_type = d.TRANSACTION
                tid = f"{self.config.broker_name}|{event.half_offset}|{event.unique_id}"
                await client.outbox.put(
                    s.TelemetryCommand(
                        status=ok(),
                        recover_orphaned_transaction_command=s.RecoverOrphanedTransactionCommand(
                            message=message, transaction_id=tid
                        ),
                    )
                )
            except Exception:
                log.exception("transaction check for client %s not sent", client.client_id)


def route_queues(topic: d.Resource, route: nameserver_pb2.GetRouteResponse) -> list[d.MessageQueue]:
    """A topic's route as v2 message queues: each queue of each live broker, with the
    broker's endpoints, its permission and the message types the topic accepts."""
    queues: list[d.MessageQueue] = []
    addresses = {b.broker_name: b.address for b in route.brokers}
    for qd in route.queues:
        address = addresses.get(qd.broker_name)
        if not address:
            continue
        broker = d.Broker(name=qd.broker_name, id=0, endpoints=endpoints_of(address))
        types = accepted_types(qd.message_type)
        for q in range(max(qd.read_queues, qd.write_queues)):
            readable = q < qd.read_queues and qd.perm & 4
            writable = q < qd.write_queues and qd.perm & 2
            perm = (
                d.READ_WRITE
                if readable and writable
                else d.READ
                if readable
                else d.WRITE
                if writable
                else d.NONE
            )
            queues.append(
                d.MessageQueue(
                    topic=topic,
                    id=q,
                    permission=perm,
                    broker=broker,
                    accept_message_types=types,  # type: ignore[arg-type]
                )
            )
    return queues
