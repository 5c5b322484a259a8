"""test and [ ]: the conditions of if and while."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import Any

from backends.fake.shell.control import ToolError
from backends.fake.shell.evaluation import Builtin, Shell

_UNARY_TESTS = frozenset("-e -f -d -s -r -w -x -L -h -S -p -b -c -z -n -t -g -u -k -O -G".split())
_BINARY_TESTS: dict[str, Callable[[Any, Any], bool]] = {
    "=": operator.eq,
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    ">": operator.gt,
    "-eq": operator.eq,
    "-ne": operator.ne,
    "-lt": operator.lt,
    "-le": operator.le,
    "-gt": operator.gt,
    "-ge": operator.ge,
}
_DEVICES = frozenset({"/dev/null", "/dev/stdin", "/dev/stdout", "/dev/stderr"})


class _Test:
    """The expression of test / [ ]: a binary operator is tried first, so `[ "$x" = -n ]` works."""

    def __init__(self, sh: Shell, args: list[str]) -> None:
        self.sh = sh
        self.args = args
        self.i = 0

    def evaluate(self) -> bool:
        if len(self.args) <= 1:
            return bool(self.args and self.args[0])
        result = self._or()
        if self.i < len(self.args):
            raise ToolError(f"{self.args[self.i]}: unexpected operator", 2)
        return result

    def _peek(self) -> str | None:
        return self.args[self.i] if self.i < len(self.args) else None

    def _or(self) -> bool:
        result = self._and()
        while self._peek() == "-o":
            self.i += 1
            result = self._and() or result
        return result

    def _and(self) -> bool:
        result = self._not()
        while self._peek() == "-a":
            self.i += 1
            result = self._not() and result
        return result

    def _not(self) -> bool:
        if self._peek() == "!" and self.i + 1 < len(self.args):
            self.i += 1
            return not self._not()
        return self._primary()

    def _primary(self) -> bool:
        args, i = self.args, self.i
        if i >= len(args):
            raise ToolError("argument expected", 2)
        if i + 2 < len(args) and (args[i + 1] in _BINARY_TESTS or args[i + 1] in ("-nt", "-ot", "-ef")):
            self.i += 3
            return self._binary(args[i], args[i + 1], args[i + 2])
        if args[i] == "(" and i + 1 < len(args):
            self.i += 1
            result = self._or()
            if self._peek() != ")":
                raise ToolError("')' expected", 2)
            self.i += 1
            return result
        if args[i] in _UNARY_TESTS and i + 1 < len(args):
            self.i += 2
            return self._unary(args[i], args[i + 1])
        self.i += 1
        return args[i] != ""

    def _unary(self, op: str, arg: str) -> bool:
        if op in ("-z", "-n"):
            return (arg == "") == (op == "-z")
        fs, path = self.sh.io.fs, self.sh.abspath(arg)
        if path in _DEVICES:
            return op in ("-e", "-r", "-w", "-c")
        if op == "-d":
            return fs.is_dir(path)
        if op == "-f":
            return fs.exists(path) and not fs.is_dir(path)
        if op == "-s":
            with contextlib.suppress(OSError):
                return fs.is_dir(path) or bool(fs.read(path))
            return False
        # No symlinks, devices, set-id bits or terminals here; every file is readable and writable.
        return op in ("-e", "-r", "-w", "-x") and fs.exists(path)

    def _binary(self, left: str, op: str, right: str) -> bool:
        compare = _BINARY_TESTS.get(op)
        if compare is None:
            return False  # -nt -ot -ef: io.fs has no times or inodes
        if op.startswith("-"):
            return compare(self._int(left), self._int(right))
        return compare(left, right)

    @staticmethod
    def _int(text: str) -> int:
        with contextlib.suppress(ValueError):
            if "_" not in text:  # which int() would accept
                return int(text)
        raise ToolError(f"{text}: integer expression expected", 2)


async def _t_test(sh: Shell, argv: list[str]) -> int:
    args = argv[1:]
    if argv[0].rsplit("/", 1)[-1] == "[":
        if not args or args[-1] != "]":
            raise ToolError("missing ]", 2)
        args = args[:-1]
    return 0 if _Test(sh, args).evaluate() else 1


COMMANDS: dict[str, Builtin] = {
    "test": _t_test,
    "[": _t_test,
}
