"""``apogee.v1.Broker``: SendMessages, GetMessage, QueryMessages."""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

import grpc.aio

from apogee.rpc.errors import OK, rpc_errors, to_status
from apogee.store import Message, StoredMessage
from apogee.store.records import PROP_KEYS, PROP_TAGS, PROP_UNIQ_KEY
from apogee.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from apogee_broker.core.lookup import MessageLookup
from apogee_broker.core.sending import Outgoing, SendService

Context = grpc.aio.ServicerContext[Any, Any]
_OWN_PROPERTIES = frozenset({PROP_TAGS, PROP_KEYS, PROP_UNIQ_KEY})


class BrokerServicer(broker_pb2_grpc.BrokerServicer):
    def __init__(self, sending: SendService, lookup: MessageLookup, broker_name: str) -> None:
        self.sending = sending
        self.lookup = lookup
        self.broker_name = broker_name

    @rpc_errors
    async def SendMessages(
        self, request: broker_pb2.SendMessagesRequest, context: Context
    ) -> broker_pb2.SendMessagesResponse:
        items = [
            Outgoing(
                Message(
                    topic=m.topic,
                    body=m.body,
                    queue_id=m.queue_id,
                    tags=m.tags or None,
                    keys=tuple(m.keys),
                    properties=dict(m.properties) if m.properties else None,
                    unique_id=m.unique_id or None,
                    flag=m.flag,
                    sys_flag=m.sys_flag,
                    born_timestamp=m.born_timestamp_ms,
                    born_host=m.born_host,
                ),
                m.delay_level,
            )
            for m in request.messages
        ]
        outcomes = await self.sending.send(items, peer_host(context.peer()))
        results = []
        for o in outcomes:
            r = o.result
            results.append(
                broker_pb2.SendResult(
                    status=OK if o.error is None else to_status(o.error),
                    unique_id=o.unique_id,
                    topic=o.topic,
                    queue_id=o.queue_id,
                    queue_offset=r.queue_offset if r is not None else 0,
                    phys_offset=r.phys_offset if r is not None else 0,
                    store_timestamp_ms=r.store_timestamp if r is not None else 0,
                )
            )
        return broker_pb2.SendMessagesResponse(results=results, broker_name=self.broker_name)

    @rpc_errors
    async def GetMessage(
        self, request: broker_pb2.GetMessageRequest, context: Context
    ) -> broker_pb2.GetMessageResponse:
        msg = await self.lookup.by_unique_id(request.unique_id)
        return broker_pb2.GetMessageResponse(message=stored_to_pb(msg, self.broker_name))

    @rpc_errors
    async def QueryMessages(
        self, request: broker_pb2.QueryMessagesRequest, context: Context
    ) -> broker_pb2.QueryMessagesResponse:
        found = await self.lookup.by_key(
            request.topic, request.key, request.begin_ms, request.end_ms, request.max_messages
        )
        return broker_pb2.QueryMessagesResponse(
            messages=[stored_to_pb(m, self.broker_name) for m in found]
        )


def stored_to_pb(msg: StoredMessage, broker_name: str) -> common_pb2.StoredMessage:
    props = msg.properties
    return common_pb2.StoredMessage(
        topic=msg.topic,
        queue_id=msg.queue_id,
        queue_offset=msg.queue_offset,
        phys_offset=msg.phys_offset,
        body=msg.body,
        tags=props.get(PROP_TAGS, ""),
        keys=props[PROP_KEYS].split(" ") if props.get(PROP_KEYS) else [],
        properties={k: v for k, v in props.items() if k not in _OWN_PROPERTIES},
        unique_id=props.get(PROP_UNIQ_KEY, ""),
        born_timestamp_ms=msg.born_timestamp,
        store_timestamp_ms=msg.store_timestamp,
        born_host=msg.born_host,
        store_host=msg.store_host,
        flag=msg.flag,
        sys_flag=msg.sys_flag,
        reconsume_times=msg.reconsume_times,
        broker_name=broker_name,
    )


def peer_host(peer: str | None) -> str:
    """``ip:port`` of a gRPC peer (``ipv4:10.0.0.7:51234``, ``ipv6:[::1]:51234``); empty for
    other kinds (unix sockets)."""
    if not peer:
        return ""
    kind, _, rest = unquote(peer).partition(":")
    if kind == "ipv4":
        return rest
    if kind == "ipv6":
        return rest if rest.startswith("[") else ""
    return ""
