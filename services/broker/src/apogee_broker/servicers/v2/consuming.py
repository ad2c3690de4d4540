"""POP consumption over v2: ReceiveMessage, AckMessage, ChangeInvisibleDuration and
ForwardMessageToDeadLetterQueue over :mod:`apogee_broker.core.pop`; what is not served (pull by
offset, lite topics) refused with its code and a sentence."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator

from apogee.common.errors import ApogeeError, UnknownTopicError
from apogee.common.topics import MessageType
from apogee.rocketmq.v2 import definition_pb2 as d
from apogee.rocketmq.v2 import service_pb2 as s
from apogee_broker.core.pop.renewals import RENEW_INVISIBLE_MS
from apogee_broker.core.pop.service import Popped
from apogee_broker.servicers.v2.base import (
    DEADLINE_MARGIN_S,
    DEFAULT_INVISIBLE_MS,
    MAX_POLL_S,
    Context,
    ServicerBase,
    duration_ms,
    measured,
    not_implemented,
    now_timestamp,
    selection_of,
)
from apogee_broker.servicers.v2.convert import (
    check_invisible_ms,
    to_wire,
)
from apogee_broker.servicers.v2.status import V2Error, ok, status_of

log = logging.getLogger(__name__)


class ConsumingPart(ServicerBase):
    """ReceiveMessage, AckMessage, ChangeInvisibleDuration, ForwardMessageToDeadLetterQueue,
    and the RPCs Apogee refuses."""

    # -- consuming ------------------------------------------------------------------------------

    async def ReceiveMessage(
        self, request: s.ReceiveMessageRequest, context: Context
    ) -> AsyncIterator[s.ReceiveMessageResponse]:
        popped: list[Popped] = []
        topic_type = ""
        started = time.perf_counter()

        def answered(code: int) -> None:
            took = time.perf_counter() - started
            name = d.Code.Name(code)  # type: ignore[arg-type]
            self.metrics.v2_request("ReceiveMessage", name, took)

        try:
            client, group, name = self._subscriber(
                context, request.group, request.message_queue.topic, "message_queue.topic"
            )
            sel = selection_of(request.filter_expression)
            renew = request.auto_renew and not request.HasField("invisible_duration")
            if request.HasField("invisible_duration"):
                invisible = check_invisible_ms(
                    duration_ms(request.invisible_duration), "invisible_duration"
                )
            else:
                invisible = RENEW_INVISIBLE_MS if renew else DEFAULT_INVISIBLE_MS
            wish = (
                duration_ms(request.long_polling_timeout) / 1000
                if request.HasField("long_polling_timeout")
                else MAX_POLL_S
            )
            hold = min(max(wish, 0.0), MAX_POLL_S)
            remaining = context.time_remaining()
            if remaining is not None:
                hold = min(hold, remaining - DEADLINE_MARGIN_S)
            self.check_receive(group)
            config = self.topics.get(name)
            if config is None:
                raise UnknownTopicError(
                    topic=name, detail=f"does not exist on broker {self.config.broker_name}"
                )
            topic_type = config.message_type.value
            popped = await self.pop.receive(
                group,
                name,
                sel,
                request.batch_size or 32,
                invisible,
                orderly=config.message_type is MessageType.FIFO,
                hold_s=max(hold, 0.0),
                first_queue=request.message_queue.id,
            )
            if renew:
                for p in popped:
                    self.renewals.add(client.client_id, group, name, p.handle)
            self.metrics.pop(group, "received", len(popped))
            if popped:
                self.metrics.sent_out(name, len(popped), sum(p.message.size for p in popped))
        except (ApogeeError, V2Error) as exc:
            status = status_of(exc)
            answered(status.code)
            yield s.ReceiveMessageResponse(status=status)
            yield s.ReceiveMessageResponse(delivery_timestamp=now_timestamp())
            return
        if not popped:
            answered(d.MESSAGE_NOT_FOUND)
            yield s.ReceiveMessageResponse(
                status=d.Status(code=d.MESSAGE_NOT_FOUND, message="no new message")
            )
            yield s.ReceiveMessageResponse(delivery_timestamp=now_timestamp())
            return
        sent = False
        answered(d.OK)
        try:
            yield s.ReceiveMessageResponse(status=ok())
            for p in popped:
                yield s.ReceiveMessageResponse(
                    message=to_wire(
                        p.message,
                        topic=name,
                        handle=p.handle,
                        attempt=p.attempt,
                        invisible_ms=p.invisible_ms,
                        topic_type=topic_type,
                    )
                )
            yield s.ReceiveMessageResponse(delivery_timestamp=now_timestamp())
            sent = True
        finally:
            if not sent:  # the stream broke: what it carried comes back in a second
                for p in popped:
                    with contextlib.suppress(ApogeeError):
                        self.pop.change_invisible(group, name, p.handle, 1000)

    @measured
    async def AckMessage(
        self, request: s.AckMessageRequest, context: Context
    ) -> s.AckMessageResponse:
        try:
            _, group, name = self._subscriber(context, request.group, request.topic)
            results = []
            first_error: d.Status | None = None
            for i, e in enumerate(request.entries):
                try:
                    self.renewals.drop(e.receipt_handle)
                    self.pop.ack(group, name, e.receipt_handle, f"entries[{i}].receipt_handle")
                    self.metrics.pop(group, "acked")
                    st = ok()
                except (ApogeeError, V2Error) as exc:
                    st = status_of(exc)
                    first_error = first_error or st
                results.append(
                    s.AckMessageResultEntry(
                        message_id=e.message_id, receipt_handle=e.receipt_handle, status=st
                    )
                )
            if not request.entries:
                raise V2Error(d.BAD_REQUEST, "entries: at least one entry is required")
            return s.AckMessageResponse(status=first_error or ok(), entries=results)
        except (ApogeeError, V2Error) as exc:
            return s.AckMessageResponse(status=status_of(exc))

    @measured
    async def ChangeInvisibleDuration(
        self, request: s.ChangeInvisibleDurationRequest, context: Context
    ) -> s.ChangeInvisibleDurationResponse:
        try:
            _, group, name = self._subscriber(context, request.group, request.topic)
            ms = duration_ms(request.invisible_duration)
            if not 0 <= ms <= 12 * 3_600_000:
                raise V2Error(
                    d.ILLEGAL_INVISIBLE_TIME,
                    f"invisible_duration: must be between 0 and 12 h, got {ms / 1000:g} s",
                )
            self.renewals.drop(request.receipt_handle)
            handle = self.pop.change_invisible(group, name, request.receipt_handle, ms)
            self.metrics.pop(group, "nacked")
            return s.ChangeInvisibleDurationResponse(status=ok(), receipt_handle=handle)
        except (ApogeeError, V2Error) as exc:
            return s.ChangeInvisibleDurationResponse(
                status=status_of(exc), receipt_handle=request.receipt_handle
            )

    @measured
    async def ForwardMessageToDeadLetterQueue(
        self, request: s.ForwardMessageToDeadLetterQueueRequest, context: Context
    ) -> s.ForwardMessageToDeadLetterQueueResponse:
        try:
            _, group, name = self._subscriber(context, request.group, request.topic)
            self.renewals.drop(request.receipt_handle)
            await self.pop.forward_to_dlq(
                group,
                name,
                request.receipt_handle,
                request.delivery_attempt,
                f"the consumer gave up after {request.delivery_attempt} attempts",
            )
            return s.ForwardMessageToDeadLetterQueueResponse(status=ok())
        except (ApogeeError, V2Error) as exc:
            return s.ForwardMessageToDeadLetterQueueResponse(status=status_of(exc))

    # -- not served ---------------------------------------------------------------------------

    async def PullMessage(
        self, request: s.PullMessageRequest, context: Context
    ) -> AsyncIterator[s.PullMessageResponse]:
        yield s.PullMessageResponse(status=not_implemented("PullMessage"))

    @measured
    async def UpdateOffset(
        self, request: s.UpdateOffsetRequest, context: Context
    ) -> s.UpdateOffsetResponse:
        return s.UpdateOffsetResponse(status=not_implemented("UpdateOffset"))

    @measured
    async def GetOffset(self, request: s.GetOffsetRequest, context: Context) -> s.GetOffsetResponse:
        return s.GetOffsetResponse(status=not_implemented("GetOffset"))

    @measured
    async def QueryOffset(
        self, request: s.QueryOffsetRequest, context: Context
    ) -> s.QueryOffsetResponse:
        return s.QueryOffsetResponse(status=not_implemented("QueryOffset"))

    @measured
    async def SyncLiteSubscription(
        self, request: s.SyncLiteSubscriptionRequest, context: Context
    ) -> s.SyncLiteSubscriptionResponse:
        return s.SyncLiteSubscriptionResponse(
            status=d.Status(code=d.UNSUPPORTED, message="lite topics are not supported by Apogee")
        )
