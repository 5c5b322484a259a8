"""$((...)): integer arithmetic compiled to closures over the shell's variables."""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable
from typing import Protocol, TypeAlias

from backends.fake.shell.control import ShellError
from backends.fake.shell.lexer import NAME


class Scope(Protocol):
    """What arithmetic reads and assigns: the shell's variables."""

    vars: dict[str, str]

    def get(self, name: str) -> str | None: ...


_ArithFn: TypeAlias = Callable[[Scope], int]
_ARITH_TOKEN = re.compile(
    r"\s*(0[xX][0-9a-fA-F]+|[0-9]+|[A-Za-z_][A-Za-z0-9_]*"
    r"|\*\*=?|<<=?|>>=?|\+\+|--|&&|\|\||[<>=!]=|[-+*/%&|^]=|[-+*/%<>=!~&|^?:()])"
)
_ARITH_NUMBER = re.compile(r"\s*([-+]?)(?:0[xX]([0-9a-fA-F]+)|(0[0-7]*)|([1-9][0-9]*))\s*")


def arith_number(text: str) -> int | None:
    """A shell integer (decimal, 0x hex or 0 octal, with a sign), or None."""
    m = _ARITH_NUMBER.fullmatch(text)
    if not m:
        return None
    sign, hexa, octal, decimal = m.groups()
    value = int(hexa, 16) if hexa else int(octal, 8) if octal else int(decimal)
    return -value if sign == "-" else value


def wrap(value: int) -> int:
    """Two's complement 64-bit, as the shells' intmax_t."""
    return ((value + (1 << 63)) & ((1 << 64) - 1)) - (1 << 63)


def _c_div(a: int, b: int) -> int:
    """Division truncating towards zero, as C does."""
    if b == 0:
        raise ShellError("arithmetic: division by zero")
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def _c_mod(a: int, b: int) -> int:
    return a - b * _c_div(a, b)


def _c_pow(a: int, b: int) -> int:
    if b < 0:
        raise ShellError("arithmetic: exponent less than 0")
    return pow(a, b, 1 << 64)


_ARITH_BINARY: dict[str, tuple[int, Callable[[int, int], int]]] = {
    "**": (13, _c_pow),
    "*": (12, operator.mul),
    "/": (12, _c_div),
    "%": (12, _c_mod),
    "+": (11, operator.add),
    "-": (11, operator.sub),
    "<<": (10, lambda a, b: a << (b & 63)),
    ">>": (10, lambda a, b: a >> (b & 63)),
    "<": (9, lambda a, b: int(a < b)),
    "<=": (9, lambda a, b: int(a <= b)),
    ">": (9, lambda a, b: int(a > b)),
    ">=": (9, lambda a, b: int(a >= b)),
    "==": (8, lambda a, b: int(a == b)),
    "!=": (8, lambda a, b: int(a != b)),
    "&": (7, operator.and_),
    "^": (6, operator.xor),
    "|": (5, operator.or_),
}
_ARITH_UNARY: dict[str, Callable[[int], int]] = {
    "+": operator.pos,
    "-": operator.neg,
    "!": lambda a: int(not a),
    "~": operator.invert,
}
_ARITH_ASSIGN = frozenset({"=", "+=", "-=", "*=", "/=", "%=", "<<=", ">>=", "&=", "^=", "|=", "**="})


def _value(sh: Scope, name: str) -> int:
    """A variable as a number: 0 when unset or empty."""
    text = sh.get(name)
    if not text:
        return 0
    value = arith_number(text)
    if value is None:
        raise ShellError(f"arithmetic: {name}: bad number '{text}'")
    return value


def _arith_binary(op: str, left: _ArithFn, right: _ArithFn) -> _ArithFn:
    if op == "&&":
        return lambda sh: int(bool(left(sh)) and bool(right(sh)))
    if op == "||":
        return lambda sh: int(bool(left(sh)) or bool(right(sh)))
    fn = _ARITH_BINARY[op][1]
    return lambda sh: fn(left(sh), right(sh))


def _arith_assign(name: str, op: str, value: _ArithFn) -> _ArithFn:
    combine = _ARITH_BINARY[op[:-1]][1] if op != "=" else None

    def assign(sh: Scope) -> int:
        result = wrap(value(sh) if combine is None else combine(_value(sh, name), value(sh)))
        sh.vars[name] = str(result)
        return result

    return assign


def _arith_step(name: str, delta: int, prefix: bool) -> _ArithFn:
    """++x, --x (prefix: the new value) and x++, x-- (the old one)."""

    def step(sh: Scope) -> int:
        old = _value(sh, name)
        sh.vars[name] = str(wrap(old + delta))
        return old + delta if prefix else old

    return step


def _arith_constant(value: int) -> _ArithFn:
    return lambda sh: value


def _arith_variable(name: str) -> _ArithFn:
    return lambda sh: _value(sh, name)


class _ArithParser:
    """$((...)) compiled to closures by precedence climbing (compiled once per text, see below)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[str] = []
        pos = 0
        while pos < len(text):
            m = _ARITH_TOKEN.match(text, pos)
            if not m:
                if text[pos:].strip():
                    raise self._error()
                break
            self.tokens.append(m.group(1))
            pos = m.end()
        self.i = 0

    def _error(self) -> ShellError:
        return ShellError(f"arithmetic syntax error: {self.text.strip()}")

    def parse(self) -> _ArithFn:
        if not self.tokens:
            return _arith_constant(0)
        fn = self._expr(0)
        if self.i < len(self.tokens):
            raise self._error()
        return fn

    def _peek(self) -> str:
        return self.tokens[self.i] if self.i < len(self.tokens) else ""

    def _take(self) -> str:
        tok = self._peek()
        if not tok:
            raise self._error()
        self.i += 1
        return tok

    def _expr(self, min_prec: int) -> _ArithFn:
        left, name = self._unary()
        while True:
            op = self._peek()
            if op in _ARITH_ASSIGN and min_prec <= 1 and name:
                self.i += 1
                left, name = _arith_assign(name, op, self._expr(1)), None
            elif op == "?" and min_prec <= 2:
                self.i += 1
                yes = self._expr(1)
                if self._take() != ":":
                    raise self._error()
                left, name = _arith_conditional(left, yes, self._expr(2)), None
            else:
                prec = {"&&": 4, "||": 3}.get(op) or (_ARITH_BINARY[op][0] if op in _ARITH_BINARY else 0)
                if not prec or prec < min_prec:
                    return left
                self.i += 1
                left, name = _arith_binary(op, left, self._expr(prec if op == "**" else prec + 1)), None

    def _unary(self) -> tuple[_ArithFn, str | None]:
        """An operand, and its variable name when it may be assigned to."""
        tok = self._take()
        if tok in _ARITH_UNARY:
            operand, _ = self._unary()
            fn = _ARITH_UNARY[tok]
            return (lambda sh: fn(operand(sh))), None
        if tok in ("++", "--"):
            name = self._take()
            if not NAME.fullmatch(name):
                raise self._error()
            return _arith_step(name, 1 if tok == "++" else -1, prefix=True), None
        if tok == "(":
            inner = self._expr(0)
            if self._take() != ")":
                raise self._error()
            return inner, None
        if tok[0].isdigit():
            value = arith_number(tok)
            if value is None:
                raise self._error()
            return _arith_constant(value), None
        if not NAME.fullmatch(tok):
            raise self._error()
        if self._peek() in ("++", "--"):
            return _arith_step(tok, 1 if self._take() == "++" else -1, prefix=False), None
        return _arith_variable(tok), tok


def _arith_conditional(cond: _ArithFn, yes: _ArithFn, no: _ArithFn) -> _ArithFn:
    return lambda sh: yes(sh) if cond(sh) else no(sh)


@functools.lru_cache(maxsize=512)
def arith_compile(text: str) -> _ArithFn:
    """Cached: `i=$((i+1))` in a loop compiles once."""
    return _ArithParser(text).parse()
