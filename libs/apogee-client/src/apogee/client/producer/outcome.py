"""Whether a failed send may have been stored all the same, the error that says so, and the
dedup ids of idempotent sends.

A send request that fails after it may have reached its broker leaves the outcome unknown: a
broker paused or slow past ``send_timeout`` stores the message once it gets to it, and a
broker killed with the request in flight may have stored it first. The send's error then says
so (:meth:`~apogee.common.errors.ApogeeError.with_unknown_outcome`: ``outcome_unknown``, the
message id, and what to do), and the send is not tried again unless it is idempotent: a plain
retry would store a second copy.

A request's failure is read here (:func:`may_have_reached`):

- the broker's own answer (an error it sent back: refused, store closed, disk full, ...) is
  an outcome: nothing was stored, except when it says it ran out of time or failed inside
  (``DEADLINE_EXCEEDED``, ``INTERNAL``), which leave the outcome unknown;
- a failure of the transport (the stream broke, the call timed out, an answer that does not
  parse) leaves it unknown, except when gRPC never connected (``failed to connect to all
  addresses``: nothing was written) or the broker ended the stream as it stopped (it answers
  every request it read first: the others were never read; :mod:`apogee.rpc.mux`);
- anything that fails before the request is handed to the transport (no address for the
  broker, a refused connection, the producer closing before the message left) is plain.

Errors rebuilt from a server's answer carry no details (:meth:`ApogeeError.from_wire`); those
this side builds for a broken transport name ``what`` and ``detail``.

An idempotent send's records carry ``APOGEE_DEDUP_ID`` (:func:`dedup_of`): the message's own
when it sets one, else its message id, which the application may give again
(``send(msg, message_id=err.message_id)``, :func:`check_message_id`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from apogee.client.message import Message
from apogee.client.producer.wire import DEDUP_PROPERTY
from apogee.codec import unique_id_rule
from apogee.common.errors import ApogeeError, InvalidArgumentError

#: Kinds that leave the outcome unknown even when a broker answered with them.
_UNKNOWN_KINDS: Final = frozenset({"DEADLINE_EXCEEDED", "INTERNAL", "NOT_REPLICATED"})
#: Starts of transport failures in which the request never reached the broker.
_NOT_SENT: Final = (
    "failed to connect to all addresses",  # gRPC: no connection was made
    "the stream ended (stopping?)",  # apogee.rpc.mux: a stopping broker answered all it read
)
#: Most ids an error's sentence lists (``message_ids`` holds them all).
_IDS_SHOWN: Final = 5


class RequestFailed(Exception):
    """A send request failed as a whole with ``error``; ``reached``: it may have reached its
    broker, so its messages may have been stored. Only the producer's deliveries see it."""

    def __init__(self, error: BaseException, reached: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.reached = reached


def may_have_reached(err: BaseException) -> bool:
    """Whether a request that failed with ``err`` (raised by the transport or answered by the
    broker) may have been acted on."""
    if not isinstance(err, ApogeeError):
        return True  # not understood: assume the worst
    if err.kind.name in _UNKNOWN_KINDS:
        return True
    if not err.details:  # the broker's (or a server's) answer: it decided
        return False
    detail = str(err.details.get("detail", ""))
    return not detail.startswith(_NOT_SENT)


def route_moved(err: BaseException) -> bool:
    """Whether ``err`` says the broker has moved: a replica that does not lead its group
    answered (NOT_LEADER, nothing stored). A retry should then wait for a fresh route, which
    names the group's leader (docs/replication.md); the broker name, and so an ordered send's
    queue, stays the same."""
    return isinstance(err, ApogeeError) and err.kind.name == "NOT_LEADER"


def answer_leaves_unknown(err: BaseException) -> bool:
    """Whether a broker's answer for one message (``err``) leaves its outcome unknown."""
    return not isinstance(err, ApogeeError) or err.kind.name in _UNKNOWN_KINDS


def unknown_outcome(err: ApogeeError, ids: Sequence[str], dedup: str) -> ApogeeError:
    """``err`` saying that the messages ``ids`` may have been stored, and what to do.
    ``dedup``: ``""`` for a plain send, ``"id"`` for an idempotent one keyed by its message id,
    ``"own"`` for one whose messages carry their own ``APOGEE_DEDUP_ID``."""
    one = len(ids) == 1
    shown = ", ".join(ids[:_IDS_SHOWN])
    if len(ids) > _IDS_SHOWN:
        shown += f" and {len(ids) - _IDS_SHOWN} more"
    what = (
        f"the message may have been stored (message id {shown})"
        if one
        else f"the {len(ids)} messages may have been stored (message ids {shown})"
    )
    it = "it" if one else "them"
    if dedup == "id":
        again = "message_id=err.message_id" if one else "message_ids=err.message_ids"
        advice = (
            f"{what}: send {it} again with idempotent sends on ({again}, stored once within "
            f"the broker's dedup window), or look {it} up by id before sending again"
        )
    elif dedup == "own":
        advice = (
            f"{what}: send {it} again with the same APOGEE_DEDUP_ID (stored once within the "
            f"broker's dedup window), or look {it} up by id before sending again"
        )
    else:
        advice = (
            f"{what}: look {it} up by id before sending again (a plain send again may store a "
            "second copy; idempotent sends, idempotent=True, are stored once)"
        )
    return err.with_unknown_outcome(ids, advice)


def check_message_id(field: str, uid: object, idempotent: bool) -> None:
    """Refuse a message id given to a send that cannot take it."""
    if not idempotent:
        raise InvalidArgumentError(
            field=field,
            rule="is taken by idempotent producers only (idempotent=True): a plain send under "
            "an id that was stored already would store a second copy",
        )
    if not isinstance(uid, str):
        raise InvalidArgumentError(field=field, rule=f"must be a str, got {type(uid).__name__}")
    rule = unique_id_rule(uid)
    if rule is not None:
        raise InvalidArgumentError(field=field, rule=f"{uid!r} {rule}")


def dedup_of(msg: Message, uid: str) -> tuple[str, str]:
    """How an idempotent send of ``msg`` under ``uid`` asks for deduplication, and its dedup
    id: ``("own", id)`` when the message carries its own ``APOGEE_DEDUP_ID``, else
    ``("id", uid)``. (A plain send's is ``("", "")``.)"""
    own = msg.properties.get(DEDUP_PROPERTY) if msg.properties else None
    return ("own", own) if own else ("id", uid)


def record_dedup(dedup: tuple[str, str]) -> str:
    """The dedup id a record must carry besides its message's properties: its message id for
    an idempotent send keyed by it, nothing otherwise (plain, or the message's own)."""
    mode, key = dedup
    return key if mode == "id" else ""
