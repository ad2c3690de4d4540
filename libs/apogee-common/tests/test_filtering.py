"""A subscription's selection: tags and an SQL92 condition together."""

from __future__ import annotations

import pytest

from apogee.common.errors import InvalidArgumentError
from apogee.common.filtering import EVERYTHING, parse_selection

pytestmark = pytest.mark.unit


def test_no_tags_and_no_condition_select_everything() -> None:
    for tags in ("", "*", "  * "):
        sel = parse_selection(tags, "")
        assert sel is EVERYTHING
        assert sel.everything
        assert sel.matches(None, {})


def test_tags_and_condition_must_both_hold() -> None:
    sel = parse_selection("A || B", "n > 2")
    assert not sel.everything
    assert sel.matches("A", {"n": "3"})
    assert not sel.matches("C", {"n": "3"})  # the tag
    assert not sel.matches("A", {"n": "1"})  # the condition
    assert not sel.matches(None, {"n": "3"})  # no tag: only '*' selects it
    only_sql = parse_selection("*", "TAGS = 'C'")
    assert only_sql.tags is None
    assert only_sql.matches("C", {"TAGS": "C"})


def test_errors_name_the_expression_at_fault_under_the_prefix() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        parse_selection("A || || B", "", "subscriptions[1].")
    assert str(caught.value).startswith("subscriptions[1].tag_expression: ")
    with pytest.raises(InvalidArgumentError) as caught:
        parse_selection("*", "a = ", "subscriptions[1].")
    assert str(caught.value) == (
        "subscriptions[1].sql_expression: syntax error at position 5: expected a value after "
        "'=', got end of expression"
    )
    with pytest.raises(InvalidArgumentError, match="sql_expression: must be a string, got int"):
        parse_selection("*", 5)  # type: ignore[arg-type]
