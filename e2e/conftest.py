"""Fixtures of the end-to-end tests: clusters of real nameserver and broker processes.

- ``cluster``: one cluster for the whole session, shared by the tests that do not disturb it
  (they use topics of their own). Its brokers do not create topics automatically and accept
  bodies of at most 64 KiB (:data:`~e2e.harness.SHARED_BROKER_ENV`).
- ``rocketmq_cluster``: one cluster for the official RocketMQ 5 clients' tests and examples
  (its transaction checker checks every second; its brokers dead-letter after 2 retries).
- ``start_cluster``: starts clusters of the test's own (``start_cluster("name", ...)``) for the
  tests that kill or stop members.
- ``images``: podman set up and every image built, once for the session (the container tests);
  it fails, saying why, when podman cannot be set up.

Every cluster is stopped at teardown, failed test or not, and nothing of it is left running.
When a test fails, the tails of its clusters' logs are added to its report.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from e2e import containers
from e2e.harness import SHARED_BROKER_ENV, Cluster, ClusterFactory
from e2e.rocketmq_support import start_rocketmq_cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    shared = Cluster.start(tmp_path_factory.mktemp("shared-cluster"), broker_env=SHARED_BROKER_ENV)
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture(scope="session")
def rocketmq_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The cluster the official RocketMQ 5 clients' tests and examples share
    (:func:`e2e.rocketmq_support.start_rocketmq_cluster`)."""
    shared = start_rocketmq_cluster(tmp_path_factory.mktemp("rocketmq-cluster"))
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture(scope="session")
def images() -> float:
    """Seconds ``scripts/images.sh`` took to build every image (after the engine's set-up)."""
    containers.set_up_engine()
    return containers.build_images()


@pytest.fixture
def start_cluster(tmp_path: Path) -> Iterator[ClusterFactory]:
    factory = ClusterFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        for value in getattr(item, "funcargs", {}).values():
            clusters = [value] if isinstance(value, Cluster) else []
            if isinstance(value, ClusterFactory):
                clusters = value.clusters
            if isinstance(value, containers.ComposeStack):
                report.sections.append(
                    (f"logs of compose project {value.project}", value.log_tails())
                )
            for c in clusters:
                report.sections.append((f"logs of the cluster in {c.data_dir}", c.log_tails()))
    return report
