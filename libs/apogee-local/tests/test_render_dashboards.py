"""The pure parts of ``scripts/render_dashboards.py`` (its ``dashboard_model``), with nothing
started: the panels and queries read from the chart's dashboards, Grafana's variables replaced,
template variables' values chosen, legends, units, and the report of empty panels."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from apogee.local.prometheus import Series

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
DASHBOARDS = sorted((ROOT / "charts" / "apogee" / "dashboards").glob("*.json"))


def _script(name: str) -> ModuleType:
    """A module of scripts/ (not a package: imported by path)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


m = _script("dashboard_model")


def test_every_panel_of_every_dashboard_has_a_query_and_a_place_in_the_grid() -> None:
    assert DASHBOARDS
    for path in DASHBOARDS:
        board = m.load_dashboard(path)
        assert board.stem == path.stem
        assert board.title.startswith("Apogee / ")
        assert board.panels, path.name
        for p in board.panels:
            assert p.targets, f"{path.name}: {p.title} has no query"
            assert p.kind != "row"
            assert 0 <= p.x < p.x + p.w <= 24, (p.title, p.x, p.w)
            assert p.h > 0


def test_a_dashboard_is_read_with_its_variables_overrides_and_thresholds(tmp_path: Path) -> None:
    board = {
        "title": "Apogee / Test",
        "templating": {
            "list": [
                {"name": "DS_PROMETHEUS", "type": "datasource", "query": "prometheus"},
                {
                    "name": "instance",
                    "type": "query",
                    "includeAll": True,
                    "allValue": ".*",
                    "query": {"query": "label_values(apogee_broker_commitlog_bytes, instance)"},
                },
                {"name": "topic", "type": "query", "query": 'label_values(m{a="b,c"}, topic)'},
            ]
        },
        "panels": [
            {
                "id": 1,
                "type": "row",
                "title": "a row",
                "panels": [
                    {
                        "id": 2,
                        "type": "timeseries",
                        "title": "Inside",
                        "gridPos": {"x": 12, "y": 1, "w": 12, "h": 8},
                        "fieldConfig": {
                            "defaults": {
                                "unit": "percentunit",
                                "min": 0,
                                "thresholds": {
                                    "steps": [
                                        {"color": "green", "value": None},
                                        {"color": "red", "value": 0.9},
                                    ]
                                },
                                "custom": {"thresholdsStyle": {"mode": "line+area"}},
                                "mappings": [
                                    {
                                        "type": "value",
                                        "options": {"0": {"color": "red", "text": "down"}},
                                    }
                                ],
                            },
                            "overrides": [
                                {
                                    "matcher": {"id": "byRegexp", "options": "waiting.*"},
                                    "properties": [
                                        {"id": "custom.axisPlacement", "value": "right"},
                                        {"id": "unit", "value": "bytes"},
                                    ],
                                }
                            ],
                        },
                        "targets": [
                            {"refId": "A", "expr": "up", "legendFormat": "{{job}}"},
                            {"refId": "B", "expr": "down", "hide": True},
                        ],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "test-board.json"
    path.write_text(json.dumps(board))
    got = m.load_dashboard(path)
    assert [v.name for v in got.variables] == ["instance", "topic"]  # the data source left out
    assert got.variables[0].include_all
    assert got.variables[0].all_value == ".*"
    assert m.label_values_query(got.variables[0].query) == (
        "apogee_broker_commitlog_bytes",
        "instance",
    )
    assert m.label_values_query(got.variables[1].query) == ('m{a="b,c"}', "topic")
    (p,) = got.panels  # the row itself is no panel
    assert (p.id, p.title, p.unit, p.minimum, p.threshold_lines) == (
        2,
        "Inside",
        "percentunit",
        0,
        True,
    )
    assert p.thresholds == ((None, "green"), (0.9, "red"))
    assert p.mappings == ((0.0, "red", "down"),)
    assert [t.expr for t in p.targets] == ["up"]  # hidden queries are not run
    (o,) = p.overrides
    assert o.right
    assert o.unit == "bytes"
    assert o.matches("waiting at broker-a")
    assert not o.matches("delivered")
    with pytest.raises(ValueError, match="label_values"):
        m.label_values_query("query_result(up)")


def test_grafana_variables_are_replaced_in_every_spelling() -> None:
    values = m.grafana_values(scrape_s=1.0, step_s=1.0, range_s=190.4)
    assert values["__rate_interval"] == "4s"  # 4 scrape intervals
    assert m.grafana_values(1.0, 5.0, 600)["__rate_interval"] == "6s"  # the step and one more
    assert m.grafana_values(1.0, 1.0, 60, rate_interval="15s")["__rate_interval"] == "15s"
    assert (values["__range"], values["__range_s"], values["__interval"]) == ("190s", "190", "1s")
    values |= {"topic": "Orders", "instance": ".*"}
    expr = (
        'sum(rate(m{topic="$topic"}[$__rate_interval])) / sum(increase(n{instance=~"${instance}"}'
        "[$__range])) + [[topic]] + ${topic:raw} + $__range_s"
    )
    assert m.substitute(expr, values) == (
        'sum(rate(m{topic="Orders"}[4s])) / sum(increase(n{instance=~".*"}[190s]))'
        " + Orders + Orders + 190"
    )
    with pytest.raises(KeyError, match=r"\$group"):
        m.substitute('m{group="$group"}', values)


def test_a_variable_takes_the_value_wanted_all_or_the_first() -> None:
    topic = m.Variable("topic", "label_values(m, topic)")
    instance = m.Variable("instance", "label_values(m, instance)", include_all=True, all_value=".*")
    found = ["Orders", "Clicks"]
    assert m.choose_value(topic, found, "Orders") == ("Orders", "Orders")
    assert m.choose_value(topic, found, "Missing") == ("Clicks", "Clicks")  # first, sorted
    assert m.choose_value(topic, found) == ("Clicks", "Clicks")
    assert m.choose_value(instance, ["a:1", "b:2"]) == (".*", "All")
    assert m.choose_value(instance, ["a:1", "b:2"], "b:2") == ("b:2", "b:2")
    no_all_value = m.Variable("instance", "label_values(m, instance)", include_all=True)
    assert m.choose_value(no_all_value, ["a:1", "b:2"]) == ("(a:1|b:2)", "All")
    with pytest.raises(ValueError, match="no value"):
        m.choose_value(topic, [])


def test_legends_and_units_read_as_grafana_writes_them() -> None:
    labels = {"group": "analytics", "topic": "Orders", "__name__": "lag"}
    assert m.legend_text("{{group}} / {{ topic }}", labels) == "analytics / Orders"
    assert m.legend_text("p99 {{instance}}", labels) == "p99 "
    assert m.legend_text("", labels) == 'lag{group="analytics", topic="Orders"}'
    assert m.legend_text("", {}) == "{}"
    assert m.format_value(0.4567, "percentunit") == "45.7%"
    assert m.format_value(3 * 1024 * 1024, "bytes") == "3 MiB"
    assert m.format_value(1536, "Bps") == "1.5 KiB/s"
    assert m.format_value(0.0042, "s") == "4.2 ms"
    assert m.format_value(0.000_25, "s") == "250 µs"
    assert m.format_value(90, "s") == "1.5 min"
    assert m.format_value(12_345, "short") == "12.3 k"
    assert m.format_value(2, "short", decimals=1) == "2.0"
    assert m.format_value(float("nan"), "short") == "-"


def test_panels_and_queries_without_data_are_reported() -> None:
    t_a, t_b = m.Target("A", "a", "in"), m.Target("B", "b", "out")
    panel = m.Panel(1, "Bytes", "timeseries", "Bps", 0, 0, 12, 8, (t_a, t_b))
    dead = m.Panel(2, "Holds", "timeseries", "s", 12, 0, 12, 8, (t_a,))
    board = m.Dashboard("b", "Apogee / B", (panel, dead), ())
    nan = float("nan")
    answers = {
        1: [
            m.Answer(t_a, "a", [Series({}, [(1.0, 2.0)])]),
            m.Answer(t_b, "b", [Series({}, [(1.0, nan)])]),
        ],
        2: [m.Answer(t_a, "a{x}", [], "bad_data: parse error")],
    }
    assert not answers[1][0].empty
    assert answers[1][1].empty
    assert m.findings(board, answers) == [
        "Bytes / out: no data",
        "    b",
        "Holds: no data",
        "    a{x}  (bad_data: parse error)",
    ]
