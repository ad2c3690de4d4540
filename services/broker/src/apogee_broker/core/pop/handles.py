"""Receipt handles: what a POP delivery gives the consumer to ack it or re-arm it with.

A handle is opaque to clients; inside it is ``<broker>|<queue id>|<queue offset>|<nonce>``,
URL-safe base64 without padding. The nonce is drawn afresh for each delivery and each re-arm, so
a handle of an earlier delivery no longer matches and is refused (``INVALID_RECEIPT_HANDLE``):
a consumer that was too slow cannot ack the copy another consumer now holds. The group and the
topic travel beside the handle in every request, as the protocol has them.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Final, NamedTuple

from apogee.common.errors import InvalidArgumentError

#: The longest handle taken in (a broker name of 127 characters and three numbers fit easily).
MAX_HANDLE_LENGTH: Final = 512


def encode_handle_text(*parts: str) -> str:
    """``parts`` as a JSON array in URL-safe base64 without padding: the form of recall
    handles (any part may hold any character)."""
    raw = json.dumps(parts, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def decode_handle_text(text: str, count: int) -> list[str]:
    """The ``count`` parts of a handle (:func:`encode_handle_text`); :class:`ValueError` when
    ``text`` is not one."""
    if not text or len(text) > MAX_HANDLE_LENGTH:
        raise ValueError("not a handle")
    try:
        parts = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
    except (binascii.Error, UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("not a handle") from None
    if (
        not isinstance(parts, list)
        or len(parts) != count
        or not all(isinstance(p, str) and p for p in parts)
    ):
        raise ValueError("not a handle")
    return parts


class Handle(NamedTuple):
    broker: str
    queue_id: int
    offset: int
    nonce: int

    def encode(self) -> str:
        raw = f"{self.broker}|{self.queue_id}|{self.offset}|{self.nonce}".encode()
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def decode_handle(text: str, field: str = "receipt_handle") -> Handle:
    """The handle ``text`` encodes; :class:`InvalidArgumentError` naming ``field`` when it is
    not one this broker family hands out."""
    rule = "is not a receipt handle from a receive of this cluster"
    if not text:
        raise InvalidArgumentError(field=field, rule="is required")
    if len(text) > MAX_HANDLE_LENGTH:
        raise InvalidArgumentError(field=field, rule=f"is longer than {MAX_HANDLE_LENGTH} chars")
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
        broker, queue_id, offset, nonce = raw.rsplit("|", 3)
        handle = Handle(broker, int(queue_id), int(offset), int(nonce))
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise InvalidArgumentError(field=field, rule=rule) from None
    if not broker or handle.queue_id < 0 or handle.offset < 0 or handle.nonce < 0:
        raise InvalidArgumentError(field=field, rule=rule)
    return handle
