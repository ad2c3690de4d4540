"""The API's numbers and their ranges, checked when a request is validated: a number out of
range is a 400 ``INVALID_ARGUMENT`` naming the field and the range (see
:mod:`apogee_console.problems`), and never reaches the cluster, whose protobuf fields hold 32 or
64 bits (a bigger number would fail there with an error of its own).

- :data:`EpochMs`: a time from 1970-01-01 to 9999-12-31 UTC in milliseconds since the epoch,
  refused in the words of the ``apogee`` command (``datetime``'s limit, as ``deliver_at`` in the
  SDK);
- integers from a low to a high bound, refused as the SDK refuses a count of queues
  (``must be an integer from 1 to 1024, got 0``): :data:`QueueId` (int32), :data:`Offset`
  (int64), a topic's queues per broker (:data:`Queues`, the SDK's bound), and the most entries
  a list answers (:data:`SearchLimit`, :data:`ListLimit`);
- :data:`TopicType`: a topic's message type, in any case (``must be one of NORMAL, FIFO, DELAY,
  TRANSACTION, MIXED, got 'ORDERED'``), as its name in capitals.

The range check runs before the integer is parsed, so that ``1e29``, ``-1`` and a number of 30
digits are refused with the same sentence.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Final

from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError

from apogee.client.admin import MAX_QUEUES
from apogee.client.admin_messages import MAX_QUERY_MESSAGES
from apogee.common.clock import EPOCH_MS_RULE, MAX_EPOCH_MS
from apogee.common.topics import MESSAGE_TYPE_NAMES

#: The latest time the API takes: 9999-12-31T23:59:59.999Z, in ms since the epoch.
MAX_TIME_MS: Final = MAX_EPOCH_MS
MAX_INT32: Final = 2**31 - 1
MAX_INT64: Final = 2**63 - 1
MAX_LIST: Final = 10_000

TIME_RULE: Final = EPOCH_MS_RULE


def _number(value: object) -> float | None:
    """``value`` as a number when it is one (JSON) or reads as one (a query string), else
    ``None`` (left to the integer's own parsing and its error)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return value
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _outside(value: object, low: int, high: int) -> bool:
    number = _number(value)
    if number is None:
        return False
    if isinstance(number, int):
        return not low <= number <= high
    return not (math.isfinite(number) and low <= number <= high)


def _shown(value: object) -> str:
    """``value`` as the error shows it: a long one cut, with its length."""
    text = str(value)
    return text if len(text) <= 40 else f"{text[:24]}... ({len(text)} characters)"


def _time_ms(value: Any) -> Any:
    if _outside(value, 0, MAX_TIME_MS):
        raise PydanticCustomError("time_range", TIME_RULE + ", got {got}", {"got": _shown(value)})
    return value


def _range_check(low: int, high: int) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if _outside(value, low, high):
            raise PydanticCustomError(
                "int_range",
                "must be an integer from {low} to {high}, got {got}",
                {"low": low, "high": high, "got": _shown(value)},
            )
        return value

    return check


def _message_type(value: Any) -> Any:
    if isinstance(value, str) and value.upper() in MESSAGE_TYPE_NAMES:
        return value.upper()
    raise PydanticCustomError(
        "message_type",
        "must be one of {types}, got {got}",
        {"types": ", ".join(MESSAGE_TYPE_NAMES), "got": _shown(repr(value))},
    )


EpochMs = Annotated[int, Field(ge=0, le=MAX_TIME_MS), BeforeValidator(_time_ms)]
QueueId = Annotated[int, Field(ge=0, le=MAX_INT32), BeforeValidator(_range_check(0, MAX_INT32))]
Offset = Annotated[int, Field(ge=0, le=MAX_INT64), BeforeValidator(_range_check(0, MAX_INT64))]
Queues = Annotated[int, Field(ge=1, le=MAX_QUEUES), BeforeValidator(_range_check(1, MAX_QUEUES))]
#: Messages a search answers at most (the brokers' limit).
SearchLimit = Annotated[
    int,
    Field(ge=1, le=MAX_QUERY_MESSAGES),
    BeforeValidator(_range_check(1, MAX_QUERY_MESSAGES)),
]
#: Dead letters or pending transactions a list answers at most.
ListLimit = Annotated[int, Field(ge=1, le=MAX_LIST), BeforeValidator(_range_check(1, MAX_LIST))]
#: A topic's message type (what it accepts), any case in, capitals out.
TopicType = Annotated[str, BeforeValidator(_message_type)]
