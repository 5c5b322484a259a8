"""Source text to tokens: operators, redirections, newlines and words already split into their parts
(quotes, escapes, parameters, command substitutions, arithmetic, here-documents)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import TypeAlias

from backends.fake.shell.syntax import Arith, Heredoc, Lit, Node, Param, Part, Subst, Word

_OPERATORS = (
    *("&&", "||", ";;", "&>>", "&>", "<<<", "<<-", "<<", ">>", ">&", "<&", ">|", "<>"),
    *("&", "|", ";", "<", ">", "(", ")"),
)
_REDIRECTIONS = frozenset({"&>>", "&>", "<<<", "<<-", "<<", ">>", ">&", "<&", ">|", "<>", "<", ">"})
_PLAIN = re.compile(r"[^ \t\n;&|<>()'\"\\$`]+")
_DQ_PLAIN = re.compile(r'[^"\\$`]+')
_TEXT_PLAIN = re.compile(r"[^\\$`]+")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BRACED_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!-]")
ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=")
_PARAM_OPS = (":-", ":=", ":+", ":?", "%%", "##", "-", "=", "+", "?", "%", "#")
TRIMS = frozenset({"%", "%%", "#", "##"})


Nested: TypeAlias = Callable[[str, int, str], tuple[Node, int]]
"""Parses the commands of a substitution in src from pos, up to its closing ")" or, with "", to the
end: (the commands, the position after them). The parser gives it to the lexer, which then needs no
parser of its own."""


class ParseError(Exception):
    """A syntax error; incomplete when more input could still make the script valid."""

    def __init__(self, message: str, incomplete: bool = False) -> None:
        super().__init__(message)
        self.incomplete = incomplete


@dataclasses.dataclass(slots=True)
class Token:
    kind: str  # "word", "op", "redir", "nl" or "eof"
    text: str = ""  # the operator, or the text of a plain word (reserved words are plain)
    word: Word | None = None
    fd: int = -1  # a redirection's explicit descriptor (the 2 of 2>), or -1


class Lexer:
    """Turns source text into tokens; words come out already split into their parts."""

    def __init__(self, src: str, pos: int, nested: Nested) -> None:
        self.src = src
        self.pos = pos
        self.nested = nested
        self.heredocs: list[Heredoc] = []  # waiting for the end of the line to read their bodies

    def next(self) -> Token:
        self._skip_blanks()
        src = self.src
        if self.pos >= len(src):
            self._read_heredocs()
            return Token("eof")
        if src[self.pos] == "\n":
            self.pos += 1
            self._read_heredocs()
            return Token("nl")
        for op in _OPERATORS:
            if src.startswith(op, self.pos):
                self.pos += len(op)
                return Token("redir" if op in _REDIRECTIONS else "op", op)
        word = self.read_word()
        if word.plain is not None and word.plain.isdecimal() and src.startswith(("<", ">"), self.pos):
            tok = self.next()
            tok.fd = int(word.plain)
            return tok
        return Token("word", word.plain or "", word)

    def read_text(self) -> list[Part]:
        """All of src as the inside of an expanding here-document or of $((...))."""
        return self._read_quoted(None)

    def _skip_blanks(self) -> None:
        src, n = self.src, len(self.src)
        while self.pos < n:
            c = src[self.pos]
            if c in " \t":
                self.pos += 1
            elif c == "\\" and src.startswith("\n", self.pos + 1):
                self.pos += 2
            elif c == "#":
                end = src.find("\n", self.pos)
                self.pos = n if end < 0 else end
            else:
                return

    def _read_heredocs(self) -> None:
        """Reads the bodies of the here-documents whose line just ended (a missing end is lenient)."""
        for doc in self.heredocs:
            lines: list[str] = []
            while self.pos < len(self.src):
                end = self.src.find("\n", self.pos)
                end = len(self.src) if end < 0 else end
                line = self.src[self.pos : end]
                self.pos = min(end + 1, len(self.src))
                if doc.strip_tabs:
                    line = line.lstrip("\t")
                if line == doc.delimiter:
                    break
                lines.append(line + "\n")
            text = "".join(lines)
            doc.body = Word(Lexer(text, 0, self.nested).read_text() if doc.expand else [Lit(text, True)])
        self.heredocs.clear()

    def read_word(self) -> Word:
        parts: list[Part] = []
        src, n = self.src, len(self.src)
        while self.pos < n:
            m = _PLAIN.match(src, self.pos)
            if m:
                parts.append(Lit(m.group(), False))
                self.pos = m.end()
                continue
            c = src[self.pos]
            if c in " \t\n;&|<>()":
                break
            self._read_special(c, parts, quoted=False)
        return Word(parts)

    def _read_special(self, c: str, parts: list[Part], quoted: bool) -> None:
        """One quoted string, escape, expansion or command substitution, starting at self.pos."""
        src = self.src
        if c == "'":
            end = src.find("'", self.pos + 1)
            if end < 0:
                raise ParseError("unterminated quoted string", incomplete=True)
            parts.append(Lit(src[self.pos + 1 : end], True))
            self.pos = end + 1
        elif c == '"':
            self.pos += 1
            parts.extend(self._read_quoted('"'))
        elif c == "\\":
            escaped = src[self.pos + 1 : self.pos + 2]
            self.pos = min(self.pos + 2, len(src))
            if escaped != "\n":
                parts.append(Lit(escaped or "\\", True))
        elif c == "$":
            parts.append(self._read_dollar(quoted))
        else:
            parts.append(self._read_backquote(quoted))

    def _read_quoted(self, end: str | None) -> list[Part]:
        """The inside of "..." (end '"'), or of an expanding here-document or $((...)) (end None)."""
        src, n = self.src, len(self.src)
        escapes, plain = ('$`"\\\n', _DQ_PLAIN) if end else ("$`\\\n", _TEXT_PLAIN)
        parts: list[Part] = []
        buf: list[str] = []
        while True:
            if self.pos >= n:
                if end:
                    raise ParseError("unterminated quoted string", incomplete=True)
                break
            m = plain.match(src, self.pos)
            if m:
                buf.append(m.group())
                self.pos = m.end()
                continue
            c = src[self.pos]
            if c == end:
                self.pos += 1
                break
            if c == "\\":
                escaped = src[self.pos + 1 : self.pos + 2]
                if escaped and escaped in escapes:
                    buf.append("" if escaped == "\n" else escaped)
                    self.pos += 2
                else:
                    buf.append(c)
                    self.pos += 1
                continue
            if buf:
                parts.append(Lit("".join(buf), True))
                buf = []
            self._read_special(c, parts, quoted=True)
        if buf or not parts:
            parts.append(Lit("".join(buf), True))
        return parts

    def _read_dollar(self, quoted: bool) -> Part:
        src, start = self.src, self.pos + 1
        nxt = src[start : start + 1]
        if nxt == "{":
            return self._read_braced(quoted)
        if nxt == "(":
            if src.startswith("((", start):
                arith = self._read_arith(quoted)
                if arith is not None:
                    return arith
            body, self.pos = self.nested(src, start + 1, ")")
            return Subst(body, quoted)
        m = NAME.match(src, start)
        if m:
            self.pos = m.end()
            return Param(m.group(), "", None, quoted)
        if nxt and nxt in "0123456789@*#?$!-":
            self.pos = start + 1
            return Param(nxt, "", None, quoted)
        self.pos = start
        return Lit("$", quoted)

    def _read_arith(self, quoted: bool) -> Arith | None:
        """$((...)), or None when its parentheses close apart: $( (a subshell) )."""
        src, start, depth = self.src, self.pos + 3, 0
        for i in range(start, len(src)):
            if src[i] == "(":
                depth += 1
            elif src[i] == ")":
                if depth:
                    depth -= 1
                elif src.startswith("))", i):
                    self.pos = i + 2
                    return Arith(Word(Lexer(src[start:i], 0, self.nested).read_text()), quoted)
                else:
                    return None
        raise ParseError("missing '))'", incomplete=True)

    def _read_backquote(self, quoted: bool) -> Subst:
        src, i = self.src, self.pos + 1
        escapes = '`\\$"' if quoted else "`\\$"
        buf: list[str] = []
        while i < len(src) and src[i] != "`":
            if src[i] == "\\" and i + 1 < len(src) and src[i + 1] in escapes:
                i += 1
            buf.append(src[i])
            i += 1
        if i >= len(src):
            raise ParseError("unterminated `", incomplete=True)
        self.pos = i + 1
        body, _ = self.nested("".join(buf), 0, "")
        return Subst(body, quoted)

    def _read_braced(self, quoted: bool) -> Param:
        src, i = self.src, self.pos + 2
        length = src.startswith("#", i) and not src.startswith("#}", i)
        m = _BRACED_NAME.match(src, i + 1 if length else i)
        if not m:
            raise ParseError("bad substitution", incomplete=i >= len(src))
        name, i = m.group(), m.end()
        if src.startswith("}", i):
            self.pos = i + 1
            return Param(name, "len" if length else "", None, quoted)
        if not length:
            for op in _PARAM_OPS:
                if src.startswith(op, i):
                    self.pos = i + len(op)
                    return Param(name, op, self._read_brace_arg(quoted), quoted)
        raise ParseError("missing '}'" if i >= len(src) else "bad substitution", incomplete=i >= len(src))

    def _read_brace_arg(self, quoted: bool) -> Word:
        """The word after the operator of ${name OP word}, up to its closing brace."""
        src, n = self.src, len(self.src)
        parts: list[Part] = []
        buf: list[str] = []
        while True:
            if self.pos >= n:
                raise ParseError("missing '}'", incomplete=True)
            c = src[self.pos]
            if c == "}":
                self.pos += 1
                break
            if c == "\\" and self.pos + 1 < n:
                escaped = src[self.pos + 1]
                buf.append(escaped if not quoted or escaped in '$`"\\}' else "\\" + escaped)
                self.pos += 2
            elif c in '"$`' or (c == "'" and not quoted):
                if buf:
                    parts.append(Lit("".join(buf), quoted))
                    buf = []
                self._read_special(c, parts, quoted)
            else:
                buf.append(c)
                self.pos += 1
        if buf:
            parts.append(Lit("".join(buf), quoted))
        return Word(parts)
