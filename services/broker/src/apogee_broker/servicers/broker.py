"""``apogee.v1.Broker``: SendMessages (multiplexed on SendStream, which the SDK uses; the unary
call stays for callers of the raw protocol), GetMessage, QueryMessages.

A request carries protobuf messages (:meth:`SendService.send_messages`) or send records, which
are checked in place and appended as one block (:mod:`apogee_broker.core.send.record_intake`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import unquote

import grpc.aio

from apogee.codec import PROP_KEYS, PROP_TAGS, PROP_UNIQ_KEY
from apogee.common.errors import ApogeeError, InvalidArgumentError
from apogee.rpc.errors import OK, rpc_errors, to_status
from apogee.rpc.mux import MuxServer
from apogee.store import Message, StoredMessage
from apogee.v1 import broker_pb2, broker_pb2_grpc, common_pb2
from apogee_broker.core.send.record_intake import RecordIntake, RecordsOutcome
from apogee_broker.core.send.service import SendService
from apogee_broker.core.storage.lookup import MessageLookup
from apogee_broker.core.storage.writer import SendOutcome

Context = grpc.aio.ServicerContext[Any, Any]
_OWN_PROPERTIES = frozenset({PROP_TAGS, PROP_KEYS, PROP_UNIQ_KEY})


class BrokerServicer(broker_pb2_grpc.BrokerServicer):
    def __init__(
        self,
        sending: SendService,
        lookup: MessageLookup,
        broker_name: str,
        streams: MuxServer | None = None,
    ) -> None:
        self.sending = sending
        self.lookup = lookup
        self.broker_name = broker_name
        self.streams = streams if streams is not None else MuxServer(f"broker {broker_name}")
        self.records = RecordIntake(sending)

    @rpc_errors
    async def SendMessages(
        self, request: broker_pb2.SendMessagesRequest, context: Context
    ) -> broker_pb2.SendMessagesResponse:
        return await self._send(request, peer_host(context.peer()))

    async def SendStream(  # type: ignore[override]  # answers with context.write
        self, request_iterator: AsyncIterator[broker_pb2.SendStreamRequest], context: Context
    ) -> None:
        host = peer_host(context.peer())

        async def handle(
            request: broker_pb2.SendMessagesRequest, _timeout: float | None
        ) -> broker_pb2.SendMessagesResponse:
            return await self._send(request, host)

        await self.streams.serve(request_iterator, context, handle, _send_answer)

    async def _send(
        self, request: broker_pb2.SendMessagesRequest, host: str
    ) -> broker_pb2.SendMessagesResponse:
        metrics = self.sending.metrics
        began = time.perf_counter()
        try:
            return await self._send_request(request, host)
        except ApogeeError as err:
            metrics.send_failed((err.kind.name,))
            raise
        finally:
            metrics.send_latency.observe(time.perf_counter() - began)

    async def _send_request(
        self, request: broker_pb2.SendMessagesRequest, host: str
    ) -> broker_pb2.SendMessagesResponse:
        records = request.records
        if records:
            if len(request.messages):
                raise InvalidArgumentError(
                    field="records", rule="a request carries messages or records, not both"
                )
            return self._records_answer(await self.records.send(records, host))
        messages: list[Message] = []
        delays: list[int] = []
        deliver_at: list[int] = []
        for m in request.messages:
            keys = m.keys
            props = m.properties
            messages.append(
                Message(
                    m.topic,
                    m.body,
                    m.queue_id,
                    m.tags or None,
                    tuple(keys) if keys else (),
                    dict(props) if props else None,
                    m.unique_id or None,
                    m.flag,
                    m.sys_flag,
                    m.born_timestamp_ms,
                    m.born_host or host,
                )
            )
            delays.append(m.delay_level)
            deliver_at.append(m.deliver_at_ms)
        outcomes = await self.sending.send_messages(messages, delays, host, deliver_at)
        resp = broker_pb2.SendMessagesResponse(broker_name=self.broker_name)
        add = resp.results.add
        failed: list[str] = []
        for o in outcomes:
            _add_result(add, o)
            if o.error is not None:
                failed.append(o.error.kind.name)
        if failed:
            self.sending.metrics.send_failed(failed)
        return resp

    def _records_answer(self, out: RecordsOutcome) -> broker_pb2.SendMessagesResponse:
        """The packed answer to records: offsets for the plain ones, results for the others."""
        resp = broker_pb2.SendMessagesResponse(
            broker_name=self.broker_name,
            queue_offsets=out.packed_offsets(),
            store_timestamp_ms=out.store_timestamp,
        )
        add = resp.results.add
        failed: list[str] = []
        for i, o in sorted(out.others, key=_first):
            _add_result(add, o, i)
            if o.error is not None:
                failed.append(o.error.kind.name)
        if failed:
            self.sending.metrics.send_failed(failed)
        return resp

    @rpc_errors
    async def GetMessage(
        self, request: broker_pb2.GetMessageRequest, context: Context
    ) -> broker_pb2.GetMessageResponse:
        newest, *older = await self.lookup.all_by_unique_id(request.unique_id)
        return broker_pb2.GetMessageResponse(
            message=stored_to_pb(newest, self.broker_name),
            more=[stored_to_pb(m, self.broker_name) for m in older],
        )

    @rpc_errors
    async def QueryMessages(
        self, request: broker_pb2.QueryMessagesRequest, context: Context
    ) -> broker_pb2.QueryMessagesResponse:
        found, more = await self.lookup.query(
            request.topic, request.key, request.begin_ms, request.end_ms, request.max_messages
        )
        return broker_pb2.QueryMessagesResponse(
            messages=[stored_to_pb(m, self.broker_name) for m in found], more=more
        )


def _first(item: tuple[int, SendOutcome]) -> int:
    return item[0]


def _add_result(add: Any, o: SendOutcome, index: int = 0) -> None:
    """One ``SendResult`` of ``o`` (``index``: of a records answer)."""
    r = o.result
    if r is not None:  # stored; an error here says durability is unconfirmed
        add(
            status=None if o.error is None else to_status(o.error),  # None: OK, left out
            unique_id=o.unique_id,
            topic=o.topic,
            queue_id=o.queue_id,
            queue_offset=-1 if o.scheduled_for else r.queue_offset,
            phys_offset=r.phys_offset,
            store_timestamp_ms=r.store_timestamp,
            index=index,
        )
    else:
        add(
            status=OK if o.error is None else to_status(o.error),
            unique_id=o.unique_id,
            topic=o.topic,
            queue_id=o.queue_id,
            index=index,
        )


def _send_answer(
    request_id: int,
    response: broker_pb2.SendMessagesResponse | None,
    status: common_pb2.Status | None,
) -> broker_pb2.SendStreamResponse:
    return broker_pb2.SendStreamResponse(id=request_id, response=response, status=status)


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
