"""A message's trace context (``traceparent``, ``tracestate``) is an ordinary property for the
rules, and can be found in the properties' text without parsing it all."""

from __future__ import annotations

import pytest

from apogee.codec import (
    PROP_TRACEPARENT,
    PROP_TRACESTATE,
    TRACE_PROPERTIES,
    encode_properties,
    find_broker_property,
    find_trace_context,
    is_broker_property,
    properties_text_problem,
    reserved_property_rule,
)

pytestmark = pytest.mark.unit

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
STATE = "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"


def test_clients_may_set_the_trace_properties() -> None:
    assert {PROP_TRACEPARENT, PROP_TRACESTATE} == TRACE_PROPERTIES
    for name in TRACE_PROPERTIES:
        assert reserved_property_rule(name) is None
        assert not is_broker_property(name)
    text = encode_properties("T", ["k"], "ID", {PROP_TRACEPARENT: PARENT, PROP_TRACESTATE: STATE})
    assert find_broker_property(text) is None
    assert properties_text_problem(text) is None


@pytest.mark.parametrize(
    ("props", "found"),
    [
        ({}, ("", "")),
        ({PROP_TRACEPARENT: PARENT}, (PARENT, "")),
        ({PROP_TRACEPARENT: PARENT, PROP_TRACESTATE: STATE}, (PARENT, STATE)),
        ({"a": "1", PROP_TRACESTATE: STATE, PROP_TRACEPARENT: PARENT}, (PARENT, STATE)),
        # a name that merely ends like one is not it
        ({"xtraceparent": "no", "my-tracestate": "no"}, ("", "")),
        # a value that holds the name is not it either
        ({"note": "traceparent", "b": "traceparent\x03"}, ("", "")),
    ],
)
def test_the_trace_context_is_found_in_the_text(
    props: dict[str, str], found: tuple[str, str]
) -> None:
    assert find_trace_context(encode_properties("T", [], "ID", props)) == found
    assert find_trace_context(encode_properties(None, [], None, props)) == found


def test_the_trace_context_as_the_first_and_last_entry() -> None:
    text = f"{PROP_TRACEPARENT}\x01{PARENT}\x02"
    assert find_trace_context(text) == (PARENT, "")
    assert find_trace_context(text[:-1]) == (PARENT, "")  # an unterminated last entry too
