"""The one mapping from what went wrong to a v2 ``Status``: every v2 answer carries the
protocol's own ``Code`` with a sentence, since the official clients act on the code (an
``INVALID_RECEIPT_HANDLE`` ack is given up, a ``TOO_MANY_REQUESTS`` send is not retried, ...).
gRPC status codes are left to what gRPC itself says (an RPC not served at all)."""

from __future__ import annotations

from typing import Final

from apogee.common.errors import ApogeeError
from apogee.rocketmq.v2 import definition_pb2 as d
from apogee_broker.core.pop.service import StaleHandleError

#: Apogee error kinds and the v2 code each becomes (the field decides among INVALID_ARGUMENT's).
KIND_CODES: Final[dict[str, int]] = {
    "INVALID_TOPIC": d.ILLEGAL_TOPIC,
    "INVALID_QUEUE_ID": d.BAD_REQUEST,
    "MESSAGE_TOO_LARGE": d.MESSAGE_BODY_TOO_LARGE,
    "PROPERTIES_TOO_LARGE": d.MESSAGE_PROPERTIES_TOO_LARGE,
    "INVALID_PROPERTY": d.ILLEGAL_MESSAGE_PROPERTY_KEY,
    "MESSAGE_TYPE_MISMATCH": d.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE,
    "NOT_FOUND": d.NOT_FOUND,
    "OFFSET_DELETED": d.NOT_FOUND,
    "UNKNOWN_TOPIC": d.TOPIC_NOT_FOUND,
    "UNAUTHENTICATED": d.UNAUTHORIZED,
    "PERMISSION_DENIED": d.FORBIDDEN,
    "UNSUPPORTED": d.UNSUPPORTED,
    "TRANSACTION_DECIDED": d.BAD_REQUEST,
    "FLUSH_TIMEOUT": d.MASTER_PERSISTENCE_TIMEOUT,
    "DEADLINE_EXCEEDED": d.PROXY_TIMEOUT,
    "UNAVAILABLE": d.INTERNAL_SERVER_ERROR,
    # a replica group (docs/replication.md): upstream's codes for its master-slave troubles
    "NOT_LEADER": d.HA_NOT_AVAILABLE,
    "NOT_ENOUGH_REPLICAS": d.HA_NOT_AVAILABLE,
    "STALE_EPOCH": d.HA_NOT_AVAILABLE,
    "NOT_REPLICATED": d.SLAVE_PERSISTENCE_TIMEOUT,
    "STORE_CLOSED": d.INTERNAL_SERVER_ERROR,
    "STORE_FAILED": d.INTERNAL_SERVER_ERROR,
    "DISK_FULL": d.INTERNAL_SERVER_ERROR,
    "CORRUPT_RECORD": d.INTERNAL_SERVER_ERROR,
    "STORE_LOCKED": d.INTERNAL_SERVER_ERROR,
    "STORE_CONFIG": d.INTERNAL_SERVER_ERROR,
    "INTERNAL": d.INTERNAL_SERVER_ERROR,
}

#: INVALID_ARGUMENT errors by the field they name (the last part of it), to v2's own codes.
FIELD_CODES: Final[dict[str, int]] = {
    "deliver_at_ms": d.ILLEGAL_DELIVERY_TIME,
    "delivery_timestamp": d.ILLEGAL_DELIVERY_TIME,
    "tags": d.ILLEGAL_MESSAGE_TAG,
    "tag": d.ILLEGAL_MESSAGE_TAG,
    "keys": d.ILLEGAL_MESSAGE_KEY,
    "unique_id": d.ILLEGAL_MESSAGE_ID,
    "message_id": d.ILLEGAL_MESSAGE_ID,
    "group": d.ILLEGAL_CONSUMER_GROUP,
    "message_group": d.ILLEGAL_MESSAGE_GROUP,
    "receipt_handle": d.INVALID_RECEIPT_HANDLE,
    "invisible_duration": d.ILLEGAL_INVISIBLE_TIME,
    "filter_expression": d.ILLEGAL_FILTER_EXPRESSION,
    "tag_expression": d.ILLEGAL_FILTER_EXPRESSION,
    "sql_expression": d.ILLEGAL_FILTER_EXPRESSION,
    "transaction_id": d.INVALID_TRANSACTION_ID,
    "long_polling_timeout": d.ILLEGAL_POLLING_TIME,
    "x-mq-client-id": d.CLIENT_ID_REQUIRED,
}


class V2Error(Exception):
    """A refusal in v2's own terms: its code and the sentence."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def ok() -> d.Status:
    return d.Status(code=d.OK, message="OK")


def code_of(exc: ApogeeError) -> int:
    kind = exc.kind.name
    if kind == "INVALID_ARGUMENT":
        field = str(exc.details.get("field", ""))
        last = field.rsplit(".", 1)[-1].split("[", 1)[0].split(" ", 1)[0]
        if last == "body" and "empty" in str(exc):
            return d.MESSAGE_BODY_EMPTY
        return FIELD_CODES.get(last, d.BAD_REQUEST)
    if isinstance(exc, StaleHandleError):  # a NOT_FOUND that v2 has a code of its own for
        return d.INVALID_RECEIPT_HANDLE
    return KIND_CODES.get(kind, d.INTERNAL_SERVER_ERROR)


def status_of(exc: BaseException) -> d.Status:
    """The v2 status of an error raised while serving a request."""
    if isinstance(exc, V2Error):
        return d.Status(code=exc.code, message=exc.message)  # type: ignore[arg-type]
    if isinstance(exc, ApogeeError):
        return d.Status(code=code_of(exc), message=str(exc))  # type: ignore[arg-type]
    return d.Status(code=d.INTERNAL_SERVER_ERROR, message=f"internal error: {exc}")
