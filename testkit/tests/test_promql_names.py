"""The metric names of PromQL expressions and Grafana template queries (what the monitoring
assets' test checks against the services' scrapes)."""

from __future__ import annotations

import pytest

from apogee.testkit.promql_names import (
    PromQLSyntaxError,
    check_brackets,
    metric_names,
    template_query_names,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("apogee_broker_commitlog_bytes", ["apogee_broker_commitlog_bytes"]),
        ("up == 0", ["up"]),
        # functions, ranges and Grafana's interval variable
        (
            "sum(rate(apogee_broker_messages_in_total[$__rate_interval]))",
            ["apogee_broker_messages_in_total"],
        ),
        ("rate(m_total[${__rate_interval}])", ["m_total"]),
        ("rate(m_total[[[interval]]])", ["m_total"]),
        # label names in matchers and in grouping lists are not metrics
        (
            'sum by (group, topic) (apogee_broker_group_lag_messages{group="$group", '
            'topic=~"$topic"})',
            ["apogee_broker_group_lag_messages"],
        ),
        ("sum(rate(x_total[5m])) by (le, instance)", ["x_total"]),
        ("sum without (instance) (x)", ["x"]),
        ("sum without(instance)(x)", ["x"]),
        (
            "histogram_quantile(0.99, sum by (le) (rate("
            "apogee_broker_send_latency_seconds_bucket[5m])))",
            ["apogee_broker_send_latency_seconds_bucket"],
        ),
        # vector matching: on/ignoring/group_left lists, and group_left without a list
        ("a / on (instance) group_left (cluster) b", ["a", "b"]),
        ("a / ignoring (kind) b", ["a", "b"]),
        ("a * on() group_left b", ["a", "b"]),
        ("a and on (job) b or c unless d", ["a", "b", "c", "d"]),
        ("a > bool 3", ["a"]),
        ("ATAN2(a) + a atan2 b", ["a", "b"]),
        # offset, @ and subqueries
        ("a offset 5m - a offset -1h30m", ["a"]),
        ("a @ start() - a @ 1609746000", ["a"]),
        ("max_over_time(deriv(lag_seconds[10m])[1h:1m])", ["lag_seconds"]),
        (
            "predict_linear(apogee_broker_disk_free_bytes[6h], 4 * 3600) < 0",
            ["apogee_broker_disk_free_bytes"],
        ),
        # strings, numbers, inf and nan
        (
            'label_replace(a, "dst", "$1", "src", "(.*)") > Inf or b != NaN',
            ["a", "b"],
        ),
        ('count_values("version", build_info)', ["build_info"]),
        ("topk(5, a) > 1e-3 and b < 0x1F", ["a", "b"]),
        ("sum by (le) (a)", ["a"]),
        ("-a", ["a"]),
        # __name__ matchers: equality only
        ('{__name__="apogee_broker_pulls_total", result="found"}', ["apogee_broker_pulls_total"]),
        ('{__name__=~"apogee_.*"}', []),
        ('{__name__!="a"}', []),
        # recording rule names have colons; comments are left out
        ("job:requests:rate5m # per job\n+ other", ["job:requests:rate5m", "other"]),
        # each name once, in the order of first use
        ("b + a + b", ["b", "a"]),
        (
            'absent(apogee_schedule_delivered_messages_total{job="x"})',
            ["apogee_schedule_delivered_messages_total"],
        ),
        ("vector(1) + time()", []),
    ],
)
def test_metric_names(expr: str, names: list[str]) -> None:
    assert metric_names(expr) == names


@pytest.mark.parametrize(
    ("query", "names"),
    [
        (
            "label_values(apogee_broker_messages_in_total, topic)",
            ["apogee_broker_messages_in_total"],
        ),
        (
            'label_values(apogee_broker_group_lag_messages{group="$group", topic=~"a,b"}, topic)',
            ["apogee_broker_group_lag_messages"],
        ),
        ("label_values(instance)", []),
        ("label_names()", []),
        ('metrics("apogee_.*")', []),
        ("query_result(topk(5, sum by (topic) (a_total)))", ["a_total"]),
        ("sum by (group) (b)", ["b"]),
    ],
)
def test_template_query_names(query: str, names: list[str]) -> None:
    assert template_query_names(query) == names


@pytest.mark.parametrize(
    "expr",
    ["sum(rate(a[5m])", "a{b='c'", "a]", "sum(a})", 'a{b="c}', "rate(a[5m)]"],
)
def test_unpaired_brackets_and_open_strings_are_refused(expr: str) -> None:
    with pytest.raises(PromQLSyntaxError, match="in: "):
        metric_names(expr)


def test_paired_brackets_pass() -> None:
    check_brackets('sum by (le) (rate(a{b="(["}[5m]))')
