"""The POP journal and the table it keeps: what a restart reads back, a torn tail cut (and
reported), compaction keeping exactly the live state."""

from __future__ import annotations

from pathlib import Path

import pytest

from apogee_broker.core.pop.journal import KIND_CURSOR, KIND_DONE, KIND_POP, Entry, encode
from apogee_broker.core.pop.table import PopTable

pytestmark = pytest.mark.unit


def pop(offset: int, visible_at: int, nonce: int, attempt: int = 1) -> Entry:
    return Entry(KIND_POP, "g", "T", 0, offset, 1000 + offset, 120, attempt, visible_at, nonce)


def state(table: PopTable) -> tuple[int, dict[int, tuple[int, int, int]]]:
    queues = table.queues("g", "T")
    assert queues is not None
    qp = queues[0]
    return qp.cursor, {o: (e.attempt, e.visible_at_ms, e.nonce) for o, e in qp.inflight.items()}


def test_a_restart_reads_back_the_cursor_the_messages_in_flight_and_the_acks(
    tmp_path: Path,
) -> None:
    table = PopTable(tmp_path)
    table.load()
    table.write(
        [Entry(KIND_CURSOR, "g", "T", 0, 3), pop(0, 500, 7), pop(1, 500, 8), pop(2, 500, 9)]
    )
    table.write([Entry(KIND_DONE, "g", "T", 0, 1), pop(2, 900, 10, attempt=2)])
    table.close()
    again = PopTable(tmp_path)
    report = again.load()
    assert (report.records, report.truncated_bytes) == (6, 0)
    assert state(again) == (3, {0: (1, 500, 7), 2: (2, 900, 10)})
    queues = again.queues("g", "T")
    assert queues is not None
    assert [e.offset for e in queues[0].expired(600)] == [0]  # 2 was re-armed until 900
    assert queues[0].committed() == 0
    again.close()


def test_a_record_cut_short_by_a_crash_is_cut_off_and_reported(tmp_path: Path) -> None:
    table = PopTable(tmp_path)
    table.load()
    table.write([Entry(KIND_CURSOR, "g", "T", 0, 1), pop(0, 500, 7)])
    table.close()
    whole = (tmp_path / "journal").stat().st_size
    torn = encode(Entry(KIND_DONE, "g", "T", 0, 0))[:-3]
    with open(tmp_path / "journal", "ab") as f:
        f.write(torn)
    again = PopTable(tmp_path)
    report = again.load()
    assert (report.records, report.truncated_bytes) == (2, len(torn))
    assert (tmp_path / "journal").stat().st_size == whole
    assert state(again) == (1, {0: (1, 500, 7)})  # the torn ack never happened
    again.write([Entry(KIND_DONE, "g", "T", 0, 0)])  # appends after the cut
    again.close()
    last = PopTable(tmp_path)
    last.load()
    assert state(last) == (1, {})
    last.close()


def test_compaction_keeps_the_live_state_only(tmp_path: Path) -> None:
    table = PopTable(tmp_path, compact_bytes=4096)
    table.load()
    for i in range(200):  # each message popped and acked: nothing stays in flight
        table.write([Entry(KIND_CURSOR, "g", "T", 0, i + 1), pop(i, 500, i)])
        table.write([Entry(KIND_DONE, "g", "T", 0, i)])
    table.write([Entry(KIND_CURSOR, "g", "T", 0, 201), pop(200, 700, 1234)])
    size = table.journal.size
    assert size < 4096 + 200  # compacted along the way
    table.close()
    again = PopTable(tmp_path)
    again.load()
    assert state(again) == (201, {200: (1, 700, 1234)})
    again.close()
