"""The Grafana dashboards as ``scripts/render_dashboards.py`` reads them, with nothing started:
panels and their queries (:func:`load_dashboard`), Grafana's variables replaced in a query
(:func:`grafana_values`, :func:`choose_value`, :func:`substitute`), a series' legend
(:func:`legend_text`), values in a panel's unit (:func:`format_value`), and the panels that
came back empty (:func:`findings`).

Grafana's variables, as a query sent by Grafana would have them:

- ``$__rate_interval``: the larger of four scrape intervals and the step plus one scrape interval;
- ``$__interval`` (``_ms``): the step; ``$__range`` (``_s``, ``_ms``): the time range;
- a template variable ``$name``, ``${name}``, ``${name:format}`` or ``[[name]]``: one value of
  the ``label_values(<selector>, <label>)`` it offers, or for *All* its ``allValue`` (else every
  value as a regular expression);
- the data source variable (``${DS_PROMETHEUS}``) is only ever a panel's data source, never in
  a query: it is not replaced.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from apogee.local import prometheus


@dataclass(frozen=True)
class Target:
    """One query of a panel: its ``refId``, PromQL (with Grafana's variables) and legend."""

    ref_id: str
    expr: str
    legend: str


@dataclass(frozen=True)
class Override:
    """A field override that matters to a picture: the series it names (by name, or a
    regular expression) go on the right axis and/or take another unit."""

    pattern: str
    regex: bool
    right: bool
    unit: str | None

    def matches(self, name: str) -> bool:
        return bool(re.fullmatch(self.pattern, name)) if self.regex else name == self.pattern


@dataclass(frozen=True)
class Panel:
    id: int
    title: str
    #: "timeseries", "stat", "state-timeline" (any other type is drawn as a time series)
    kind: str
    unit: str
    #: place in the dashboard's grid, 24 columns wide
    x: int
    y: int
    w: int
    h: int
    targets: tuple[Target, ...]
    minimum: float | None = None
    decimals: int | None = None
    #: (value, colour) of each threshold step; the first one's value is None (the base)
    thresholds: tuple[tuple[float | None, str], ...] = ()
    threshold_lines: bool = False
    overrides: tuple[Override, ...] = ()
    #: value mappings: (value, colour, text), as a state timeline shows them
    mappings: tuple[tuple[float, str, str], ...] = ()


@dataclass(frozen=True)
class Variable:
    """A ``query`` template variable: ``label_values(<selector>, <label>)``."""

    name: str
    query: str
    include_all: bool = False
    all_value: str = ""


@dataclass(frozen=True)
class Dashboard:
    stem: str
    title: str
    panels: tuple[Panel, ...]
    variables: tuple[Variable, ...]


def panels_of(board: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every panel of a dashboard's JSON model, those inside rows included; rows left out."""
    for p in board.get("panels", []):
        if p.get("type") != "row":
            yield p
        yield from p.get("panels", [])


def _overrides(raw: Sequence[Mapping[str, Any]]) -> tuple[Override, ...]:
    out = []
    for o in raw:
        matcher = o.get("matcher", {})
        if matcher.get("id") not in ("byName", "byRegexp"):
            continue
        props = {p["id"]: p.get("value") for p in o.get("properties", [])}
        pattern, regex = str(matcher.get("options", "")), matcher["id"] == "byRegexp"
        right = props.get("custom.axisPlacement") == "right"
        out.append(Override(pattern, regex, right, props.get("unit")))
    return tuple(out)


def _mappings(raw: Sequence[Mapping[str, Any]]) -> tuple[tuple[float, str, str], ...]:
    out = []
    for m in raw:
        if m.get("type") == "value":
            for value, shown in m.get("options", {}).items():
                text = str(shown.get("text", value))
                out.append((float(value), str(shown.get("color", "")), text))
    return tuple(out)


def _panel(p: Mapping[str, Any]) -> Panel:
    config = p.get("fieldConfig", {})
    defaults = config.get("defaults", {})
    style = defaults.get("custom", {}).get("thresholdsStyle", {})
    grid = p.get("gridPos", {})
    return Panel(
        id=int(p["id"]),
        title=str(p.get("title", "")),
        kind=str(p.get("type", "timeseries")),
        unit=str(defaults.get("unit", "short")),
        x=int(grid.get("x", 0)),
        y=int(grid.get("y", 0)),
        w=int(grid.get("w", 12)),
        h=int(grid.get("h", 8)),
        targets=tuple(
            Target(str(t.get("refId", "")), str(t["expr"]), str(t.get("legendFormat", "")))
            for t in p.get("targets", [])
            if t.get("expr") and not t.get("hide")
        ),
        minimum=defaults.get("min"),
        decimals=defaults.get("decimals"),
        thresholds=tuple(
            (s.get("value"), str(s.get("color", "")))
            for s in defaults.get("thresholds", {}).get("steps", [])
        ),
        threshold_lines="line" in str(style.get("mode", "")),
        overrides=_overrides(config.get("overrides", [])),
        mappings=_mappings(defaults.get("mappings", [])),
    )


def load_dashboard(path: Path) -> Dashboard:
    """The panels (each with its queries) and the template variables of a dashboard file."""
    board = json.loads(path.read_text())
    variables = []
    for v in board.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query", "")
            variables.append(
                Variable(
                    name=str(v["name"]),
                    query=str(q.get("query", "") if isinstance(q, dict) else q),
                    include_all=bool(v.get("includeAll")),
                    all_value=str(v.get("allValue") or ""),
                )
            )
    panels = tuple(_panel(p) for p in panels_of(board))
    return Dashboard(path.stem, str(board.get("title", path.stem)), panels, tuple(variables))


_LABEL_VALUES: Final = re.compile(r"^\s*label_values\(\s*(.+)\s*,\s*(\w+)\s*\)\s*$", re.S)


def label_values_query(query: str) -> tuple[str, str]:
    """(selector, label) of ``label_values(<selector>, <label>)``."""
    m = _LABEL_VALUES.match(query)
    if m is None:
        raise ValueError(f"not label_values(<metric>, <label>): {query!r}")
    return m[1].strip(), m[2]


def choose_value(var: Variable, found: Sequence[str], wanted: str | None = None) -> tuple[str, str]:
    """(what replaces ``var`` in a query, what a title shows): ``wanted`` when the run has it
    (``All``: every value), else *All* when ``var`` offers it, else the first value in order
    (where Grafana starts)."""
    if wanted == "All" or (var.include_all and wanted not in found):
        return var.all_value or "(" + "|".join(found) + ")", "All"
    if wanted is not None and wanted in found:
        return wanted, wanted
    if not found:
        raise ValueError(f"variable {var.name}: {var.query} has no value in the run")
    first = sorted(found)[0]
    return first, first


def grafana_values(
    scrape_s: float, step_s: float, range_s: float, rate_interval: str | None = None
) -> dict[str, str]:
    """Grafana's global variables for a query every ``step_s`` seconds over ``range_s``
    seconds of a data source scraped every ``scrape_s`` (``rate_interval`` overrides
    ``$__rate_interval``)."""
    rate = rate_interval or prometheus.duration_text(max(4 * scrape_s, step_s + scrape_s))
    whole = max(1, round(range_s))
    return {
        "__interval": prometheus.duration_text(step_s),
        "__interval_ms": str(round(step_s * 1000)),
        "__rate_interval": rate,
        "__range": f"{whole}s",
        "__range_s": str(whole),
        "__range_ms": str(whole * 1000),
    }


#: $name, ${name}, ${name:format}, [[name]], [[name:format]]
_VARIABLE: Final = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """``expr`` with every Grafana variable replaced by its value in ``values``; one without a
    value raises :class:`KeyError` naming it."""

    def one(m: re.Match[str]) -> str:
        name = m[1] or m[2] or m[3]
        if name not in values:
            raise KeyError(f"no value for the variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(one, expr)


def legend_text(fmt: str, labels: Mapping[str, str]) -> str:
    """A series' name as Grafana's legend format makes it (``{{label}}`` replaced, by "" when
    the series has no such label); without a format, ``name{a="b", ...}``."""
    if fmt and fmt != "__auto":
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), fmt)
    name = labels.get("__name__", "")
    rest = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
    return f"{name}{{{rest}}}" if rest or not name else name


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """Sorts ``level 2`` before ``level 10``."""
    return tuple((0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", text) if t)


def _number(x: float, decimals: int | None) -> str:
    if decimals is not None:
        return f"{x:.{decimals}f}"
    text = f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _scaled(x: float, base: float, names: Sequence[str], decimals: int | None) -> str:
    i = 0
    while abs(x) >= base and i < len(names) - 1:
        x /= base
        i += 1
    return f"{_number(x, decimals)} {names[i]}".rstrip()


def _seconds(x: float, decimals: int | None) -> str:
    a = abs(x)
    if a == 0:
        return "0 s"
    for least, factor, name in ((3600, 1 / 3600, "h"), (60, 1 / 60, "min"), (1, 1, "s")):
        if a >= least:
            return f"{_number(x * factor, decimals)} {name}"
    if a >= 1e-3:
        return f"{_number(x * 1e3, decimals)} ms"
    return f"{_number(x * 1e6, decimals)} µs"


def format_value(x: float, unit: str, decimals: int | None = None) -> str:
    """``x`` in Grafana's ``unit``: ``percentunit``, ``bytes``, ``Bps``, ``s``, else ``short``
    (k, M, G)."""
    if not math.isfinite(x):
        return "-"
    if unit == "percentunit":
        return f"{_number(x * 100, decimals)}%"
    if unit in ("bytes", "decbytes"):
        return _scaled(x, 1024, ("B", "KiB", "MiB", "GiB", "TiB"), decimals)
    if unit in ("Bps", "binBps"):
        return _scaled(x, 1024, ("B/s", "KiB/s", "MiB/s", "GiB/s", "TiB/s"), decimals)
    if unit == "s":
        return _seconds(x, decimals)
    return _scaled(x, 1000, ("", "k", "M", "G", "T"), decimals)


# -- answers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """The time range of the range queries (epoch seconds), their step, and the time shown as
    0:00 (the start unless given)."""

    start: float
    end: float
    step: float
    origin: float | None = None

    @property
    def zero(self) -> float:
        return self.start if self.origin is None else self.origin


@dataclass
class Answer:
    """What one query of a panel gave: its series, or the error Prometheus answered."""

    target: Target
    promql: str
    series: list[prometheus.Series]
    error: str = ""

    @property
    def empty(self) -> bool:
        return not any(math.isfinite(v) for s in self.series for _, v in s.points)


def findings(board: Dashboard, answers: Mapping[int, Sequence[Answer]]) -> list[str]:
    """A line per panel with no data at all and per query with none in a panel that has
    some, each followed by the queries as sent (indented)."""
    out = []
    for p in board.panels:
        got = answers.get(p.id, [])
        if all(a.empty for a in got):
            out.append(f"{p.title}: no data")
            out += [f"    {a.promql}" + (f"  ({a.error})" if a.error else "") for a in got]
            continue
        for a in got:
            if a.empty:
                out.append(f"{p.title} / {a.target.legend or a.target.ref_id}: no data")
                out.append(f"    {a.promql}" + (f"  ({a.error})" if a.error else ""))
    return out
