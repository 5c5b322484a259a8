"""awk, the part pods use to pick fields: ``awk [-F FS] [-v VAR=VALUE] 'PROGRAM' [FILE...]``.

Why: the e2e specs' scripts cut a field out of a line (``wc -l $f | awk '{print $1}'``, ``awk -F":\\t*"
'/Cpus_allowed_list/ { print $2 }' /proc/self/status``); an awk the shell lacks would run silently
until stopped inside ``$(...)`` and hang the script.

The programs it takes: rules ``[BEGIN | END | /REGEX/] { print [ITEM[, ITEM]...] [; print ...] }``
(a rule with no action prints the line), where an ITEM is a juxtaposition of ``$N``, ``$NF``,
``$(NF-N)``, ``NR``, ``NF``, a -v variable and ``"strings"``; commas join with a space (OFS). The
field separator: whitespace runs by default, one character literally, else a regular expression.
Anything else fails with ``awk: ... not supported by the fake runtime's awk`` (exit 2).
"""

from __future__ import annotations

import dataclasses
import re

from backends.fake.shell.control import ToolError, reason
from backends.fake.shell.evaluation import Builtin, Shell
from backends.fake.shell.options import getopt
from backends.fake.shell.streams import dec

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<str>"(?:[^"\\]|\\.)*")
    | (?P<field>\$(?:\d+|NF|\(\s*NF\s*-\s*\d+\s*\)))
    | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
    | (?P<comma>,)
    )""",
    re.VERBOSE,
)
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\", "/": "/"}


@dataclasses.dataclass(frozen=True)
class _Rule:
    when: str  # "BEGIN", "END", "" (every line) or a regular expression
    prints: (
        tuple[tuple[tuple[str, ...], ...], ...] | None
    )  # print statements: items of tokens; None: print $0


def _unsupported(what: str) -> ToolError:
    return ToolError(f"{what}: not supported by the fake runtime's awk", 2)


def _statement(text: str) -> tuple[tuple[str, ...], ...]:
    """One ``print ITEM, ITEM`` as its items, each a tuple of tokens."""
    rest = text.strip()
    if not rest.startswith("print") or (len(rest) > 5 and rest[5].isalnum()):
        raise _unsupported(f"statement {text.strip()!r}")
    rest = rest[5:]
    items: list[tuple[str, ...]] = []
    current: list[str] = []
    while rest.strip():
        m = _TOKEN.match(rest)
        if m is None or not m.group(0).strip():
            raise _unsupported(f"expression {rest.strip()!r}")
        rest = rest[m.end() :]
        if m.lastgroup == "comma":
            items.append(tuple(current))
            current = []
        else:
            current.append(m.group(m.lastgroup or 0))
    if current or items:
        items.append(tuple(current))
    return tuple(items)


def _parse(program: str) -> list[_Rule]:
    rules: list[_Rule] = []
    rest = program.strip()
    while rest:
        when = ""
        if rest.startswith("/"):
            end = re.match(r"/((?:[^/\\]|\\.)*)/", rest)
            if end is None:
                raise ToolError("unterminated regular expression", 2)
            when, rest = end.group(1), rest[end.end() :].lstrip()
        elif rest.startswith(("BEGIN", "END")):
            when = "BEGIN" if rest.startswith("BEGIN") else "END"
            rest = rest[len(when) :].lstrip()
        if not rest.startswith("{"):
            if when and when not in ("BEGIN", "END") and not rest.strip(";\n "):
                rules.append(_Rule(when, None))
                break
            raise _unsupported(f"program {program!r}")
        close = rest.find("}")
        if close < 0:
            raise ToolError("unexpected end of program: missing '}'", 2)
        body = [s for s in re.split(r"[;\n]", rest[1:close]) if s.strip()]
        rules.append(_Rule(when, tuple(_statement(s) for s in body)))
        rest = rest[close + 1 :].lstrip(" \t\n;")
    return rules


class _Awk:
    def __init__(self, rules: list[_Rule], separator: str, variables: dict[str, str]) -> None:
        self.rules = rules
        self.separator = separator
        self.variables = variables
        self.nr = 0

    def fields(self, line: str) -> list[str]:
        fs = self.separator
        if fs == " ":
            return line.split()
        if len(fs) == 1 and fs != "\\":
            return line.split(fs)
        return re.split(fs, line)

    def value(self, token: str, line: str, fields: list[str]) -> str:
        if token.startswith('"'):
            return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), "\\" + m.group(1)), token[1:-1])
        if token.startswith("$"):
            spec = token[1:].strip("()").replace(" ", "")
            n = (
                len(fields)
                if spec == "NF"
                else len(fields) - int(spec[3:])
                if spec.startswith("NF-")
                else int(spec)
            )
            if n == 0:
                return line
            return fields[n - 1] if 0 < n <= len(fields) else ""
        if token == "NR":
            return str(self.nr)
        if token == "NF":
            return str(len(fields))
        return self.variables.get(token, "")

    def run(self, when: str, line: str) -> str:
        """The output of the rules for ``when`` (BEGIN, END, or a line of input)."""
        out = []
        fields = self.fields(line) if when == "" else []
        for rule in self.rules:
            if when in ("BEGIN", "END"):
                if rule.when != when:
                    continue
            elif rule.when in ("BEGIN", "END") or (rule.when and re.search(rule.when, line) is None):
                continue
            if rule.prints is None:
                out.append(line + "\n")
                continue
            for items in rule.prints:
                if not items:
                    out.append(line + "\n")
                    continue
                text = " ".join("".join(self.value(t, line, fields) for t in item) for item in items)
                out.append(text + "\n")
        return "".join(out)


async def _t_awk(sh: Shell, argv: list[str]) -> int:
    opts, operands = getopt(argv, "", "Fvf")
    if "f" in opts:
        raise _unsupported("-f PROGFILE")
    if not operands:
        raise ToolError("usage: awk [-F sep] [-v var=val] 'PROGRAM' [FILE]...", 2)
    variables = dict(v.partition("=")[::2] for v in opts.get("v", "").split("\n") if "=" in v)
    separator = opts.get("F", " ")
    separator = "\t" if separator == "t" else separator
    awk = _Awk(_parse(operands[0]), separator, variables)
    await sh.out(awk.run("BEGIN", ""))
    status = 0
    for name in operands[1:] or ["-"]:
        try:
            data = await sh.read_all(sh.open_input(name))
        except OSError as exc:
            await sh.err(f"awk: cannot open {name}: {reason(exc)}")
            status = 2
            continue
        for line in dec(data).splitlines():
            awk.nr += 1
            await sh.out(awk.run("", line))
    await sh.out(awk.run("END", ""))
    return status


COMMANDS: dict[str, Builtin] = {"awk": _t_awk}
