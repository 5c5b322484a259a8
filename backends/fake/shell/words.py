"""Words to fields: IFS splitting of expansions and of `read`'s line, and quoting values back."""

from __future__ import annotations

import re

IFS = " \t\n"


class Fields:
    """Accumulates the fields of one word while its parts are expanded."""

    def __init__(self) -> None:
        self.done: list[str] = []
        self._current: list[str] = []
        self._started = False  # quoted or non-empty text makes a field even if it ends up empty

    def add(self, text: str, starts: bool = True) -> None:
        self._current.append(text)
        self._started = self._started or starts

    def end(self) -> None:
        if self._started:
            self.done.append("".join(self._current))
        self._current = []
        self._started = False

    def split(self, value: str, ifs: str) -> None:
        """An unquoted expansion: its IFS-separated pieces join the text around them."""
        pieces, lead, trail = _ifs_split(value, ifs)
        if lead:
            self.end()
        for i, piece in enumerate(pieces):
            if i:
                self.end()
            self.add(piece)
        if trail:
            self.end()


IFS_RUN = re.compile(r"[ \t\n]+")


def _ifs_split(value: str, ifs: str) -> tuple[list[str], bool, bool]:
    """Field splitting of an unquoted expansion: (pieces, starts with a separator, ends with one).
    IFS whitespace runs separate once; each other IFS character ends a field, even an empty one."""
    if not value or not ifs:
        return ([value] if value else []), False, False
    lead, trail = value[0] in ifs, value[-1] in ifs
    if ifs == IFS:
        stripped = value.strip(IFS)
        return (IFS_RUN.split(stripped) if stripped else []), lead, trail
    white = "".join(c for c in ifs if c in IFS)
    pieces: list[str] = []
    i, n = 0, len(value)
    while i < n and value[i] in white:
        i += 1
    while i < n:
        j = i
        while j < n and value[j] not in ifs:
            j += 1
        pieces.append(value[i:j])
        while j < n and value[j] in white:
            j += 1
        if j < n and value[j] in ifs:
            j += 1
            while j < n and value[j] in white:
                j += 1
        i = j
    return pieces, lead, trail


def read_fields(text: str, ifs: str, count: int) -> list[str]:
    """How `read` splits a line: count-1 fields, then the rest with its outer IFS whitespace removed."""
    white = "".join(c for c in ifs if c in IFS)
    fields: list[str] = []
    rest = text.lstrip(white)
    while len(fields) < count - 1 and rest:
        end = next((i for i, c in enumerate(rest) if c in ifs), len(rest))
        fields.append(rest[:end])
        rest = rest[end:].lstrip(white)
        if rest and rest[0] in ifs:
            rest = rest[1:].lstrip(white)
    fields.append(rest.rstrip(white))
    return fields


def quote(value: str) -> str:
    """value in single quotes, as set, export -p and trap print it back."""
    return "'" + value.replace("'", "'\\''") + "'"
