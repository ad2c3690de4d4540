"""SQL92 conditions on message properties, as RocketMQ's ``MessageSelector.bySql``.

A consumer may subscribe with a condition on the properties of messages (user properties, and
the ones the broker exposes such as ``TAGS`` and ``KEYS``); the broker evaluates it for every
candidate message and delivers those for which it is TRUE. :func:`compile_sql` checks the text
once and turns it into a :class:`SqlFilter`, a tree of small closures that
:meth:`SqlFilter.matches` runs; the text itself is never evaluated as Python.

Grammar (keywords in any case; property names are case-sensitive)::

    condition  := and_expr ( OR and_expr )*
    and_expr   := not_expr ( AND not_expr )*
    not_expr   := NOT not_expr | predicate
    predicate  := '(' condition ')'
                | TRUE | FALSE
                | operand ( '=' | '<>' | '!=' | '<' | '<=' | '>' | '>=' ) operand
                | operand [ NOT ] BETWEEN operand AND operand
                | operand [ NOT ] IN '(' string ( ',' string )* ')'
                | operand IS [ NOT ] NULL
    operand    := name | string | number | TRUE | FALSE | NULL
    name       := ( letter | '_' | '$' ) ( letter | digit | '_' | '$' | '.' )*
    string     := "'" ( any character but "'" | "''" )* "'"          'it''s' is it's
    number     := [ '+' | '-' ] ( digits [ '.' [ digits ] ] | '.' digits )
                  [ ( 'e' | 'E' ) [ '+' | '-' ] digits ]             integer unless '.' or 'e'

``AND OR NOT BETWEEN IN IS NULL TRUE FALSE`` are keywords and cannot name properties. A sign
belongs to its number (``-5``, no space between); there is no arithmetic. NOT binds tighter
than AND, and AND tighter than OR: ``a = 1 OR b = 2 AND c = 3`` is ``a = 1 OR (b = 2 AND c = 3)``.

Semantics: SQL's three-valued logic (TRUE, FALSE, UNKNOWN). A message is selected only when the
whole condition is TRUE. FALSE AND UNKNOWN is FALSE, TRUE OR UNKNOWN is TRUE, other mixes with
UNKNOWN are UNKNOWN, and NOT UNKNOWN is UNKNOWN: ``NOT (size > 3)`` does not select a message
whose ``size`` is missing or is not a number.

- A property's value is text; a property the message lacks is NULL. Every comparison, BETWEEN
  and IN involving NULL is UNKNOWN; ``x IS NULL`` and ``x IS NOT NULL`` test for absence and are
  never UNKNOWN. ``x = NULL`` and ``x <> NULL`` are refused (write ``x IS [NOT] NULL``).
- Against a number (``=  <>  <  <=  >  >=`` and BETWEEN), a property's text is read as a number,
  spaces around it allowed, in the number syntax above (``'10'``, ``' 3 '``, ``'-0.5'``,
  ``'1e2'``): an integer, else a decimal (a double). Text that is not a number makes the
  comparison UNKNOWN, not an error.
- Against a string, ``=`` and ``<>`` compare text exactly (case and spaces count). ``<``, ``<=``,
  ``>``, ``>=`` and BETWEEN compare numbers only and refuse strings (and TRUE, FALSE, NULL).
- Against TRUE or FALSE (``=`` and ``<>`` only), the text ``true`` or ``false`` in any case,
  spaces around it allowed, is that truth value; other text makes the comparison UNKNOWN.
- Property against property: ``=`` and ``<>`` compare numbers when both read as numbers, else
  text; ``<  <=  >  >=`` compare numbers, UNKNOWN unless both read as numbers.
- ``x BETWEEN a AND b`` is ``x >= a AND x <= b`` (bounds included; none when a > b);
  ``x NOT BETWEEN a AND b`` is its negation.
- ``x IN ('a', 'b')`` is exact text membership; the list holds strings only. ``x NOT IN (...)``
  is its negation, so it too is UNKNOWN when ``x`` is missing.
- A literal compared with a literal follows the same rules (a string literal is read like a
  property's text against a number or TRUE/FALSE) and is worked out once, at compile time.
  A number is never equal to TRUE or FALSE: ``1 = TRUE`` is refused.

Limits: at most :data:`MAX_SQL_EXPRESSION` characters, :data:`MAX_DEPTH` nested parentheses
and NOTs, :data:`MAX_IN_VALUES` strings in one IN list.

``SqlFilter.canonical`` renders a condition in one spelling: keywords upper case, single spaces,
``!=`` as ``<>``, strings re-quoted, numbers normalised (``+05`` is ``5``, ``1e3`` is
``1000.0``), IN lists sorted without duplicates, nested AND and OR chains flattened and
parentheses only where precedence needs them. Filters compare equal (and hash) by it.

Every refusal is an :class:`~apogee.common.errors.InvalidArgumentError` naming the field;
syntax errors give the 1-based position of what was found, and what was expected there.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from typing import Any, Final, NoReturn, cast

from apogee.common.errors import InvalidArgumentError
from apogee.common.sql_lexer import (
    INTEGER,
    NUMBER_AT,
    Token,
    describe,
    quote,
    short,
    tokenize,
)

#: Longest condition accepted, in characters.
MAX_SQL_EXPRESSION: Final = 4096
#: Deepest nesting of parentheses and NOTs accepted.
MAX_DEPTH: Final = 64
#: Most strings one IN list may hold.
MAX_IN_VALUES: Final = 1000

#: The three truth values: True, False and None for UNKNOWN.
_Truth = bool | None
_Eval = Callable[[Mapping[str, str]], _Truth]

_LITERAL_KEYWORDS: Final = frozenset({"TRUE", "FALSE", "NULL"})
_ORDERING: Final = frozenset({"<", "<=", ">", ">="})
_MIRROR: Final = {"=": "=", "<>": "<>", "<": ">", "<=": ">=", ">": "<", ">=": "<="}
_OPS: Final[dict[str, Callable[[Any, Any], bool]]] = {
    "=": operator.eq,
    "<>": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}

# Precedence levels of a condition's top operator, for parenthesising its canonical text.
_OR, _AND, _NOT, _PREDICATE = 0, 1, 2, 3


def _read_number(text: str) -> int | float | None:
    """The number ``text`` spells (spaces around allowed), or None."""
    if text.isascii() and text.isdigit():
        try:
            return int(text)
        except ValueError:  # more digits than int() converts
            return float(text)
    text = text.strip()
    if INTEGER.fullmatch(text) is not None:
        try:
            return int(text)
        except ValueError:
            return float(text)
    if NUMBER_AT.fullmatch(text) is not None:
        return float(text)
    return None


def _read_bool(text: str) -> bool | None:
    """True or False for the text ``true`` or ``false`` in any case, spaces around; else None."""
    word = text.strip().lower()
    return True if word == "true" else False if word == "false" else None


@dataclasses.dataclass(frozen=True, slots=True)
class SqlFilter:
    """A compiled SQL92 condition; see the module docstring for its grammar and meaning.

    ``expression`` is the text as given, ``canonical`` its normalised spelling (filters compare
    equal and hash by it), ``names`` the property names it reads. Build it with
    :func:`compile_sql`; it is immutable and safe to share between threads."""

    expression: str = dataclasses.field(compare=False)
    canonical: str
    names: frozenset[str] = dataclasses.field(compare=False)
    _evaluate: _Eval = dataclasses.field(repr=False, compare=False)

    def matches(self, properties: Mapping[str, str]) -> bool:
        """Whether the condition is TRUE for a message with ``properties`` (FALSE and UNKNOWN
        select nothing). Never raises for any mapping of strings to strings."""
        return self._evaluate(properties) is True


def compile_sql(expression: str, field: str = "sql_expression") -> SqlFilter:
    """Check ``expression`` and compile it into a :class:`SqlFilter`.

    Raises :class:`InvalidArgumentError` naming ``field`` for anything but a valid condition:
    not a string, empty, longer than :data:`MAX_SQL_EXPRESSION`, a syntax error (with the
    1-based position), a comparison the rules refuse, nesting deeper than :data:`MAX_DEPTH`,
    or an IN list over :data:`MAX_IN_VALUES` values. It raises nothing else, whatever the text.
    """
    given: object = expression
    if not isinstance(given, str):
        raise InvalidArgumentError(
            field=field, rule=f"must be a string, got {type(given).__name__}"
        )
    if len(given) > MAX_SQL_EXPRESSION:
        raise InvalidArgumentError(
            field=field, rule=f"is {len(given)} characters, at most {MAX_SQL_EXPRESSION}"
        )
    if not given.strip():
        raise InvalidArgumentError(
            field=field, rule="is empty; write a condition such as \"color = 'red'\""
        )
    parser = _Parser(given, field)
    cond = parser.parse()
    return SqlFilter(given, cond.text, frozenset(parser.names), cond.evaluate)


# --- syntax -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Operand:
    #: "name", "string", "number", "bool" or "null"
    kind: str
    value: str | int | float | bool | None
    #: canonical spelling
    text: str
    pos: int

    def describe(self) -> str:
        if self.kind == "string":
            return f"the string {short(self.text)}"
        if self.kind == "number":
            return f"the number {self.text}"
        if self.kind == "name":
            return f"the property '{short(self.text)}'"
        return self.text


@dataclasses.dataclass(frozen=True, slots=True)
class _Cond:
    """A parsed condition: its canonical text, the precedence level of its top operator, its
    evaluation, and for an AND or OR chain the conditions it joins."""

    text: str
    level: int
    evaluate: _Eval
    parts: tuple[_Cond, ...] = ()


class _Parser:
    """Recursive descent over the tokens; recursion is bounded by :data:`MAX_DEPTH`."""

    def __init__(self, expression: str, field: str) -> None:
        self.expression = expression
        self.field = field
        self.names: set[str] = set()
        self.depth = 0
        self.i = 0
        self.tokens = tokenize(expression, field)

    def fail(self, pos: int, what: str) -> NoReturn:
        raise InvalidArgumentError(field=self.field, rule=f"syntax error at position {pos}: {what}")

    def refuse(self, pos: int, what: str) -> NoReturn:
        raise InvalidArgumentError(field=self.field, rule=f"at position {pos}: {what}")

    def peek(self) -> Token:
        return self.tokens[self.i]

    def advance(self) -> Token:
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def after(self) -> str:
        """`` after '<previous token>'``, or nothing at the start."""
        return f" after {describe(self.tokens[self.i - 1])}" if self.i else ""

    def at_keyword(self, word: str) -> bool:
        tok = self.tokens[self.i]
        return tok.kind == "keyword" and tok.value == word

    def enter(self, tok: Token) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self.refuse(tok.pos, f"nests deeper than {MAX_DEPTH} levels of parentheses and NOT")

    # conditions

    def parse(self) -> _Cond:
        cond = self.condition()
        tok = self.peek()
        if tok.kind == ")":
            self.fail(tok.pos, "')' closes no '('")
        if tok.kind != "end":
            self.fail(tok.pos, f"expected AND, OR or end of expression, got {describe(tok)}")
        return cond

    def condition(self) -> _Cond:
        parts = [self.conjunction()]
        while self.at_keyword("OR"):
            self.advance()
            parts.append(self.conjunction())
        return parts[0] if len(parts) == 1 else _or(parts)

    def conjunction(self) -> _Cond:
        parts = [self.negation()]
        while self.at_keyword("AND"):
            self.advance()
            parts.append(self.negation())
        return parts[0] if len(parts) == 1 else _and(parts)

    def negation(self) -> _Cond:
        nots = 0
        while self.at_keyword("NOT"):
            self.enter(self.advance())
            nots += 1
        cond = self.predicate()
        for _ in range(nots):
            cond = _negate(cond)
        self.depth -= nots
        return cond

    def predicate(self) -> _Cond:
        tok = self.peek()
        if tok.kind == "(":
            self.enter(self.advance())
            cond = self.condition()
            close = self.peek()
            if close.kind != ")":
                self.fail(
                    close.pos,
                    f"expected ')' to close the '(' at position {tok.pos}, got {describe(close)}",
                )
            self.advance()
            self.depth -= 1
            return cond
        left = self.operand("a condition")
        nxt = self.peek()
        if nxt.kind == "op":
            self.advance()
            right = self.operand("a value")
            op = str(nxt.value)
            evaluate = self.compare(left, op, right, nxt.pos)
            return _Cond(f"{left.text} {op} {right.text}", _PREDICATE, evaluate)
        if nxt.kind == "keyword":
            if nxt.value == "NOT":
                self.advance()
                if self.at_keyword("BETWEEN"):
                    return self.between(left, negated=True)
                if self.at_keyword("IN"):
                    return self.in_list(left, negated=True)
                self.fail(
                    self.peek().pos,
                    f"expected BETWEEN or IN{self.after()}, got {describe(self.peek())}",
                )
            if nxt.value == "BETWEEN":
                return self.between(left, negated=False)
            if nxt.value == "IN":
                return self.in_list(left, negated=False)
            if nxt.value == "IS":
                return self.is_null(left)
        if left.kind == "bool":
            return _Cond(left.text, _PREDICATE, _constant(cast(bool, left.value)))
        self.fail(nxt.pos, f"expected a comparison{self.after()}, got {describe(nxt)}")

    def operand(self, what: str) -> _Operand:
        tok = self.peek()
        pos = tok.pos
        if tok.kind == "name":
            self.names.add(tok.text)
            self.advance()
            return _Operand("name", tok.text, tok.text, pos)
        if tok.kind == "string":
            self.advance()
            return _Operand("string", tok.value, quote(str(tok.value)), pos)
        if tok.kind == "number":
            self.advance()
            return _Operand("number", tok.value, tok.canon, pos)
        if tok.kind == "keyword" and tok.value in _LITERAL_KEYWORDS:
            self.advance()
            word = str(tok.value)
            value = None if word == "NULL" else word == "TRUE"
            return _Operand("null" if value is None else "bool", value, word, pos)
        hint = ""
        if tok.kind == "keyword" and self.tokens[self.i + 1].kind == "op":
            hint = f" ({tok.value} is a keyword and cannot name a property)"
        self.fail(pos, f"expected {what}{self.after()}, got {describe(tok)}{hint}")

    def compare(self, left: _Operand, op: str, right: _Operand, pos: int) -> _Eval:
        if op in _ORDERING:
            for side in (left, right):
                if side.kind in ("string", "bool", "null"):
                    self.refuse(side.pos, f"'{op}' compares numbers; got {side.describe()}")
        else:
            for side, other in ((left, right), (right, left)):
                if side.kind == "null":
                    test = "IS NULL" if op == "=" else "IS NOT NULL"
                    self.refuse(
                        side.pos,
                        f'a comparison with NULL is never true; write "{short(other.text)} {test}"',
                    )
            if {left.kind, right.kind} == {"number", "bool"}:
                self.refuse(pos, f"'{op}' cannot compare {left.describe()} with {right.describe()}")
        if left.kind != "name" and right.kind == "name":
            left, right, op = right, left, _MIRROR[op]
        if left.kind == "name":
            return _compare_name(str(left.value), op, right)
        return _constant(_compare_literals(left, op, right))

    def between(self, left: _Operand, negated: bool) -> _Cond:
        self.advance()
        low = self.operand("a value")
        if not self.at_keyword("AND"):
            tok = self.peek()
            self.fail(tok.pos, f"expected AND{self.after()} in BETWEEN, got {describe(tok)}")
        self.advance()
        high = self.operand("a value")
        for side in (left, low, high):
            if side.kind in ("string", "bool", "null"):
                self.refuse(side.pos, f"BETWEEN compares numbers; got {side.describe()}")
        if left.kind == "name" and low.kind == high.kind == "number":
            evaluate = _name_between(str(left.value), low.value, high.value, negated)
        else:
            both = _all([self.compare(left, ">=", low, 0), self.compare(left, "<=", high, 0)])
            evaluate = _negated(both) if negated else both
        word = "NOT BETWEEN" if negated else "BETWEEN"
        return _Cond(f"{left.text} {word} {low.text} AND {high.text}", _PREDICATE, evaluate)

    def in_list(self, left: _Operand, negated: bool) -> _Cond:
        if left.kind not in ("name", "string"):
            self.refuse(left.pos, f"IN compares strings; got {left.describe()}")
        self.advance()
        tok = self.peek()
        if tok.kind != "(":
            self.fail(tok.pos, f"expected '('{self.after()}, got {describe(tok)}")
        self.advance()
        values: list[str] = []
        while True:
            tok = self.peek()
            if tok.kind == "string":
                if len(values) == MAX_IN_VALUES:
                    self.refuse(tok.pos, f"an IN list holds at most {MAX_IN_VALUES} strings")
                values.append(str(tok.value))
                self.advance()
            elif tok.kind in ("name", "number") or (
                tok.kind == "keyword" and tok.value in _LITERAL_KEYWORDS
            ):
                what = f"the property {tok.text!r}" if tok.kind == "name" else describe(tok)
                self.refuse(
                    tok.pos, f"IN takes strings; value {len(values) + 1} of the list is {what}"
                )
            else:
                self.fail(tok.pos, f"expected a string{self.after()}, got {describe(tok)}")
            sep = self.peek()
            if sep.kind not in (",", ")"):
                self.fail(sep.pos, f"expected ',' or ')' in the IN list, got {describe(sep)}")
            self.advance()
            if sep.kind == ")":
                break
        members = frozenset(values)
        if left.kind == "name":
            evaluate = _name_in(str(left.value), members, negated)
        else:
            evaluate = _constant((left.value in members) != negated)
        word = "NOT IN" if negated else "IN"
        listed = ", ".join(quote(v) for v in sorted(members))
        return _Cond(f"{left.text} {word} ({listed})", _PREDICATE, evaluate)

    def is_null(self, left: _Operand) -> _Cond:
        self.advance()
        negated = self.at_keyword("NOT")
        if negated:
            self.advance()
        if not self.at_keyword("NULL"):
            tok = self.peek()
            self.fail(tok.pos, f"expected NULL{self.after()}, got {describe(tok)}")
        self.advance()
        if left.kind == "name":
            evaluate = _name_is_null(str(left.value), negated)
        else:
            evaluate = _constant((left.kind == "null") != negated)
        word = "IS NOT NULL" if negated else "IS NULL"
        return _Cond(f"{left.text} {word}", _PREDICATE, evaluate)


# --- evaluation -------------------------------------------------------------------------------


def _or(parts: list[_Cond]) -> _Cond:
    flat = [p for c in parts for p in (c.parts if c.level == _OR else (c,))]
    text = " OR ".join(c.text for c in flat)
    return _Cond(text, _OR, _any([c.evaluate for c in flat]), tuple(flat))


def _and(parts: list[_Cond]) -> _Cond:
    flat = [p for c in parts for p in (c.parts if c.level == _AND else (c,))]
    text = " AND ".join(f"({c.text})" if c.level < _AND else c.text for c in flat)
    return _Cond(text, _AND, _all([c.evaluate for c in flat]), tuple(flat))


def _negate(cond: _Cond) -> _Cond:
    text = f"NOT {cond.text}" if cond.level >= _NOT else f"NOT ({cond.text})"
    return _Cond(text, _NOT, _negated(cond.evaluate))


def _constant(value: _Truth) -> _Eval:
    def constant(props: Mapping[str, str]) -> _Truth:
        return value

    return constant


def _negated(inner: _Eval) -> _Eval:
    def negated(props: Mapping[str, str]) -> _Truth:
        r = inner(props)
        return None if r is None else not r

    return negated


def _all(evals: list[_Eval]) -> _Eval:
    if len(evals) == 2:
        first, second = evals

        def both(props: Mapping[str, str]) -> _Truth:
            a = first(props)
            if a is False:
                return False
            b = second(props)
            if b is False:
                return False
            return a and b  # True, or None when either is UNKNOWN

        return both

    def every(props: Mapping[str, str]) -> _Truth:
        unknown = False
        for evaluate in evals:
            r = evaluate(props)
            if r is False:
                return False
            if r is None:
                unknown = True
        return None if unknown else True

    return every


def _any(evals: list[_Eval]) -> _Eval:
    if len(evals) == 2:
        first, second = evals

        def either(props: Mapping[str, str]) -> _Truth:
            a = first(props)
            if a is True:
                return True
            b = second(props)
            if b is True:
                return True
            return None if a is None or b is None else False

        return either

    def some(props: Mapping[str, str]) -> _Truth:
        unknown = False
        for evaluate in evals:
            r = evaluate(props)
            if r is True:
                return True
            if r is None:
                unknown = True
        return None if unknown else False

    return some


def _literal_value(lit: _Operand, other_kind: str) -> str | int | float | bool | None:
    if lit.kind == "string" and other_kind == "number":
        return _read_number(cast(str, lit.value))
    if lit.kind == "string" and other_kind == "bool":
        return _read_bool(cast(str, lit.value))
    return lit.value


def _compare_literals(left: _Operand, op: str, right: _Operand) -> _Truth:
    a = _literal_value(left, right.kind)
    b = _literal_value(right, left.kind)
    return None if a is None or b is None else bool(_OPS[op](a, b))


def _compare_name(name: str, op: str, right: _Operand) -> _Eval:
    """``name op right``, ``right`` a property or a literal the rules allow with ``op``."""
    cmp = _OPS[op]
    if right.kind == "name":
        other = str(right.value)
        ordering = op in _ORDERING

        def names(props: Mapping[str, str]) -> _Truth:
            a = props.get(name)
            b = props.get(other)
            if a is None or b is None:
                return None
            x = _read_number(a)
            y = _read_number(b)
            if x is not None and y is not None:
                return cmp(x, y)
            return None if ordering else cmp(a, b)

        return names
    if right.kind == "number":
        number = right.value

        def versus_number(props: Mapping[str, str]) -> _Truth:
            v = props.get(name)
            if v is None:
                return None
            x = _read_number(v)
            return None if x is None else cmp(x, number)

        return versus_number
    if right.kind == "bool":
        truth = right.value
        equal = op == "="

        def versus_bool(props: Mapping[str, str]) -> _Truth:
            v = props.get(name)
            if v is None:
                return None
            b = _read_bool(v)
            return None if b is None else (b is truth) is equal

        return versus_bool
    text = right.value
    if op == "=":

        def equals(props: Mapping[str, str]) -> _Truth:
            v = props.get(name)
            return None if v is None else v == text

        return equals

    def differs(props: Mapping[str, str]) -> _Truth:
        v = props.get(name)
        return None if v is None else v != text

    return differs


def _name_between(name: str, low: Any, high: Any, negated: bool) -> _Eval:
    def between(props: Mapping[str, str]) -> _Truth:
        v = props.get(name)
        if v is None:
            return None
        x = _read_number(v)
        return None if x is None else (low <= x <= high) is not negated

    return between


def _name_in(name: str, members: frozenset[str], negated: bool) -> _Eval:
    def among(props: Mapping[str, str]) -> _Truth:
        v = props.get(name)
        return None if v is None else (v in members) is not negated

    return among


def _name_is_null(name: str, negated: bool) -> _Eval:
    def is_null(props: Mapping[str, str]) -> _Truth:
        return (props.get(name) is None) is not negated

    return is_null
