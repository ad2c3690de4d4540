"""The actions: role ``admin``, the ``X-CSRF-Token`` header, an audit line each."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from apogee.common.errors import InvalidArgumentError
from apogee_console.api.deps import actor, console
from apogee_console.api.fields import EpochMs, Queues, TopicType
from apogee_console.core.access import Session
from apogee_console.core.views import Json

router = APIRouter(tags=["act"])


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NewTopic(_Body):
    name: str
    queues: Queues = 8
    perm: str | None = None
    #: the messages it accepts; left out: MIXED (every type)
    message_type: TopicType | None = None


class TopicChange(_Body):
    queues: Queues
    perm: str | None = None
    #: left out: the topic keeps its type
    message_type: TopicType | None = None


class Reset(_Body):
    topic: str
    to: Literal["earliest", "latest", "timestamp"]
    timestamp_ms: EpochMs | None = None
    dry_run: bool = False


class Redrive(_Body):
    key: str | None = None
    tag: str | None = None
    topic: str | None = None
    since_ms: EpochMs = 0
    dry_run: bool = False


class Resolve(_Body):
    commit: bool


class NewMessage(_Body):
    topic: str
    body: str
    encoding: Literal["utf-8", "base64"] = "utf-8"
    tags: str = ""
    keys: list[str] = Field(default_factory=list)
    properties: dict[str, str] = Field(default_factory=dict)


@router.post("/topics", status_code=201)
async def create_topic(
    body: NewTopic, request: Request, s: Annotated[Session, Depends(actor("create a topic"))]
) -> Json:
    c = console(request)
    updates = await c.audited(
        s,
        "create topic",
        body.name,
        c.cluster.put_topic(body.name, body.queues, body.perm, body.message_type),
    )
    return {"name": body.name, "brokers": updates}


@router.put("/topics/{name}")
async def update_topic(
    name: str,
    body: TopicChange,
    request: Request,
    s: Annotated[Session, Depends(actor("update a topic"))],
) -> Json:
    c = console(request)
    updates = await c.audited(
        s,
        "update topic",
        name,
        c.cluster.put_topic(name, body.queues, body.perm, body.message_type),
    )
    return {"name": name, "brokers": updates}


@router.delete("/topics/{name}")
async def delete_topic(
    name: str, request: Request, s: Annotated[Session, Depends(actor("delete a topic"))]
) -> Json:
    c = console(request)
    deleted = await c.audited(s, "delete topic", name, c.cluster.delete_topic(name))
    return {"name": name, "deleted_from": deleted}


@router.post("/groups/{name}/reset")
async def reset_offsets(
    name: str,
    body: Reset,
    request: Request,
    s: Annotated[Session, Depends(actor("reset a group's offsets"))],
) -> list[Json]:
    if body.to == "timestamp" and body.timestamp_ms is None:
        raise InvalidArgumentError(field="timestamp_ms", rule="is required when to is timestamp")
    if body.to != "timestamp" and body.timestamp_ms is not None:
        raise InvalidArgumentError(field="timestamp_ms", rule="is only for to = timestamp")
    c = console(request)
    if body.dry_run:
        return await c.cluster.reset_preview(name, body.topic, body.to, body.timestamp_ms)
    return await c.audited(
        s,
        "reset offsets",
        f"group {name} topic {body.topic} to {body.to}"
        + (f" {body.timestamp_ms}" if body.timestamp_ms is not None else ""),
        c.cluster.reset(name, body.topic, body.to, body.timestamp_ms),
    )


@router.post("/dlq/{group}/redrive")
async def redrive(
    group: str,
    body: Redrive,
    request: Request,
    s: Annotated[Session, Depends(actor("redrive dead letters"))],
) -> Json:
    c = console(request)
    op = c.cluster.redrive(group, body.key, body.tag, body.topic, body.since_ms, body.dry_run)
    if body.dry_run:
        return await op
    return await c.audited(s, "redrive dead letters", f"group {group}", op)


@router.post("/transactions/{transaction_id}/resolve")
async def resolve(
    transaction_id: str,
    body: Resolve,
    request: Request,
    s: Annotated[Session, Depends(actor("resolve a transaction"))],
) -> Json:
    c = console(request)
    return await c.audited(
        s,
        "commit transaction" if body.commit else "roll back transaction",
        transaction_id,
        c.cluster.resolve(transaction_id, body.commit, f"console:{s.user}"),
    )


@router.post("/messages", status_code=201)
async def send(
    body: NewMessage,
    request: Request,
    s: Annotated[Session, Depends(actor("send a message"))],
) -> Json:
    if body.encoding == "base64":
        try:
            payload = base64.b64decode(body.body, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgumentError(field="body", rule="is not valid base64") from None
    else:
        try:
            payload = body.body.encode()
        except UnicodeEncodeError as exc:
            raise InvalidArgumentError(
                field="body",
                rule=f"is not valid Unicode text (a lone surrogate at position {exc.start}); "
                "send bytes that are not text with encoding base64",
            ) from None
    c = console(request)
    return await c.audited(
        s,
        "send message",
        f"topic {body.topic}",
        c.cluster.send(body.topic, payload, body.tags, body.keys, body.properties),
    )
