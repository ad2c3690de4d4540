"""apogee.codec: the CommitLog record format, shared by the store, the broker and the SDK.

- :mod:`apogee.codec.layout`: the record drawn once (its structs, offsets, magics, system flags,
  hosts);
- :mod:`apogee.codec.properties`: the properties' text and the system property names;
- :mod:`apogee.codec.crc`: the CRC-32 every record carries;
- :mod:`apogee.codec.records`: encoding, and decoding into :class:`StoredMessage`;
- :mod:`apogee.codec.view`: decoding a pull's records in place, lazily;
- :mod:`apogee.codec.send`: send records, as a producer encodes a message once and a broker
  appends it (imported from there: ``from apogee.codec.send import encode_send_record``).

Everything is importable from here (``from apogee.codec import HEADER, PROP_TAGS, decode``).
"""

from apogee.codec.body import inflate_problem
from apogee.codec.crc import crc32
from apogee.codec.layout import (
    BLANK,
    BLANK_MAGIC,
    CRC_FROM,
    EMPTY_HOST,
    FIELDS,
    HEAD,
    HEADER,
    HEADER_SIZE,
    HOST_SIZE,
    MESSAGE_MAGIC,
    MIN_BLANK,
    OFFSET,
    SYSFLAG_COMPRESSED,
    SYSFLAG_MULTI_TAGS,
    SYSFLAG_TXN_COMMIT,
    SYSFLAG_TXN_PREPARED,
    SYSFLAG_TXN_ROLLBACK,
    TAIL,
    decode_host,
    encode_host,
)
from apogee.codec.properties import (
    BROKER_PREFIXES,
    BROKER_PROPERTIES,
    MAX_REASON,
    NAME_SEP,
    OWN_FIELDS,
    PROP_ATTEMPTS,
    PROP_DELAY,
    PROP_DELIVER_AT,
    PROP_DLQ_ORIGIN_TOPIC,
    PROP_DLQ_REASON,
    PROP_KEYS,
    PROP_ORIGIN_MSG_ID,
    PROP_REAL_QID,
    PROP_REAL_TOPIC,
    PROP_RETRY_TOPIC,
    PROP_SEP,
    PROP_TAGS,
    PROP_UNIQ_KEY,
    decode_properties,
    encode_properties,
    find_broker_property,
    is_broker_property,
    reserved_property_rule,
)
from apogee.codec.records import Message, StoredMessage, decode, decode_run, encode_record
from apogee.codec.view import RecordView, decode_records

__all__ = [
    "BLANK",
    "BLANK_MAGIC",
    "BROKER_PREFIXES",
    "BROKER_PROPERTIES",
    "CRC_FROM",
    "EMPTY_HOST",
    "FIELDS",
    "HEAD",
    "HEADER",
    "HEADER_SIZE",
    "HOST_SIZE",
    "MAX_REASON",
    "MESSAGE_MAGIC",
    "MIN_BLANK",
    "NAME_SEP",
    "OFFSET",
    "OWN_FIELDS",
    "PROP_ATTEMPTS",
    "PROP_DELAY",
    "PROP_DELIVER_AT",
    "PROP_DLQ_ORIGIN_TOPIC",
    "PROP_DLQ_REASON",
    "PROP_KEYS",
    "PROP_ORIGIN_MSG_ID",
    "PROP_REAL_QID",
    "PROP_REAL_TOPIC",
    "PROP_RETRY_TOPIC",
    "PROP_SEP",
    "PROP_TAGS",
    "PROP_UNIQ_KEY",
    "SYSFLAG_COMPRESSED",
    "SYSFLAG_MULTI_TAGS",
    "SYSFLAG_TXN_COMMIT",
    "SYSFLAG_TXN_PREPARED",
    "SYSFLAG_TXN_ROLLBACK",
    "TAIL",
    "Message",
    "RecordView",
    "StoredMessage",
    "crc32",
    "decode",
    "decode_host",
    "decode_properties",
    "decode_records",
    "decode_run",
    "encode_host",
    "encode_properties",
    "encode_record",
    "find_broker_property",
    "inflate_problem",
    "is_broker_property",
    "reserved_property_rule",
]
