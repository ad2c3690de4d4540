"""The metric names a PromQL expression selects, so that a test can check every name a
dashboard or an alert rule queries against what the services export.

:func:`metric_names` reads an expression token by token and keeps each identifier that stands
for a series selector; it leaves out

- functions and aggregations (an identifier followed by ``(``, or an aggregation followed by
  ``by``/``without``): ``rate``, ``sum``, ``histogram_quantile``, ...;
- label names: inside ``{...}`` matchers, and in the lists of ``by``, ``without``, ``on``,
  ``ignoring``, ``group_left`` and ``group_right``;
- keywords (``and``, ``or``, ``unless``, ``bool``, ``offset``, ``atan2``, ``inf``, ``nan``, ...),
  numbers and durations, strings, ranges and subqueries (``[5m]``, ``[1h:1m]``), comments;
- Grafana's variables (``$topic``, ``${topic}``, ``[[topic]]``, ``$__rate_interval``).

A selector written as ``{__name__="apogee_broker_pulls_total"}`` counts too (an equality
matcher only: a regex names no one metric).

Names are as Prometheus stores them: a histogram's ``_bucket``/``_sum``/``_count``, a counter's
``_total``. :func:`template_query_names` does the same for the query of a Grafana template
variable (``label_values(metric{...}, label)``, ``query_result(expr)``).

:func:`check_brackets` raises :class:`PromQLSyntaxError` for an expression whose brackets do not
pair up (:func:`metric_names` raises it too): it is no full parser, ``promtool`` is one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

#: Keywords that are never metric names (compared in lower case).
KEYWORDS: Final = frozenset(
    {
        "and",
        "or",
        "unless",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "offset",
        "atan2",
        "inf",
        "nan",
    }
)
#: Keywords followed by a parenthesised list of label names.
LABEL_LIST_KEYWORDS: Final = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right"}
)
#: Keywords that may follow an aggregation's name (``sum by (le) (...)``).
GROUPING_KEYWORDS: Final = frozenset({"by", "without"})

_OPENING: Final = {"(": ")", "{": "}", "[": "]"}
_CLOSING: Final = {v: k for k, v in _OPENING.items()}

_TOKEN_RE: Final = re.compile(
    r"""
      (?P<space>\s+)
    | (?P<comment>\#[^\n]*)
    | (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
    | (?P<variable>\$\{[^}]*\}|\$\w+|\[\[[^\[\]]*\]\])
    | (?P<number>\.?\d[\w.]*)
    | (?P<ident>[A-Za-z_:][\w:]*)
    | (?P<punct>\S)
    """,
    re.VERBOSE,
)

_LABEL_VALUES_RE: Final = re.compile(r"^\s*label_values\s*\((?P<args>.*)\)\s*$", re.DOTALL)
_QUERY_RESULT_RE: Final = re.compile(r"^\s*query_result\s*\((?P<expr>.*)\)\s*$", re.DOTALL)
_NO_METRIC_RE: Final = re.compile(r"^\s*(?:label_names|metrics)\s*\(.*\)\s*$", re.DOTALL)


class PromQLSyntaxError(ValueError):
    """An expression this module cannot read (its brackets do not pair up, a string does not
    end)."""


@dataclass(frozen=True, slots=True)
class Token:
    kind: str
    text: str
    at: int


def tokens(expr: str) -> list[Token]:
    """The tokens of ``expr``, blanks and comments left out; Grafana variables are tokens of
    kind ``variable``."""
    out: list[Token] = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN_RE.match(expr, pos)
        if m is None:  # only an unterminated string gets here: \S matches anything else
            raise PromQLSyntaxError(f"a string does not end at {pos} in: {expr}")
        kind = m.lastgroup
        assert kind is not None
        if kind == "punct" and m.group() in "\"'`":
            raise PromQLSyntaxError(f"a string does not end at {pos} in: {expr}")
        if kind not in ("space", "comment"):
            out.append(Token(kind, m.group(), pos))
        pos = m.end()
    return out


def check_brackets(expr: str) -> None:
    """Raise :class:`PromQLSyntaxError` unless the brackets of ``expr`` pair up."""
    stack: list[Token] = []
    for t in tokens(expr):
        if t.kind != "punct":
            continue
        if t.text in _OPENING:
            stack.append(t)
        elif t.text in _CLOSING:
            if not stack or stack[-1].text != _CLOSING[t.text]:
                raise PromQLSyntaxError(f"unexpected {t.text!r} at {t.at} in: {expr}")
            stack.pop()
    if stack:
        raise PromQLSyntaxError(f"{stack[-1].text!r} at {stack[-1].at} is not closed in: {expr}")


def _unquote(text: str) -> str:
    if text[0] == "`":
        return text[1:-1]
    return re.sub(r"\\(.)", r"\1", text[1:-1])


def metric_names(expr: str) -> list[str]:
    """The metric names ``expr`` selects, each once, in the order of their first use."""
    check_brackets(expr)
    toks = tokens(expr)
    found: dict[str, None] = {}
    # what each open bracket holds: "matchers" {..}, "range" [..], "labels" by (..), "expr" (..)
    context: list[str] = []
    i = 0
    while i < len(toks):
        t = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else None
        inside = context[-1] if context else "expr"
        if t.kind == "punct" and t.text in _CLOSING:
            context.pop()
        elif inside == "matchers":
            if t.text == "__name__" and t.kind == "ident":
                name = _name_matcher(toks, i)
                if name:
                    found.setdefault(name)
        elif inside in ("range", "labels"):
            if t.kind == "punct" and t.text in _OPENING:  # cannot happen in valid PromQL
                context.append(inside)
        elif t.kind == "punct" and t.text in _OPENING:
            context.append({"{": "matchers", "[": "range"}.get(t.text, "expr"))
        elif t.kind == "ident":
            lower = t.text.lower()
            if lower in LABEL_LIST_KEYWORDS and nxt is not None and nxt.text == "(":
                context.append("labels")
                i += 1  # the "(" of the list
            elif lower in KEYWORDS:
                pass
            elif nxt is not None and (
                nxt.text == "(" or (nxt.kind == "ident" and nxt.text.lower() in GROUPING_KEYWORDS)
            ):
                pass  # a function, or an aggregation: sum by (...) (...)
            else:
                found.setdefault(t.text)
        i += 1
    return list(found)


def _name_matcher(toks: list[Token], i: int) -> str | None:
    """The metric name of ``__name__="..."`` at ``toks[i]`` (None for any other matcher)."""
    rest = toks[i + 1 : i + 3]
    if len(rest) == 2 and rest[0].text == "=" and rest[1].kind == "string":
        return _unquote(rest[1].text)
    return None


def _split_top_level(args: str) -> list[str]:
    """``args`` split at the commas outside brackets and strings."""
    parts: list[str] = []
    depth = 0
    start = 0
    for t in tokens(args):
        if t.kind != "punct":
            continue
        if t.text in _OPENING:
            depth += 1
        elif t.text in _CLOSING:
            depth -= 1
        elif t.text == "," and depth == 0:
            parts.append(args[start : t.at])
            start = t.at + 1
    parts.append(args[start:])
    return parts


def template_query_names(query: str) -> list[str]:
    """The metric names a Grafana template variable's Prometheus query reads:
    ``label_values(<selector>, <label>)``, ``label_values(<label>)`` (none),
    ``query_result(<expr>)``, ``label_names()`` and ``metrics(<regex>)`` (none), or a plain
    expression."""
    if m := _LABEL_VALUES_RE.match(query):
        args = _split_top_level(m.group("args"))
        return metric_names(args[0]) if len(args) > 1 else []
    if m := _QUERY_RESULT_RE.match(query):
        return metric_names(m.group("expr"))
    if _NO_METRIC_RE.match(query):
        return []
    return metric_names(query)
