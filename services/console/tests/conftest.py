"""The console's test fixtures: a local cluster of real processes per test module."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from apogee.local.cluster import ClusterState

# the tests' helpers (support/console_support.py) are imported by name
sys.path.insert(0, str(Path(__file__).parent / "support"))

from console_support import start_cluster, stop_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterState]:
    data = tmp_path_factory.mktemp("cluster")
    state = start_cluster(data)
    try:
        yield state
    finally:
        stop_cluster(data)
