"""The ``apogee.v1.NameServer`` RPCs: requests become registry calls, results become responses.

Errors raised by the registry become gRPC statuses in :func:`apogee.rpc.errors.rpc_errors`.
"""

from __future__ import annotations

from typing import Any

import grpc.aio

from apogee.common.errors import ApogeeError, InvalidArgumentError, UnknownTopicError
from apogee.common.topics import TopicConfig
from apogee.rpc.errors import rpc_errors
from apogee.v1 import nameserver_pb2 as pb
from apogee.v1 import nameserver_pb2_grpc
from apogee_nameserver.core.registry import RouteRegistry
from apogee_nameserver.metrics import NameServerMetrics

Context = grpc.aio.ServicerContext[Any, Any]


class NameServerServicer(nameserver_pb2_grpc.NameServerServicer):
    def __init__(self, registry: RouteRegistry, metrics: NameServerMetrics | None = None) -> None:
        self._registry = registry
        self._metrics = metrics if metrics is not None else NameServerMetrics()
        queries = self._metrics.route_queries
        self._found = queries.labels("found")
        self._auto_create = queries.labels("auto_create")
        self._unknown = queries.labels("unknown")
        self._bad = queries.labels("error")
        registrations = self._metrics.registrations
        self._full = registrations.labels("full")
        self._short = registrations.labels("short")

    @rpc_errors
    async def RegisterBroker(
        self, request: pb.RegisterBrokerRequest, context: Context
    ) -> pb.RegisterBrokerResponse:
        if request.topics_unchanged:
            if request.topics:
                raise InvalidArgumentError(
                    field="topics", rule="must be empty when topics_unchanged is set"
                )
            kept = self._registry.refresh_broker(
                cluster=request.cluster,
                broker_name=request.broker_name,
                address=request.address,
                topics_version=request.topics_version,
                auto_create_topics=request.auto_create_topics,
                epoch=request.epoch,
            )
            if kept:
                self._short.inc()
            return pb.RegisterBrokerResponse(
                expiry_ms=self._registry.expiry_ms,
                knows_topics_unchanged=True,
                topics_needed=not kept,
            )
        self._registry.register_broker(
            cluster=request.cluster,
            broker_name=request.broker_name,
            address=request.address,
            topics=[TopicConfig.from_pb(t) for t in request.topics],
            auto_create_topics=request.auto_create_topics,
            heartbeat_interval_ms=request.heartbeat_interval_ms,
            epoch=request.epoch,
            topics_version=request.topics_version,
        )
        self._full.inc()
        return pb.RegisterBrokerResponse(
            expiry_ms=self._registry.expiry_ms, knows_topics_unchanged=True
        )

    @rpc_errors
    async def UnregisterBroker(
        self, request: pb.UnregisterBrokerRequest, context: Context
    ) -> pb.UnregisterBrokerResponse:
        self._registry.unregister_broker(
            request.cluster, request.broker_name, request.address, request.epoch
        )
        return pb.UnregisterBrokerResponse()

    @rpc_errors
    async def GetRoute(self, request: pb.GetRouteRequest, context: Context) -> pb.GetRouteResponse:
        try:
            route = self._registry.route(request.topic)
        except UnknownTopicError:
            self._unknown.inc()
            raise
        except ApogeeError:
            self._bad.inc()
            raise
        (self._auto_create if route.auto_create else self._found).inc()
        return pb.GetRouteResponse(
            topic=route.topic,
            queues=[
                pb.QueueData(
                    broker_name=q.broker_name,
                    read_queues=q.read_queues,
                    write_queues=q.write_queues,
                    perm=q.perm,
                    message_type=q.message_type,
                )
                for q in route.queues
            ],
            brokers=[
                pb.BrokerData(cluster=b.cluster, broker_name=b.broker_name, address=b.address)
                for b in route.brokers
            ],
        )

    @rpc_errors
    async def GetClusterInfo(
        self, request: pb.GetClusterInfoRequest, context: Context
    ) -> pb.GetClusterInfoResponse:
        return pb.GetClusterInfoResponse(
            brokers=[
                pb.BrokerInfo(
                    cluster=b.cluster,
                    broker_name=b.broker_name,
                    address=b.address,
                    last_heartbeat_ms=b.last_heartbeat_ms,
                    topic_count=b.topic_count,
                    auto_create_topics=b.auto_create_topics,
                    epoch=b.epoch,
                    topics_version=b.topics_version,
                )
                for b in self._registry.cluster_info()
            ]
        )

    @rpc_errors
    async def ListTopics(
        self, request: pb.ListTopicsRequest, context: Context
    ) -> pb.ListTopicsResponse:
        return pb.ListTopicsResponse(topics=self._registry.list_topics())
