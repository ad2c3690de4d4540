"""``Consumer.Deliver``: one push delivery stream, turned into calls on a
:class:`~apogee_broker.core.consume.push.DeliverySession`.

A reader task applies the client's requests as they come (subscriptions, credits, commits);
the handler writes each answer the session makes, one write at a time (the next answer is read
from the store only after the previous one was written). The stream ends when the client closes
its side (OK), a request is bad (its error: INVALID_ARGUMENT naming the field, or the commit's
error), or the broker stops (UNAVAILABLE). Whatever ends it, the reader task is cancelled and
awaited (bounded) and the session's watches are cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any, Final

import grpc.aio

from apogee.common.errors import (
    ApogeeError,
    InvalidArgumentError,
    UnavailableError,
)
from apogee.rpc.errors import abort, first_request, to_status
from apogee.store import GetStatus
from apogee.v1 import consumer_pb2 as pb
from apogee_broker.core.consume.push import Batch, DeliveryHub, DeliverySession, Subscribe

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]

#: How long the stream may stay without its first request.
FIRST_REQUEST_TIMEOUT_S: Final = 30.0
#: How long the handler waits for its reader task once the stream ends.
READER_STOP_S: Final = 2.0

PULL_STATUS: Final = {
    GetStatus.FOUND: pb.PULL_FOUND,
    GetStatus.NO_NEW_MESSAGE: pb.PULL_NO_NEW_MESSAGE,
    GetStatus.NO_MATCHED_MESSAGE: pb.PULL_NO_MATCHED_MESSAGE,
    GetStatus.OFFSET_TOO_SMALL: pb.PULL_OFFSET_TOO_SMALL,
    GetStatus.OFFSET_OVERFLOW: pb.PULL_OFFSET_OVERFLOW,
}


async def serve_delivery(
    hub: DeliveryHub, requests: AsyncIterator[pb.DeliverRequest], context: Context
) -> None:
    """Serve one ``Deliver`` stream until it ends (see the module docstring)."""
    it = aiter(requests)
    first = await first_request(
        it, context, "the first request of this delivery stream", FIRST_REQUEST_TIMEOUT_S
    )
    if first is None:
        return
    try:
        session = hub.open(first.group, first.client_id)
    except ApogeeError as err:
        await abort(context, err)
    failed: list[ApogeeError] = []
    reader = asyncio.create_task(
        _read(session, first, it, failed), name="apogee-broker-delivery-reader"
    )
    try:
        while True:
            batches = await session.next_batches()
            if not batches:
                break
            await context.write(_response(batches))
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(reader, READER_STOP_S)
        hub.close(session)
    if failed:
        await abort(context, failed[0])
    if session.stopped:
        await abort(context, UnavailableError(what="the broker", detail="is stopping"))


async def _read(
    session: DeliverySession,
    first: pb.DeliverRequest,
    it: AsyncIterator[pb.DeliverRequest],
    failed: list[ApogeeError],
) -> None:
    """Apply the stream's requests until the client closes its side, the stream breaks or a
    request is bad (its error goes to ``failed``); then end the session."""
    try:
        apply(session, first)
        async for request in it:
            apply(session, request)
    except ApogeeError as err:
        failed.append(err)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the stream broke under us: the session ends with it
        log.debug("%r: reading requests failed: %s", session, exc)
    session.end()


def apply(session: DeliverySession, r: pb.DeliverRequest) -> None:
    """One request's subscriptions, unsubscriptions, credits and commits, in that order."""
    for name, value in (("group", r.group), ("client_id", r.client_id)):
        if value and value != getattr(session, name):
            raise InvalidArgumentError(
                field=name,
                rule=f"must stay {getattr(session, name)!r} on one stream, got {value!r}",
            )
    for s in r.subscribe:
        session.subscribe(
            Subscribe(
                s.sub,
                s.topic,
                s.queue_id,
                s.offset,
                s.tag_expression,
                s.credit_messages,
                s.credit_bytes,
                s.sql_expression,
                s.exclusive,
            )
        )
    if r.unsubscribe:
        session.unsubscribe(r.unsubscribe)
    for c in r.credit:
        session.grant(c.sub, c.messages, c.bytes)
    if r.commit:
        session.commit([(o.topic, o.queue_id, o.offset) for o in r.commit])


def _response(batches: list[Batch]) -> pb.DeliverResponse:
    resp = pb.DeliverResponse()
    for b in batches:
        item = resp.batches.add(sub=b.sub)
        if b.error is not None:
            item.status.CopyFrom(to_status(b.error))
            continue
        r = b.result
        assert r is not None
        out = item.response
        out.status = PULL_STATUS[r.status]
        if r.count:
            out.records = r.records
            out.count = r.count
        out.next_offset = r.next_offset
        out.min_offset = r.min_offset
        out.max_offset = r.max_offset
    return resp
