"""Fixtures shared by the broker's tests."""

from __future__ import annotations

import pytest

from apogee.testkit import store as testing


@pytest.fixture(scope="session")
def crc32_twins() -> tuple[str, str]:
    """Two different tags of equal length with the same CRC-32 (the same tag code)."""
    return testing.crc32_twins()
