"""What the local cluster's tests share: a data folder whose cluster is stopped after the test,
whatever happened in it."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from apogee.local import cluster as local_cluster
from apogee.local.cluster import ClusterState


@pytest.fixture
def data(tmp_path: Path) -> Iterator[Path]:
    """``<tmp>/cluster``; afterwards ``apogee cluster down`` on it, and whatever it started
    that still runs is killed."""
    folder = (tmp_path / "cluster").resolve()
    try:
        yield folder
    finally:  # whatever happened, nothing the test started keeps running
        state = ClusterState.load(folder)
        local_cluster.down(folder, timeout=10)
        for p in state.all() if state else []:
            if local_cluster.pid_alive(p.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
