"""The producer's options in docs/configuration.md are generated from ProducerConfig."""

from __future__ import annotations

from pathlib import Path

import pytest

from apogee.client.consumer.config import config_reference as consumer_reference
from apogee.client.producer.config import config_reference

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_configuration_reference_matches_producer_config() -> None:
    assert config_reference() in DOC.read_text(), (
        "docs/configuration.md is out of date: run `uv run python scripts/gen_config_docs.py`"
    )


def test_configuration_reference_matches_consumer_config() -> None:
    assert consumer_reference() in DOC.read_text(), (
        "docs/configuration.md is out of date: run `uv run python scripts/gen_config_docs.py`"
    )
