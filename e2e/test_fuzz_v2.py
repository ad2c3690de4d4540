"""Hostile input for every RPC of ``apache.rocketmq.v2.MessagingService`` (the protocol of the
official RocketMQ 5 clients), against a cluster of real processes: one nameserver and two
brokers, seeded with topics of every type, stored messages, messages in flight (so real receipt
handles exist), delay messages (recall handles) and open transactions (transaction ids).

Requests are well-typed protobuf messages drawn by hypothesis (:class:`Draw`), half of them a
good request of the RPC (:func:`templates`) with up to three fields replaced or cleared, the
others built field by field from the request type's descriptor. A field gets a plausible value
(the cluster's topics and group, real and forged receipt handles, transaction ids and recall
handles, filter expressions in both syntaxes) or a hostile one: strings of random text, random
bytes read as Latin-1 (control characters, NUL) and the hostile strings of :mod:`e2e.fuzzing`
(10,000 characters, reserved and malformed names, separators); bytes empty, random, over the
brokers' largest body, gzip that does or does not inflate; integers at their type's limits;
enums defined or not; durations and timestamps huge, negative, beyond what a timestamp holds;
repeated fields empty, one, 64 or (a map) 130 long. The ``x-mq-client-id`` header is there,
missing or random. ReceiveMessage is a server stream; Telemetry a bidi stream that writes 0 to 3
commands and reads until each Settings is answered, then ends.

What must hold: every answer carries a ``Status`` whose code is one of the protocol's other than
``CODE_UNSPECIFIED``, ``INTERNAL_ERROR`` and ``INTERNAL_SERVER_ERROR``, with a sentence when it
is not OK (the entries of SendMessage and AckMessage too); a receive stream carries a status,
never an error beside messages, and each message it delivers can be acked (a receipt handle,
``delivery_attempt`` >= 1, a body encoding); each Settings written on Telemetry is answered; no
call fails with a gRPC status other than RESOURCE_EXHAUSTED (a frame over gRPC's limit; a
receive is held for at most the call's deadline less half a second, so even it never runs into
DEADLINE_EXCEEDED). Afterwards both brokers answer their health check and a good send, receive
and ack, and no member's log holds a traceback or an ERROR line.

The seed is printed; ``APOGEE_FUZZ_SEED=<n>`` runs another one, ``APOGEE_FUZZ_V2_EXAMPLES=<n>``
more examples per RPC. A failure names the RPC and shows hypothesis' smallest failing request.
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import itertools
import os
import string
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import grpc
import pytest
from google.protobuf import text_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from apogee.client import SyncAdminClient
from apogee.common.topics import MessageType
from apogee.rocketmq.v2 import definition_pb2 as d
from apogee.rocketmq.v2 import service_pb2 as s
from apogee.rocketmq.v2 import service_pb2_grpc as sg
from apogee.rpc.server import check_health
from apogee_broker.core.pop.handles import Handle, encode_handle_text
from e2e.fuzzing import HOSTILE_STRINGS, INT32, INT64, INT_RANGES
from e2e.harness import Cluster, ClusterFactory, wait_until
from e2e.test_fuzz import log_problems

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SEED: Final = int(os.environ.get("APOGEE_FUZZ_SEED", "20250611"))
#: Examples per RPC, times its weight (the RPCs with the most fields get more).
EXAMPLES: Final = int(os.environ.get("APOGEE_FUZZ_V2_EXAMPLES", "100"))
WEIGHTS: Final = {"SendMessage": 4.0, "Telemetry": 2.0, "ReceiveMessage": 2.0}
REFUSING: Final = frozenset(
    {"PullMessage", "UpdateOffset", "GetOffset", "QueryOffset", "SyncLiteSubscription"}
)
SERVICE: Final = s.DESCRIPTOR.services_by_name["MessagingService"]
#: Deadlines: of a unary call, of a stream (a receive may be held for all but half a second).
UNARY_TIMEOUT: Final = 5.0
STREAM_TIMEOUT: Final = 1.5
#: Tries of a call whose status grpcio lost (its "Internal error from Core", see e2e.fuzzing).
LOST_RETRIES: Final = 3
MAX_BODY: Final = 256 * 1024  # the test brokers' max_message_size (e2e.harness.BROKER_ENV)

CLIENT_ID: Final = "fuzz-v2@1@1@abc"
MD: Final = (("x-mq-client-id", CLIENT_ID),)
GROUP: Final = "FuzzV2Group"
TOPICS: Final = {
    "FuzzV2": MessageType.MIXED,
    "FuzzV2Normal": MessageType.NORMAL,
    "FuzzV2Fifo": MessageType.FIFO,
    "FuzzV2Delay": MessageType.DELAY,
    "FuzzV2Txn": MessageType.TRANSACTION,
}
AFTER_TOPIC: Final = "FuzzV2After"
BROKERS: Final = ("broker-a", "broker-b")
BAD: Final = frozenset({d.CODE_UNSPECIFIED, d.INTERNAL_ERROR, d.INTERNAL_SERVER_ERROR})
CODES: Final = frozenset(v.number for v in d.Code.DESCRIPTOR.values)
SQL: Final = (
    "a = 'b'",
    "TAGS IN ('TagA', 'TagB') AND color IS NOT NULL",
    "n BETWEEN -9223372036854775809 AND 1e309",
    "NOT (x <> 'y' OR z > 3)",
    "a = 'b' AND (",
    "))) ?? !!",
    "a IN ()",
    "'unterminated",
    "x = 1 AND " * 400 + "TRUE",
    "TRUE",
)
TAGS: Final = ("*", "", "TagA", "TagA || TagB", "||", "TagA ||", " || ", "a\x00b")


@dataclass
class Known:
    """What exists in the cluster, for plausible values."""

    ids: list[str] = field(default_factory=list)
    handles: list[str] = field(default_factory=list)
    transactions: list[str] = field(default_factory=list)
    recalls: list[str] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)


# -- values --------------------------------------------------------------------------------------


def integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [lo, hi, lo + 1, hi - 1, 0, 1, -1, 2**31 - 1, -(2**31), 2**32 - 1, 2**63 - 1]
    return st.one_of(
        st.integers(max(lo, -3), min(hi, 40)),
        st.sampled_from([v for v in edges if lo <= v <= hi]),
        st.integers(lo, hi),
    )


WILD_TEXT: Final = st.one_of(
    st.text(max_size=40),
    st.sampled_from(HOSTILE_STRINGS),
    st.binary(max_size=64).map(lambda b: b.decode("latin-1")),  # random bytes, as text can be
)
GZIPPED: Final = (gzip.compress(b"zipped body"), gzip.compress(b"\0" * (4 * MAX_BODY)))
WILD_BYTES: Final = st.one_of(
    st.binary(max_size=64),
    st.sampled_from((0, 1, MAX_BODY, MAX_BODY + 1, 1 << 20)).map(lambda n: b"x" * n),
    st.sampled_from((*GZIPPED, b"\x1f\x8b\x08\x00broken", b"x\x9c\x03\x00")),
)
#: Durations and timestamps: any seconds and nanos protobuf carries, most beyond the valid.
WILD_INT64: Final = st.one_of(st.sampled_from((*INT64, 2**62, -(2**62), 0)), st.integers(*INT64))
WILD_TIMES: Final = {
    "google.protobuf.Duration": st.builds(Duration, seconds=WILD_INT64, nanos=integers(*INT32)),
    "google.protobuf.Timestamp": st.builds(Timestamp, seconds=WILD_INT64, nanos=integers(*INT32)),
}


def durations(lo_ms: int, hi_ms: int) -> st.SearchStrategy[Duration]:
    return st.integers(lo_ms, hi_ms).map(lambda ms: Duration(seconds=ms // 1000))


def timestamps(lo_s: int, hi_s: int) -> st.SearchStrategy[Timestamp]:
    return st.integers(lo_s, hi_s).map(lambda x: Timestamp(seconds=int(time.time()) + x))


#: The fields of :func:`tame_values` that are messages (a name may be of two kinds of field:
#: ``expression`` is text in a FilterExpression, a FilterExpression in a SubscriptionEntry).
TIMES: Final = frozenset(
    {"invisible_duration", "long_polling_timeout", "delivery_timestamp", "born_timestamp"}
)


def tame_values(k: Known) -> dict[str, st.SearchStrategy[Any]]:
    """Plausible values by field name."""
    broker = st.sampled_from(BROKERS)
    small = st.integers(0, 40)
    ids = st.sampled_from(k.ids)
    handle = st.builds(lambda *a: Handle(*a).encode(), broker, small, small, integers(*INT64))
    tid = st.builds(lambda b, o, u: f"{b}|{o}|{u}", broker, integers(*INT64), ids)
    recall = st.builds(
        lambda b, due, u, t: encode_handle_text(b, str(due), u, t),
        broker,
        integers(*INT64),
        ids,
        st.sampled_from(list(TOPICS)),
    )
    return {
        "name": st.sampled_from([*TOPICS, GROUP, "NoSuchTopic"]),
        "resource_namespace": st.just(""),
        "message_id": ids,
        "receipt_handle": st.one_of(st.sampled_from(k.handles), handle),
        "transaction_id": st.one_of(st.sampled_from(k.transactions), tid),
        "recall_handle": st.one_of(st.sampled_from(k.recalls), recall),
        "expression": st.one_of(st.sampled_from(TAGS), st.sampled_from(SQL)),
        "tag": st.sampled_from(("TagA", "TagB")),
        "keys": st.sampled_from(("k1", "k2")),
        "key": st.sampled_from(("color", "size")),  # of user_properties
        "value": st.sampled_from(("blue", "")),
        "message_group": st.sampled_from(("g1", "g2")),
        "body": st.sampled_from((b"body", GZIPPED[0])),
        "body_encoding": st.sampled_from((d.IDENTITY, d.GZIP)),
        "born_host": st.sampled_from(("10.0.0.7", "::1", "host.example")),
        "host": st.sampled_from(k.hosts),
        "port": st.sampled_from(k.ports),
        "batch_size": st.integers(1, 32),
        "id": st.sampled_from((-1, 0, 1, 3)),
        "delivery_attempt": st.integers(1, 20),
        "max_delivery_attempts": st.integers(1, 20),
        "invisible_duration": durations(0, 60_000),
        "long_polling_timeout": durations(0, 1_000),
        "delivery_timestamp": timestamps(-10, 3_600),
        "born_timestamp": timestamps(-10, 0),
    }


#: Good requests of each RPC in protobuf's text format (Telemetry's: a command, written twice as
#: clients do), the fuzz's starting points; ``$names`` are what the cluster has. Ack, re-arm and
#: dead-letter get a third of the receipt handles each.
MESSAGE: Final = (
    'messages {topic {name: "$topic"} body: "fuzz" user_properties {key: "color" value: "blue"} '
    'system_properties {tag: "TagA" keys: "k1" message_id: "$id" born_host: "10.0.0.7" '
    "body_encoding: IDENTITY $more}}"
)
GROUP_TOPIC: Final = 'group {name: "FuzzV2Group"} topic {name: "FuzzV2"}'
SUBSCRIPTION: Final = (
    'subscription {group {name: "FuzzV2Group"} long_polling_timeout {seconds: 1} '
    'subscriptions {topic {name: "FuzzV2"} expression {type: TAG expression: "*"}}} '
    'user_agent {language: PYTHON version: "5.1.2" hostname: "fuzz"}'
)
RECEIVE: Final = (
    'group {name: "FuzzV2Group"} message_queue {topic {name: "FuzzV2"} id: -1 '
    'permission: READ_WRITE broker {name: "broker-a"}} batch_size: 4 '
    "invisible_duration {seconds: 30} long_polling_timeout {seconds: 0} "
)
ENDPOINTS: Final = 'endpoints {scheme: IPv4 addresses {host: "$host" port: $port}}'
TEMPLATES: Final = {
    "QueryRoute": ['topic {name: "FuzzV2"} ' + ENDPOINTS],
    "Heartbeat": ['group {name: "FuzzV2Group"} client_type: SIMPLE_CONSUMER'],
    "SendMessage": [
        MESSAGE.replace("$topic", "FuzzV2").replace("$more", "message_type: NORMAL"),
        MESSAGE.replace("$topic", "FuzzV2Normal").replace("$more", "message_type: NORMAL"),
        MESSAGE.replace("$topic", "FuzzV2Fifo").replace(
            "$more", 'message_group: "g1" message_type: FIFO'
        ),
        MESSAGE.replace("$topic", "FuzzV2Delay").replace(
            "$more", "delivery_timestamp {seconds: $later} message_type: DELAY"
        ),
        MESSAGE.replace("$topic", "FuzzV2Txn").replace("$more", "message_type: TRANSACTION"),
    ],
    "QueryAssignment": [GROUP_TOPIC + " " + ENDPOINTS],
    "ReceiveMessage": [
        RECEIVE + 'filter_expression {type: TAG expression: "*"}',
        RECEIVE + 'filter_expression {type: SQL expression: "TRUE"} auto_renew: true',
    ],
    "AckMessage": [GROUP_TOPIC + ' entries {message_id: "$id" receipt_handle: "$handle"}'],
    "ChangeInvisibleDuration": [
        GROUP_TOPIC
        + ' receipt_handle: "$handle" message_id: "$id" invisible_duration {seconds: 20}'
    ],
    "ForwardMessageToDeadLetterQueue": [
        GROUP_TOPIC + ' receipt_handle: "$handle" message_id: "$id" delivery_attempt: 17 '
        "max_delivery_attempts: 17"
    ],
    "EndTransaction": [
        f'topic {{name: "FuzzV2Txn"}} message_id: "$id" transaction_id: "$tid" resolution: {r} '
        "source: SOURCE_CLIENT"
        for r in ("COMMIT", "ROLLBACK", "TRANSACTION_RESOLUTION_UNSPECIFIED")
    ],
    "Telemetry": [
        'settings {client_type: PRODUCER publishing {topics {name: "FuzzV2"} '
        'topics {name: "FuzzV2Txn"} validate_message_type: true}}',
        "settings {client_type: SIMPLE_CONSUMER " + SUBSCRIPTION + "}",
        "settings {client_type: PUSH_CONSUMER " + SUBSCRIPTION + "}",
    ],
    "NotifyClientTermination": ['group {name: "FuzzV2Group"}'],
    "RecallMessage": ['topic {name: "FuzzV2Delay"} recall_handle: "$recall"'],
}
HANDLE_SLOTS: Final = ("AckMessage", "ChangeInvisibleDuration", "ForwardMessageToDeadLetterQueue")


def templates(k: Known) -> dict[str, list[Any]]:
    """:data:`TEMPLATES` made requests, one per handle, transaction id or recall handle."""
    fixed = {"host": k.hosts[0], "port": str(k.ports[0]), "id": k.ids[0]}
    fixed["later"] = str(int(time.time()) + 600)
    out: dict[str, list[Any]] = {}
    for rpc, texts in TEMPLATES.items():
        desc = SERVICE.methods_by_name[rpc].input_type
        made: list[Any] = []
        for text in texts:
            handles = k.handles[HANDLE_SLOTS.index(rpc) :: 3] if rpc in HANDLE_SLOTS else [""]
            tids = k.transactions if "$tid" in text else [""]
            recalls = k.recalls if "$recall" in text else [""]
            for handle, tid, recall in itertools.product(handles, tids, recalls):
                values = fixed | {"handle": handle, "tid": tid, "recall": recall}
                msg = text_format.Parse(
                    string.Template(text).substitute(values), GetMessageClass(desc)()
                )
                made.append([msg, _copy(msg)] if rpc == "Telemetry" else msg)
        out[rpc] = made
    return out


class Draw:
    """Requests of any v2 RPC: a template with up to three fields replaced or cleared, or one
    built from the descriptor, tame, mixed or wild (the share of its fields that get a plausible
    value rather than a hostile one)."""

    SHARES: Final = {"tame": 95, "mixed": 60, "wild": 15}
    MAX_DEPTH: Final = 4

    def __init__(self, known: Known) -> None:
        self.tame = tame_values(known)
        self.templates = templates(known)

    def request(self, rpc: str) -> st.SearchStrategy[Any]:
        desc = SERVICE.methods_by_name[rpc].input_type
        built: st.SearchStrategy[Any] = self._built(desc)
        if rpc == "Telemetry":
            built = st.lists(built, max_size=3)
        good = self.templates.get(rpc)
        if not good:
            return built
        return st.one_of(self._mutated(good), built)

    def _built(self, desc: Descriptor) -> st.SearchStrategy[Message]:
        @st.composite
        def build(draw: st.DrawFn) -> Message:
            share = self.SHARES[draw(st.sampled_from(list(self.SHARES)))]
            return self._message(draw, desc, share, 0)

        return build()

    def _mutated(self, good: list[Any]) -> st.SearchStrategy[Any]:
        @st.composite
        def mutate(draw: st.DrawFn) -> Any:
            picked = draw(st.sampled_from(good))
            items = [_copy(x) for x in (picked if isinstance(picked, list) else [picked])]
            for m in getattr(items[0], "messages", ()):  # a new message, not a retry
                m.system_properties.message_id = draw(st.uuids()).hex.upper()
            for _ in range(draw(st.integers(0, 3))):
                self._mutate(draw, draw(st.sampled_from(items)))
            return items if isinstance(picked, list) else items[0]

        return mutate()

    def _mutate(self, draw: st.DrawFn, msg: Message) -> None:
        """Replace (mostly with a hostile value) or clear one field anywhere in ``msg``: every
        field of every message inside is as likely, so deep ones are reached too."""
        path = draw(st.sampled_from(paths(msg.DESCRIPTOR)))
        for f in path[:-1]:
            target = getattr(msg, f.name)
            if f.is_repeated:
                at = draw(st.integers(0, len(target) - 1)) if len(target) else 0
                msg = target[at] if len(target) else target.add()
            else:
                msg = target
        msg.ClearField(path[-1].name)
        if draw(st.integers(0, 9)) > 0:
            self._fill(draw, msg, path[-1], self.SHARES["wild"], len(path))

    def _message(self, draw: st.DrawFn, desc: Descriptor, share: int, depth: int) -> Message:
        msg: Message = GetMessageClass(desc)()
        if depth > self.MAX_DEPTH:
            return msg
        chosen = {
            o.name: draw(st.sampled_from([*o.fields, None]))
            for o in desc.oneofs
            if len(o.fields) > 1  # a proto3 optional is a oneof of one
        }
        for f in desc.fields:
            o = f.containing_oneof
            if o is not None and o.name in chosen and chosen[o.name] is not f:
                continue
            if draw(st.integers(0, 9)) >= 8:
                continue  # left unset (20%)
            self._fill(draw, msg, f, share, depth)
        return msg

    def _fill(
        self, draw: st.DrawFn, msg: Message, f: FieldDescriptor, share: int, depth: int
    ) -> None:
        entry = f.message_type if f.type == FieldDescriptor.TYPE_MESSAGE else None
        if entry is not None and entry.GetOptions().map_entry:
            target = getattr(msg, f.name)
            for _ in range(draw(st.sampled_from((1, 0, 2, 130 if depth < 2 else 3)))):
                key = self._scalar(draw, entry.fields_by_name["key"], share)
                target[key] = self._scalar(draw, entry.fields_by_name["value"], share)
            return
        if f.is_repeated:
            target = getattr(msg, f.name)
            for _ in range(draw(st.sampled_from((1, 0, 2, 3, 64 if depth == 0 else 1)))):
                if entry is not None:
                    target.add().CopyFrom(self._nested(draw, f, entry, share, depth))
                else:
                    target.append(self._scalar(draw, f, share))
            return
        if entry is not None:
            getattr(msg, f.name).CopyFrom(self._nested(draw, f, entry, share, depth))
        else:
            setattr(msg, f.name, self._scalar(draw, f, share))

    def _plausible(self, draw: st.DrawFn, f: FieldDescriptor, share: int) -> bool:
        if f.name not in self.tame or (f.type == FieldDescriptor.TYPE_MESSAGE) != (f.name in TIMES):
            return False
        return draw(st.integers(0, 99)) < share

    def _nested(
        self, draw: st.DrawFn, f: FieldDescriptor, desc: Descriptor, share: int, depth: int
    ) -> Message:
        if self._plausible(draw, f, share):
            tame: Message = draw(self.tame[f.name])
            return tame
        if desc.full_name in WILD_TIMES:
            wild: Message = draw(WILD_TIMES[desc.full_name])
            return wild
        return self._message(draw, desc, share, depth + 1)

    def _scalar(self, draw: st.DrawFn, f: FieldDescriptor, share: int) -> Any:
        if self._plausible(draw, f, share):
            return draw(self.tame[f.name])
        t = f.type
        if t in INT_RANGES:
            return draw(integers(*INT_RANGES[t]))
        if t == FieldDescriptor.TYPE_BOOL:
            return draw(st.booleans())
        if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            return draw(st.floats(allow_nan=True, allow_infinity=True, width=32))
        if t == FieldDescriptor.TYPE_ENUM:
            assert f.enum_type is not None
            defined = [v.number for v in f.enum_type.values]
            return draw(st.sampled_from([*defined[1:], defined[0], 7, 99, -1, *INT32]))
        if t == FieldDescriptor.TYPE_STRING:
            return draw(WILD_TEXT)
        if t == FieldDescriptor.TYPE_BYTES:
            return draw(WILD_BYTES)
        raise AssertionError(f"field {f.full_name}: type {t} is not drawn; add it")


def paths(desc: Any, depth: int = 0) -> list[tuple[FieldDescriptor, ...]]:
    """Every field of ``desc`` and of the messages inside it (not their maps, durations and
    timestamps, which are replaced whole), as the fields that lead to it."""
    out: list[tuple[FieldDescriptor, ...]] = []
    for f in desc.fields:
        out.append((f,))
        inner = f.message_type if f.type == FieldDescriptor.TYPE_MESSAGE else None
        if inner is None or inner.GetOptions().map_entry or inner.full_name in WILD_TIMES:
            continue
        if depth < 3:
            out += [(f, *rest) for rest in paths(inner, depth + 1)]
    return out


def _copy(msg: Message) -> Message:
    out: Message = type(msg)()
    out.CopyFrom(msg)
    return out


PRINTABLE: Final = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300)
#: Metadata: the client id mostly, else none, a random one, or beside a random authorization.
METADATA: Final = st.integers(0, 9).flatmap(
    lambda roll: (
        st.just(MD)
        if roll < 6
        else st.one_of(
            st.just(()),
            st.builds(lambda c: (("x-mq-client-id", c),), PRINTABLE),
            st.builds(lambda a: (*MD, ("authorization", a)), PRINTABLE),
        )
    )
)


# -- calling and checking ------------------------------------------------------------------------


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: list[Any]


def _commands(commands: list[Any], done: threading.Event) -> Iterator[s.TelemetryCommand]:
    yield from commands
    done.wait(STREAM_TIMEOUT)  # the stream stays open until every Settings is answered


def call(stub: sg.MessagingServiceStub, rpc: str, request: Any, md: Any) -> Outcome:
    """One call; its gRPC status and the responses it got."""
    method = getattr(stub, rpc)
    out: list[Any] = []
    done = threading.Event()
    try:
        if rpc == "Telemetry":
            want = sum(c.HasField("settings") for c in request)
            if not want:
                done.set()
            for answer in method(_commands(request, done), metadata=md, timeout=STREAM_TIMEOUT):
                out.append(answer)
                if sum(x.HasField("status") for x in out) >= want:
                    done.set()
        elif SERVICE.methods_by_name[rpc].server_streaming:
            out.extend(method(request, metadata=md, timeout=STREAM_TIMEOUT))
        else:
            out.append(method(request, metadata=md, timeout=UNARY_TIMEOUT))
    except grpc.RpcError as exc:
        return Outcome(exc.code(), exc.details() or "", out)
    finally:
        done.set()
    return Outcome(grpc.StatusCode.OK, "", out)


def status_problems(where: str, status: d.Status) -> list[str]:
    code = status.code
    if code not in CODES:
        return [f"{where}: code {code} is not one of the protocol's ({status.message!r})"]
    name = d.Code.Name(code)
    if code in BAD:
        return [f"{where}: {name} {status.message!r}"]
    if code != d.OK and not status.message.strip():
        return [f"{where}: {name} without a sentence"]
    return []


def problems(rpc: str, request: Any, outcome: Outcome) -> list[str]:
    """What is wrong with the outcome of one call (nothing: an empty list)."""
    found: list[str] = []
    if outcome.code not in (grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED):
        found.append(f"gRPC status {outcome.code.name}: {outcome.details!r}")
    statuses = [r.status for r in outcome.responses if r.HasField("status")]
    for i, r in enumerate(outcome.responses):
        if r.HasField("status"):
            found += status_problems(f"response {i}", r.status)
        for j, e in enumerate(getattr(r, "entries", ())):
            found += status_problems(f"response {i} entries[{j}]", e.status)
    if outcome.code != grpc.StatusCode.OK:
        return found
    if rpc != "Telemetry" and not statuses:
        found.append("no status in the answer")
    if rpc == "Telemetry":
        want = sum(c.HasField("settings") for c in request)
        refused = any(x.code != d.OK for x in statuses)
        if len(statuses) < want and not refused:
            found.append(f"{want} Settings written, {len(statuses)} answered")
    if rpc == "ReceiveMessage":
        messages = [r.message for r in outcome.responses if r.HasField("message")]
        if messages and statuses[-1:] != [d.Status(code=d.OK, message="OK")]:
            found.append(f"{len(messages)} messages beside status {statuses[-1:]}")
        for m in messages:
            sp = m.system_properties
            encoded = sp.body_encoding in (d.IDENTITY, d.GZIP)
            if not sp.receipt_handle or sp.delivery_attempt < 1 or not encoded:
                found.append(f"a message that cannot be acked: {sp}")
    return found


# -- the cluster ---------------------------------------------------------------------------------


def v2_message(topic: str, body: bytes, mid: str, **sp: Any) -> d.Message:
    return d.Message(
        topic=d.Resource(name=topic),
        body=body,
        system_properties=d.SystemProperties(message_id=mid, body_encoding=d.IDENTITY, **sp),
    )


def routed(stub: sg.MessagingServiceStub, topic: str) -> bool:
    r = stub.QueryRoute(s.QueryRouteRequest(topic=d.Resource(name=topic)), metadata=MD, timeout=5)
    return r.status.code == d.OK and {q.broker.name for q in r.message_queues} == set(BROKERS)


def sent(stub: sg.MessagingServiceStub, m: d.Message) -> s.SendResultEntry:
    r = stub.SendMessage(s.SendMessageRequest(messages=[m]), metadata=MD, timeout=5)
    assert r.status.code == d.OK, r
    entry: s.SendResultEntry = r.entries[0]
    return entry


def received(
    stub: sg.MessagingServiceStub, topic: str, invisible_s: int, group: str = GROUP
) -> list[d.Message]:
    req = s.ReceiveMessageRequest(
        group=d.Resource(name=group),
        message_queue=d.MessageQueue(topic=d.Resource(name=topic), id=-1),
        filter_expression=d.FilterExpression(type=d.TAG, expression="*"),
        batch_size=32,
        invisible_duration=Duration(seconds=invisible_s),
        long_polling_timeout=Duration(seconds=5),
    )
    answers = stub.ReceiveMessage(req, metadata=MD, timeout=10)
    return [r.message for r in answers if r.HasField("message")]


def seed_cluster(cluster: Cluster, by_broker: dict[str, sg.MessagingServiceStub]) -> Known:
    """Topics of every type on both brokers, and at each broker stored messages, messages in
    flight, a delay message and an open transaction."""
    with SyncAdminClient(cluster.namesrv) as admin:
        for name, kind in TOPICS.items():
            admin.create_or_update_topic(name, queues=2, message_type=kind)
    for name in TOPICS:
        wait_until(functools.partial(routed, by_broker[BROKERS[0]], name), 20, f"{name} routed")
    k = Known()
    k.hosts = [b.address.rsplit(":", 1)[0] for b in cluster.brokers]
    k.ports = [int(b.address.rsplit(":", 1)[1]) for b in cluster.brokers]
    later = Timestamp(seconds=int(time.time()) + 3600)
    for i, broker in enumerate(BROKERS):
        stub = by_broker[broker]
        for j in range(16):
            mid = f"01F0{i:02X}{j:02X}{'0' * 26}"
            k.ids.append(mid)
            sent(stub, v2_message("FuzzV2", b"seed %d" % j, mid, tag="TagA", keys=["k1"]))
        k.ids.append(mid := f"01F1{i:02X}{'0' * 28}")
        delay = v2_message("FuzzV2Delay", b"later", mid, delivery_timestamp=later)
        k.recalls.append(sent(stub, delay).recall_handle)
        k.ids.append(mid := f"01F2{i:02X}{'0' * 28}")
        half = v2_message("FuzzV2Txn", b"half", mid, message_type=d.TRANSACTION)
        k.transactions.append(sent(stub, half).transaction_id)
        got = received(stub, "FuzzV2", 3600)
        assert len(got) >= 12, f"{len(got)} of 16 messages received from {broker}"
        k.handles += [m.system_properties.receipt_handle for m in got[:12]]
    return k


# -- the test ------------------------------------------------------------------------------------


def fuzz_rpc(
    rpc: str,
    draw: Draw,
    by_broker: dict[str, sg.MessagingServiceStub],
    examples: int,
    codes: Counter[str],
) -> str | None:
    """``examples`` calls of ``rpc`` at either broker (the codes of the answers counted in
    ``codes``); hypothesis' smallest failing call, or None."""

    @seed(SEED)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=(
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
            HealthCheck.filter_too_much,
        ),
        report_multiple_bugs=False,
    )
    @given(req=draw.request(rpc), md=METADATA, broker=st.sampled_from(BROKERS))
    def one(req: Any, md: Any, broker: str) -> None:
        for _ in range(LOST_RETRIES):
            outcome = call(by_broker[broker], rpc, req, md)
            lost = outcome.code == grpc.StatusCode.INTERNAL
            if not (lost and outcome.details == "Internal error from Core"):
                break
        for r in outcome.responses:
            if r.HasField("status"):
                codes[d.Code.Name(r.status.code)] += 1
        if outcome.code != grpc.StatusCode.OK:
            codes[f"gRPC {outcome.code.name}"] += 1
        wrong = problems(rpc, req, outcome)
        assert not wrong, f"{rpc} at {broker}: " + "; ".join(wrong)

    try:
        one()
    except AssertionError as exc:
        notes = "\n".join(getattr(exc, "__notes__", ()))
        return f"{exc}\n{notes[:3000]}"
    return None


def after_the_fuzz(cluster: Cluster, by_broker: dict[str, sg.MessagingServiceStub]) -> None:
    """Every member healthy; a good send, receive and ack at each broker."""
    for p in cluster.state.all():
        assert asyncio.run(check_health(p.address, 5.0)), f"{p.name} does not answer its health"
    with SyncAdminClient(cluster.namesrv) as admin:
        admin.create_or_update_topic(AFTER_TOPIC, queues=2, message_type=MessageType.NORMAL)
    for i, broker in enumerate(BROKERS):
        stub = by_broker[broker]
        wait_until(functools.partial(routed, stub, AFTER_TOPIC), 20, f"{AFTER_TOPIC} routed")
        sent(stub, v2_message(AFTER_TOPIC, b"after the fuzz", f"01FA{i:02X}{'0' * 28}"))
        got = received(stub, AFTER_TOPIC, 30, group="FuzzV2After")
        assert [m.body for m in got] == [b"after the fuzz"], got
        sp = got[0].system_properties
        r = stub.AckMessage(
            s.AckMessageRequest(
                group=d.Resource(name="FuzzV2After"),
                topic=d.Resource(name=AFTER_TOPIC),
                entries=[
                    s.AckMessageEntry(message_id=sp.message_id, receipt_handle=sp.receipt_handle)
                ],
            ),
            metadata=MD,
            timeout=5,
        )
        assert r.status.code == d.OK, r


def test_every_request_type_of_the_service_can_be_drawn() -> None:
    assert len(SERVICE.methods) >= 16, [m.name for m in SERVICE.methods]
    assert {m.name for m in SERVICE.methods} >= REFUSING
    known = Known(["ID"], ["h", "h", "h"], ["b|1|ID"], ["r"], ["127.0.0.1"], [1])
    draw = Draw(known)
    assert set(draw.templates) | REFUSING == {m.name for m in SERVICE.methods}
    for m in SERVICE.methods:
        types = {m.input_type.full_name}

        @seed(SEED)
        @settings(max_examples=20, deadline=None, database=None)
        @given(req=draw.request(m.name))
        def drawn(req: Any) -> None:
            for r in req if isinstance(req, list) else [req]:
                assert r.DESCRIPTOR.full_name in types  # noqa: B023 (run in this turn)
                r.SerializeToString()  # every value drawn is one protobuf takes

        drawn()


def test_fuzzing_every_v2_rpc_gets_a_status_and_breaks_nothing(
    start_cluster: ClusterFactory,
) -> None:
    print(f"fuzz seed {SEED} (APOGEE_FUZZ_SEED={SEED} repeats this run)")
    cluster = start_cluster("fuzz-v2", brokers=2, nameservers=1)
    channels = {b.name: grpc.insecure_channel(b.address) for b in cluster.brokers}
    by_broker = {name: sg.MessagingServiceStub(ch) for name, ch in channels.items()}
    findings: list[str] = []
    try:
        assert sorted(by_broker) == sorted(BROKERS), by_broker
        draw = Draw(seed_cluster(cluster, by_broker))
        for m in SERVICE.methods:
            started = time.monotonic()
            codes: Counter[str] = Counter()
            n = int(EXAMPLES * WEIGHTS.get(m.name, 0.25 if m.name in REFUSING else 1.0))
            finding = fuzz_rpc(m.name, draw, by_broker, n, codes)
            tally = ", ".join(f"{c} {n}" for c, n in codes.most_common())
            print(f"  {m.name} ({time.monotonic() - started:.1f}s): {tally}")
            if finding is not None:
                findings.append(finding)
        after_the_fuzz(cluster, by_broker)
    finally:
        for ch in channels.values():
            ch.close()
    logged = log_problems(cluster)
    report = []
    if findings:
        report.append(f"{len(findings)} RPCs answered badly (seed {SEED}):")
        report += findings
    if logged:
        report.append(f"{len(logged)} tracebacks or ERROR lines in the logs (seed {SEED}):")
        report += logged[:10]
    assert not report, "\n\n".join(report)
    cluster.stop()
