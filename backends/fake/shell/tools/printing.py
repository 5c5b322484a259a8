"""echo and printf, with their backslash escapes."""

from __future__ import annotations

import re

from backends.fake.shell.arithmetic import arith_number
from backends.fake.shell.control import ToolError
from backends.fake.shell.evaluation import Builtin, Shell

_ECHO_FLAGS = re.compile(r"-[neE]+")
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{1,2}|[0-7]{1,4}|.)", re.S)
_ESCAPES = {
    "\\": "\\",
    "a": "\a",
    "b": "\b",
    "e": "\x1b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    '"': '"',
}


def _byte(value: int) -> str:
    """The character for one byte value; above 0x7f a surrogate that enc turns back into the byte."""
    value &= 0xFF
    return chr(value) if value < 0x80 else chr(0xDC00 + value)


def _escape(esc: str, printf: bool) -> str:
    if esc[0] == "x" and len(esc) > 1:
        return _byte(int(esc[1:], 16))
    if esc[0] in "01234567":
        if printf:  # \NNN
            return _byte(int(esc[:3], 8)) + esc[3:]
        if esc[0] == "0":  # echo -e and %b: \0NNN
            return _byte(int(esc[1:] or "0", 8))
    return _ESCAPES.get(esc, "\\" + esc)


def unescape(text: str, printf: bool) -> tuple[str, bool]:
    """The backslash escapes of a printf format (\\NNN octal) or of echo -e and %b (\\0NNN);
    True when \\c stopped the output."""
    if "\\" not in text:
        return text, False
    out: list[str] = []
    last = 0
    for m in _ESCAPE.finditer(text):
        out.append(text[last : m.start()])
        last = m.end()
        if m.group(1) == "c":
            return "".join(out), True
        out.append(_escape(m.group(1), printf))
    out.append(text[last:])
    return "".join(out), False


async def _t_echo(sh: Shell, argv: list[str]) -> int:
    """echo [-neE] ARGS: escapes only with -e, as bash and busybox do."""
    args = argv[1:]
    newline, escapes = True, False
    while args and _ECHO_FLAGS.fullmatch(args[0]):
        newline = newline and "n" not in args[0]
        escapes = args[0].rfind("e") > args[0].rfind("E")
        args = args[1:]
    text = " ".join(args)
    if escapes:
        text, stopped = unescape(text, printf=False)
        newline = newline and not stopped
    await sh.out(text + "\n" if newline else text)
    return 0


_FORMAT_SPEC = re.compile(
    r"%(?P<flags>[-+ #0]*)(?P<width>\*|\d+)?(?:\.(?P<prec>\*|\d*))?(?P<conv>[diouxXeEfFgGcsb%])"
)


class _Printf:
    """printf FORMAT ARGS: the format is used again while arguments remain, as POSIX says."""

    def __init__(self, fmt: str, args: list[str]) -> None:
        self.fmt = fmt
        self.args = args
        self.i = 0
        self.out: list[str] = []
        self.errors: list[str] = []

    def render(self) -> str:
        while True:
            start = self.i
            if not self._once() or self.i >= len(self.args) or self.i == start:
                return "".join(self.out)

    def _once(self) -> bool:
        """The format once; False when \\c stopped the output."""
        last = 0
        for m in _FORMAT_SPEC.finditer(self.fmt):
            if not self._literal(self.fmt[last : m.start()]) or not self._convert(m):
                return False
            last = m.end()
        return self._literal(self.fmt[last:])

    def _literal(self, text: str) -> bool:
        text, stopped = unescape(text, printf=True)
        self.out.append(text)
        return not stopped

    def _arg(self) -> str | None:
        self.i += 1
        return self.args[self.i - 1] if self.i <= len(self.args) else None

    def _int(self, arg: str | None) -> int:
        if not arg:
            return 0
        if arg[0] in "'\"":
            return ord(arg[1]) if len(arg) > 1 else 0
        value = arith_number(arg)
        if value is None:
            self.errors.append(f"invalid number '{arg}'")
            return 0
        return value

    def _float(self, arg: str | None) -> float:
        try:
            return float(arg or 0)
        except ValueError:
            self.errors.append(f"invalid number '{arg}'")
            return 0.0

    def _convert(self, m: re.Match[str]) -> bool:
        conv = m["conv"]
        if conv == "%":
            self.out.append("%")
            return True
        width = str(self._int(self._arg())) if m["width"] == "*" else m["width"] or ""
        prec = str(self._int(self._arg())) if m["prec"] == "*" else m["prec"]
        spec = "%" + m["flags"] + width + ("" if prec is None else "." + prec)
        arg = self._arg()
        if conv in "sbc":
            text, stopped = unescape(arg or "", printf=False) if conv == "b" else (arg or "", False)
            self.out.append((spec + "s") % (text[:1] if conv == "c" else text))
            return not stopped
        if conv in "eEfFgG":
            self.out.append((spec + conv) % self._float(arg))
            return True
        value = self._int(arg)
        if conv in "oxXu" and value < 0:
            value &= (1 << 64) - 1
        self.out.append((spec + ("d" if conv in "iu" else conv)) % value)
        return True


async def _t_printf(sh: Shell, argv: list[str]) -> int:
    if len(argv) < 2:
        raise ToolError("usage: printf FORMAT [ARGUMENT]...")
    printf = _Printf(argv[1], argv[2:])
    await sh.out(printf.render())
    for error in printf.errors:
        await sh.err(f"printf: {error}")
    return 1 if printf.errors else 0


COMMANDS: dict[str, Builtin] = {
    "echo": _t_echo,
    "printf": _t_printf,
}
