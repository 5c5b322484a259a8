"""The syntax tree a script parses into: words made of parts, and the commands they form."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeAlias


@dataclasses.dataclass(frozen=True, slots=True)
class Lit:
    """Literal text; quoted text is neither split into fields nor a pattern."""

    text: str
    quoted: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Param:
    """``$name`` or ``${name OP arg}``; op is "", "len" (``${#name}``) or the
    operator (":-", "%%"...)."""

    name: str
    op: str
    arg: Word | None
    quoted: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Subst:
    """``$(...)`` or backquotes: the output of body, trailing newlines removed."""

    body: Node
    quoted: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Arith:
    """``$((...))``: expr is expanded first, then evaluated as integer arithmetic."""

    expr: Word
    quoted: bool


Part: TypeAlias = Lit | Param | Subst | Arith


class Word:
    """A word as parsed, with what evaluation needs precomputed: most words are plain literals."""

    __slots__ = ("fields", "parts", "plain", "split", "static", "variable")

    def __init__(self, parts: Sequence[Part], split: bool = True) -> None:
        self.parts = tuple(parts)
        self.split = split  # False for NAME=value operands of export/local: not field-split
        lits = [p for p in self.parts if isinstance(p, Lit)]
        self.static = "".join(p.text for p in lits) if len(lits) == len(self.parts) else None
        quoted = any(p.quoted for p in lits)
        self.fields = None if self.static is None else (self.static,) if self.static or quoted else ()
        first = self.parts[0] if len(self.parts) == 1 else None
        # The text of an unquoted literal word: only such a word can be a reserved word or a name.
        self.plain = first.text if isinstance(first, Lit) and not first.quoted else None
        # The name of an unquoted $name alone in a word, which argv splits without the general machinery.
        simple = (
            split and isinstance(first, Param) and not (first.quoted or first.op or first.name in ("@", "*"))
        )
        self.variable = first.name if simple and isinstance(first, Param) else None


EMPTY_WORD = Word(())


@dataclasses.dataclass(slots=True)
class Heredoc:
    """A here-document; its body is filled in when the lexer reaches the end of its line."""

    delimiter: str
    strip_tabs: bool
    expand: bool
    body: Word = EMPTY_WORD


@dataclasses.dataclass(frozen=True, slots=True)
class Redir:
    fd: int
    op: str
    target: Word | None  # None for a here-document
    heredoc: Heredoc | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Simple:
    assigns: tuple[tuple[str, Word], ...]
    words: tuple[Word, ...]
    redirs: tuple[Redir, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Pipeline:
    cmds: tuple[Node, ...]
    negate: bool


@dataclasses.dataclass(frozen=True, slots=True)
class AndOr:
    first: Node
    rest: tuple[tuple[str, Node], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Seq:
    items: tuple[tuple[Node, bool], ...]  # (command, run in the background)


@dataclasses.dataclass(frozen=True, slots=True)
class Group:
    body: Node


@dataclasses.dataclass(frozen=True, slots=True)
class Subshell:
    body: Node


@dataclasses.dataclass(frozen=True, slots=True)
class If:
    branches: tuple[tuple[Node, Node], ...]
    orelse: Node | None


@dataclasses.dataclass(frozen=True, slots=True)
class Loop:
    cond: Node
    body: Node
    until: bool


@dataclasses.dataclass(frozen=True, slots=True)
class For:
    var: str
    items: tuple[Word, ...] | None  # None: "$@"
    body: Node


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    word: Word
    items: tuple[tuple[tuple[Word, ...], Node | None], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class FuncDef:
    name: str
    body: Node


@dataclasses.dataclass(frozen=True, slots=True)
class Redirected:
    cmd: Node
    redirs: tuple[Redir, ...]


Node: TypeAlias = (
    Simple | Pipeline | AndOr | Seq | Group | Subshell | If | Loop | For | Case | FuncDef | Redirected
)
