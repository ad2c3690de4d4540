"""Messages checked and prepared for the CommitLog: the store's side of writing records.

The record format itself (layout, property names, encoding, decoding, CRC) is
:mod:`apogee.codec`; this module applies the store's limits (:class:`StoreConfig`) to a batch
and prepares what does not depend on where the records land (:class:`Encoder`), and computes
the ConsumeQueue tag code of a message.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Final

from apogee.codec import (
    NAME_SEP,
    OWN_FIELDS,
    PROP_KEYS,
    PROP_SEP,
    PROP_TAGS,
    PROP_UNIQ_KEY,
    Message,
    control_character_rule,
    encode_host,
    unique_id_rule,
)
from apogee.common.errors import (
    InvalidArgumentError,
    InvalidPropertyError,
    InvalidQueueIdError,
    MessageTooLargeError,
    PropertiesTooLargeError,
)
from apogee.common.ids import IdGenerator
from apogee.common.topics import MAX_TOPIC_LENGTH
from apogee.common.topics import validate_topic as _validate_topic
from apogee.store.config import StoreConfig

#: The starts of the properties a message's own fields are kept under.
_TAGS_AT: Final = PROP_TAGS + NAME_SEP
_KEYS_AT: Final = PROP_KEYS + NAME_SEP
_UNIQ_AT: Final = PROP_UNIQ_KEY + NAME_SEP


def tag_hash(tags: str | None) -> int:
    """The ConsumeQueue tag code of a tag: CRC-32 of its UTF-8 bytes, 0 for no tag."""
    return zlib.crc32(tags.encode()) if tags else 0


#: Computes a message's ConsumeQueue tag code from (topic, tags, properties, store timestamp).
#: The default is :func:`tag_hash`; the schedule topic puts the delivery time there instead.
TagCode = Callable[[str, "str | None", Mapping[str, str], int], int]


def default_tag_code(topic: str, tags: str | None, props: Mapping[str, str], store_ts: int) -> int:
    return tag_hash(tags)


class Encoder:
    """Validates messages and encodes them into records; one per CommitLog (not thread-safe)."""

    def __init__(
        self, config: StoreConfig, store_host: str = "", tag_code: TagCode | None = None
    ) -> None:
        self._cfg = config
        self._store_host = encode_host(store_host)
        self._tag_code = tag_code
        self._topics: dict[str, bytes] = {}
        self._tag_cache: dict[str, tuple[str, int]] = {}
        self._ids = IdGenerator()

    def topic_bytes(self, topic: str) -> bytes:
        raw = self._topics.get(topic)
        if raw is None:
            raw = validate_topic(topic, self._cfg.max_topic_length).encode()
            if len(self._topics) < 100_000:
                self._topics[topic] = raw
        return raw

    def prepare(self, msgs: Sequence[Message]) -> list[tuple[bytes, bytes, str, int]]:
        """Check a batch and encode what does not depend on placement. Returns, per message,
        its topic bytes, encoded properties, unique id and tag code (-1: compute at append).
        Raises on the first bad message, before anything is written."""
        cfg = self._cfg
        max_q = cfg.max_queues_per_topic
        max_body = cfg.max_message_size
        max_props = cfg.max_properties_size
        topics = self._topics
        tag_cache = self._tag_cache
        custom = self._tag_code is not None
        ids: list[str] | None = None
        out: list[tuple[bytes, bytes, str, int]] = []
        for i, msg in enumerate(msgs):
            topic_b = topics.get(msg.topic)
            if topic_b is None:
                topic_b = self.topic_bytes(msg.topic)
            qid = msg.queue_id
            if not 0 <= qid < max_q:
                raise InvalidQueueIdError(
                    value=qid,
                    rule=f"must be between 0 and {max_q - 1} (max_queues_per_topic)",
                )
            blen = len(msg.body)
            if blen > max_body:
                raise MessageTooLargeError(
                    field="body",
                    size=blen,
                    rule=f"the maximum is {max_body} bytes (max_message_size)",
                )
            if msg.born_host:
                encode_host(msg.born_host)  # checked here, not half-way through the append
            born = msg.born_timestamp
            if (
                msg.flag
                or msg.sys_flag
                or msg.reconsume_times
                or msg.prepared_txn_offset
                or (born and not (type(born) is int and 0 < born < _INT64[1]))
            ):
                _check_numbers(msg)
            uid = msg.unique_id
            if uid:
                rule = unique_id_rule(uid)  # first: it names the id, not a property
                if rule is not None:
                    raise InvalidArgumentError(field="unique_id", rule=rule)
                _check_value("unique_id", uid)
            else:
                if ids is None:
                    ids = self._ids.next_ids(len(msgs))
                uid = ids[i]
            tags = msg.tags
            if tags:
                cached = tag_cache.get(tags)
                if cached is None:
                    _check_value("tags", tags)
                    cached = (f"{_TAGS_AT}{tags}{PROP_SEP}", zlib.crc32(tags.encode()))
                    if len(tag_cache) < 10_000:
                        tag_cache[tags] = cached
                tag_part, code = cached
            else:
                tag_part, code = "", 0
            keys = msg.keys
            if keys:
                for key in keys:
                    if not key or " " in key or NAME_SEP in key or PROP_SEP in key:
                        raise InvalidPropertyError(
                            field="keys",
                            rule=f"key {key!r} must be non-empty, without spaces, \\x01 or \\x02",
                        )
                key_part = f"{_KEYS_AT}{' '.join(keys)}{PROP_SEP}"
            else:
                key_part = ""
            user = msg.properties
            user_part = _encode_user_properties(user) if user else ""
            props = f"{tag_part}{key_part}{_UNIQ_AT}{uid}{PROP_SEP}{user_part}".encode()
            if len(props) > max_props:
                raise PropertiesTooLargeError(
                    size=len(props),
                    rule=f"the maximum is {max_props} bytes (max_properties_size), "
                    "tags, keys and unique id included",
                )
            out.append((topic_b, props, uid, -1 if custom else code))
        return out

    def tag_code_of(self, msg: Message, store_ts: int) -> int:
        if self._tag_code is None:
            return zlib.crc32(msg.tags.encode()) if msg.tags else 0
        return self._tag_code(msg.topic, msg.tags, msg.properties or {}, store_ts)

    @property
    def store_host(self) -> bytes:
        return self._store_host


def _encode_user_properties(props: Mapping[str, str]) -> str:
    parts: list[str] = []
    for name, value in props.items():
        if name in OWN_FIELDS:
            continue  # the message's own fields win
        if not name or NAME_SEP in name or PROP_SEP in name:
            raise InvalidPropertyError(
                field=name, rule="a property name must be non-empty, without \\x01 or \\x02"
            )
        rule = control_character_rule(name)
        if rule is not None:
            raise InvalidPropertyError(field=name, rule=rule)
        _check_value(name, value)
        parts.append(f"{name}{NAME_SEP}{value}{PROP_SEP}")
    return "".join(parts)


def validate_topic(topic: str, max_len: int = MAX_TOPIC_LENGTH) -> str:
    """The topic name rule of :mod:`apogee.common.topics`, the one implementation."""
    return _validate_topic(topic, max_len)


_INT32 = (-(1 << 31), 1 << 31)
_INT64 = (0, 1 << 63)


def _check_numbers(msg: Message) -> None:
    for name, value, (lo, hi) in (
        ("flag", msg.flag, _INT32),
        ("sys_flag", msg.sys_flag, _INT32),
        ("reconsume_times", msg.reconsume_times, (0, 1 << 31)),
        ("born_timestamp", msg.born_timestamp, _INT64),
        ("prepared_txn_offset", msg.prepared_txn_offset, _INT64),
    ):
        if not isinstance(value, int) or not lo <= value < hi:
            raise InvalidArgumentError(
                field=name, rule=f"must be an integer from {lo} to {hi - 1}, got {value!r}"
            )


def _check_value(name: str, value: str) -> None:
    if NAME_SEP in value or PROP_SEP in value:
        raise InvalidPropertyError(field=name, rule="a value must not contain \\x01 or \\x02")
