"""The tokens of an SQL92 condition (:mod:`apogee.common.selector`): names, strings, numbers,
keywords, operators and punctuation, each with its 1-based position for error messages."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Final, NoReturn

from apogee.common.errors import InvalidArgumentError

KEYWORDS: Final = frozenset({"AND", "OR", "NOT", "BETWEEN", "IN", "IS", "NULL", "TRUE", "FALSE"})
NUMBER_AT: Final = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
INTEGER: Final = re.compile(r"[+-]?[0-9]+")
_NAME_PUNCT: Final = frozenset("_$.0123456789")
#: Longest piece of the expression an error message quotes.
_SHORT: Final = 40


@dataclasses.dataclass(frozen=True, slots=True)
class Token:
    #: "name", "string", "number", "keyword", "op", "(", ")", "," or "end"
    kind: str
    #: as written
    text: str
    #: 1-based position of its first character
    pos: int
    #: a string's or name's text, a keyword upper case, an operator ("!=" as "<>"), a number
    value: str | int | float
    #: a number's canonical spelling
    canon: str = ""


def describe(tok: Token) -> str:
    if tok.kind == "end":
        return "end of expression"
    if tok.kind == "string":
        return f"the string {short(quote(str(tok.value)))}"
    if tok.kind == "number":
        return f"the number {short(tok.text)}"
    return f"'{short(tok.text)}'"


def quote(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def short(text: str) -> str:
    return text if len(text) <= _SHORT else text[: _SHORT - 3] + "..."


def tokenize(expression: str, field: str) -> list[Token]:
    """The tokens of ``expression``, ending with an ``end`` token; raises
    :class:`InvalidArgumentError` naming ``field`` and the position of what is not a token."""
    return _Lexer(expression, field).tokenize()


class _Lexer:
    def __init__(self, expression: str, field: str) -> None:
        self.expression = expression
        self.field = field

    def fail(self, pos: int, what: str) -> NoReturn:
        raise InvalidArgumentError(field=self.field, rule=f"syntax error at position {pos}: {what}")

    def refuse(self, pos: int, what: str) -> NoReturn:
        raise InvalidArgumentError(field=self.field, rule=f"at position {pos}: {what}")

    def tokenize(self) -> list[Token]:
        text, n = self.expression, len(self.expression)
        tokens: list[Token] = []
        i = 0
        while i < n:
            ch = text[i]
            if ch.isspace():
                i += 1
            elif ch in "(),":
                tokens.append(Token(ch, ch, i + 1, ch))
                i += 1
            elif ch in "=<>!":
                op = text[i : i + 2]
                if op not in ("<=", ">=", "<>", "!="):
                    if ch == "!":
                        self.fail(i + 1, "unexpected character '!'; write '<>' for 'not equal'")
                    op = ch
                tokens.append(Token("op", op, i + 1, "<>" if op == "!=" else op))
                i += len(op)
            elif ch == "'":
                i = self._string(i, tokens)
            elif ch in "+-.0123456789":
                i = self._number(i, tokens)
            elif ch.isalpha() or ch in "_$":
                j = i + 1
                while j < n and (text[j].isalpha() or text[j] in _NAME_PUNCT):
                    j += 1
                word = text[i:j]
                if word.isascii() and word.upper() in KEYWORDS:
                    tokens.append(Token("keyword", word, i + 1, word.upper()))
                else:
                    tokens.append(Token("name", word, i + 1, word))
                i = j
            else:
                self.fail(i + 1, f"unexpected character {ch!r}")
        tokens.append(Token("end", "", n + 1, ""))
        return tokens

    def _string(self, start: int, tokens: list[Token]) -> int:
        text = self.expression
        pieces: list[str] = []
        j = start + 1
        while True:
            k = text.find("'", j)
            if k < 0:
                self.fail(
                    start + 1,
                    "unterminated string: the quote here is never closed "
                    "(write '' for a quote inside a string)",
                )
            pieces.append(text[j:k])
            if text.startswith("'", k + 1):
                pieces.append("'")
                j = k + 2
                continue
            tokens.append(Token("string", text[start : k + 1], start + 1, "".join(pieces)))
            return k + 1

    def _number(self, start: int, tokens: list[Token]) -> int:
        text = self.expression
        m = NUMBER_AT.match(text, start)
        if m is None:
            sign = " (a sign touches its number, as in -5; there is no arithmetic)"
            self.fail(
                start + 1,
                f"unexpected character {text[start]!r}{sign if text[start] != '.' else ''}",
            )
        end = m.end()
        if end < len(text) and (text[end].isalpha() or text[end] in _NAME_PUNCT):
            while end < len(text) and (text[end].isalpha() or text[end] in _NAME_PUNCT):
                end += 1
            self.fail(start + 1, f"malformed number {short(text[start:end])!r}")
        written = m.group()
        value: int | float
        try:
            if INTEGER.fullmatch(written) is not None:
                value = int(written)
                canon = str(value)
            else:
                value = float(written)
                if not math.isfinite(value):
                    self.refuse(start + 1, f"the number {short(written)} is out of range")
                value = value or 0.0  # -0.0 is 0.0
                canon = repr(value)
        except ValueError:
            self.refuse(start + 1, f"the number {short(written)} has too many digits")
        tokens.append(Token("number", written, start + 1, value, canon))
        return end
