"""What a replica that does not lead answers of ``apache.rocketmq.v2``: the access point's part.

Official clients start from one address (the "endpoints" they are given) and send it only
QueryRoute and RecallMessage; everything else goes to the brokers the routes name, which are the
groups' leaders. A Kubernetes Service in front of every broker pod (the Helm chart's
``<fullname>-endpoint``) may land a client on a follower, so a follower answers those two as a
leader does: the route of the whole cluster from the nameservers, and a recall forwarded to the
leader of the broker the message waits on. Every other call is refused ``NOT_LEADER``
(:class:`apogee_broker.replication.servicer.NotLeaderHandler`).
"""

from __future__ import annotations

from typing import Any, Final

import grpc
import grpc.aio

from apogee.common.errors import ApogeeError
from apogee.rocketmq.v2 import service_pb2 as s
from apogee.rpc.errors import call
from apogee.rpc.security import ClientSecurity
from apogee.v1 import schedule_pb2, schedule_pb2_grpc
from apogee_broker.nameserver_link import RouteLookup
from apogee_broker.servicers.v2.base import ROUTE_TIMEOUT_S, Context, PeerChannels, route_topic
from apogee_broker.servicers.v2.clients_rpc import route_queues
from apogee_broker.servicers.v2.producing import recall_target
from apogee_broker.servicers.v2.status import V2Error, ok, status_of

SERVICE: Final = "apache.rocketmq.v2.MessagingService"


class AccessPoint:
    """QueryRoute and RecallMessage of the v2 service, from the nameservers alone."""

    def __init__(self, nameservers: list[str], security: ClientSecurity) -> None:
        self.routes = RouteLookup(nameservers, security)
        self._peers = PeerChannels(security)

    async def close(self) -> None:
        await self.routes.close()
        await self._peers.close()

    async def query_route(
        self, request: s.QueryRouteRequest, context: Context
    ) -> s.QueryRouteResponse:
        try:
            name = route_topic(request.topic)
            route = await self.routes.route(name, ROUTE_TIMEOUT_S)
            return s.QueryRouteResponse(
                status=ok(), message_queues=route_queues(request.topic, route)
            )
        except (ApogeeError, V2Error) as exc:
            return s.QueryRouteResponse(status=status_of(exc))

    async def recall(
        self, request: s.RecallMessageRequest, context: Context
    ) -> s.RecallMessageResponse:
        try:
            name, broker, uid, due_ms = recall_target(request)
            route = await self.routes.route(name, ROUTE_TIMEOUT_S)
            await call(
                f"broker {broker}",
                schedule_pb2_grpc.ScheduleStub(self._peers.owner(route, name, broker)).Recall(
                    schedule_pb2.RecallRequest(topic=name, unique_id=uid, deliver_at_ms=due_ms),
                    timeout=ROUTE_TIMEOUT_S,
                ),
            )
            return s.RecallMessageResponse(status=ok(), message_id=uid)
        except (ApogeeError, V2Error) as exc:
            return s.RecallMessageResponse(status=status_of(exc))


class AccessPointHandler(grpc.GenericRpcHandler):
    """Serves :class:`AccessPoint`'s two methods; any other method is left to the handlers
    after this one."""

    def __init__(self, access: AccessPoint) -> None:
        self._methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            f"/{SERVICE}/QueryRoute": grpc.unary_unary_rpc_method_handler(
                access.query_route,
                request_deserializer=s.QueryRouteRequest.FromString,
                response_serializer=s.QueryRouteResponse.SerializeToString,
            ),
            f"/{SERVICE}/RecallMessage": grpc.unary_unary_rpc_method_handler(
                access.recall,
                request_deserializer=s.RecallMessageRequest.FromString,
                response_serializer=s.RecallMessageResponse.SerializeToString,
            ),
        }

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        return self._methods.get(str(handler_call_details.method))
