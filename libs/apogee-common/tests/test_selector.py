"""SQL92 property filters: every operator's TRUE / FALSE / UNKNOWN, numbers read from text, NULL,
precedence, the canonical spelling, every refusal's sentence, and random text that must only
ever be refused with InvalidArgumentError."""

from __future__ import annotations

import contextlib
import operator
import random
from collections.abc import Callable, Mapping

import pytest

from apogee.common.errors import InvalidArgumentError
from apogee.common.selector import (
    MAX_DEPTH,
    MAX_IN_VALUES,
    MAX_SQL_EXPRESSION,
    SqlFilter,
    compile_sql,
)

pytestmark = pytest.mark.unit

Truth = bool | None


def truth(expression: str, props: Mapping[str, str]) -> Truth:
    """TRUE, FALSE or UNKNOWN (None), told apart by the condition and its negation."""
    selected = compile_sql(expression).matches(props)
    negation = compile_sql(f"NOT ({expression})").matches(props)
    assert not (selected and negation)
    return True if selected else False if negation else None


def check(expression: str, props: Mapping[str, str], expected: Truth) -> None:
    assert truth(expression, props) is expected, (expression, dict(props))


# --- comparisons ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value", "expected"),
    [
        ("n = 3", "3", True),
        ("n = 3", "4", False),
        ("n = 3", " 3 ", True),
        ("n = 3", "3.0", True),
        ("n = 100", "1e2", True),
        ("n = 3", "abc", None),
        ("n = 3", "", None),
        ("n <> 3", "4", True),
        ("n <> 3", "3", False),
        ("n != 3", "4", True),
        ("n <> 3", "abc", None),
        ("n > 9", "10", True),
        ("n > 9", "9", False),
        ("n > 1", "abc", None),
        ("n >= 9", "9", True),
        ("n >= 9", "8.99", False),
        ("n < 0", "-0.5", True),
        ("n < -5", "-5", False),
        ("n <= -5", "-5", True),
        ("n <= 2.5", "+2.5", True),
        ("n > 0.5", ".75", True),
        ("n = 5", "5.", True),
        ("n > 1", "1_000", None),
        ("n > 1", "nan", None),
        ("n > 1", "inf", None),
        ("n > 1", "\u0661\u0662", None),
        ("n > 5", "1e999", True),
        ("n > 5", "9" * 5000, True),
        ("n = 1", "1 2", None),
        ("n = 1", "0x1", None),
    ],
)
def test_property_against_number(expression: str, value: str, expected: Truth) -> None:
    check(expression, {"n": value}, expected)


def test_abc_greater_than_one_is_selected_neither_way() -> None:
    props = {"n": "abc"}
    assert not compile_sql("n > 1").matches(props)
    assert not compile_sql("NOT (n > 1)").matches(props)
    assert not compile_sql("NOT n > 1").matches(props)


@pytest.mark.parametrize(
    ("expression", "value", "expected"),
    [
        ("s = 'red'", "red", True),
        ("s = 'red'", "Red", False),
        ("s = 'red'", " red", False),
        ("s <> 'red'", "blue", True),
        ("s <> 'red'", "red", False),
        ("s = '10'", "10", True),
        ("s = '10'", "10.0", False),
        ("s = 'it''s'", "it's", True),
        ("s = ''''", "'", True),
        ("s = ''", "", True),
        ("s = 'a b  c'", "a b  c", True),
        ("s = 'AND OR ( ) = <'", "AND OR ( ) = <", True),
        ("s = 'caf\u00e9'", "caf\u00e9", True),
    ],
)
def test_property_against_string(expression: str, value: str, expected: Truth) -> None:
    check(expression, {"s": value}, expected)


@pytest.mark.parametrize(
    ("expression", "value", "expected"),
    [
        ("b = TRUE", "true", True),
        ("b = TRUE", "TRUE", True),
        ("b = true", " True ", True),
        ("b = TRUE", "false", False),
        ("b = FALSE", "FALSE", True),
        ("b <> TRUE", "false", True),
        ("b <> FALSE", "false", False),
        ("b = TRUE", "yes", None),
        ("b = TRUE", "1", None),
        ("TRUE = b", "true", True),
    ],
)
def test_property_against_boolean(expression: str, value: str, expected: Truth) -> None:
    check(expression, {"b": value}, expected)


@pytest.mark.parametrize(
    ("x", "y", "expression", "expected"),
    [
        ("3", " 3.0", "x = y", True),
        ("abc", "abc", "x = y", True),
        ("abc", "abd", "x = y", False),
        ("abc", "abd", "x <> y", True),
        ("3", "abc", "x = y", False),
        ("10", "9", "x > y", True),
        ("10", "9", "x < y", False),
        ("10", "9", "x <= y", False),
        ("b", "a", "x > y", None),
        ("1", "a", "x >= y", None),
    ],
)
def test_property_against_property(x: str, y: str, expression: str, expected: Truth) -> None:
    check(expression, {"x": x, "y": y}, expected)


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 = 1", True),
        ("1 < 2", True),
        ("2.5 >= 3", False),
        ("'a' = 'a'", True),
        ("'a' <> 'a'", False),
        ("'5' = 5", True),
        ("5 = ' 5 '", True),
        ("'x' = 5", None),
        ("'true' = TRUE", True),
        ("TRUE = FALSE", False),
        ("TRUE <> FALSE", True),
        ("'maybe' = TRUE", None),
        ("TRUE", True),
        ("FALSE", False),
        ("1 BETWEEN 0 AND 2", True),
        ("'a' IN ('a', 'b')", True),
        ("'c' NOT IN ('a', 'b')", True),
        ("NULL IS NULL", True),
        ("1 IS NULL", False),
        ("'x' IS NOT NULL", True),
    ],
)
def test_literals_are_constant(expression: str, expected: Truth) -> None:
    check(expression, {}, expected)


def test_literal_on_the_left_mirrors() -> None:
    check("3 < n", {"n": "4"}, True)
    check("3 >= n", {"n": "4"}, False)
    check("'red' = s", {"s": "red"}, True)


# --- BETWEEN, IN, IS NULL --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "props", "expected"),
    [
        ("n BETWEEN 1 AND 3", {"n": "1"}, True),
        ("n BETWEEN 1 AND 3", {"n": "3"}, True),
        ("n BETWEEN 1 AND 3", {"n": "2.5"}, True),
        ("n BETWEEN 1 AND 3", {"n": "4"}, False),
        ("n BETWEEN 3 AND 1", {"n": "2"}, False),
        ("n BETWEEN 1 AND 3", {"n": "x"}, None),
        ("n BETWEEN 1 AND 3", {}, None),
        ("n NOT BETWEEN 1 AND 3", {"n": "4"}, True),
        ("n NOT BETWEEN 1 AND 3", {"n": "2"}, False),
        ("n NOT BETWEEN 1 AND 3", {}, None),
        ("n BETWEEN lo AND hi", {"n": "2", "lo": "1", "hi": "3"}, True),
        ("n BETWEEN lo AND hi", {"n": "5", "lo": "1", "hi": "3"}, False),
        ("n BETWEEN lo AND hi", {"n": "5", "hi": "3"}, False),
        ("n BETWEEN lo AND hi", {"n": "2", "hi": "3"}, None),
        ("2 BETWEEN lo AND 3", {"lo": "1"}, True),
    ],
)
def test_between(expression: str, props: dict[str, str], expected: Truth) -> None:
    check(expression, props, expected)


@pytest.mark.parametrize(
    ("expression", "props", "expected"),
    [
        ("r IN ('eu', 'us')", {"r": "eu"}, True),
        ("r IN ('eu', 'us')", {"r": "EU"}, False),
        ("r IN ('eu')", {"r": "eu"}, True),
        ("r IN ('eu', 'us')", {}, None),
        ("r NOT IN ('eu', 'us')", {"r": "ap"}, True),
        ("r NOT IN ('eu', 'us')", {"r": "us"}, False),
        ("r NOT IN ('eu', 'us')", {}, None),
        ("r IN ('1')", {"r": "1.0"}, False),
    ],
)
def test_in(expression: str, props: dict[str, str], expected: Truth) -> None:
    check(expression, props, expected)


def test_is_null_is_never_unknown() -> None:
    check("a IS NULL", {}, True)
    check("a IS NULL", {"a": ""}, False)
    check("a IS NOT NULL", {"a": ""}, True)
    check("a IS NOT NULL", {}, False)


@pytest.mark.parametrize(
    "expression",
    ["a = 1", "a <> 'x'", "a > 1", "a = TRUE", "a = b", "b = a", "a IN ('x')", "a NOT IN ('x')"],
)
def test_missing_property_is_unknown(expression: str) -> None:
    check(expression, {"b": "1"}, None)


# --- logic -----------------------------------------------------------------------------------

T, F, U = "TRUE", "FALSE", "missing = 1"
VALUE: dict[str, Truth] = {T: True, F: False, U: None}


@pytest.mark.parametrize("left", [T, F, U])
@pytest.mark.parametrize("right", [T, F, U])
def test_three_valued_and_or(left: str, right: str) -> None:
    a, b = VALUE[left], VALUE[right]
    expected_and = False if False in (a, b) else None if None in (a, b) else True
    expected_or = True if True in (a, b) else None if None in (a, b) else False
    check(f"{left} AND {right}", {}, expected_and)
    check(f"{left} OR {right}", {}, expected_or)
    check(f"{left} AND {right} AND TRUE", {}, expected_and)
    check(f"FALSE OR {left} OR {right}", {}, expected_or)


@pytest.mark.parametrize(("operand", "expected"), [(T, False), (F, True), (U, None)])
def test_not(operand: str, expected: Truth) -> None:
    check(f"NOT {operand}", {}, expected)
    check(f"NOT NOT {operand}", {}, None if expected is None else not expected)


def test_and_binds_tighter_than_or() -> None:
    expression = "a = 1 OR b = 2 AND c = 3"
    check(expression, {"a": "1", "b": "0", "c": "0"}, True)
    check(expression, {"a": "0", "b": "2", "c": "3"}, True)
    check(expression, {"a": "0", "b": "2", "c": "0"}, False)
    check("(a = 1 OR b = 2) AND c = 3", {"a": "1", "b": "0", "c": "0"}, False)
    check("NOT a = 1 AND b = 2", {"a": "0", "b": "2"}, True)
    check("NOT (a = 1 AND b = 2)", {"a": "0", "b": "2"}, True)
    check("NOT (a = 0 OR b = 0)", {"a": "0", "b": "2"}, False)


def test_keywords_in_any_case_names_case_sensitive() -> None:
    props = {"Color": "red", "n": "2"}
    check("Color = 'red' and n between 1 And 3 oR false", props, True)
    check("color = 'red'", props, None)
    check("nOt Color iS nUlL", props, True)
    check("n nOt In ('1')", props, True)
    check("flag = tRuE", {"flag": "true"}, True)


def test_names() -> None:
    f = compile_sql("a.b = 1 OR $x IS NULL AND _y IN ('q') OR a.b > c_1")
    assert f.names == frozenset({"a.b", "$x", "_y", "c_1"})
    assert compile_sql("TRUE").names == frozenset()
    assert compile_sql("caf\u00e9 = 'x'").names == frozenset({"caf\u00e9"})


# --- canonical spelling ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("a=1 and b in ('x','y')", "a = 1 AND b IN ('x', 'y')"),
        ("a=1 and b in ('y','x','x')", "a = 1 AND b IN ('x', 'y')"),
        ("a != 'q'", "a <> 'q'"),
        ("((a = 1))", "a = 1"),
        ("a = 1 OR (b = 2 OR c = 3)", "(a = 1 OR b = 2) OR c = 3"),
        ("a = 1 OR (b = 2 AND c = 3)", "a = 1 OR b = 2 AND c = 3"),
        ("n = +05", "n = 5"),
        ("n = 1e3", "n = 1000.0"),
        ("n = -0.0", "n = 0.0"),
        ("\tnot(a is not null)\n", "NOT a IS NOT NULL"),
    ],
)
def test_equivalent_spellings_are_equal(one: str, other: str) -> None:
    assert compile_sql(one).canonical == compile_sql(other).canonical
    assert compile_sql(one) == compile_sql(other)
    assert hash(compile_sql(one)) == hash(compile_sql(other))


def test_canonical_renderings() -> None:
    assert compile_sql("a=1 and b in ('y','x')").canonical == "a = 1 AND b IN ('x', 'y')"
    assert compile_sql("(a=1 or b=2) and c=3").canonical == "(a = 1 OR b = 2) AND c = 3"
    assert compile_sql("not (a=1 and b=2)").canonical == "NOT (a = 1 AND b = 2)"
    assert compile_sql("s = 'it''s'").canonical == "s = 'it''s'"
    assert compile_sql("x not between -1 and 2.50").canonical == "x NOT BETWEEN -1 AND 2.5"
    f = compile_sql("a=1  and  b=2")
    assert f.expression == "a=1  and  b=2"


def test_keywords_fold_names_do_not() -> None:
    one = compile_sql("a=1 and b in ('x','y')")
    assert one.canonical == "a = 1 AND b IN ('x', 'y')"
    other = compile_sql("A = 1 AND b IN ('x', 'y')")
    assert other.canonical == "A = 1 AND b IN ('x', 'y')"
    assert one != other


# --- refusals --------------------------------------------------------------------------------


UNTERMINATED = (
    "unterminated string: the quote here is never closed (write '' for a quote inside a string)"
)
SIGN = "(a sign touches its number, as in -5; there is no arithmetic)"
END = "end of expression"

SYNTAX_ERRORS = [
    ("a = 1 AND b =", 14, f"expected a value after '=', got {END}"),
    ("a = AND", 5, "expected a value after '=', got 'AND'"),
    ("a = and", 5, "expected a value after '=', got 'and'"),
    ("a", 2, f"expected a comparison after 'a', got {END}"),
    ("a b", 3, "expected a comparison after 'a', got 'b'"),
    ("5", 2, f"expected a comparison after the number 5, got {END}"),
    ("NULL", 5, f"expected a comparison after 'NULL', got {END}"),
    ("color = 'red", 9, UNTERMINATED),
    ("s = 'it's'", 10, UNTERMINATED),
    ("a # 1", 3, "unexpected character '#'"),
    ("a = 1;", 6, "unexpected character ';'"),
    ("a = \x00", 5, "unexpected character '\\x00'"),
    ("a ! b", 3, "unexpected character '!'; write '<>' for 'not equal'"),
    ("a = - 5", 5, f"unexpected character '-' {SIGN}"),
    ("a = 1abc", 5, "malformed number '1abc'"),
    ("a = 1.2.3", 5, "malformed number '1.2.3'"),
    ("a = 1 b = 2", 7, "expected AND, OR or end of expression, got 'b'"),
    ("a = 1 = 2", 7, "expected AND, OR or end of expression, got '='"),
    ("a = 1)", 6, "')' closes no '('"),
    ("(a = 1", 7, f"expected ')' to close the '(' at position 1, got {END}"),
    ("()", 2, "expected a condition after '(', got ')'"),
    ("a = 1 AND", 10, f"expected a condition after 'AND', got {END}"),
    ("OR a = 1", 1, "expected a condition, got 'OR'"),
    ("in = 'x'", 1, "expected a condition, got 'in' (IN is a keyword and cannot name a property)"),
    ("a NOT x", 7, "expected BETWEEN or IN after 'NOT', got 'x'"),
    ("a IS x", 6, "expected NULL after 'IS', got 'x'"),
    ("a IS NOT 1", 10, "expected NULL after 'NOT', got the number 1"),
    ("a BETWEEN 1 3", 13, "expected AND after the number 1 in BETWEEN, got the number 3"),
    ("a IN 'x'", 6, "expected '(' after 'IN', got the string 'x'"),
    ("a IN ()", 7, "expected a string after '(', got ')'"),
    ("a IN ('x',)", 11, "expected a string after ',', got ')'"),
    ("a IN ('x' 'y')", 11, "expected ',' or ')' in the IN list, got the string 'y'"),
    ("a IN ('x'", 10, f"expected ',' or ')' in the IN list, got {END}"),
]

REFUSALS = [
    ("a < 'abc'", 5, "'<' compares numbers; got the string 'abc'"),
    ("'abc' >= 1", 1, "'>=' compares numbers; got the string 'abc'"),
    ("a > TRUE", 5, "'>' compares numbers; got TRUE"),
    ("a BETWEEN 'x' AND 3", 11, "BETWEEN compares numbers; got the string 'x'"),
    ("a BETWEEN 1 AND NULL", 17, "BETWEEN compares numbers; got NULL"),
    ("a = NULL", 5, 'a comparison with NULL is never true; write "a IS NULL"'),
    ("NULL <> a", 1, 'a comparison with NULL is never true; write "a IS NOT NULL"'),
    ("1 = TRUE", 3, "'=' cannot compare the number 1 with TRUE"),
    ("a IN (1)", 7, "IN takes strings; value 1 of the list is the number 1"),
    ("a IN ('x', b)", 12, "IN takes strings; value 2 of the list is the property 'b'"),
    ("a IN ('x', NULL)", 12, "IN takes strings; value 2 of the list is 'NULL'"),
    ("5 IN ('5')", 1, "IN compares strings; got the number 5"),
    ("a = 1e999", 5, "the number 1e999 is out of range"),
]


def _refused(expression: str) -> InvalidArgumentError:
    with pytest.raises(InvalidArgumentError) as caught:
        compile_sql(expression, field="subscriptions[0].sql_expression")
    return caught.value


@pytest.mark.parametrize(("expression", "position", "what"), SYNTAX_ERRORS)
def test_syntax_errors_name_the_position(expression: str, position: int, what: str) -> None:
    rule = f"syntax error at position {position}: {what}"
    err = _refused(expression)
    assert str(err) == f"subscriptions[0].sql_expression: {rule}"
    assert err.details == {"field": "subscriptions[0].sql_expression", "rule": rule}


@pytest.mark.parametrize(("expression", "position", "what"), REFUSALS)
def test_refusals_name_the_position(expression: str, position: int, what: str) -> None:
    assert str(_refused(expression)) == (
        f"subscriptions[0].sql_expression: at position {position}: {what}"
    )


@pytest.mark.parametrize("expression", ["", "   ", "\n\t"])
def test_empty_refused(expression: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        compile_sql(expression)
    assert str(caught.value) == (
        "sql_expression: is empty; write a condition such as \"color = 'red'\""
    )


@pytest.mark.parametrize("given", [None, 5, b"a = 1", ["a = 1"]])
def test_non_string_refused(given: object) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^sql_expression: must be a string, got "):
        compile_sql(given)  # type: ignore[arg-type]


def test_length_limit() -> None:
    longest = "a = '" + "x" * (MAX_SQL_EXPRESSION - 6) + "'"
    assert len(longest) == MAX_SQL_EXPRESSION
    compile_sql(longest)
    with pytest.raises(InvalidArgumentError) as caught:
        compile_sql(longest + " ")
    assert str(caught.value) == (
        f"sql_expression: is {MAX_SQL_EXPRESSION + 1} characters, at most {MAX_SQL_EXPRESSION}"
    )


def test_depth_limit() -> None:
    assert compile_sql("(" * MAX_DEPTH + "a = 1" + ")" * MAX_DEPTH).canonical == "a = 1"
    assert compile_sql("NOT " * MAX_DEPTH + "a = 1").matches({"a": "1"})
    assert compile_sql("NOT (" * (MAX_DEPTH // 2) + "a = 1" + ")" * (MAX_DEPTH // 2))
    rule = f"nests deeper than {MAX_DEPTH} levels of parentheses and NOT"
    too_deep = "(" * (MAX_DEPTH + 1) + "a = 1" + ")" * (MAX_DEPTH + 1)
    with pytest.raises(InvalidArgumentError, match=rf"at position {MAX_DEPTH + 1}: {rule}$"):
        compile_sql(too_deep)
    with pytest.raises(InvalidArgumentError, match=rf"at position {4 * MAX_DEPTH + 1}: {rule}$"):
        compile_sql("NOT " * (MAX_DEPTH + 1) + "a = 1")
    with pytest.raises(InvalidArgumentError, match=rule):
        compile_sql("(" * 4000)


def test_long_chains_do_not_recurse() -> None:
    chain = " OR ".join(f"a{i} = {i}" for i in range(250))
    assert len(chain) < MAX_SQL_EXPRESSION
    f = compile_sql(chain)
    assert f.matches({"a249": "249"})
    assert not f.matches({})
    g = compile_sql(" AND ".join(["TRUE"] * 400))
    assert g.matches({})


def test_in_list_limit() -> None:
    most = "a IN ('x'" + ",'x'" * (MAX_IN_VALUES - 1) + ")"
    assert compile_sql(most).canonical == "a IN ('x')"
    too_many = "a IN ('x'" + ",'x'" * MAX_IN_VALUES + ")"
    assert len(too_many) <= MAX_SQL_EXPRESSION
    with pytest.raises(InvalidArgumentError) as caught:
        compile_sql(too_many)
    position = too_many.rindex("'x'") + 1
    assert str(caught.value) == (
        f"sql_expression: at position {position}: an IN list holds at most {MAX_IN_VALUES} strings"
    )


# --- random text -----------------------------------------------------------------------------

TOKENS = [
    "a", "b", "c", "TAGS", "x.y", "$p", "_q", "AND", "or", "Not", "between", "IN", "is", "NULL",
    "true", "FALSE", "=", "<>", "!=", "<", "<=", ">", ">=", "(", ")", ",", "'red'", "'it''s'",
    "''", "'", "1", "-5", "+2", "3.14", ".5", "1e3", "1e999", "-", "+", ".", "!", "9" * 30,
]  # fmt: skip
ODD_CHARS = "()',.=<>!+-eE0123456789 \t\n#;\"`\\\x00\u00e9\u0131\u0661\u2028\U0001f600"


def _random_text(rng: random.Random) -> str:
    pieces: list[str] = []
    for _ in range(rng.randrange(1, 25)):
        if rng.random() < 0.9:
            pieces.append(rng.choice(TOKENS))
        else:
            pieces.append("".join(rng.choice(ODD_CHARS) for _ in range(rng.randrange(1, 4))))
    return "".join(p + rng.choice(["", " ", " ", "  "]) for p in pieces)


PROPERTY_VALUES = ["", "1", " 2 ", "-3.5", "1e2", "abc", "true", "FALSE", "red", "it's", "9" * 5000]


def _random_props(rng: random.Random) -> dict[str, str]:
    names = ["a", "b", "c", "TAGS", "x.y", "$p", "_q"]
    return {n: rng.choice(PROPERTY_VALUES) for n in names if rng.random() < 0.7}


def test_random_text_is_compiled_or_refused_with_invalid_argument() -> None:
    rng = random.Random(20240611)
    refusals: list[str] = []
    compiled: list[SqlFilter] = []
    for _ in range(4000):
        text = _random_text(rng)
        try:
            compiled.append(compile_sql(text))
        except InvalidArgumentError as err:
            refusals.append(str(err))
    assert all(r.startswith("sql_expression: ") for r in refusals)
    assert compiled
    for f in compiled:
        again = compile_sql(f.canonical)
        assert again == f
        assert again.canonical == f.canonical
        for _ in range(5):
            props = _random_props(rng)
            assert f.matches(props) is again.matches(props)


# A generated condition and its meaning, worked out independently of the module.
Reference = Callable[[Mapping[str, str]], Truth]
NUMBERS: dict[str, float | None] = {
    "": None, "1": 1, " 2 ": 2, "-3.5": -3.5, "1e2": 100, "abc": None, "true": None,
    "FALSE": None, "red": None, "it's": None,
}  # fmt: skip


COMPARE: dict[str, Callable[[float, float], bool]] = {
    "=": operator.eq,
    "<>": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


def _kw(rng: random.Random, word: str) -> str:
    return "".join(c.upper() if rng.random() < 0.5 else c.lower() for c in word)


def _leaf(rng: random.Random) -> tuple[str, Reference]:
    name = rng.choice(["a", "b", "c"])
    kind = rng.randrange(5)
    if kind == 0:
        op, limit = rng.choice(["=", "<>", "<", "<=", ">", ">="]), rng.choice([-3.5, 0, 1, 2, 50])
        cmp = COMPARE[op]

        def number(p: Mapping[str, str]) -> Truth:
            n = NUMBERS.get(p.get(name, "")) if name in p else None
            return None if n is None else bool(cmp(n, limit))

        return f"{name}{op}{limit}", number
    if kind == 1:
        word = rng.choice(["red", "it's", "abc"])
        return (
            f"{name} = '{word.replace(chr(39), chr(39) * 2)}'",
            lambda p: None if name not in p else p[name] == word,
        )
    if kind == 2:
        negated = rng.random() < 0.5
        sql = (
            f"{name} {_kw(rng, 'is')} {_kw(rng, 'not') + ' ' if negated else ''}{_kw(rng, 'null')}"
        )
        return sql, lambda p: (name not in p) is not negated
    if kind == 3:
        words = rng.sample(["red", "abc", "1", "true"], 2)
        negated = rng.random() < 0.5
        listed = ",".join(f"'{w}'" for w in words)
        sql = f"{name} {_kw(rng, 'not') + ' ' if negated else ''}{_kw(rng, 'in')} ({listed})"
        return sql, lambda p: None if name not in p else (p[name] in words) is not negated
    low, high = sorted(rng.sample([-5, 0, 1, 2, 3, 100], 2))

    def between(p: Mapping[str, str]) -> Truth:
        n = NUMBERS.get(p.get(name, "")) if name in p else None
        return None if n is None else low <= n <= high

    return f"{name} {_kw(rng, 'between')} {low} {_kw(rng, 'and')} {high}", between


def _condition(rng: random.Random, depth: int) -> tuple[str, Reference]:
    if depth == 0 or rng.random() < 0.3:
        return _leaf(rng)
    choice = rng.randrange(3)
    if choice == 0:
        text, ref = _condition(rng, depth - 1)
        return f"{_kw(rng, 'not')} ({text})", lambda p: None if (v := ref(p)) is None else not v
    (lt, lr), (rt, rr) = _condition(rng, depth - 1), _condition(rng, depth - 1)
    if choice == 1:

        def both(p: Mapping[str, str]) -> Truth:
            x, y = lr(p), rr(p)
            return False if False in (x, y) else None if None in (x, y) else True

        return f"({lt}) {_kw(rng, 'and')} ({rt})", both

    def either(p: Mapping[str, str]) -> Truth:
        x, y = lr(p), rr(p)
        return True if True in (x, y) else None if None in (x, y) else False

    return f"({lt}) {_kw(rng, 'or')} ({rt})", either


def test_generated_conditions_agree_with_a_reference() -> None:
    rng = random.Random(7)
    for _ in range(1500):
        text, ref = _condition(rng, 4)
        f = compile_sql(text)
        canonical = compile_sql(f.canonical)
        assert canonical.canonical == f.canonical
        for _ in range(4):
            props = {n: rng.choice(list(NUMBERS)) for n in "abc" if rng.random() < 0.8}
            assert f.matches(props) is (ref(props) is True), (text, props)
            assert canonical.matches(props) is f.matches(props)


def test_mutated_conditions_are_compiled_or_refused() -> None:
    rng = random.Random(11)
    for _ in range(3000):
        text, _ref = _condition(rng, 3)
        cut = list(text)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(cut))
            action = rng.randrange(3)
            if action == 0:
                del cut[at]
            elif action == 1:
                cut.insert(at, rng.choice(ODD_CHARS))
            else:
                cut[at : at + 1] = [rng.choice(TOKENS), " "]
        with contextlib.suppress(InvalidArgumentError):
            compile_sql("".join(cut)).matches(_random_props(rng))


def test_matches_many_messages() -> None:
    f = compile_sql("color = 'red' AND size > 3 AND region IN ('eu','us')")
    variants: list[dict[str, str]] = [
        {"color": "red", "size": "10", "region": "eu", "KEYS": "k", "TAGS": "A"},
        {"color": "red", "size": "2", "region": "us"},
        {"color": "blue", "size": "x"},
        {"size": " 4.5 ", "region": "us", "color": "red"},
        {},
    ]
    selected = sum(f.matches(variants[i % len(variants)]) for i in range(100_000))
    assert selected == 40_000


def test_filter_is_frozen() -> None:
    f = compile_sql("a = 1")
    assert isinstance(f, SqlFilter)
    with pytest.raises(AttributeError):
        f.canonical = "b = 2"  # type: ignore[misc]
