"""The topics a broker holds: their queue counts and permissions, kept in ``topics.json``.

The file lives in the broker's data directory. A change appends only the topic it changed to
the journal beside it, ``topics.journal`` (:mod:`apogee_broker.core.journal`: CRC-framed,
numbered records, fsynced), so creating a topic costs the same with ten topics or fifty
thousand; ``topics.json`` is the snapshot, written atomically (temp file, fsync, rename; see
:mod:`apogee.store.metadata`) at the first change after a start that found no snapshot of this
shape and whenever the journal would outgrow it, after which the journal starts anew. A crash
leaves the old table or the new, never a torn one. The snapshot's content::

    {"version": 1, "seq": 12,
     "topics": {"Orders": {"read_queues": 8, "write_queues": 8, "perm": 6,
                           "message_type": "FIFO"}, ...}}

``seq`` numbers the last change the snapshot holds; loading applies the journal's records
numbered above it (a record names a topic and its config, or ``null`` for a deleted one). A
snapshot without ``seq`` (an earlier version's) has no journal: one found beside it is not
applied. A replica group's followers keep the same two files from the group's state records
(:mod:`apogee_broker.replication.state`). A damaged journal record
ends the replay there, with a warning naming the file and the byte offset.

A topic without ``message_type`` (every topic written before types existed) reads as MIXED, so
it keeps taking every type of message; it is written with its type at the next change.

Only the topics users made are stored. The system topics are the broker's own and always present,
defined here rather than read back: ``TBW102`` (the template of auto-created topics, with
``default_topic_queues`` queues and perm read|write|inherit), ``SCHEDULE_TOPIC_XXXX`` (one queue
per delay level), and the transaction topics with one queue each. Nobody can change or delete them
(:class:`PermissionDeniedError`). ``%RETRY%<group>`` and ``%DLQ%<group>`` topics are ordinary
topics: they can be created, changed, written to and deleted.

All methods run on the broker's event loop; a change calls the listeners (registration with the
nameservers, so routes follow at once).
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

from apogee.common.errors import (
    CorruptRecordError,
    InvalidArgumentError,
    PermissionDeniedError,
    UnknownTopicError,
)
from apogee.common.topics import (
    ALL_PERMS,
    AUTO_CREATE_TEMPLATE_TOPIC,
    READ_WRITE,
    SCHEDULE_TOPIC,
    TRANS_CHECK_MAX_TIME_TOPIC,
    TRANS_HALF_TOPIC,
    TRANS_OP_HALF_TOPIC,
    Perm,
    is_system_topic,
    parse_message_type,
    validate_topic,
)

# re-exported (PEP 484's `X as X`) for the broker's modules: the one definition lives in common
from apogee.common.topics import TopicConfig as TopicConfig  # noqa: PLC0414
from apogee.common.topics import perm_text as perm_text  # noqa: PLC0414
from apogee.store.metadata import read_json
from apogee_broker.core import journal

log = logging.getLogger(__name__)

#: Queues of SCHEDULE_TOPIC_XXXX by default: 32 for delay levels, then the timer wheel's slots
#: (apogee_broker.core.schedule.layout.ScheduleLayout says which is which).
SCHEDULE_QUEUES: Final = 32 + 1440
FILE_NAME: Final = "topics.json"
FILE_VERSION: Final = 1
JOURNAL_NAME: Final = "topics.journal"
#: what the journal's records hold their changes under, and what warnings call it
JOURNAL_KEY: Final = "topics"
JOURNAL_WHAT: Final = "topic table journal"


def system_topics(
    default_topic_queues: int, schedule_queues: int = SCHEDULE_QUEUES
) -> dict[str, TopicConfig]:
    """The topics every broker holds, as it defines them."""
    rw = READ_WRITE
    return {
        t.name: t
        for t in (
            TopicConfig(
                AUTO_CREATE_TEMPLATE_TOPIC,
                default_topic_queues,
                default_topic_queues,
                ALL_PERMS,
                True,
            ),
            TopicConfig(SCHEDULE_TOPIC, schedule_queues, schedule_queues, rw, True),
            TopicConfig(TRANS_HALF_TOPIC, 1, 1, rw, True),
            TopicConfig(TRANS_OP_HALF_TOPIC, 1, 1, rw, True),
            TopicConfig(TRANS_CHECK_MAX_TIME_TOPIC, 1, 1, rw, True),
        )
    }


class TopicManager:
    """The topic table of one broker, persisted in ``<data_dir>/topics.json``."""

    def __init__(
        self,
        data_dir: Path,
        *,
        default_topic_queues: int = 8,
        max_queues: int = 1024,
        auto_create: bool = False,
        max_topic_length: int = 127,
        broker_name: str = "broker",
        schedule_queues: int = SCHEDULE_QUEUES,
    ) -> None:
        self.path = Path(data_dir) / FILE_NAME
        self.files = journal.JournaledFile(
            self.path, Path(data_dir) / JOURNAL_NAME, JOURNAL_KEY, JOURNAL_WHAT
        )
        self.max_queues = max_queues
        self.auto_create = auto_create
        self.max_topic_length = max_topic_length
        self.broker_name = broker_name
        self._system = system_topics(default_topic_queues, schedule_queues)
        self._topics: dict[str, TopicConfig] = dict(self._system)
        #: the table's digest, computed at its first use (None: not yet)
        self._digest: int | None = None
        self._listeners: list[Callable[[str], None]] = []
        #: a replica group's leader: each change as it is made, as (topic, its entry in the
        #: file's shape or None when deleted, whether the change wrote a whole snapshot)
        self.on_change: Callable[[str, dict[str, Any] | None, bool], None] | None = None

    # -- life -----------------------------------------------------------------------------------

    def load(self) -> int:
        """Read ``topics.json`` (or its backup); returns how many user topics it held. A file
        that is damaged beyond its backup raises :class:`CorruptRecordError` naming it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = read_json(self.path)
        replay = self.files.journal.read()
        seq = journal.snapshot_seq(data)
        applied = journal.apply_replay(data, JOURNAL_KEY, replay, seq, apply_changes)
        if seq is None and replay.records:
            log.warning(
                "topic table journal %s not applied: the snapshot %s has no sequence number (an "
                "earlier version's, or a replica's copy); the next change writes both anew",
                self.files.journal.path,
                self.path,
            )
        self.files.loaded(seq, replay, applied)
        topics: dict[str, TopicConfig] = dict(self._system)
        if data is not None:
            for name, entry in _entries(data, self.path):
                if is_system_topic(name):
                    continue  # the broker defines its own
                try:
                    validate_topic(name, self.max_topic_length)
                    topics[name] = self._checked(
                        TopicConfig(
                            name,
                            int(entry["read_queues"]),
                            int(entry["write_queues"]),
                            int(entry["perm"]),
                            message_type=parse_message_type(
                                str(entry.get("message_type", "")), "message_type"
                            ),
                        )
                    )
                except (KeyError, TypeError, ValueError, InvalidArgumentError) as exc:
                    raise CorruptRecordError(
                        where=str(self.path), detail=f"topic {name!r}: {exc}"
                    ) from exc
        self._topics = topics
        self._digest = None
        loaded = len(topics) - len(self._system)
        log.info(
            "%d topics loaded from %s and %d records of %s (and %d system topics)",
            loaded,
            self.path,
            applied,
            self.files.journal.path,
            len(self._system),
        )
        return loaded

    def snapshot(self) -> dict[str, Any]:
        """The table as ``topics.json`` holds it."""
        return _to_json(self._topics.values())

    def add_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(name)`` after every change of the table, with the topic changed."""
        self._listeners.append(listener)

    # -- reading --------------------------------------------------------------------------------

    def get(self, name: str) -> TopicConfig | None:
        return self._topics.get(name)

    def require(self, name: str) -> TopicConfig:
        """The topic, or :class:`UnknownTopicError` naming it and this broker."""
        topic = self._topics.get(name)
        if topic is None:
            validate_topic(name, self.max_topic_length)
            raise UnknownTopicError(
                topic=name, detail=f"does not exist on broker {self.broker_name}"
            )
        return topic

    def list_topics(self, include_system: bool = True) -> list[TopicConfig]:
        """Every topic, sorted by name."""
        return sorted(
            (t for t in self._topics.values() if include_system or not t.system),
            key=lambda t: t.name,
        )

    def __len__(self) -> int:
        return len(self._topics)

    @property
    def digest(self) -> int:
        """A 64-bit digest of the whole table (every topic's config, system topics included),
        never 0: two tables with the same digest are the same table, in this process or in
        another (a broker restarted), so a nameserver holding a table at this digest holds
        exactly this one. Computed at its first use (the first registration, once the broker
        serves: about 0.15 s with 50,000 topics), then kept up to date at each change, at the
        cost of that change."""
        if self._digest is None:
            self._digest = _digest(self._topics.values())
        return self._digest or 1

    def __contains__(self, name: object) -> bool:
        return name in self._topics

    # -- changing -------------------------------------------------------------------------------

    def put(self, topic: TopicConfig) -> tuple[TopicConfig, bool]:
        """Create ``topic`` or update its queue counts and permission. Returns the stored config
        and whether it was created. Queue counts may shrink: queues beyond the new counts keep
        their messages but get no new ones."""
        validate_topic(topic.name, self.max_topic_length)
        if is_system_topic(topic.name):
            raise PermissionDeniedError(
                what=f"topic {topic.name!r}", rule="is a system topic; it cannot be changed"
            )
        if topic.system:
            raise InvalidArgumentError(
                field="topic.system",
                rule="only the broker's own topics are system topics; leave it false",
            )
        checked = self._checked(topic)
        old = self._topics.get(topic.name)
        if old == checked:
            return checked, False
        self._commit({**self._topics, checked.name: checked}, checked.name)
        log.info(
            "topic %s %s: %d read / %d write queues, perm %s, %s messages",
            checked.name,
            "created" if old is None else "updated",
            checked.read_queues,
            checked.write_queues,
            perm_text(checked.perm),
            checked.message_type.value,
        )
        return checked, old is None

    def delete(self, name: str) -> TopicConfig:
        """Remove a topic from the table (its stored messages stay until retention); returns
        what it was."""
        validate_topic(name, self.max_topic_length)
        if is_system_topic(name):
            raise PermissionDeniedError(
                what=f"topic {name!r}", rule="is a system topic; it cannot be deleted"
            )
        old = self.require(name)
        table = dict(self._topics)
        del table[name]
        self._commit(table, name)
        log.info("topic %s deleted", name)
        return old

    def get_or_create(self, name: str) -> TopicConfig:
        """The topic; when unknown and auto-creation is on, a new one copied from TBW102 (its
        queue counts, its permission without the inherit bit). :class:`UnknownTopicError` when
        unknown and auto-creation is off."""
        topic = self._topics.get(name)
        if topic is not None:
            return topic
        if not self.auto_create:
            validate_topic(name, self.max_topic_length)
            raise UnknownTopicError(
                topic=name,
                detail=f"does not exist on broker {self.broker_name} and auto_create_topics is "
                "off: create it first (PutTopic)",
            )
        template = self._topics[AUTO_CREATE_TEMPLATE_TOPIC]
        created, _ = self.put(
            TopicConfig(
                name, template.read_queues, template.write_queues, template.perm & ~Perm.INHERIT
            )
        )
        return created

    def ensure(self, name: str, queues: int = 1, perm: int = READ_WRITE) -> TopicConfig:
        """The topic, created with ``queues`` queues when it does not exist, whether or not
        auto-creation is on: the broker's own topics of a group (``%RETRY%<group>``,
        ``%DLQ%<group>``)."""
        topic = self._topics.get(name)
        if topic is not None:
            return topic
        validate_topic(name, self.max_topic_length)
        created, _ = self.put(TopicConfig(name, queues, queues, perm))
        log.info("topic %s created for its group", name)
        return created

    # -- helpers --------------------------------------------------------------------------------

    def _checked(self, topic: TopicConfig) -> TopicConfig:
        for field, count in (
            ("read_queues", topic.read_queues),
            ("write_queues", topic.write_queues),
        ):
            if not 1 <= count <= self.max_queues:
                raise InvalidArgumentError(
                    field=f"topic.{field}",
                    rule=f"must be between 1 and {self.max_queues}, got {count}",
                )
        if not 0 <= topic.perm <= ALL_PERMS:
            raise InvalidArgumentError(
                field="topic.perm",
                rule="must combine PERM_READ (4), PERM_WRITE (2) and PERM_INHERIT (1), "
                f"got {topic.perm}",
            )
        return replace(topic, system=False) if topic.system else topic

    def _commit(self, table: dict[str, TopicConfig], changed: str) -> None:
        """Persist ``table``, which differs from the current one in topic ``changed``, and make
        it current (in that order: a failed write changes nothing), then tell the listeners."""
        topic = table.get(changed)
        entry = None if topic is None else _entry(topic)
        record = self.files.record({changed: entry})
        if record is not None:
            self.files.append(record)
        else:
            self.files.write_snapshot(_to_json(table.values()))
        old = self._topics.get(changed)
        if self._digest is not None:
            self._digest ^= (0 if old is None else topic_hash(old)) ^ (
                0 if topic is None else topic_hash(topic)
            )
        self._topics = table
        if self.on_change is not None:
            self.on_change(changed, entry, record is None)
        for listener in self._listeners:
            try:
                listener(changed)
            except Exception:
                log.exception("topic change listener %r failed", listener)


def topic_hash(t: TopicConfig) -> int:
    """A topic config's 64-bit hash, the same in every process (unlike ``hash()``)."""
    fields = _HASHED.pack(t.read_queues, t.write_queues, t.perm, t.system)
    key = fields + t.message_type.value.encode() + b"\0" + t.name.encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


#: a topic's numbers, as :func:`topic_hash` reads them (then its message type and name)
_HASHED: Final = struct.Struct(">IIIB")


def _digest(topics: Iterable[TopicConfig]) -> int:
    """The topics' hashes combined (XOR: a change updates it in O(1), whatever the order)."""
    out = 0
    for t in topics:
        out ^= topic_hash(t)
    return out


def _to_json(topics: Iterable[TopicConfig]) -> dict[str, Any]:
    return {
        "version": FILE_VERSION,
        "topics": {t.name: _entry(t) for t in sorted(topics, key=lambda t: t.name) if not t.system},
    }


def _entry(t: TopicConfig) -> dict[str, Any]:
    return {
        "read_queues": t.read_queues,
        "write_queues": t.write_queues,
        "perm": t.perm,
        "message_type": t.message_type.value,
    }


def read_topics(data_dir: Path) -> dict[str, Any] | None:
    """The content of ``<data_dir>/topics.json`` with its journal applied, without ``seq``;
    None when there is no file (or it holds no JSON object)."""
    path = Path(data_dir) / FILE_NAME
    return journal.read_journaled(
        path,
        journal.Journal(path.with_name(JOURNAL_NAME), JOURNAL_KEY, JOURNAL_WHAT),
        apply_changes,
    )


def apply_changes(table: dict[str, Any], changes: journal.Changes) -> None:
    """Apply one journal record's (or replicated record's) ``changes`` to the topics table
    ``table``: an entry replaces the topic's, None removes it."""
    for name, entry in changes.items():
        if entry is None:
            table.pop(name, None)
        else:
            table[name] = entry


def _entries(data: Any, path: Path) -> list[tuple[str, dict[str, Any]]]:
    if not isinstance(data, dict) or not isinstance(data.get("topics"), dict):
        raise CorruptRecordError(where=str(path), detail="expected {'version': 1, 'topics': {...}}")
    if data.get("version") != FILE_VERSION:
        raise CorruptRecordError(
            where=str(path), detail=f"version {data.get('version')!r} is not {FILE_VERSION}"
        )
    out: list[tuple[str, dict[str, Any]]] = []
    for name, entry in data["topics"].items():
        if not isinstance(entry, dict):
            raise CorruptRecordError(where=str(path), detail=f"topic {name!r} is not an object")
        out.append((name, entry))
    return out
