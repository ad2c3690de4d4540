"""A record's properties: their text form and the names of the system properties.

Properties are ``name 0x01 value 0x02`` repeated, UTF-8. A message's tags, keys (space
separated) and unique id are kept among them under :data:`PROP_TAGS`, :data:`PROP_KEYS` and
:data:`PROP_UNIQ_KEY`; brokers add the other system properties below, and clients read them
(one spelling for both sides).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Final

NAME_SEP: Final = "\x01"
PROP_SEP: Final = "\x02"

PROP_TAGS: Final = "TAGS"
PROP_KEYS: Final = "KEYS"
PROP_UNIQ_KEY: Final = "UNIQ_KEY"
#: The original topic of a message in ``%RETRY%<group>`` (kept through every retry).
PROP_RETRY_TOPIC: Final = "RETRY_TOPIC"
#: The unique id of the message a retried, dead or redriven message stands for.
PROP_ORIGIN_MSG_ID: Final = "ORIGIN_MSG_ID"
#: Of a dead letter: its original topic, the consumer's last failure and how often it was tried.
PROP_DLQ_ORIGIN_TOPIC: Final = "DLQ_ORIGIN_TOPIC"
PROP_DLQ_REASON: Final = "DLQ_REASON"
PROP_ATTEMPTS: Final = "ATTEMPTS"
#: Most characters of a failure reason (``DLQ_REASON``) a broker keeps.
MAX_REASON: Final = 1024
#: Of a message on its way through the schedule topic: where it goes, its delay level or
#: delivery time.
PROP_REAL_TOPIC: Final = "REAL_TOPIC"
PROP_REAL_QID: Final = "REAL_QID"
PROP_DELAY: Final = "DELAY"
PROP_DELIVER_AT: Final = "DELIVER_AT_MS"
#: Of a delayed or timer message once delivered to its topic: when it was due (ms; RocketMQ 5's
#: name). The broker's (its ``TIMER_`` prefix is), kept so consumers can tell when it was due.
PROP_TIMER_DELIVER: Final = "TIMER_DELIVER_MS"
#: Of a transaction's half message (``RMQ_SYS_TRANS_HALF_TOPIC``; its real topic and queue in
#: ``REAL_TOPIC`` / ``REAL_QID``): the mark of a half, its producer group (whose producers are
#: asked about it), how often it was checked (absent: never), and when its first copy was stored
#: (ms; absent on the first copy, whose store time it is). All four are the broker's.
PROP_TRAN_MSG: Final = "TRAN_MSG"
PROP_PRODUCER_GROUP: Final = "PGROUP"
PROP_TRANSACTION_CHECK_TIMES: Final = "TRANSACTION_CHECK_TIMES"
PROP_TRAN_FIRST_STORED: Final = "TRAN_FIRST_STORED"
#: The client's: how long after it is stored a half is first checked (whole seconds, 1 to
#: :data:`MAX_CHECK_IMMUNITY_S`); absent, the checker's default.
PROP_CHECK_IMMUNITY: Final = "CHECK_IMMUNITY_TIME_IN_SECONDS"
MAX_CHECK_IMMUNITY_S: Final = 86_400
#: The client's: a message's message group (RocketMQ's sharding key). A message carrying it is a
#: FIFO message (its group's messages are consumed in order), sent only to FIFO and MIXED topics.
PROP_SHARDING_KEY: Final = "__SHARDINGKEY"

#: A message's trace context (W3C Trace Context, https://www.w3.org/TR/trace-context/): the
#: ``traceparent`` of the span that sent it and the vendors' ``tracestate``. Ordinary properties
#: as far as the rules go (a client may set them; a tracing producer writes them), and kept by
#: every copy a broker makes (retries, dead letters, delayed deliveries, transactions), so that
#: every hop of the message joins its trace (:mod:`apogee.common.tracing`).
PROP_TRACEPARENT: Final = "traceparent"
PROP_TRACESTATE: Final = "tracestate"
TRACE_PROPERTIES: Final = frozenset({PROP_TRACEPARENT, PROP_TRACESTATE})

#: The names a message's own fields (tags, keys, unique id) are kept under.
OWN_FIELDS: Final = frozenset({PROP_TAGS, PROP_KEYS, PROP_UNIQ_KEY})

#: Properties only brokers write, because brokers and the schedule service act on them (where a
#: delayed message goes, where a retried one came from, a dead letter's reason, a transaction's
#: group and checks): a client that sets one is refused. ``ORIGIN_MSG_ID`` is not among them:
#: nothing is routed by it, and a redriven dead letter carries it from its sender.
BROKER_PROPERTIES: Final = frozenset(
    {
        PROP_REAL_TOPIC,
        PROP_REAL_QID,
        PROP_DELAY,
        PROP_DELIVER_AT,
        PROP_RETRY_TOPIC,
        PROP_DLQ_ORIGIN_TOPIC,
        PROP_DLQ_REASON,
        PROP_ATTEMPTS,
        PROP_TRAN_MSG,
        PROP_PRODUCER_GROUP,
        PROP_TRANSACTION_CHECK_TIMES,
        PROP_TRAN_FIRST_STORED,
    }
)
#: Name prefixes kept for brokers as well (their present and future system properties).
BROKER_PREFIXES: Final = ("REAL_", "DLQ_", "TIMER_")

_RESERVED_IN_TEXT: Final = re.compile(
    "(?:^|\x02)((?:"
    + "|".join(re.escape(p) for p in BROKER_PREFIXES)
    + ")[^\x01\x02]*|"
    + "|".join(re.escape(n) for n in sorted(BROKER_PROPERTIES))
    + ")\x01"
)


#: Longest unique id a message may carry (a producer's own are 32 hex characters).
MAX_UNIQUE_ID: Final = 128
_CONTROL: Final = re.compile("[\\x00-\\x1f\\x7f]")
_SPACE_OR_CONTROL: Final = re.compile("[\\x00-\\x20\\x7f]")
#: a property name (what precedes NAME_SEP in an entry) holding a control character
_CONTROL_IN_NAME: Final = re.compile(
    "(?:^|\\x02)([^\\x01\\x02]*[\\x00\\x03-\\x1f\\x7f][^\\x01\\x02]*)\\x01"
)


def unique_id_rule(uid: str) -> str | None:
    """Why ``uid`` cannot be a message's unique id, or None when it can: 1 to
    :data:`MAX_UNIQUE_ID` characters, no spaces or control characters (ids are looked up, listed
    and printed)."""
    if not uid:
        return "must not be empty"
    if len(uid) > MAX_UNIQUE_ID:
        return f"is {len(uid)} characters; at most {MAX_UNIQUE_ID} are allowed"
    if _SPACE_OR_CONTROL.search(uid):
        return "must not contain spaces or control characters"
    return None


def control_character_rule(name: str) -> str | None:
    """Why ``name`` cannot be a property name for a control character it holds, or None."""
    m = _CONTROL.search(name)
    if m is None:
        return None
    return f"a property name must not contain control characters, got {m.group()!r}"


#: properties' text as writers lay it out: entries of a name (one or more characters, none of
#: them a control character) and a value (no separator), each entry ended by PROP_SEP
_WELL_FORMED: Final = re.compile("(?:[^\\x00-\\x1f\\x7f]+\\x01[^\\x01\\x02]*\\x02)*")


def properties_text_problem(raw: str) -> tuple[str, str] | None:
    """``(field, rule)`` for the first entry of ``raw`` (the properties' text, as a sender wrote
    it) that is not ``name 0x01 value 0x02`` with a non-empty name free of control characters
    and a value free of separators; None when every entry is. Stored properties are written
    back as they are read (retries, dead letters, delayed messages), so what could not be
    written again is refused when it arrives."""
    if _WELL_FORMED.fullmatch(raw):
        return None
    *entries, rest = raw.split(PROP_SEP)
    for entry in entries:
        name, sep, value = entry.partition(NAME_SEP)
        if not sep:
            return "properties", f"entry {entry!r} has no \\x01 between a name and a value"
        if not name:
            return name, "a property name must be non-empty, without \\x01 or \\x02"
        rule = control_character_rule(name)
        if rule is not None:
            return name, rule
        if NAME_SEP in value:
            return name, "a value must not contain \\x01 or \\x02"
    return "properties", f"must end each entry with \\x02; {rest!r} does not"


def find_control_in_name(raw: str) -> str | None:
    """The first property name of ``raw`` (the properties' text) holding a control character
    other than the separators, or None."""
    m = _CONTROL_IN_NAME.search(raw)
    return m.group(1) if m is not None else None


def is_broker_property(name: str) -> bool:
    """Whether ``name`` is a property only brokers may set (:data:`BROKER_PROPERTIES`, or a name
    starting with one of :data:`BROKER_PREFIXES`)."""
    return name in BROKER_PROPERTIES or name.startswith(BROKER_PREFIXES)


def check_immunity_rule(value: str) -> str | None:
    """Why ``value`` cannot be a half's :data:`PROP_CHECK_IMMUNITY`, or None when it can: a
    whole number of seconds from 1 to :data:`MAX_CHECK_IMMUNITY_S`, in plain decimal digits."""
    if value.isascii() and value.isdigit() and 1 <= int(value) <= MAX_CHECK_IMMUNITY_S:
        return None
    return (
        f"must be a whole number of seconds from 1 to {MAX_CHECK_IMMUNITY_S} (how long after "
        f"it is stored a half is first checked), got {value!r}"
    )


def reserved_property_rule(name: str) -> str | None:
    """Why a client may not set a property called ``name``, or None when it may."""
    if name in OWN_FIELDS:
        return "is reserved; use the message's tags, keys or unique id"
    if is_broker_property(name):
        return (
            "is set by brokers only; use the message's delay_level or deliver_at_ms for a "
            "delayed message"
        )
    return None


def find_broker_property(raw: str) -> str | None:
    """The first property of ``raw`` (the properties' text) that only brokers may set, or None."""
    m = _RESERVED_IN_TEXT.search(raw)
    return m.group(1) if m is not None else None


_TRACEPARENT_AT: Final = PROP_TRACEPARENT + NAME_SEP
_TRACESTATE_AT: Final = PROP_TRACESTATE + NAME_SEP


def find_trace_context(raw: str) -> tuple[str, str]:
    """The ``traceparent`` and ``tracestate`` values of ``raw`` (the properties' text), ``""``
    for each that is absent, found without parsing every property."""
    return _find_value(raw, _TRACEPARENT_AT), _find_value(raw, _TRACESTATE_AT)


def _find_value(raw: str, start: str) -> str:
    if raw.startswith(start):
        at = len(start)
    else:
        found = raw.find(PROP_SEP + start)
        if found < 0:
            return ""
        at = found + 1 + len(start)
    end = raw.find(PROP_SEP, at)
    return raw[at:] if end < 0 else raw[at:end]


def decode_properties(raw: str) -> dict[str, str]:
    """Every property of ``raw`` (the properties' text), system ones included."""
    props: dict[str, str] = {}
    for item in raw.split(PROP_SEP):
        if item:
            name, _, value = item.partition(NAME_SEP)
            props[name] = value
    return props


def encode_properties(
    tags: str | None = None,
    keys: Sequence[str] = (),
    unique_id: str | None = None,
    properties: Mapping[str, str] | None = None,
) -> str:
    """The properties' text of a message: its tags, keys and unique id (each when present),
    then ``properties``. Nothing is checked here (names and values must not hold the
    separators); writers validate first."""
    parts = []
    if tags:
        parts.append(f"{PROP_TAGS}{NAME_SEP}{tags}{PROP_SEP}")
    if keys:
        parts.append(f"{PROP_KEYS}{NAME_SEP}{' '.join(keys)}{PROP_SEP}")
    if unique_id:
        parts.append(f"{PROP_UNIQ_KEY}{NAME_SEP}{unique_id}{PROP_SEP}")
    for name, value in (properties or {}).items():
        parts.append(f"{name}{NAME_SEP}{value}{PROP_SEP}")
    return "".join(parts)
