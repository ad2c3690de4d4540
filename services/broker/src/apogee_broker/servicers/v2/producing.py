"""Sending over v2: SendMessage (normal, FIFO, delay and transactional messages), EndTransaction
(forwarded to the broker that holds the half), RecallMessage (forwarded to the broker that holds
the delay message)."""

from __future__ import annotations

import logging
import zlib

from apogee.common.errors import ApogeeError, InvalidArgumentError
from apogee.common.topics import MessageType
from apogee.rocketmq.v2 import definition_pb2 as d
from apogee.rocketmq.v2 import service_pb2 as s
from apogee.rpc.errors import call
from apogee.service.rights import (
    require_signed,
    require_topic,
)
from apogee.v1 import (
    schedule_pb2,
    schedule_pb2_grpc,
    transaction_pb2,
    transaction_pb2_grpc,
)
from apogee_broker.core.clients.official import OfficialClient
from apogee_broker.core.pop.handles import decode_handle_text, encode_handle_text
from apogee_broker.core.send.dedup import DEDUP_PROPERTY
from apogee_broker.core.send.service import Outgoing
from apogee_broker.core.txn.ends import End, EndSource
from apogee_broker.core.txn.records import Decision
from apogee_broker.servicers.v2.base import (
    ROUTE_TIMEOUT_S,
    Context,
    ServicerBase,
    measured,
    topic_of,
    transaction_id_parts,
)
from apogee_broker.servicers.v2.convert import (
    from_wire,
)
from apogee_broker.servicers.v2.status import V2Error, ok, status_of

log = logging.getLogger(__name__)


class ProducingPart(ServicerBase):
    """SendMessage, EndTransaction, RecallMessage."""

    # -- sending ------------------------------------------------------------------------------

    @measured
    async def SendMessage(
        self, request: s.SendMessageRequest, context: Context
    ) -> s.SendMessageResponse:
        entries: list[s.SendResultEntry] = []
        first_error: d.Status | None = None
        try:
            client = self._client(context)
            if not request.messages:
                raise V2Error(d.BAD_REQUEST, "messages: at least one message is required")
            for m in request.messages:
                try:
                    entries.append(await self._send_one(m, client))
                except (ApogeeError, V2Error) as exc:
                    st = status_of(exc)
                    first_error = first_error or st
                    entries.append(
                        s.SendResultEntry(status=st, message_id=m.system_properties.message_id)
                    )
        except (ApogeeError, V2Error) as exc:
            return s.SendMessageResponse(status=status_of(exc))
        return s.SendMessageResponse(status=first_error or ok(), entries=entries)

    async def _send_one(self, m: d.Message, client: OfficialClient) -> s.SendResultEntry:
        name = topic_of(m.topic, "message.topic")
        require_topic(name, "PUB")  # before anything, a duplicate's answer included
        incoming = from_wire(m, self.config.max_body_size)
        config = self.topics.get_or_create(name)
        self.sending.checks.check_type("message", config, incoming.kind, incoming.why)
        msg = incoming.message
        if incoming.kind is MessageType.FIFO:
            msg.queue_id = zlib.crc32(incoming.message_group.encode()) % config.write_queues
        else:
            msg.queue_id = next(self._turns) % config.write_queues
        host = client.host
        if incoming.kind is MessageType.TRANSACTION:
            half = await self.halves.send_half(name, msg, host=host)
            tid = f"{self.config.broker_name}|{half.half_offset}|{half.unique_id}"
            return s.SendResultEntry(
                status=ok(),
                message_id=half.unique_id,
                transaction_id=tid,
                offset=half.half_offset,
            )
        dedup = self.sending.dedup
        uid = msg.unique_id or ""
        if dedup is not None:  # a client's retry of a send that was stored: not again
            first = dedup.claim(name, uid)
            if first is not None:
                return s.SendResultEntry(status=ok(), message_id=uid, offset=max(first, 0))
            msg.properties = {**(msg.properties or {}), DEDUP_PROPERTY: uid}
        try:
            outcomes = await self.sending.send([Outgoing(msg, 0, incoming.deliver_at_ms)], host)
        except BaseException:
            if dedup is not None:
                dedup.release(name, uid)
            raise
        o = outcomes[0]
        if dedup is not None:
            if o.result is not None:
                dedup.stored(name, uid, o.result.queue_offset)
            else:
                dedup.release(name, uid)
        if o.error is not None:
            raise o.error
        assert o.result is not None
        recall = ""
        if o.scheduled_for:  # a delay message: it can be recalled until it is due
            recall = encode_handle_text(
                self.config.broker_name, str(o.scheduled_for), o.unique_id, name
            )
        return s.SendResultEntry(
            status=ok(),
            message_id=o.unique_id,
            offset=o.result.queue_offset,
            recall_handle=recall,
        )

    # -- transactions -------------------------------------------------------------------------

    @measured
    async def EndTransaction(
        self, request: s.EndTransactionRequest, context: Context
    ) -> s.EndTransactionResponse:
        try:
            client = self._client(context)
            name = topic_of(request.topic)
            require_topic(name, "PUB")
            broker, offset, uid = transaction_id_parts(request.transaction_id)
            decision = {
                d.COMMIT: Decision.COMMIT,
                d.ROLLBACK: Decision.ROLLBACK,
            }.get(request.resolution, Decision.UNKNOWN)
            source = (
                EndSource.CHECK if request.source == d.SOURCE_SERVER_CHECK else EndSource.PRODUCER
            )
            if broker == self.config.broker_name:
                try:
                    await self.ends.end(End(name, uid, offset, decision, source, client.client_id))
                except InvalidArgumentError as exc:  # in v2's terms: the id, or the topic
                    field = exc.details.get("field")
                    if field == "producer_group":
                        raise V2Error(d.BAD_REQUEST, f"topic {name!r}: {exc}") from None
                    if field not in ("unique_id", "half_offset"):
                        raise
                    raise V2Error(
                        d.INVALID_TRANSACTION_ID,
                        f"transaction_id {request.transaction_id[:80]!r}: {exc}",
                    ) from None
            else:  # a check this broker relayed, of a half another broker holds
                stub = transaction_pb2_grpc.TransactionStub(await self._owner(name, broker))
                tx = transaction_pb2
                await call(
                    f"broker {broker}",
                    stub.EndTransaction(
                        tx.EndTransactionRequest(
                            producer_group=name,
                            unique_id=uid,
                            half_offset=offset,
                            decision={
                                Decision.COMMIT: tx.COMMIT,
                                Decision.ROLLBACK: tx.ROLLBACK,
                            }.get(decision, tx.UNKNOWN),
                            source=tx.CHECK if source is EndSource.CHECK else tx.PRODUCER,
                            client_id=client.client_id,
                        ),
                        timeout=ROUTE_TIMEOUT_S,
                    ),
                )
            return s.EndTransactionResponse(status=ok())
        except (ApogeeError, V2Error) as exc:
            return s.EndTransactionResponse(status=status_of(exc))

    # -- recall ---------------------------------------------------------------------------------

    @measured
    async def RecallMessage(
        self, request: s.RecallMessageRequest, context: Context
    ) -> s.RecallMessageResponse:
        try:
            name, broker, uid, due_ms = recall_target(request)
            if broker == self.config.broker_name:
                await self.schedule.recall(name, uid, due_ms)
            else:
                stub = schedule_pb2_grpc.ScheduleStub(await self._owner(name, broker))
                await call(
                    f"broker {broker}",
                    stub.Recall(
                        schedule_pb2.RecallRequest(topic=name, unique_id=uid, deliver_at_ms=due_ms),
                        timeout=ROUTE_TIMEOUT_S,
                    ),
                )
            return s.RecallMessageResponse(status=ok(), message_id=uid)
        except (ApogeeError, V2Error) as exc:
            return s.RecallMessageResponse(status=status_of(exc))


def recall_target(request: s.RecallMessageRequest) -> tuple[str, str, str, int]:
    """The topic, the broker, the message id and the due time a recall names, once the caller
    may publish to the topic and the handle is one this cluster gave."""
    require_signed()
    name = topic_of(request.topic)
    require_topic(name, "PUB")
    try:
        broker, due, uid, topic = decode_handle_text(request.recall_handle, 4)
        due_ms = int(due)
        if not 0 <= due_ms < 2**63:
            raise ValueError(due)
    except ValueError:
        raise V2Error(
            d.BAD_REQUEST,
            "recall_handle: not a recall handle this cluster gave (SendMessage gives one "
            "for a message with a delivery time)",
        ) from None
    if topic != name:
        raise V2Error(
            d.BAD_REQUEST,
            f"recall_handle: is of a message of topic {topic!r}, not {name!r}",
        )
    return name, broker, uid, due_ms
