"""The SDK's results as the JSON the API answers: plain dicts, ``None`` for unknown.

A body is shown as text (UTF-8), JSON (pretty-printed) or hex (anything else), at most
:data:`PREVIEW_BYTES` of it (``truncated`` says when it was cut). A message's trace id is the
second field of its W3C ``traceparent`` property, when it has a valid one.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from apogee.client.dlq import DeadLetter
from apogee.client.groups import GroupDescription, GroupMember, OfficialClientInfo, QueueLag
from apogee.client.message import StoredMessage
from apogee.client.txn_admin import PendingTransaction

#: Most bytes of a body a preview shows.
PREVIEW_BYTES: Final = 64 * 1024
TRACEPARENT: Final = "traceparent"
_TRACEPARENT_RE: Final = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")

Json = dict[str, Any]


def body_view(body: bytes, limit: int = PREVIEW_BYTES) -> Json:
    """``{"kind": "text"|"json"|"binary", "preview", "size", "truncated"}``."""
    size = len(body)
    head = body[:limit]
    truncated = size > limit
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        # a cut inside a multi-byte character is still text
        if truncated and exc.start >= len(head) - 3 and exc.reason == "unexpected end of data":
            text = head[: exc.start].decode("utf-8")
        else:
            return {
                "kind": "binary",
                "preview": head.hex(" "),
                "size": size,
                "truncated": truncated,
            }
    if not truncated and text.lstrip()[:1] in ("{", "["):
        try:
            pretty = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
        except ValueError:
            pass
        else:
            return {"kind": "json", "preview": pretty, "size": size, "truncated": False}
    if any(ord(c) < 32 and c not in "\t\n\r" for c in text):
        return {"kind": "binary", "preview": head.hex(" "), "size": size, "truncated": truncated}
    return {"kind": "text", "preview": text, "size": size, "truncated": truncated}


def trace_id(properties: dict[str, str] | Any) -> str | None:
    """The trace id of a ``traceparent`` property (``None`` without a valid one)."""
    value = properties.get(TRACEPARENT)
    if not isinstance(value, str):
        return None
    m = _TRACEPARENT_RE.match(value.strip())
    if m is None or m.group(1) == "0" * 32:
        return None
    return m.group(1)


def message_view(m: StoredMessage) -> Json:
    props = dict(m.properties)
    return {
        "id": m.unique_id,
        "topic": m.topic,
        "broker": m.broker_name,
        "queue_id": m.queue_id,
        "queue_offset": m.queue_offset,
        "tags": m.tags,
        "keys": list(m.keys),
        "properties": props,
        "born_ms": m.born_timestamp_ms,
        "store_ms": m.store_timestamp_ms,
        "born_host": m.born_host,
        "reconsume_times": m.reconsume_times,
        "trace_id": trace_id(props),
        "body": body_view(m.body),
        "body_error": m.body_error or None,
    }


def copy_view(m: StoredMessage) -> Json:
    """Where one copy of a message is stored (a message id may be stored more than once)."""
    return {
        "topic": m.topic,
        "broker": m.broker_name,
        "queue_id": m.queue_id,
        "queue_offset": m.queue_offset,
        "store_ms": m.store_timestamp_ms,
    }


def dead_letter_view(d: DeadLetter) -> Json:
    return {
        "id": d.unique_id,
        "origin_topic": d.origin_topic,
        "reason": d.reason,
        "attempts": d.attempts,
        "store_ms": d.store_timestamp_ms,
        "broker": d.broker_name,
        "queue_id": d.queue_id,
        "queue_offset": d.queue_offset,
        "tags": d.tags,
        "keys": list(d.keys),
        "properties": dict(d.properties),
        "trace_id": trace_id(d.properties),
        "body": body_view(d.body),
    }


def pending_view(p: PendingTransaction) -> Json:
    return {
        "id": p.transaction_id,
        "broker": p.broker_name,
        "producer_group": p.producer_group,
        "topic": p.topic,
        "first_stored_ms": p.first_stored_ms,
        "check_times": p.check_times,
        "checking": p.checking,
        "keys": p.keys,
    }


def _member_view(m: GroupMember) -> Json:
    return {
        "client_id": m.client_id,
        "host": m.host,
        "mode": m.mode,
        "subscriptions": [
            {"topic": s.topic, "tags": s.tag_expression, "sql": s.sql_expression or None}
            for s in m.subscriptions
        ],
        "last_heartbeat_ms": m.last_heartbeat_ms,
        "brokers": list(m.brokers),
    }


def _queue_view(q: QueueLag) -> Json:
    return {
        "broker": q.broker_name,
        "topic": q.topic,
        "queue_id": q.queue_id,
        "broker_offset": q.broker_offset,
        "consumer_offset": q.consumer_offset,
        "lag_messages": q.lag_messages,
        "lag_seconds": q.lag_seconds,
        "locked_by": q.locked_by,
        "in_flight": q.in_flight,
        "invisible": q.invisible,
    }


def _client_view(c: OfficialClientInfo) -> Json:
    return {
        "client_id": c.client_id,
        "language": c.language or None,
        "version": c.version or None,
        "client_type": c.client_type or None,
        "host": c.host or None,
        "broker": c.broker_name,
    }


def group_view(g: GroupDescription) -> Json:
    """A group; ``consumption`` is ``"POP"``, ``"OFFSETS"`` or ``None`` (not known yet), and
    ``clients`` the official RocketMQ 5 clients connected (one row per broker)."""
    return {
        "name": g.group,
        "consumption": g.consumption or None,
        "members": [_member_view(m) for m in g.members],
        "clients": [_client_view(c) for c in g.clients],
        "queues": [_queue_view(q) for q in g.queues],
        "lag_messages": g.lag_messages,
        "lag_seconds": g.lag_seconds,
        "in_flight": g.in_flight,
        "invisible": g.invisible,
        "warnings": list(g.warnings),
    }
