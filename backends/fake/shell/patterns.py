"""Shell patterns (case, ${x%...}) and POSIX regular expressions (grep), as Python regular expressions."""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Iterator

CLASSES = {
    "alpha": "a-zA-Z",
    "digit": "0-9",
    "alnum": "a-zA-Z0-9",
    "upper": "A-Z",
    "lower": "a-z",
    "space": r" \t\n\r\f\v",
    "blank": r" \t",
    "punct": "".join("\\" + c for c in string.punctuation),
    "xdigit": "0-9A-Fa-f",
    "cntrl": r"\x00-\x1f\x7f",
    "print": r"\x20-\x7e",
    "graph": r"\x21-\x7e",
    "word": "a-zA-Z0-9_",
}


def _bracket_end(pattern: str, i: int) -> int:
    """The index of the ']' that closes the bracket expression at pattern[i], or -1."""
    j = i + 1
    if j < len(pattern) and pattern[j] in "!^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        j += 1
    while j < len(pattern):
        if pattern.startswith("[:", j) and (k := pattern.find(":]", j + 2)) >= 0:
            j = k + 2
            continue
        if pattern[j] == "]":
            return j
        j += 1
    return -1


def _bracket(content: str, negations: str) -> str:
    """A bracket expression's inside as a Python character set ([:classes:] included)."""
    negate = bool(content) and content[0] in negations
    if negate:
        content = content[1:]
    out: list[str] = []
    i = 0
    while i < len(content):
        k = content.find(":]", i + 2) if content.startswith("[:", i) else -1
        if k >= 0 and content[i + 2 : k] in CLASSES:
            out.append(CLASSES[content[i + 2 : k]])
            i = k + 2
            continue
        c = content[i]
        out.append("\\" + c if c in "\\[]&~|^" else c)
        i += 1
    return "[" + ("^" if negate else "") + "".join(out) + "]"


def _elements(pattern: str, negations: str) -> Iterator[tuple[str, str]]:
    """A pattern's elements, left to right: ("\\", c) for a character after a backslash, ("[", set)
    for a bracket expression as a Python character set, ("", c) for any other character."""
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            yield "\\", pattern[i + 1]
            i += 2
            continue
        end = _bracket_end(pattern, i) if c == "[" else -1
        if end > 0:
            yield "[", _bracket(pattern[i + 1 : end], negations)
            i = end + 1
            continue
        yield "", c
        i += 1


@functools.lru_cache(maxsize=512)
def glob(pattern: str) -> re.Pattern[str]:
    """A shell pattern (case, ${x%...}) as a regular expression; a backslash quotes a character."""
    out: list[str] = []
    for kind, text in _elements(pattern, "!^"):
        if kind == "[":
            out.append(text)
        elif not kind and text in "*?":
            out.append(".*" if text == "*" else ".")
        else:
            out.append(re.escape(text))
    return re.compile("".join(out), re.S)


_GLOB_SPECIAL = re.compile(r"([*?\[\\])")


def glob_escape(text: str) -> str:
    return _GLOB_SPECIAL.sub(r"\\\1", text)


def trim(value: str, pattern: re.Pattern[str], op: str) -> str:
    """${x#p} ${x##p} (prefix) and ${x%p} ${x%%p} (suffix), shortest or longest match removed."""
    n = len(value)
    if op.startswith("#"):
        ends = range(n, -1, -1) if op == "##" else range(n + 1)
        return next((value[i:] for i in ends if pattern.fullmatch(value, 0, i)), value)
    starts = range(n + 1) if op == "%%" else range(n, -1, -1)
    return next((value[:i] for i in starts if pattern.fullmatch(value, i)), value)


def posix_regex(pattern: str, extended: bool) -> str:
    """A POSIX basic (or extended) regular expression in Python's syntax: in a basic one \\( \\)
    \\{ \\} \\| \\+ \\? are the operators and the bare characters are literal."""
    out: list[str] = []
    for kind, c in _elements(pattern, "^"):
        if kind == "[":
            out.append(c)
        elif kind:  # escaped
            if c in "<>":
                out.append(r"\b")
            elif not extended and c in "(){}|+?":
                out.append(c)
            else:
                out.append("\\" + c)
        elif (not extended and c in "(){}|+?") or (c == "*" and (not out or out[-1] in ("^", "(", "|"))):
            out.append("\\" + c)
        else:
            out.append(c)
    return "".join(out)
