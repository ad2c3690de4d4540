"""Atomic metadata files: old or new content after any crash, backup when the file is damaged."""

from __future__ import annotations

from pathlib import Path

import pytest

from apogee.common.errors import CorruptRecordError
from apogee.store.metadata import read_json, write_json_atomic

pytestmark = pytest.mark.unit


def test_round_trip_and_backup_of_the_previous_version(tmp_path: Path) -> None:
    path = tmp_path / "topics.json"
    assert read_json(path) is None
    write_json_atomic(path, {"v": 1})
    write_json_atomic(path, {"v": 2})
    assert read_json(path) == {"v": 2}
    assert read_json(tmp_path / "topics.json.bak") == {"v": 1}
    assert not (tmp_path / "topics.json.tmp").exists()


def test_a_damaged_file_falls_back_to_its_backup(tmp_path: Path) -> None:
    path = tmp_path / "consumerOffset.json"
    write_json_atomic(path, {"offsets": {"a": 1}})
    write_json_atomic(path, {"offsets": {"a": 2}})
    path.write_bytes(b'{"offsets": {"a"')  # torn
    assert read_json(path) == {"offsets": {"a": 1}}


def test_a_crash_between_the_two_renames_leaves_the_backup(tmp_path: Path) -> None:
    path = tmp_path / "subscriptionGroup.json"
    write_json_atomic(path, {"g": 1})
    path.rename(tmp_path / "subscriptionGroup.json.bak")
    assert read_json(path) == {"g": 1}


def test_both_damaged_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text("{")
    (tmp_path / "x.json.bak").write_text("[")
    with pytest.raises(CorruptRecordError, match=r"x\.json"):
        read_json(path)
