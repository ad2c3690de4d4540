"""Metrics pieces the SDK, the tools and the services share (``prometheus-client``; the
``metrics`` extra of apogee-common). The services' ``/metrics`` endpoints are
:mod:`apogee.service.metrics`.

- :class:`LabelCap`: bounds the values of one label (topics, groups). The first ``limit``
  distinct values seen are kept as they are, for the life of the process; every later one is
  reported as :data:`OTHER`.
- :func:`scrape`: the samples of a running service's ``/metrics`` (over HTTP, or HTTPS given
  the CA), as tools and tests read them.
"""

from __future__ import annotations

import ssl
import threading
import urllib.request
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

#: The label value of every topic or group beyond a :class:`LabelCap`'s limit.
OTHER: Final = "other"


class LabelCap:
    """Bounds the values of a label: the first ``limit`` distinct values are kept (first come,
    first kept, for the life of the process), every later one becomes :data:`OTHER`.

    Thread-safe; a value already kept costs one set lookup."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit must not be negative, got {limit}")
        self.limit = limit
        self._kept: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        if value in self._kept:
            return value
        with self._lock:
            if value in self._kept:
                return value
            if len(self._kept) < self.limit:
                self._kept.add(value)
                return value
        return OTHER

    def __len__(self) -> int:
        return len(self._kept)


#: One sample of a scrape: its name (with ``_total``, ``_bucket``, ... as exposed) and labels.
SampleKey = tuple[str, frozenset[tuple[str, str]]]


class Samples(dict[SampleKey, float]):
    """The samples of one scrape; :meth:`get_sample` finds one by name and labels."""

    def get_sample(self, name: str, **labels: str) -> float | None:
        """The value of sample ``name`` with exactly ``labels`` (None when absent)."""
        return self.get((name, frozenset(labels.items())))

    def names(self) -> set[str]:
        return {name for name, _ in self}


def scrape(address: str, timeout: float = 5.0, ca_file: str = "") -> Samples:
    """GET ``http://<address>/metrics`` (``https://``, verified with ``ca_file``, when it is
    given) and parse it (the text format)."""
    if ca_file:
        ctx = ssl.create_default_context(cafile=ca_file)
        url = f"https://{address}/metrics"
    else:
        ctx, url = None, f"http://{address}/metrics"
    with urllib.request.urlopen(url, timeout=timeout, context=ctx) as resp:
        text = resp.read().decode()
    out = Samples()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = float(s.value)
    return out
