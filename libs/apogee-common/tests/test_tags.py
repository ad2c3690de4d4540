import pytest

from apogee.common.errors import InvalidArgumentError
from apogee.common.tags import MAX_TAG_EXPRESSION, parse_tag_expression, tag_matches

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("expr", ["", "*", "  *  ", "   "])
def test_everything(expr: str) -> None:
    assert parse_tag_expression(expr) is None


def test_tags_split_and_trimmed() -> None:
    assert parse_tag_expression("TagA || TagB||TagC ") == frozenset({"TagA", "TagB", "TagC"})
    assert parse_tag_expression("only") == frozenset({"only"})


@pytest.mark.parametrize("expr", ["A || || B", "A ||", "|| A"])
def test_empty_tag_rejected(expr: str) -> None:
    with pytest.raises(InvalidArgumentError, match="empty tag"):
        parse_tag_expression(expr, field="subscription")


def test_star_inside_a_list_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="stands alone"):
        parse_tag_expression("A || *")


def test_too_long_rejected_naming_the_field() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^tag_expression: is \d+ characters"):
        parse_tag_expression("a" * (MAX_TAG_EXPRESSION + 1))


def test_matching() -> None:
    sel = parse_tag_expression("A || B")
    assert tag_matches(sel, "A")
    assert not tag_matches(sel, "C")
    assert not tag_matches(sel, None)
    assert tag_matches(None, None)
    assert tag_matches(None, "anything")
