"""The epoch checkpoint: entries kept durably in order, Kafka's end-of-epoch lookup, and the point
up to which a follower's log agrees with its leader's."""

from __future__ import annotations

from pathlib import Path

import pytest

from apogee.common.errors import InvalidArgumentError, StoreConfigError
from apogee.store import EpochEntry, EpochFile, consistent_point

pytestmark = pytest.mark.unit


def reopened(path: Path) -> EpochFile:
    f = EpochFile(path)
    f.load()
    return f


def test_missing_file_holds_no_epochs(tmp_path: Path) -> None:
    f = reopened(tmp_path / "epochs")
    assert f.entries == []
    assert f.last is None
    assert f.end_of(3, 100) == (-1, -1)
    assert not (tmp_path / "epochs").exists()


def test_entries_survive_reopen_in_kafkas_layout(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "epochs"
    f = reopened(path)
    f.begin(1, 0)
    f.begin(2, 4096)
    f.begin(5, 4096)  # epoch 2 appended nothing: legal, both are kept
    assert path.read_text() == "0\n3\n1 0\n2 4096\n5 4096\n"
    again = reopened(path)
    assert again.entries == [EpochEntry(1, 0), EpochEntry(2, 4096), EpochEntry(5, 4096)]
    assert again.last == EpochEntry(5, 4096)
    assert not path.with_name("epochs.tmp").exists()


@pytest.mark.parametrize(
    ("epoch", "start", "field", "rule"),
    [
        (2, 200, "epoch", "must be greater than the last epoch (2), got 2"),
        (1, 200, "epoch", "must be greater than the last epoch (2), got 1"),
        (3, 99, "start_offset", "must not be below the last epoch's start (100), got 99"),
        (-1, 0, "epoch", "must not be negative, got -1"),
    ],
)
def test_begin_refuses_out_of_order_entries(
    tmp_path: Path, epoch: int, start: int, field: str, rule: str
) -> None:
    f = reopened(tmp_path / "epochs")
    f.begin(1, 0)
    f.begin(2, 100)
    with pytest.raises(InvalidArgumentError) as caught:
        f.begin(epoch, start)
    assert str(caught.value) == f"{field}: {rule}"
    assert reopened(tmp_path / "epochs").entries == [EpochEntry(1, 0), EpochEntry(2, 100)]


def test_end_of_finds_the_largest_epoch_at_or_below(tmp_path: Path) -> None:
    f = reopened(tmp_path / "epochs")
    for epoch, start in [(2, 0), (4, 100), (7, 250)]:
        f.begin(epoch, start)
    assert f.end_of(1, 400) == (-1, -1)  # older than the first epoch
    assert f.end_of(2, 400) == (2, 100)
    assert f.end_of(3, 400) == (2, 100)  # epoch 3 never appended here: 2 is the largest below
    assert f.end_of(4, 400) == (4, 250)
    assert f.end_of(7, 400) == (7, 400)  # the last one ends at the log's end
    assert f.end_of(9, 400) == (7, 400)


def test_truncate_from_drops_entries_starting_at_or_past_the_offset(tmp_path: Path) -> None:
    f = reopened(tmp_path / "epochs")
    for epoch, start in [(1, 0), (2, 100), (3, 200), (4, 300)]:
        f.begin(epoch, start)
    assert f.truncate_from(200) == 2
    assert f.entries == [EpochEntry(1, 0), EpochEntry(2, 100)]
    assert reopened(tmp_path / "epochs").entries == f.entries
    assert f.truncate_from(500) == 0
    f.begin(3, 150)  # a new epoch may begin where the cut log ends
    assert reopened(tmp_path / "epochs").entries[-1] == EpochEntry(3, 150)


@pytest.mark.parametrize(
    ("text", "line", "rule"),
    [
        ("", 1, "the file must start with a version line and a count line"),
        ("1\n0\n", 1, "the version must be 0, got 1"),
        ("0\nx\n", 2, "the number of entries must be a whole number that is not negative"),
        ("0\n2\n1 0\n", 2, "says 2 entries but the file holds 1"),
        ("0\n1\n1\n", 3, "an entry is '<epoch> <start offset>', got '1'"),
        ("0\n1\n1 -5\n", 3, "the offset must be a whole number that is not negative"),
        ("0\n2\n3 0\n3 10\n", 4, "epoch 3 must be greater than the one before it"),
        ("0\n2\n1 50\n2 10\n", 4, "start offset 10 is below the one before it"),
    ],
)
def test_a_damaged_file_names_the_file_and_line(
    tmp_path: Path, text: str, line: int, rule: str
) -> None:
    path = tmp_path / "epochs"
    path.write_text(text)
    with pytest.raises(StoreConfigError) as caught:
        EpochFile(path).load()
    assert str(caught.value).startswith(f"{path} line {line}: {rule}")


def test_same_history_agrees_up_to_the_shorter_log() -> None:
    history = [(1, 0), (2, 100)]
    assert consistent_point(history, 300, history, 250) == 250
    assert consistent_point(history, 250, history, 300) == 250
    assert consistent_point(history, 300, history, 300) == 300


def test_follower_tail_in_an_epoch_the_leader_never_saw() -> None:
    # the follower led epoch 2 briefly from 180 and appended to 230; the leader never saw it
    leader = [(1, 0), (3, 200)]
    mine = [(1, 0), (2, 180)]
    assert consistent_point(leader, 400, mine, 230) == 180


def test_leader_moved_on_at_a_different_offset() -> None:
    # both hold epoch 1, but the follower kept more of it than the leader had when epoch 2 began
    leader = [(1, 0), (2, 100)]
    mine = [(1, 0)]
    assert consistent_point(leader, 300, mine, 160) == 100
    # the follower is behind within epoch 1: all of its log agrees
    assert consistent_point(leader, 300, mine, 60) == 60


def test_same_epoch_number_at_another_start_is_not_shared() -> None:
    leader = [(1, 0), (2, 100), (3, 200)]
    mine = [(1, 0), (2, 120)]
    assert consistent_point(leader, 300, mine, 150) == 100


def test_empty_histories_share_nothing() -> None:
    assert consistent_point([], 0, [], 0) == 0
    assert consistent_point([(1, 0)], 100, [], 0) == 0
    assert consistent_point([], 0, [(1, 0)], 100) == 0
    assert consistent_point([(2, 0)], 100, [(1, 0)], 100) == 0
