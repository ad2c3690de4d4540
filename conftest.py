"""What every test of the repository runs under.

- Every default port of the services, the local cluster and its Prometheus
  (:data:`apogee.testkit.ports.DEFAULT_PORTS`) is held for the whole session (those another
  process holds already, a running ``apogee cluster up`` say, are left to it): a test that binds
  one fails at once, here as in CI, instead of only beside a running cluster.
- The local cluster (:func:`apogee.local.cluster.up`) started by a test gives its members ports
  the system picks free, not the next free one above each default as ``apogee cluster up`` does:
  clusters started at once by tests running side by side would race for the same ones.
- Every test carries one of the markers ``unit``, ``integration``, ``e2e`` or ``slow``
  (``pytestmark`` in its module, usually): collection fails naming those that carry none.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from apogee.local import cluster as local_cluster
from apogee.testkit.ports import DEFAULT_PORTS, free_port, holding

KINDS = ("unit", "integration", "e2e", "slow")


@pytest.fixture(scope="session", autouse=True)
def default_ports_held() -> Iterator[list[int]]:
    """The default ports this session holds (the others are someone else's already)."""
    with holding(DEFAULT_PORTS.values()) as held:
        yield held


def _any_free_port(preferred: int, taken: set[int]) -> int:
    """:func:`apogee.local.cluster.pick_port` for tests: a free port the system picks."""
    while (port := free_port()) in taken:
        pass
    taken.add(port)
    return port


@pytest.fixture(scope="session", autouse=True)
def local_cluster_on_free_ports() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(local_cluster, "pick_port", _any_free_port)
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    unmarked = [item.nodeid for item in items if not any(item.get_closest_marker(k) for k in KINDS)]
    if unmarked:
        raise pytest.UsageError(
            f"tests without a marker of {', '.join(KINDS)} (set pytestmark in the module): "
            + ", ".join(unmarked)
        )
