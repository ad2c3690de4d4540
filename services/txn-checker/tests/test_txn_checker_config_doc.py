"""The configuration reference in docs/ is generated from TxnCheckerSettings and must match it."""

from __future__ import annotations

from pathlib import Path

import pytest

from apogee_txn_checker.settings import config_reference

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_configuration_reference_matches_txn_checker_settings() -> None:
    assert config_reference() in DOC.read_text(), (
        "docs/configuration.md is out of date: run `uv run python scripts/gen_config_docs.py`"
    )
