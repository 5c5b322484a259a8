"""Tokens to the syntax tree: a recursive descent over the POSIX shell grammar."""

from __future__ import annotations

import functools
from collections.abc import Callable

from backends.fake.shell.lexer import ASSIGNMENT, NAME, Lexer, ParseError, Token
from backends.fake.shell.syntax import (
    AndOr,
    Case,
    For,
    FuncDef,
    Group,
    Heredoc,
    If,
    Lit,
    Loop,
    Node,
    Pipeline,
    Redir,
    Redirected,
    Seq,
    Simple,
    Subshell,
    Word,
)

_CLOSERS = frozenset({"then", "else", "elif", "fi", "do", "done", "esac", "}"})
KEYWORDS = frozenset("if then else elif fi do done case esac while until for in { } !".split())
_DECLARATIONS = frozenset({"export", "local", "readonly"})


class Parser:
    """Recursive descent over the POSIX shell grammar; single-element lists and pipelines collapse
    into their one command, so evaluation does not walk empty levels in tight loops."""

    def __init__(self, src: str, pos: int = 0) -> None:
        self.lexer = Lexer(src, pos, _nested)
        self._ahead: list[Token] = []

    def parse_program(self) -> Node:
        body = self._list()
        if self._peek().kind != "eof":
            raise self._unexpected()
        return body

    def parse_until_paren(self) -> Node:
        """The body of $(...); the lexer is left just after its ')'."""
        body = self._list()
        self._expect_op(")")
        return body

    # -- tokens

    def _peek(self, n: int = 0) -> Token:
        while len(self._ahead) <= n:
            self._ahead.append(self.lexer.next())
        return self._ahead[n]

    def _next(self) -> Token:
        tok = self._peek()
        del self._ahead[0]
        return tok

    def _unexpected(self) -> ParseError:
        tok = self._peek()
        if tok.kind == "eof":
            return ParseError("unexpected end of file", incomplete=True)
        what = "newline" if tok.kind == "nl" else tok.text or "word"
        return ParseError(f'unexpected "{what}"')

    def _is_op(self, text: str, n: int = 0) -> bool:
        tok = self._peek(n)
        return tok.kind == "op" and tok.text == text

    def _is_word(self, text: str) -> bool:
        tok = self._peek()
        return tok.kind == "word" and tok.text == text

    def _expect_op(self, text: str) -> None:
        if not self._is_op(text):
            raise self._unexpected()
        self._next()

    def _expect_word(self, text: str) -> None:
        if not self._is_word(text):
            raise self._unexpected()
        self._next()

    def _take_word(self) -> Word:
        word = self._peek().word
        if word is None:
            raise self._unexpected()
        self._next()
        return word

    def _skip_newlines(self) -> None:
        while self._peek().kind == "nl":
            self._next()

    # -- lists and pipelines

    def _starts_command(self) -> bool:
        tok = self._peek()
        if tok.kind == "word":
            return tok.text not in _CLOSERS
        return tok.kind == "redir" or (tok.kind == "op" and tok.text == "(")

    def _list(self) -> Node:
        items: list[tuple[Node, bool]] = []
        self._skip_newlines()
        while self._starts_command():
            node = self._and_or()
            background = self._is_op("&")
            items.append((node, background))
            if not (background or self._is_op(";") or self._peek().kind == "nl"):
                break
            self._next()
            self._skip_newlines()
        if len(items) == 1 and not items[0][1]:
            return items[0][0]
        return Seq(tuple(items))

    def _body(self) -> Node:
        """A compound command's list, which must not be empty."""
        node = self._list()
        if isinstance(node, Seq) and not node.items:
            raise self._unexpected()
        return node

    def _and_or(self) -> Node:
        first = self._pipeline()
        rest: list[tuple[str, Node]] = []
        while self._is_op("&&") or self._is_op("||"):
            op = self._next().text
            self._skip_newlines()
            rest.append((op, self._pipeline()))
        return AndOr(first, tuple(rest)) if rest else first

    def _pipeline(self) -> Node:
        negate = False
        while self._is_word("!"):
            self._next()
            negate = not negate
        cmds = [self._command()]
        while self._is_op("|"):
            self._next()
            self._skip_newlines()
            cmds.append(self._command())
        if len(cmds) == 1 and not negate:
            return cmds[0]
        return Pipeline(tuple(cmds), negate)

    # -- commands

    def _command(self) -> Node:
        tok = self._peek()
        if tok.kind == "op" and tok.text == "(":
            self._next()
            body = self._body()
            self._expect_op(")")
            return self._redirected(Subshell(body))
        if tok.kind == "word":
            compound = _COMPOUND.get(tok.text)
            if compound is not None:
                self._next()
                return self._redirected(compound(self))
            if NAME.fullmatch(tok.text) and self._is_op("(", 1):
                return self._function()
            if tok.text == "function" and NAME.fullmatch(self._peek(1).text):
                self._next()
                return self._function()
        return self._simple()

    def _function(self) -> Node:
        """NAME() BODY, or bash's function NAME [()] BODY."""
        name = self._next().text
        if self._is_op("("):
            self._next()
            self._expect_op(")")
        self._skip_newlines()
        return FuncDef(name, self._command())

    def _group(self) -> Node:
        body = self._body()
        self._expect_word("}")
        return Group(body)

    def _if(self) -> Node:
        branches: list[tuple[Node, Node]] = []
        while True:
            cond = self._body()
            self._expect_word("then")
            branches.append((cond, self._body()))
            if not self._is_word("elif"):
                break
            self._next()
        orelse = None
        if self._is_word("else"):
            self._next()
            orelse = self._body()
        self._expect_word("fi")
        return If(tuple(branches), orelse)

    def _loop(self, until: bool) -> Node:
        cond = self._body()
        self._expect_word("do")
        body = self._body()
        self._expect_word("done")
        return Loop(cond, body, until)

    def _while(self) -> Node:
        return self._loop(until=False)

    def _until(self) -> Node:
        return self._loop(until=True)

    def _for(self) -> Node:
        var = self._peek().text
        if not NAME.fullmatch(var):
            raise ParseError("bad for loop variable")
        self._next()
        self._skip_newlines()
        items = None
        if self._is_word("in"):
            self._next()
            words: list[Word] = []
            while self._peek().kind == "word":
                words.append(self._take_word())
            items = tuple(words)
            if not (self._is_op(";") or self._peek().kind == "nl"):
                raise self._unexpected()
            self._next()
        elif self._is_op(";"):
            self._next()
        self._skip_newlines()
        self._expect_word("do")
        body = self._body()
        self._expect_word("done")
        return For(var, items, body)

    def _case(self) -> Node:
        word = self._take_word()
        self._skip_newlines()
        self._expect_word("in")
        self._skip_newlines()
        items: list[tuple[tuple[Word, ...], Node | None]] = []
        while not self._is_word("esac"):
            if self._is_op("("):
                self._next()
            patterns = [self._take_word()]
            while self._is_op("|"):
                self._next()
                patterns.append(self._take_word())
            self._expect_op(")")
            body = self._list()
            items.append((tuple(patterns), None if isinstance(body, Seq) and not body.items else body))
            if self._is_op(";;"):
                self._next()
                self._skip_newlines()
            elif not self._is_word("esac"):
                raise self._unexpected()
        self._next()
        return Case(word, tuple(items))

    def _redirected(self, node: Node) -> Node:
        redirs: list[Redir] = []
        while self._peek().kind == "redir":
            redirs.extend(self._redirect())
        return Redirected(node, tuple(redirs)) if redirs else node

    def _redirect(self) -> list[Redir]:
        tok = self._next()
        fd = tok.fd if tok.fd >= 0 else 0 if tok.text[0] == "<" else 1
        target = self._take_word()
        if tok.text in ("&>", "&>>"):  # bash: >file 2>&1
            return [Redir(1, tok.text[1:], target), Redir(2, ">&", Word([Lit("1", True)]))]
        if tok.text not in ("<<", "<<-"):
            return [Redir(fd, tok.text, target)]
        delimiter = "".join(p.text for p in target.parts if isinstance(p, Lit))
        quoted = any(isinstance(p, Lit) and p.quoted for p in target.parts)
        doc = Heredoc(delimiter, strip_tabs=tok.text == "<<-", expand=not quoted)
        self.lexer.heredocs.append(doc)  # before anything past the delimiter is lexed
        return [Redir(fd, tok.text, None, doc)]

    def _simple(self) -> Node:
        assigns: list[tuple[str, Word]] = []
        words: list[Word] = []
        redirs: list[Redir] = []
        while True:
            tok = self._peek()
            if tok.kind == "redir":
                redirs.extend(self._redirect())
            elif tok.word is not None:
                self._next()
                assign = None if words else _assignment(tok.word)
                if assign is not None:
                    assigns.append(assign)
                else:
                    words.append(tok.word)
            else:
                break
        if not (assigns or words or redirs):
            raise self._unexpected()
        if words and words[0].plain in _DECLARATIONS:
            words[1:] = [Word(w.parts, split=False) if _assignment(w) else w for w in words[1:]]
        return Simple(tuple(assigns), tuple(words), tuple(redirs))


_COMPOUND: dict[str, Callable[[Parser], Node]] = {
    "{": Parser._group,
    "if": Parser._if,
    "while": Parser._while,
    "until": Parser._until,
    "for": Parser._for,
    "case": Parser._case,
}


def _nested(src: str, pos: int, closing: str) -> tuple[Node, int]:
    """The commands of $(...) (closing ")") or of backquotes (closing ""), for the lexer."""
    parser = Parser(src, pos)
    body = parser.parse_until_paren() if closing else parser.parse_program()
    return body, parser.lexer.pos


def _assignment(word: Word) -> tuple[str, Word] | None:
    """(name, value) when word is NAME=value with an unquoted name, else None."""
    first = word.parts[0] if word.parts else None
    if not isinstance(first, Lit) or first.quoted:
        return None
    m = ASSIGNMENT.match(first.text)
    if not m:
        return None
    rest = first.text[m.end() :]
    return m.group(1), Word([*([Lit(rest, False)] if rest else []), *word.parts[1:]], split=False)


@functools.lru_cache(maxsize=256)
def parse(script: str) -> Node:
    """Parses a script (cached: traps, evals and loops parse the same text again)."""
    try:
        return Parser(script).parse_program()
    except RecursionError:
        raise ParseError("too deeply nested") from None
