"""The dedup window rebuilt at start-up from what the CommitLog stored within it.

Every message the window remembers was stored with its ``APOGEE_DEDUP_ID`` property, and its
record says when (the store timestamp) and in which topic, so the window is read back from the
log after any stop, a ``kill -9`` included (after recovery: the log then ends at its last whole
record, and a message it lost was never stored, so sending it again stores it). Reading only
what is needed:

1. Where the window starts: each CommitLog file begins with a record, so the first record's
   store time of each file is a sorted list (files in log order, times as appended); a binary
   search over it finds the last file that began before the window (it holds the window's
   start) - ``log2(files)`` headers read.
2. From there, each file is searched for the property's name (``APOGEE_DEDUP_ID 0x01``) with
   one ``find`` over its map, at memory speed: a file without it (plain producers) is done.
3. A file with some is walked record by record (its header's size leads to the next), and the
   records holding a match are read: those stored within the window, of a user's topic (or of
   the schedule topic, for their ``REAL_TOPIC``: a delayed message is claimed under its real
   topic), give ``(topic, id)``, when they were stored and their queue offset.

Records of the brokers' own topics (retries, dead letters, transactions) are left out: they
never went through the dedup check. What it did is returned as a :class:`RebuildReport`, logged.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from apogee.codec import BLANK, HEADER, HEADER_SIZE, MESSAGE_MAGIC, PROP_REAL_TOPIC
from apogee.codec.layout import FIELD_NAMES, FIELDS, STORE_TIMESTAMP, header_struct
from apogee.common.topics import DLQ_PREFIX, RETRY_PREFIX, SCHEDULE_TOPIC, SYSTEM_TOPICS
from apogee.store import MessageStore
from apogee.store.mapped_file import MappedFile
from apogee_broker.core.send.dedup import DEDUP_PROPERTY, PENDING, DedupWindow

log = logging.getLogger(__name__)

#: What a record holding a dedup id has in its properties (in its body, by chance, too: each
#: match is checked against the record's properties).
_NEEDLE: Final = (DEDUP_PROPERTY + "\x01").encode()
_NEEDLE_LEN: Final = len(_NEEDLE)
_SEP: Final = 0x02
_SEP_BYTE: Final = b"\x02"
_REAL_AT: Final = PROP_REAL_TOPIC + "\x01"
#: The header fields read of a record holding a match: queue offset, store time, body and
#: topic lengths.
_WANTED: Final = header_struct(
    FIELDS,
    skip=set(FIELD_NAMES) - {"queue_offset", "store_timestamp", "body_length", "topic_length"},
)
#: Topics whose records never went through the dedup check (the schedule topic's did, under
#: their real topic): the brokers' own, retries and dead letters.
_SKIPPED: Final = SYSTEM_TOPICS - {SCHEDULE_TOPIC}
_PREFIXES: Final = (RETRY_PREFIX, DLQ_PREFIX)


@dataclass(slots=True)
class RebuildReport:
    """What rebuilding the window read and found."""

    window_s: float
    #: the log offset the walk started from (the start of the file holding the window's start)
    from_offset: int = 0
    files_searched: int = 0
    bytes_searched: int = 0
    #: records walked over in files that hold the property, and records read in full
    records_walked: int = 0
    records_read: int = 0
    #: ids remembered again
    ids: int = 0
    seconds: float = 0.0

    def summary(self) -> str:
        return (
            f"dedup window of {self.window_s:g}s rebuilt: {self.ids} ids from "
            f"{self.records_read} records ({self.records_walked} walked over) in "
            f"{self.files_searched} CommitLog files ({self.bytes_searched} bytes searched) from "
            f"offset {self.from_offset}; {self.seconds:.3f}s"
        )


def rebuild(window: DedupWindow, store: MessageStore, now_ms: int) -> RebuildReport:
    """Remember in ``window`` the ids ``store`` stored within the window before ``now_ms`` (the
    broker's wall clock, the one store timestamps are taken from). Call it before the broker
    takes sends."""
    t0 = time.perf_counter()
    report = RebuildReport(window.window_s)
    cutoff = now_ms - int(window.window_s * 1000)
    files: Sequence[MappedFile] = store.commitlog.files.files
    first = max(0, bisect_left(range(len(files)), cutoff, key=lambda i: _first_stamp(files[i])) - 1)
    if files:
        report.from_offset = files[first].start
    now = window.clock()
    for mf in files[first:]:
        try:
            _scan_file(mf, window, cutoff, now_ms, now, report)
        except (ValueError, OSError) as exc:  # removed by retention under the scan
            log.warning("dedup window: CommitLog file at %d not read: %s", mf.start, exc)
    report.seconds = time.perf_counter() - t0
    log.info("%s", report.summary())
    return report


def _first_stamp(mf: MappedFile) -> int:
    """The store time of the file's first record; one past any time when it holds none."""
    if mf.wrote < HEADER_SIZE:
        return 1 << 62
    f = HEADER.unpack_from(mf.mm, 0)
    return int(f[STORE_TIMESTAMP]) if f[1] == MESSAGE_MAGIC else 1 << 62


def _scan_file(
    mf: MappedFile,
    window: DedupWindow,
    cutoff: int,
    now_ms: int,
    now: float,
    report: RebuildReport,
) -> None:
    mm = mf.mm
    end = mf.wrote
    report.files_searched += 1
    report.bytes_searched += end
    find = mm.find
    hit = find(_NEEDLE, 0, end)
    if hit < 0:
        return
    unpack_head = BLANK.unpack_from
    unpack = _WANTED.unpack_from
    remember = window.remember
    #: a topic's name by its bytes; "" for the topics left out
    topics: dict[bytes, str] = {}
    since = now - now_ms / 1000  # a store time (s) plus this is on the window's clock
    pos = walked = read = ids = 0
    while hit >= 0 and pos + HEADER_SIZE <= end:
        size, magic = unpack_head(mm, pos)
        if magic != MESSAGE_MAGIC or size < HEADER_SIZE or pos + size > end:
            break  # the blank record that ends the file, or the end of the log
        walked += 1
        rec_end = pos + size
        if hit < rec_end:  # in its properties, or by chance in its body
            read += 1
            offset, stored, blen, tlen = unpack(mm, pos)
            props_at = pos + HEADER_SIZE + blen + tlen
            while 0 <= hit < props_at or (hit > props_at and mm[hit - 1] != _SEP):
                hit = find(_NEEDLE, hit + 1, rec_end)  # not a property's name: look on
            if hit >= 0 and stored >= cutoff:
                at = hit + _NEEDLE_LEN
                stop = find(_SEP_BYTE, at, rec_end)
                key = mm[at : stop if stop >= 0 else rec_end].decode(errors="replace")
                raw = mm[props_at - tlen : props_at]
                topic = topics.get(raw)
                if topic is None:
                    topic = topics[raw] = _kept(raw.decode(errors="replace"))
                if topic == SCHEDULE_TOPIC:  # delayed: claimed under the topic it was sent to
                    topic = _real_topic(mm[props_at:rec_end].decode(errors="replace"))
                    offset = PENDING
                seen = since + stored / 1000
                if key and topic and remember(topic, key, seen if seen < now else now, offset):
                    ids += 1
            hit = find(_NEEDLE, rec_end, end)
        pos = rec_end
    report.records_walked += walked
    report.records_read += read
    report.ids += ids


def _kept(topic: str) -> str:
    """``topic``, or "" when its records never went through the dedup check."""
    return "" if topic in _SKIPPED or topic.startswith(_PREFIXES) else topic


def _real_topic(props: str) -> str:
    at = props.find("\x02" + _REAL_AT)
    if at >= 0:
        at += 1
    elif props.startswith(_REAL_AT):
        at = 0
    else:
        return ""
    start = at + len(_REAL_AT)
    end = props.find("\x02", start)
    return props[start:] if end < 0 else props[start:end]
