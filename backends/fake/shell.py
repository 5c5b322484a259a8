"""An asyncio interpreter for the POSIX sh subset that Kubernetes docs and e2e test pods use.

Why: a fake container has to *run* its command (``sh -c 'echo hi; sleep 3600'``, ``trap 'exit 0'
TERM; sleep infinity & wait``, a probe's ``cat /tmp/healthy``) without a process, a host file or a
real clock. :func:`run` takes the container's argv and :func:`run_script` a script; both parse once
into a small syntax tree and evaluate it with coroutines, so output reaches the caller as it is
produced and an idle ``while true; do sleep 1; done`` is one sleeping coroutine.

The caller provides, in :class:`ShellIO`: the container's files (an :class:`Fs`; :class:`MemoryFs`
is a ready one), its environment, stdin/stdout/stderr callables, an :class:`asyncio.Event` that
delivers SIGTERM, an injectable ``sleep`` and ``clock``, and extra commands. An extra command is
:data:`Command`: ``async def cmd(argv: list[str], io: ShellIO) -> int``, where ``argv[0]`` is the
name as invoked and ``io`` is a copy of the caller's ShellIO bound to the command's (redirected)
stdin, stdout and stderr, its environment (exported variables and ``X=1 cmd`` assignments) and the
shell's working directory; its result is the exit status. Names are looked up as: the shell's own
builtins (``cd``, ``export``, ``trap``, ``read``, ``wait``...), functions, extra commands, built-in
tools (``echo``, ``cat``, ``grep``...), then shell scripts in ``io.fs`` (by path or on ``PATH``);
``/usr/bin/NAME`` finds the extra command or tool ``NAME``.

Signals: the container's main shell (the outermost one, or the one ``exec``-ed into) takes SIGTERM.
Setting ``io.term`` interrupts its current ``sleep``, ``wait`` or blocking read; the shell clears the
event as it takes the signal (setting it again delivers another), runs its TERM trap and continues
after the interrupted command, or with no trap ends with 143. An ``exit`` in the trap ends the run
with that code. Background jobs are not signalled; they are stopped when the run ends.

Known gaps, on purpose: no file-name globbing, ``[[``, arrays, aliases, ``getopts``, job control,
``sed``/``awk``/``cut``/``uniq``, networking tools (add them as extra commands), ``tail -f``
following (it prints, then waits), ``$LINENO``, ``${x/a/b}``. ``set -u``, ``-f``, ``-v`` and ``-n``
are accepted and ignored; ERR/DEBUG traps are accepted and never run; ``kill`` from a background
job only delivers SIGTERM to the shell.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import copy
import dataclasses
import datetime
import errno
import functools
import itertools
import operator
import posixpath
import random
import re
import string
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias, TypeVar

__all__ = ["Command", "Fs", "MemoryFs", "ShellIO", "knows", "run", "run_script"]

_T = TypeVar("_T")

_IFS = " \t\n"
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_MAX_DEPTH = 1000  # nested function calls, evals, subshells: a runaway recursion stops here
_HOP = 8  # every this many levels the evaluation continues in a fresh task (a short Python stack)
_YIELD_EVERY = 256  # commands between two yields to the event loop, for loops that never block
_PIPE_LIMIT = 65536  # bytes a pipe holds before its writer waits
_SHELLS = frozenset({"sh", "bash", "ash", "dash"})


# --------------------------------------------------------------------------- the caller's side


class Fs(Protocol):
    """The container's filesystem as the shell sees it: absolute, normalised paths."""

    def read(self, path: str) -> bytes: ...

    def write(self, path: str, data: bytes, append: bool = False) -> None: ...

    def exists(self, path: str) -> bool: ...

    def is_dir(self, path: str) -> bool: ...

    def listdir(self, path: str) -> list[str]: ...

    def mkdir(self, path: str, parents: bool = False) -> None: ...

    def remove(self, path: str) -> None: ...


def _norm(path: str) -> str:
    """An absolute, normalised path; POSIX keeps a leading '//', a container does not.

    Interned: every container of a fake node holds the same few paths (/etc/hosts,
    /proc/sys/..., their parents), once each for all of them rather than once each."""
    return sys.intern("/" + posixpath.normpath(path if path.startswith("/") else "/" + path).lstrip("/"))


class MemoryFs:
    """An :class:`Fs` held in a dict of file contents by path and a set of directories.

    Why: tests and simple callers need a container filesystem that never touches the host. The
    parent directories of the ``files`` given are created; paths under ``read_only`` refuse changes
    with PermissionError, as a read-only mount (a ConfigMap volume) would.
    """

    def __init__(self, files: Mapping[str, bytes | str] | None = None, read_only: Iterable[str] = ()) -> None:
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = {"/"}
        self._read_only: tuple[str, ...] = ()
        for path, data in (files or {}).items():
            full = _norm(path)
            self.mkdir(posixpath.dirname(full), parents=True)
            self.files[full] = data.encode() if isinstance(data, str) else bytes(data)
        self._read_only = tuple(_norm(p) for p in read_only)

    def _check_writable(self, path: str) -> None:
        for top in self._read_only:
            if path == top or path.startswith(top.rstrip("/") + "/"):
                raise PermissionError(errno.EROFS, "Read-only file system", path)

    def _check_parent(self, path: str) -> None:
        """Raises unless the directory of path exists, as open(O_CREAT) and mkdir do."""
        parent = posixpath.dirname(path)
        if parent in self.dirs:
            return
        if parent in self.files:
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)

    def read(self, path: str) -> bytes:
        p = _norm(path)
        if p in self.dirs:
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        try:
            return self.files[p]
        except KeyError:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path) from None

    def write(self, path: str, data: bytes, append: bool = False) -> None:
        p = _norm(path)
        self._check_writable(p)
        if p in self.dirs:
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        self._check_parent(p)
        self.files[p] = self.files.get(p, b"") + data if append else bytes(data)

    def exists(self, path: str) -> bool:
        p = _norm(path)
        return p in self.files or p in self.dirs

    def is_dir(self, path: str) -> bool:
        return _norm(path) in self.dirs

    def listdir(self, path: str) -> list[str]:
        p = _norm(path)
        if p in self.files:
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        if p not in self.dirs:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        prefix = p.rstrip("/") + "/"
        names = {q[len(prefix) :].split("/", 1)[0] for q in (*self.files, *self.dirs) if q.startswith(prefix)}
        names.discard("")
        return sorted(names)

    def mkdir(self, path: str, parents: bool = False) -> None:
        p = _norm(path)
        if p in self.dirs and parents:
            return
        self._check_writable(p)
        if p in self.dirs or p in self.files:
            raise FileExistsError(errno.EEXIST, "File exists", path)
        parent = posixpath.dirname(p)
        if parents and parent not in self.dirs and parent not in self.files:
            self.mkdir(parent, parents=True)
        self._check_parent(p)
        self.dirs.add(p)

    def remove(self, path: str) -> None:
        p = _norm(path)
        self._check_writable(p)
        if p in self.files:
            del self.files[p]
            return
        if p not in self.dirs:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        if p == "/":
            raise PermissionError(errno.EBUSY, "Device or resource busy", path)
        if self.listdir(p):
            raise OSError(errno.ENOTEMPTY, "Directory not empty", path)
        self.dirs.remove(p)


Command: TypeAlias = Callable[[list[str], "ShellIO"], Awaitable[int]]
"""An extra command: ``await cmd(argv, io)`` gives its exit status (see the module docstring)."""


@dataclasses.dataclass
class ShellIO:
    """Everything a shell run touches of its container; the shell itself has no other way out."""

    fs: Fs
    env: dict[str, str]  # the container's environment (PATH, HOSTNAME, user variables)
    hostname: str = "localhost"
    cwd: str = "/"
    stdin: Callable[[], Awaitable[bytes]] | None = None  # b"" at end of input; None: no stdin
    stdout: Callable[[bytes], Awaitable[None]] = dataclasses.field(kw_only=True)
    stderr: Callable[[bytes], Awaitable[None]] = dataclasses.field(kw_only=True)
    term: asyncio.Event | None = None  # set by the caller to deliver SIGTERM; the shell clears it
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep  # injectable, for tests
    commands: Mapping[str, Command] = dataclasses.field(default_factory=dict)
    pid: int = 1  # $$; `kill $$` (or `kill 1` when this is PID 1) signals the shell itself
    processes: Callable[[], list[str]] | None = None  # command names, for pgrep and ps
    clock: Callable[[], float] = time.time  # seconds since the epoch, for date
    # A command not found runs, silently, until stopped (a container's own program the fake cannot
    # run: `sh -c "prepare; nginx"`), instead of failing with 127 as an exec's does.
    unknown_runs: bool = False


async def run(argv: Sequence[str], io: ShellIO) -> int:
    """Runs a container command and returns its exit code (0-255).

    argv is what the container runs: ``["sh", "-c", "script", "name", "arg"...]``, ``["/bin/sh",
    "-c", ...]``, ``["echo", "hi"]``, ``["sleep", "3600"]``, ``["cat"]``. An unknown command prints
    ``sh: NAME: not found`` on stderr and gives 127. Never starts a process or touches a host file.
    """
    if not argv:
        return 0
    shell = _root_shell(io)
    shell.exec_next = True  # the container's command is exec-ed: a shell it names takes SIGTERM
    command = _Simple((), tuple(_Word([_Lit(arg, True)]) for arg in argv), ())  # as if quoted
    return await shell.main(functools.partial(shell.run, command))


async def run_script(script: str, io: ShellIO) -> int:
    """Runs a shell script as the container's main shell; a syntax error prints and gives 2."""
    shell = _root_shell(io)
    return await shell.main(functools.partial(shell.run_text, script))


# --------------------------------------------------------------------------- syntax tree


@dataclasses.dataclass(frozen=True, slots=True)
class _Lit:
    """Literal text; quoted text is neither split into fields nor a pattern."""

    text: str
    quoted: bool


@dataclasses.dataclass(frozen=True, slots=True)
class _Param:
    """``$name`` or ``${name OP arg}``; op is "", "len" (``${#name}``) or one of _PARAM_OPS."""

    name: str
    op: str
    arg: _Word | None
    quoted: bool


@dataclasses.dataclass(frozen=True, slots=True)
class _Subst:
    """``$(...)`` or backquotes: the output of body, trailing newlines removed."""

    body: _Node
    quoted: bool


@dataclasses.dataclass(frozen=True, slots=True)
class _Arith:
    """``$((...))``: expr is expanded first, then evaluated as integer arithmetic."""

    expr: _Word
    quoted: bool


_Part: TypeAlias = _Lit | _Param | _Subst | _Arith


class _Word:
    """A word as parsed, with what evaluation needs precomputed: most words are plain literals."""

    __slots__ = ("fields", "parts", "plain", "split", "static", "variable")

    def __init__(self, parts: Sequence[_Part], split: bool = True) -> None:
        self.parts = tuple(parts)
        self.split = split  # False for NAME=value operands of export/local: not field-split
        lits = [p for p in self.parts if isinstance(p, _Lit)]
        self.static = "".join(p.text for p in lits) if len(lits) == len(self.parts) else None
        quoted = any(p.quoted for p in lits)
        self.fields = None if self.static is None else (self.static,) if self.static or quoted else ()
        first = self.parts[0] if len(self.parts) == 1 else None
        # The text of an unquoted literal word: only such a word can be a reserved word or a name.
        self.plain = first.text if isinstance(first, _Lit) and not first.quoted else None
        # The name of an unquoted $name alone in a word, which argv splits without the general machinery.
        simple = (
            split and isinstance(first, _Param) and not (first.quoted or first.op or first.name in ("@", "*"))
        )
        self.variable = first.name if simple and isinstance(first, _Param) else None


_EMPTY_WORD = _Word(())


@dataclasses.dataclass(slots=True)
class _Heredoc:
    """A here-document; its body is filled in when the lexer reaches the end of its line."""

    delimiter: str
    strip_tabs: bool
    expand: bool
    body: _Word = _EMPTY_WORD


@dataclasses.dataclass(frozen=True, slots=True)
class _Redir:
    fd: int
    op: str
    target: _Word | None  # None for a here-document
    heredoc: _Heredoc | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Simple:
    assigns: tuple[tuple[str, _Word], ...]
    words: tuple[_Word, ...]
    redirs: tuple[_Redir, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class _Pipeline:
    cmds: tuple[_Node, ...]
    negate: bool


@dataclasses.dataclass(frozen=True, slots=True)
class _AndOr:
    first: _Node
    rest: tuple[tuple[str, _Node], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class _Seq:
    items: tuple[tuple[_Node, bool], ...]  # (command, run in the background)


@dataclasses.dataclass(frozen=True, slots=True)
class _Group:
    body: _Node


@dataclasses.dataclass(frozen=True, slots=True)
class _Subshell:
    body: _Node


@dataclasses.dataclass(frozen=True, slots=True)
class _If:
    branches: tuple[tuple[_Node, _Node], ...]
    orelse: _Node | None


@dataclasses.dataclass(frozen=True, slots=True)
class _Loop:
    cond: _Node
    body: _Node
    until: bool


@dataclasses.dataclass(frozen=True, slots=True)
class _For:
    var: str
    items: tuple[_Word, ...] | None  # None: "$@"
    body: _Node


@dataclasses.dataclass(frozen=True, slots=True)
class _Case:
    word: _Word
    items: tuple[tuple[tuple[_Word, ...], _Node | None], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class _FuncDef:
    name: str
    body: _Node


@dataclasses.dataclass(frozen=True, slots=True)
class _Redirected:
    cmd: _Node
    redirs: tuple[_Redir, ...]


_Node: TypeAlias = (
    _Simple
    | _Pipeline
    | _AndOr
    | _Seq
    | _Group
    | _Subshell
    | _If
    | _Loop
    | _For
    | _Case
    | _FuncDef
    | _Redirected
)


# --------------------------------------------------------------------------- lexer


_OPERATORS = (
    *("&&", "||", ";;", "&>>", "&>", "<<<", "<<-", "<<", ">>", ">&", "<&", ">|", "<>"),
    *("&", "|", ";", "<", ">", "(", ")"),
)
_REDIRECTIONS = frozenset({"&>>", "&>", "<<<", "<<-", "<<", ">>", ">&", "<&", ">|", "<>", "<", ">"})
_PLAIN = re.compile(r"[^ \t\n;&|<>()'\"\\$`]+")
_DQ_PLAIN = re.compile(r'[^"\\$`]+')
_TEXT_PLAIN = re.compile(r"[^\\$`]+")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BRACED_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!-]")
_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=")
_PARAM_OPS = (":-", ":=", ":+", ":?", "%%", "##", "-", "=", "+", "?", "%", "#")
_TRIMS = frozenset({"%", "%%", "#", "##"})


class _ParseError(Exception):
    """A syntax error; incomplete when more input could still make the script valid."""

    def __init__(self, message: str, incomplete: bool = False) -> None:
        super().__init__(message)
        self.incomplete = incomplete


@dataclasses.dataclass(slots=True)
class _Tok:
    kind: str  # "word", "op", "redir", "nl" or "eof"
    text: str = ""  # the operator, or the text of a plain word (reserved words are plain)
    word: _Word | None = None
    fd: int = -1  # a redirection's explicit descriptor (the 2 of 2>), or -1


class _Lexer:
    """Turns source text into tokens; words come out already split into their parts."""

    def __init__(self, src: str, pos: int = 0) -> None:
        self.src = src
        self.pos = pos
        self.heredocs: list[_Heredoc] = []  # waiting for the end of the line to read their bodies

    def next(self) -> _Tok:
        self._skip_blanks()
        src = self.src
        if self.pos >= len(src):
            self._read_heredocs()
            return _Tok("eof")
        if src[self.pos] == "\n":
            self.pos += 1
            self._read_heredocs()
            return _Tok("nl")
        for op in _OPERATORS:
            if src.startswith(op, self.pos):
                self.pos += len(op)
                return _Tok("redir" if op in _REDIRECTIONS else "op", op)
        word = self.read_word()
        if word.plain is not None and word.plain.isdecimal() and src.startswith(("<", ">"), self.pos):
            tok = self.next()
            tok.fd = int(word.plain)
            return tok
        return _Tok("word", word.plain or "", word)

    def read_text(self) -> list[_Part]:
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
            doc.body = _Word(_Lexer(text).read_text() if doc.expand else [_Lit(text, True)])
        self.heredocs.clear()

    def read_word(self) -> _Word:
        parts: list[_Part] = []
        src, n = self.src, len(self.src)
        while self.pos < n:
            m = _PLAIN.match(src, self.pos)
            if m:
                parts.append(_Lit(m.group(), False))
                self.pos = m.end()
                continue
            c = src[self.pos]
            if c in " \t\n;&|<>()":
                break
            self._read_special(c, parts, quoted=False)
        return _Word(parts)

    def _read_special(self, c: str, parts: list[_Part], quoted: bool) -> None:
        """One quoted string, escape, expansion or command substitution, starting at self.pos."""
        src = self.src
        if c == "'":
            end = src.find("'", self.pos + 1)
            if end < 0:
                raise _ParseError("unterminated quoted string", incomplete=True)
            parts.append(_Lit(src[self.pos + 1 : end], True))
            self.pos = end + 1
        elif c == '"':
            self.pos += 1
            parts.extend(self._read_quoted('"'))
        elif c == "\\":
            escaped = src[self.pos + 1 : self.pos + 2]
            self.pos = min(self.pos + 2, len(src))
            if escaped != "\n":
                parts.append(_Lit(escaped or "\\", True))
        elif c == "$":
            parts.append(self._read_dollar(quoted))
        else:
            parts.append(self._read_backquote(quoted))

    def _read_quoted(self, end: str | None) -> list[_Part]:
        """The inside of "..." (end '"'), or of an expanding here-document or $((...)) (end None)."""
        src, n = self.src, len(self.src)
        escapes, plain = ('$`"\\\n', _DQ_PLAIN) if end else ("$`\\\n", _TEXT_PLAIN)
        parts: list[_Part] = []
        buf: list[str] = []
        while True:
            if self.pos >= n:
                if end:
                    raise _ParseError("unterminated quoted string", incomplete=True)
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
                parts.append(_Lit("".join(buf), True))
                buf = []
            self._read_special(c, parts, quoted=True)
        if buf or not parts:
            parts.append(_Lit("".join(buf), True))
        return parts

    def _read_dollar(self, quoted: bool) -> _Part:
        src, start = self.src, self.pos + 1
        nxt = src[start : start + 1]
        if nxt == "{":
            return self._read_braced(quoted)
        if nxt == "(":
            if src.startswith("((", start):
                arith = self._read_arith(quoted)
                if arith is not None:
                    return arith
            parser = _Parser(src, start + 1)
            body = parser.parse_until_paren()
            self.pos = parser.lexer.pos
            return _Subst(body, quoted)
        m = _NAME.match(src, start)
        if m:
            self.pos = m.end()
            return _Param(m.group(), "", None, quoted)
        if nxt and nxt in "0123456789@*#?$!-":
            self.pos = start + 1
            return _Param(nxt, "", None, quoted)
        self.pos = start
        return _Lit("$", quoted)

    def _read_arith(self, quoted: bool) -> _Arith | None:
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
                    return _Arith(_Word(_Lexer(src[start:i]).read_text()), quoted)
                else:
                    return None
        raise _ParseError("missing '))'", incomplete=True)

    def _read_backquote(self, quoted: bool) -> _Subst:
        src, i = self.src, self.pos + 1
        escapes = '`\\$"' if quoted else "`\\$"
        buf: list[str] = []
        while i < len(src) and src[i] != "`":
            if src[i] == "\\" and i + 1 < len(src) and src[i + 1] in escapes:
                i += 1
            buf.append(src[i])
            i += 1
        if i >= len(src):
            raise _ParseError("unterminated `", incomplete=True)
        self.pos = i + 1
        return _Subst(_Parser("".join(buf)).parse_program(), quoted)

    def _read_braced(self, quoted: bool) -> _Param:
        src, i = self.src, self.pos + 2
        length = src.startswith("#", i) and not src.startswith("#}", i)
        m = _BRACED_NAME.match(src, i + 1 if length else i)
        if not m:
            raise _ParseError("bad substitution", incomplete=i >= len(src))
        name, i = m.group(), m.end()
        if src.startswith("}", i):
            self.pos = i + 1
            return _Param(name, "len" if length else "", None, quoted)
        if not length:
            for op in _PARAM_OPS:
                if src.startswith(op, i):
                    self.pos = i + len(op)
                    return _Param(name, op, self._read_brace_arg(quoted), quoted)
        raise _ParseError("missing '}'" if i >= len(src) else "bad substitution", incomplete=i >= len(src))

    def _read_brace_arg(self, quoted: bool) -> _Word:
        """The word after the operator of ${name OP word}, up to its closing brace."""
        src, n = self.src, len(self.src)
        parts: list[_Part] = []
        buf: list[str] = []
        while True:
            if self.pos >= n:
                raise _ParseError("missing '}'", incomplete=True)
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
                    parts.append(_Lit("".join(buf), quoted))
                    buf = []
                self._read_special(c, parts, quoted)
            else:
                buf.append(c)
                self.pos += 1
        if buf:
            parts.append(_Lit("".join(buf), quoted))
        return _Word(parts)


# --------------------------------------------------------------------------- parser


_CLOSERS = frozenset({"then", "else", "elif", "fi", "do", "done", "esac", "}"})
_KEYWORDS = frozenset("if then else elif fi do done case esac while until for in { } !".split())
_DECLARATIONS = frozenset({"export", "local", "readonly"})


class _Parser:
    """Recursive descent over the POSIX shell grammar; single-element lists and pipelines collapse
    into their one command, so evaluation does not walk empty levels in tight loops."""

    def __init__(self, src: str, pos: int = 0) -> None:
        self.lexer = _Lexer(src, pos)
        self._ahead: list[_Tok] = []

    def parse_program(self) -> _Node:
        body = self._list()
        if self._peek().kind != "eof":
            raise self._unexpected()
        return body

    def parse_until_paren(self) -> _Node:
        """The body of $(...); the lexer is left just after its ')'."""
        body = self._list()
        self._expect_op(")")
        return body

    # -- tokens

    def _peek(self, n: int = 0) -> _Tok:
        while len(self._ahead) <= n:
            self._ahead.append(self.lexer.next())
        return self._ahead[n]

    def _next(self) -> _Tok:
        tok = self._peek()
        del self._ahead[0]
        return tok

    def _unexpected(self) -> _ParseError:
        tok = self._peek()
        if tok.kind == "eof":
            return _ParseError("unexpected end of file", incomplete=True)
        what = "newline" if tok.kind == "nl" else tok.text or "word"
        return _ParseError(f'unexpected "{what}"')

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

    def _take_word(self) -> _Word:
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

    def _list(self) -> _Node:
        items: list[tuple[_Node, bool]] = []
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
        return _Seq(tuple(items))

    def _body(self) -> _Node:
        """A compound command's list, which must not be empty."""
        node = self._list()
        if isinstance(node, _Seq) and not node.items:
            raise self._unexpected()
        return node

    def _and_or(self) -> _Node:
        first = self._pipeline()
        rest: list[tuple[str, _Node]] = []
        while self._is_op("&&") or self._is_op("||"):
            op = self._next().text
            self._skip_newlines()
            rest.append((op, self._pipeline()))
        return _AndOr(first, tuple(rest)) if rest else first

    def _pipeline(self) -> _Node:
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
        return _Pipeline(tuple(cmds), negate)

    # -- commands

    def _command(self) -> _Node:
        tok = self._peek()
        if tok.kind == "op" and tok.text == "(":
            self._next()
            body = self._body()
            self._expect_op(")")
            return self._redirected(_Subshell(body))
        if tok.kind == "word":
            compound = _COMPOUND.get(tok.text)
            if compound is not None:
                self._next()
                return self._redirected(compound(self))
            if _NAME.fullmatch(tok.text) and self._is_op("(", 1):
                return self._function()
            if tok.text == "function" and _NAME.fullmatch(self._peek(1).text):
                self._next()
                return self._function()
        return self._simple()

    def _function(self) -> _Node:
        """NAME() BODY, or bash's function NAME [()] BODY."""
        name = self._next().text
        if self._is_op("("):
            self._next()
            self._expect_op(")")
        self._skip_newlines()
        return _FuncDef(name, self._command())

    def _group(self) -> _Node:
        body = self._body()
        self._expect_word("}")
        return _Group(body)

    def _if(self) -> _Node:
        branches: list[tuple[_Node, _Node]] = []
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
        return _If(tuple(branches), orelse)

    def _loop(self, until: bool) -> _Node:
        cond = self._body()
        self._expect_word("do")
        body = self._body()
        self._expect_word("done")
        return _Loop(cond, body, until)

    def _while(self) -> _Node:
        return self._loop(until=False)

    def _until(self) -> _Node:
        return self._loop(until=True)

    def _for(self) -> _Node:
        var = self._peek().text
        if not _NAME.fullmatch(var):
            raise _ParseError("bad for loop variable")
        self._next()
        self._skip_newlines()
        items = None
        if self._is_word("in"):
            self._next()
            words: list[_Word] = []
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
        return _For(var, items, body)

    def _case(self) -> _Node:
        word = self._take_word()
        self._skip_newlines()
        self._expect_word("in")
        self._skip_newlines()
        items: list[tuple[tuple[_Word, ...], _Node | None]] = []
        while not self._is_word("esac"):
            if self._is_op("("):
                self._next()
            patterns = [self._take_word()]
            while self._is_op("|"):
                self._next()
                patterns.append(self._take_word())
            self._expect_op(")")
            body = self._list()
            items.append((tuple(patterns), None if isinstance(body, _Seq) and not body.items else body))
            if self._is_op(";;"):
                self._next()
                self._skip_newlines()
            elif not self._is_word("esac"):
                raise self._unexpected()
        self._next()
        return _Case(word, tuple(items))

    def _redirected(self, node: _Node) -> _Node:
        redirs: list[_Redir] = []
        while self._peek().kind == "redir":
            redirs.extend(self._redirect())
        return _Redirected(node, tuple(redirs)) if redirs else node

    def _redirect(self) -> list[_Redir]:
        tok = self._next()
        fd = tok.fd if tok.fd >= 0 else 0 if tok.text[0] == "<" else 1
        target = self._take_word()
        if tok.text in ("&>", "&>>"):  # bash: >file 2>&1
            return [_Redir(1, tok.text[1:], target), _Redir(2, ">&", _Word([_Lit("1", True)]))]
        if tok.text not in ("<<", "<<-"):
            return [_Redir(fd, tok.text, target)]
        delimiter = "".join(p.text for p in target.parts if isinstance(p, _Lit))
        quoted = any(isinstance(p, _Lit) and p.quoted for p in target.parts)
        doc = _Heredoc(delimiter, strip_tabs=tok.text == "<<-", expand=not quoted)
        self.lexer.heredocs.append(doc)  # before anything past the delimiter is lexed
        return [_Redir(fd, tok.text, None, doc)]

    def _simple(self) -> _Node:
        assigns: list[tuple[str, _Word]] = []
        words: list[_Word] = []
        redirs: list[_Redir] = []
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
            words[1:] = [_Word(w.parts, split=False) if _assignment(w) else w for w in words[1:]]
        return _Simple(tuple(assigns), tuple(words), tuple(redirs))


_COMPOUND: dict[str, Callable[[_Parser], _Node]] = {
    "{": _Parser._group,
    "if": _Parser._if,
    "while": _Parser._while,
    "until": _Parser._until,
    "for": _Parser._for,
    "case": _Parser._case,
}


def _assignment(word: _Word) -> tuple[str, _Word] | None:
    """(name, value) when word is NAME=value with an unquoted name, else None."""
    first = word.parts[0] if word.parts else None
    if not isinstance(first, _Lit) or first.quoted:
        return None
    m = _ASSIGNMENT.match(first.text)
    if not m:
        return None
    rest = first.text[m.end() :]
    return m.group(1), _Word([*([_Lit(rest, False)] if rest else []), *word.parts[1:]], split=False)


@functools.lru_cache(maxsize=256)
def _parse(script: str) -> _Node:
    """Parses a script (cached: traps, evals and loops parse the same text again)."""
    try:
        return _Parser(script).parse_program()
    except RecursionError:
        raise _ParseError("too deeply nested") from None


# --------------------------------------------------------------------------- streams

_Block: TypeAlias = Callable[[Awaitable[bytes]], Awaitable[bytes]]


class _Reader:
    """A descriptor open for reading, with the pushback that line readers (read, head) need so
    that what they did not consume stays for the next command."""

    def __init__(self, source: Callable[[], Awaitable[bytes]] | None = None, data: bytes = b"") -> None:
        self._source = source  # None once at end of input
        self._buf = data

    async def chunk(self, block: _Block) -> bytes:
        """Some data, b"" at end of input; block makes the wait interruptible."""
        if self._buf:
            data, self._buf = self._buf, b""
            return data
        if self._source is None:
            return b""
        data = await block(self._source())
        if not data:
            self._source = None
        return data

    async def line(self, block: _Block) -> bytes:
        """One line with its newline (without one at end of input), b"" at end of input."""
        while b"\n" not in self._buf and self._source is not None:
            data = await block(self._source())
            if data:
                self._buf += data
            else:
                self._source = None
        end = self._buf.find(b"\n") + 1 or len(self._buf)
        line, self._buf = self._buf[:end], self._buf[end:]
        return line

    async def rest(self, block: _Block) -> bytes:
        chunks = []
        while chunk := await self.chunk(block):
            chunks.append(chunk)
        return b"".join(chunks)

    def unread(self, data: bytes) -> None:
        self._buf = data + self._buf


class _Writer:
    """A descriptor open for writing; this base one is /dev/null."""

    async def write(self, data: bytes) -> None:
        """Discards data."""


_NULL = _Writer()


class _CallbackWriter(_Writer):
    """The caller's stdout or stderr."""

    def __init__(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        self._send = send

    async def write(self, data: bytes) -> None:
        if data:
            await self._send(data)


class _BufferWriter(_Writer):
    """The output of a command substitution."""

    def __init__(self) -> None:
        self.data = bytearray()

    async def write(self, data: bytes) -> None:
        self.data += data


class _FileWriter(_Writer):
    """Output redirected to a file of io.fs: each write appends to what the redirection opened."""

    def __init__(self, fs: Fs, path: str) -> None:
        self._fs = fs
        self._path = path

    async def write(self, data: bytes) -> None:
        # The directory may have gone since: the data is lost, as it is for an unlinked file.
        with contextlib.suppress(OSError):
            self._fs.write(self._path, data, append=True)


class _Pipe(_Writer):
    """A bounded pipe between two pipeline stages: the writer waits while it is full and breaks
    (SIGPIPE) once the reader is gone, which is what ends `yes | head -n1`."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._write_closed = False
        self._read_closed = False
        self._changed = asyncio.Event()

    async def write(self, data: bytes) -> None:
        while not self._read_closed and len(self._buf) >= _PIPE_LIMIT:
            await self._wait()
        if self._read_closed:
            raise _BrokenPipe
        self._buf += data
        self._changed.set()

    async def read(self) -> bytes:
        while not self._buf and not self._write_closed:
            await self._wait()
        data = bytes(self._buf)
        self._buf.clear()
        self._changed.set()
        return data

    def close_write(self) -> None:
        self._write_closed = True
        self._changed.set()

    def close_read(self) -> None:
        self._read_closed = True
        self._buf.clear()
        self._changed.set()

    async def _wait(self) -> None:
        self._changed.clear()
        await self._changed.wait()


_Fd: TypeAlias = _Reader | _Writer


def _enc(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _dec(data: bytes) -> str:
    """Bytes as text; undecodable bytes survive the round trip back through _enc."""
    return data.decode("utf-8", "surrogateescape")


# --------------------------------------------------------------------------- control flow


class _Unwind(Exception):
    """Control flow that leaves commands early; code is an exit status or a loop count."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _Exit(_Unwind):
    """`exit N`: ends the current shell (a subshell's ends at its parenthesis)."""


class _Return(_Unwind):
    """`return N` from a function or a sourced file."""


class _Break(_Unwind):
    """`break N`."""


class _Continue(_Unwind):
    """`continue N`."""


class _Terminated(_Unwind):
    """A signal ends the shell that takes signals: TERM with no trap, or `exit` in its trap."""


class _Interrupted(Exception):
    """SIGTERM interrupted a blocking command (sleep, wait, a read); the trap runs after it."""


class _BrokenPipe(Exception):
    """The reader of a pipe is gone: the writing stage ends, as SIGPIPE would end it."""


class _ShellError(Exception):
    """An error that ends the (sub)shell, as a failed expansion does in a non-interactive sh."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


class _ToolError(Exception):
    """A command's usage or runtime error, printed as "NAME: message" with its exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class _RedirError(Exception):
    """A redirection that cannot be opened: the command does not run and gives 1."""


def _propagate(jump: _Break | _Continue) -> None:
    """Re-raises `break N`/`continue N` for the enclosing loop when N > 1."""
    if jump.code > 1:
        raise type(jump)(jump.code - 1)


_REASONS: tuple[tuple[type[OSError], str], ...] = (
    (FileNotFoundError, "No such file or directory"),
    (IsADirectoryError, "Is a directory"),
    (NotADirectoryError, "Not a directory"),
    (FileExistsError, "File exists"),
    (PermissionError, "Permission denied"),
)


def _reason(exc: OSError) -> str:
    """The strerror a tool prints for a failed file operation."""
    if exc.strerror:
        return exc.strerror
    return next((text for kind, text in _REASONS if isinstance(exc, kind)), str(exc) or "I/O error")


# --------------------------------------------------------------------------- words


class _Fields:
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


_IFS_RUN = re.compile(r"[ \t\n]+")


def _ifs_split(value: str, ifs: str) -> tuple[list[str], bool, bool]:
    """Field splitting of an unquoted expansion: (pieces, starts with a separator, ends with one).
    IFS whitespace runs separate once; each other IFS character ends a field, even an empty one."""
    if not value or not ifs:
        return ([value] if value else []), False, False
    lead, trail = value[0] in ifs, value[-1] in ifs
    if ifs == _IFS:
        stripped = value.strip(_IFS)
        return (_IFS_RUN.split(stripped) if stripped else []), lead, trail
    white = "".join(c for c in ifs if c in _IFS)
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


def _read_fields(text: str, ifs: str, count: int) -> list[str]:
    """How `read` splits a line: count-1 fields, then the rest with its outer IFS whitespace removed."""
    white = "".join(c for c in ifs if c in _IFS)
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


def _quote(value: str) -> str:
    """value in single quotes, as set, export -p and trap print it back."""
    return "'" + value.replace("'", "'\\''") + "'"


# --------------------------------------------------------------------------- patterns

_CLASSES = {
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
        if k >= 0 and content[i + 2 : k] in _CLASSES:
            out.append(_CLASSES[content[i + 2 : k]])
            i = k + 2
            continue
        c = content[i]
        out.append("\\" + c if c in "\\[]&~|^" else c)
        i += 1
    return "[" + ("^" if negate else "") + "".join(out) + "]"


@functools.lru_cache(maxsize=512)
def _glob(pattern: str) -> re.Pattern[str]:
    """A shell pattern (case, ${x%...}) as a regular expression; a backslash quotes a character."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 2
            continue
        end = _bracket_end(pattern, i) if c == "[" else -1
        if end > 0:
            out.append(_bracket(pattern[i + 1 : end], "!^"))
            i = end + 1
            continue
        out.append(".*" if c == "*" else "." if c == "?" else re.escape(c))
        i += 1
    return re.compile("".join(out), re.S)


_GLOB_SPECIAL = re.compile(r"([*?\[\\])")


def _glob_escape(text: str) -> str:
    return _GLOB_SPECIAL.sub(r"\\\1", text)


def _trim(value: str, pattern: re.Pattern[str], op: str) -> str:
    """${x#p} ${x##p} (prefix) and ${x%p} ${x%%p} (suffix), shortest or longest match removed."""
    n = len(value)
    if op.startswith("#"):
        ends = range(n, -1, -1) if op == "##" else range(n + 1)
        return next((value[i:] for i in ends if pattern.fullmatch(value, 0, i)), value)
    starts = range(n + 1) if op == "%%" else range(n, -1, -1)
    return next((value[:i] for i in starts if pattern.fullmatch(value, i)), value)


def _posix_regex(pattern: str, extended: bool) -> str:
    """A POSIX basic (or extended) regular expression in Python's syntax: in a basic one \\( \\)
    \\{ \\} \\| \\+ \\? are the operators and the bare characters are literal."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            escaped = pattern[i + 1]
            if escaped in "<>":
                out.append(r"\b")
            elif not extended and escaped in "(){}|+?":
                out.append(escaped)
            else:
                out.append("\\" + escaped)
            i += 2
            continue
        end = _bracket_end(pattern, i) if c == "[" else -1
        if end > 0:
            out.append(_bracket(pattern[i + 1 : end], "^"))
            i = end + 1
            continue
        if (not extended and c in "(){}|+?") or (c == "*" and (not out or out[-1] in ("^", "(", "|"))):
            out.append("\\" + c)
        else:
            out.append(c)
        i += 1
    return "".join(out)


# --------------------------------------------------------------------------- arithmetic

_ArithFn: TypeAlias = Callable[["_Shell"], int]
_ARITH_TOKEN = re.compile(
    r"\s*(0[xX][0-9a-fA-F]+|[0-9]+|[A-Za-z_][A-Za-z0-9_]*"
    r"|\*\*=?|<<=?|>>=?|\+\+|--|&&|\|\||[<>=!]=|[-+*/%&|^]=|[-+*/%<>=!~&|^?:()])"
)
_ARITH_NUMBER = re.compile(r"\s*([-+]?)(?:0[xX]([0-9a-fA-F]+)|(0[0-7]*)|([1-9][0-9]*))\s*")


def _arith_number(text: str) -> int | None:
    """A shell integer (decimal, 0x hex or 0 octal, with a sign), or None."""
    m = _ARITH_NUMBER.fullmatch(text)
    if not m:
        return None
    sign, hexa, octal, decimal = m.groups()
    value = int(hexa, 16) if hexa else int(octal, 8) if octal else int(decimal)
    return -value if sign == "-" else value


def _wrap(value: int) -> int:
    """Two's complement 64-bit, as the shells' intmax_t."""
    return ((value + (1 << 63)) & ((1 << 64) - 1)) - (1 << 63)


def _c_div(a: int, b: int) -> int:
    """Division truncating towards zero, as C does."""
    if b == 0:
        raise _ShellError("arithmetic: division by zero")
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def _c_mod(a: int, b: int) -> int:
    return a - b * _c_div(a, b)


def _c_pow(a: int, b: int) -> int:
    if b < 0:
        raise _ShellError("arithmetic: exponent less than 0")
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


def _arith_binary(op: str, left: _ArithFn, right: _ArithFn) -> _ArithFn:
    if op == "&&":
        return lambda sh: int(bool(left(sh)) and bool(right(sh)))
    if op == "||":
        return lambda sh: int(bool(left(sh)) or bool(right(sh)))
    fn = _ARITH_BINARY[op][1]
    return lambda sh: fn(left(sh), right(sh))


def _arith_assign(name: str, op: str, value: _ArithFn) -> _ArithFn:
    combine = _ARITH_BINARY[op[:-1]][1] if op != "=" else None

    def assign(sh: _Shell) -> int:
        result = _wrap(value(sh) if combine is None else combine(sh.arith_get(name), value(sh)))
        sh.vars[name] = str(result)
        return result

    return assign


def _arith_step(name: str, delta: int, prefix: bool) -> _ArithFn:
    """++x, --x (prefix: the new value) and x++, x-- (the old one)."""

    def step(sh: _Shell) -> int:
        old = sh.arith_get(name)
        sh.vars[name] = str(_wrap(old + delta))
        return old + delta if prefix else old

    return step


def _arith_constant(value: int) -> _ArithFn:
    return lambda sh: value


def _arith_variable(name: str) -> _ArithFn:
    return lambda sh: sh.arith_get(name)


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

    def _error(self) -> _ShellError:
        return _ShellError(f"arithmetic syntax error: {self.text.strip()}")

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
            if not _NAME.fullmatch(name):
                raise self._error()
            return _arith_step(name, 1 if tok == "++" else -1, prefix=True), None
        if tok == "(":
            inner = self._expr(0)
            if self._take() != ")":
                raise self._error()
            return inner, None
        if tok[0].isdigit():
            value = _arith_number(tok)
            if value is None:
                raise self._error()
            return _arith_constant(value), None
        if not _NAME.fullmatch(tok):
            raise self._error()
        if self._peek() in ("++", "--"):
            return _arith_step(tok, 1 if self._take() == "++" else -1, prefix=False), None
        return _arith_variable(tok), tok


def _arith_conditional(cond: _ArithFn, yes: _ArithFn, no: _ArithFn) -> _ArithFn:
    return lambda sh: yes(sh) if cond(sh) else no(sh)


@functools.lru_cache(maxsize=512)
def _arith_compile(text: str) -> _ArithFn:
    """Cached: `i=$((i+1))` in a loop compiles once."""
    return _ArithParser(text).parse()


# --------------------------------------------------------------------------- evaluation

_SIGNALS = {
    "EXIT": 0,
    "HUP": 1,
    "INT": 2,
    "QUIT": 3,
    "KILL": 9,
    "USR1": 10,
    "USR2": 12,
    "PIPE": 13,
    "ALRM": 14,
    "TERM": 15,
    "CHLD": 17,
    "CONT": 18,
    "STOP": 19,
    "TSTP": 20,
    "WINCH": 28,
}
_HARMLESS = frozenset({"CHLD", "CONT", "WINCH", "STOP", "TSTP"})  # by default they do not end a process


class _Session:
    """What the shells of one run share: the container's I/O, background jobs, and which shell
    takes SIGTERM (the owner)."""

    def __init__(self, io: ShellIO) -> None:
        self.io = io
        self.term = io.term if io.term is not None else asyncio.Event()  # also set by `kill $$`
        self.stdin = _Reader(io.stdin)  # one reader: what a command left unread stays for the next
        self.jobs: dict[int, asyncio.Task[int]] = {}
        self.killed: dict[int, int] = {}  # status of jobs stopped by kill
        self.next_pid = io.pid
        self.ticks = 0
        self.owner: _Shell

    def add_job(self, task: asyncio.Task[int]) -> int:
        if len(self.jobs) > 64:  # forget finished jobs nobody waited for, in a loop that starts many
            for pid in [pid for pid, job in self.jobs.items() if job.done()]:
                job = self.jobs.pop(pid)
                self.killed.pop(pid, None)
                if not job.cancelled():
                    job.exception()  # retrieved, so that asyncio does not report it
        self.next_pid += 1
        self.jobs[self.next_pid] = task
        return self.next_pid

    def job_status(self, pid: int) -> int:
        """The exit status of a finished job, forgotten once asked, as `wait` does."""
        task = self.jobs.pop(pid)
        if task.cancelled():
            return self.killed.pop(pid, 143)
        return task.result()

    async def stop_jobs(self) -> None:
        """The run ended: so do its background jobs, as when a container's main process exits."""
        tasks = list(self.jobs.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        for task in tasks:
            if not task.cancelled():
                task.exception()  # retrieved: a job failing as the container stops is of no interest
        self.jobs.clear()


class _Shell:
    """One shell process: variables, functions, traps, options and open descriptors. Subshells
    (parentheses, pipeline stages, $(...), background jobs) are copies; `sh` starts a new one."""

    def __init__(
        self,
        session: _Session,
        env: Mapping[str, str],
        arg0: str,
        args: list[str],
        fds: dict[int, _Fd],
        cwd: str,
    ) -> None:
        self.session = session
        self.io = session.io
        self.vars: dict[str, str] = dict(env)
        self.exported: set[str] = set(env)
        self.arg0 = arg0
        self.args = args
        self.fds = fds
        self.cwd = cwd
        self.vars["PWD"] = cwd
        self.functions: dict[str, _Node] = {}
        self.traps: dict[str, str] = {}
        self.flags: set[str] = set()  # set -e, -x... ("e", "x") and "pipefail"
        self.status = 0
        self.no_errexit = 0  # > 0 in conditions, where set -e does not apply
        self.loop_depth = 0
        self.locals: list[dict[str, str | None]] = []  # per function call: the values `local` hides
        self.sourcing = 0
        self.depth = 0
        self.background = False  # a background job: not signalled, never interrupted
        self.last_job = ""  # $!
        self.subst_status: int | None = None  # of the last $(...) of the current command
        self.exec_next = False  # the shell `exec` (or run) starts next becomes the signal owner

    # -- shells

    def fork(self) -> _Shell:
        """A subshell: a copy whose changes do not leak back; traps other than ignored ones reset."""
        child = copy.copy(self)
        child.vars = dict(self.vars)
        child.exported = set(self.exported)
        child.args = list(self.args)
        child.fds = dict(self.fds)
        child.functions = dict(self.functions)
        child.traps = {name: action for name, action in self.traps.items() if not action}
        child.flags = set(self.flags)
        child.locals = [dict(frame) for frame in self.locals]
        child.loop_depth = 0
        return child

    def program(self, arg0: str, args: list[str]) -> _Shell:
        """A new shell process (sh, a script) with this shell's environment and descriptors."""
        child = _Shell(self.session, self.environ(), arg0, args, dict(self.fds), self.cwd)
        child.background = self.background
        child.depth = self.depth
        return child

    async def run_program(self, child: _Shell, make: Callable[[], Awaitable[int]]) -> int:
        """Runs a new shell process; one that `exec` started takes SIGTERM while it runs."""
        previous = self.session.owner
        if self.exec_next:
            self.exec_next = False
            self.session.owner = child
        try:
            return await make()
        finally:
            if self.session.owner is child:
                self.session.owner = previous

    def environ(self) -> dict[str, str]:
        return {name: value for name, value in self.vars.items() if name in self.exported}

    async def main(self, make: Callable[[], Awaitable[int]]) -> int:
        """The container's program from start to end: its exit code, and no job left behind."""
        try:
            return await self.boundary(make)
        finally:
            await self.session.stop_jobs()

    async def boundary(self, make: Callable[[], Awaitable[int]]) -> int:
        """Runs a whole shell program (script, subshell, $(...), pipeline stage): exit, fatal errors
        and SIGPIPE end it here, then its EXIT trap runs. A signal's end stops at the signal owner."""
        try:
            status = await make()
        except (_Exit, _Return) as exc:
            status = exc.code
        except _ShellError as exc:
            await self.err(f"sh: {exc}")
            status = exc.code
        except _BrokenPipe:
            status = 128 + _SIGNALS["PIPE"]
        except _Terminated as exc:
            if self is not self.session.owner:
                raise
            status = exc.code
        return await self._exit_trap(status & 255)

    async def _exit_trap(self, status: int) -> int:
        action = self.traps.pop("EXIT", None)
        if not action:
            return status
        self.status = status
        try:
            await self.eval(action)
        except _Exit as exc:
            return exc.code & 255
        except _ShellError as exc:
            await self.err(f"sh: {exc}")
            return exc.code
        return status

    async def nested(self, make: Callable[[], Awaitable[int]]) -> int:
        """Runs make() one level deeper (a function call, eval, subshell...). Every _HOP levels the
        evaluation continues in a fresh task, which keeps Python's stack short however deep the
        script recurses; beyond _MAX_DEPTH a runaway recursion fails with a message."""
        if self.depth >= _MAX_DEPTH:
            raise _ShellError(f"maximum nesting depth ({_MAX_DEPTH}) exceeded: endless recursion?")
        self.depth += 1
        try:
            if self.depth % _HOP:
                return await make()
            return await asyncio.ensure_future(make())
        finally:
            self.depth -= 1

    async def run_text(self, text: str) -> int:
        """Runs a script as this shell's program; a syntax error prints and gives 2, running nothing."""
        try:
            node = _parse(text)
        except _ParseError as exc:
            await self.err(f"sh: syntax error: {exc}")
            return 2
        return await self.subshell(node)

    async def subshell(self, body: _Node) -> int:
        """Runs body as the whole program of this (new or forked) shell."""
        return await self.nested(functools.partial(self.boundary, functools.partial(self.run, body)))

    async def eval(self, text: str) -> int:
        """Parses and runs text in this shell: eval, traps."""
        try:
            node = _parse(text)
        except _ParseError as exc:
            await self.err(f"sh: syntax error: {exc}")
            return 2
        return await self.nested(functools.partial(self.run, node))

    async def run_stdin(self) -> int:
        """`sh` with no script: runs the commands of stdin as they arrive (kubectl exec -i -- sh)."""
        return await self.boundary(self._stdin_commands)

    async def _stdin_commands(self) -> int:
        reader = self.input()
        pending = ""
        while True:
            try:
                line = await reader.line(self.block)
            except _Interrupted:
                await self.check_signals()
                continue
            pending += _dec(line)
            if not line and not pending.strip():
                return self.status
            try:
                node = _parse(pending)
            except _ParseError as exc:
                if line and exc.incomplete:
                    continue
                await self.err(f"sh: syntax error: {exc}")
                return 2
            pending = ""
            await self.run(node)

    # -- signals

    async def check_signals(self) -> None:
        """Takes a pending SIGTERM between commands: its trap runs here, or the run ends (143)."""
        term = self.session.term
        if term.is_set() and not self.background:
            term.clear()
            await self.session.owner.signal("TERM")

    async def signal(self, name: str) -> None:
        """What signal `name` does to this shell: its trap, nothing if ignored, else the end."""
        action = self.traps.get(name)
        if action is None:
            if name in _HARMLESS:
                return
            raise _Terminated(128 + _SIGNALS[name])
        if not action:
            return
        saved = self.status
        try:
            await self.eval(action)
        except _Exit as exc:
            raise _Terminated(exc.code & 255) from None
        self.status = saved

    async def block(self, awaitable: Awaitable[_T]) -> _T:
        """Awaits a blocking operation (sleep, wait, a read) that SIGTERM interrupts, unless the
        signal is ignored or this is a background job; _Interrupted lets the trap run after it."""
        if self.background:
            return await awaitable
        term = self.session.term
        task = asyncio.ensure_future(awaitable)
        waiter: asyncio.Task[bool] | None = None
        try:
            while not task.done():
                if term.is_set():
                    if self.session.owner.traps.get("TERM") != "":
                        raise _Interrupted
                    term.clear()
                waiter = asyncio.ensure_future(term.wait())
                await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            return task.result()
        finally:
            task.cancel()
            if waiter is not None:
                waiter.cancel()

    async def sleep_forever(self) -> None:
        await self.block(asyncio.get_running_loop().create_future())

    async def kill(self, pid: int, name: str) -> None:
        """kill: to this shell ($$) a background job delivers only TERM; a job of ours is stopped."""
        if pid == self.io.pid:
            if name == "TERM":
                self.session.term.set()
            elif not self.background:
                await self.session.owner.signal(name)
            return
        job = self.session.jobs.get(pid)
        if job is not None and not job.done():
            self.session.killed[pid] = 128 + _SIGNALS[name]
            job.cancel()

    # -- descriptors

    def input(self) -> _Reader:
        fd = self.fds.get(0)
        return fd if isinstance(fd, _Reader) else _Reader()

    def writer(self, n: int) -> _Writer:
        fd = self.fds.get(n)
        return fd if isinstance(fd, _Writer) else _NULL

    async def out(self, data: bytes | str) -> None:
        await self.writer(1).write(data if isinstance(data, bytes) else _enc(data))

    async def err(self, line: str) -> None:
        await self.writer(2).write(_enc(line + "\n"))

    async def read(self, reader: _Reader) -> bytes:
        return await reader.chunk(self.block)

    async def read_all(self, reader: _Reader) -> bytes:
        return await reader.rest(self.block)

    def abspath(self, path: str) -> str:
        return _norm(posixpath.join(self.cwd, path))

    def _device(self, path: str, reading: bool) -> _Fd | None:
        """/dev/null, /dev/std{in,out,err} and /dev/fd/N, which are no files of io.fs."""
        if path == "/dev/null":
            return _Reader() if reading else _NULL
        fd = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}.get(path)
        if (
            fd is None
            and path.startswith(("/dev/fd/", "/proc/self/fd/"))
            and path.rsplit("/", 1)[1].isdecimal()
        ):
            fd = int(path.rsplit("/", 1)[1])
        if fd is None:
            return None
        return self.fds.get(fd) or (_Reader() if reading else _NULL)

    def open_input(self, name: str) -> _Reader:
        """A file operand of cat, head, grep...: "-" is stdin; raises OSError."""
        if name == "-":
            return self.input()
        device = self._device(self.abspath(name), reading=True)
        if device is not None:
            return device if isinstance(device, _Reader) else _Reader()
        return _Reader(data=self.io.fs.read(self.abspath(name)))

    def open_output(self, name: str, append: bool) -> _Writer:
        """A file opened for writing (created, truncated unless append); raises OSError."""
        device = self._device(self.abspath(name), reading=False)
        if device is not None:
            return device if isinstance(device, _Writer) else _NULL
        path = self.abspath(name)
        self.io.fs.write(path, b"", append=append)
        return _FileWriter(self.io.fs, path)

    async def _redirect(self, redirs: Sequence[_Redir]) -> dict[int, _Fd]:
        """The descriptors of a command with its redirections applied, left to right."""
        saved = self.fds
        self.fds = dict(saved)
        try:
            for r in redirs:
                self.fds[r.fd] = await self._open(r)
            return self.fds
        finally:
            self.fds = saved

    async def _open(self, r: _Redir) -> _Fd:
        if r.heredoc is not None:
            return _Reader(data=_enc(await self.string(r.heredoc.body)))
        target = await self.string(r.target) if r.target is not None else ""
        if r.op == "<<<":  # bash's here-string
            return _Reader(data=_enc(target + "\n"))
        if r.op in (">&", "<&"):
            if target == "-":
                return _Reader() if r.op == "<&" else _NULL
            fd = self.fds.get(int(target)) if target.isdecimal() else None
            if fd is None:
                raise _RedirError(f"{target}: bad file descriptor")
            return fd
        try:
            if r.op in ("<", "<>"):
                return self.open_input(target)
            return self.open_output(target, append=r.op == ">>")
        except OSError as exc:
            verb = "open" if r.op in ("<", "<>") else "create"
            raise _RedirError(f"can't {verb} {target}: {_reason(exc)}") from None

    # -- variables

    def get(self, name: str) -> str | None:
        value = self.vars.get(name)
        if value is not None:
            return value
        if name.isdecimal():
            n = int(name)
            return self.arg0 if n == 0 else self.args[n - 1] if n <= len(self.args) else None
        special = _SPECIAL_PARAMS.get(name)
        return special(self) if special is not None else None

    def arith_get(self, name: str) -> int:
        text = self.get(name)
        if not text:
            return 0
        value = _arith_number(text)
        if value is None:
            raise _ShellError(f"arithmetic: {name}: bad number '{text}'")
        return value

    def declare(self, item: str) -> str:
        """NAME or NAME=value, as export, readonly and local take them; returns NAME."""
        name, eq, value = item.partition("=")
        if not _NAME.fullmatch(name):
            raise _ToolError(f"{name}: bad variable name")
        if eq:
            self.vars[name] = value
        return name

    def _pop_locals(self) -> None:
        for name, value in self.locals.pop().items():
            if value is None:
                self.vars.pop(name, None)
            else:
                self.vars[name] = value

    # -- expansion

    async def string(self, word: _Word) -> str:
        """A word expanded without field splitting: assignments, redirections, case, here-documents."""
        if word.static is not None:
            return word.static
        return "".join([await self._expand(part) for part in word.parts])

    async def argv(self, words: Sequence[_Word]) -> list[str]:
        argv: list[str] = []
        for word in words:
            if word.fields is not None:
                argv.extend(word.fields)
            elif word.variable is not None and "IFS" not in self.vars:  # $name, the common case
                value = self.get(word.variable)
                argv.extend(_IFS_RUN.split(value.strip(_IFS)) if value and value.strip(_IFS) else ())
            else:
                argv.extend(await self._fields(word))
        return argv

    async def _fields(self, word: _Word) -> list[str]:
        """A word expanded into fields: unquoted expansions split on IFS, "$@" one per argument."""
        fields = _Fields()
        ifs = self.vars.get("IFS", _IFS)
        for part in word.parts:
            if isinstance(part, _Lit):
                fields.add(part.text, part.quoted or bool(part.text))
            elif part.quoted and isinstance(part, _Param) and part.name == "@" and not part.op:
                for i, arg in enumerate(self.args):
                    if i:
                        fields.end()
                    fields.add(arg)
            elif part.quoted or not word.split:
                fields.add(await self._expand(part))
            else:
                fields.split(await self._expand(part), ifs)
        fields.end()
        return fields.done

    async def _expand(self, part: _Part) -> str:
        if isinstance(part, _Lit):
            return part.text
        if isinstance(part, _Param):
            return await self._param(part)
        if isinstance(part, _Subst):
            return await self._substitute(part.body)
        try:
            return str(_wrap(_arith_compile(await self.string(part.expr))(self)))
        except ValueError:
            raise _ShellError("arithmetic: negative shift") from None

    async def _param(self, part: _Param) -> str:
        value = self.get(part.name)
        op, arg = part.op, part.arg or _EMPTY_WORD
        if not op:
            return value or ""
        if op == "len":
            return str(len(value or ""))
        if op in _TRIMS:
            return _trim(value or "", _glob(await self._pattern(arg)), op)
        unset = value is None or (op[0] == ":" and not value)
        kind = op[-1]
        if kind == "-":
            return await self.string(arg) if unset else value or ""
        if kind == "+":
            return "" if unset else await self.string(arg)
        if not unset:
            return value or ""
        if kind == "=":
            if not _NAME.fullmatch(part.name):
                raise _ShellError(f"{part.name}: cannot assign in this way")
            self.vars[part.name] = await self.string(arg)
            return self.vars[part.name]
        message = await self.string(arg) or (
            "parameter not set" if value is None else "parameter null or not set"
        )
        raise _ShellError(f"{part.name}: {message}")

    async def _pattern(self, word: _Word) -> str:
        """A word as a shell pattern: its quoted characters match themselves."""
        texts = []
        for part in word.parts:
            text = await self._expand(part)
            texts.append(_glob_escape(text) if part.quoted else text)
        return "".join(texts)

    async def _substitute(self, body: _Node) -> str:
        child = self.fork()
        buffer = _BufferWriter()
        child.fds[1] = buffer
        self.subst_status = await child.subshell(body)
        return _dec(bytes(buffer.data)).rstrip("\n")

    # -- commands

    async def run(self, node: _Node) -> int:
        status = await _RUNNERS[type(node)](self, node)
        self.status = status
        return status

    def _errexit(self, status: int) -> None:
        if status and "e" in self.flags and not self.no_errexit:
            raise _Exit(status)

    async def _condition(self, node: _Node) -> int:
        self.no_errexit += 1
        try:
            return await self.run(node)
        finally:
            self.no_errexit -= 1

    async def _run_seq(self, node: _Seq) -> int:
        for item, background in node.items:
            if background:
                self._spawn(item)
            else:
                await self.run(item)
        return self.status

    def _spawn(self, node: _Node) -> None:
        """cmd &: a background job, with stdin from /dev/null as in a non-interactive shell."""
        job = self.fork()
        job.background = True
        job.fds[0] = _Reader()
        self.last_job = str(self.session.add_job(asyncio.ensure_future(job.subshell(node))))
        self.status = 0

    async def _run_and_or(self, node: _AndOr) -> int:
        # set -e ignores every failure but the last command's.
        last = len(node.rest) - 1
        status = await self._condition(node.first)
        for i, (op, pipeline) in enumerate(node.rest):
            if (op == "&&") != (status == 0):
                continue
            status = await (self.run(pipeline) if i == last else self._condition(pipeline))
        return status

    async def _run_pipeline(self, node: _Pipeline) -> int:
        if node.negate:
            status = await self._condition(
                _Pipeline(node.cmds, False) if len(node.cmds) > 1 else node.cmds[0]
            )
            return int(status == 0)
        status = await self._stages(node.cmds)
        self._errexit(status)
        return status

    async def _stages(self, cmds: Sequence[_Node]) -> int:
        """A pipeline: its commands run concurrently, each in a subshell, joined by bounded pipes."""
        pipes = [_Pipe() for _ in cmds[1:]]
        tasks = []
        for i, cmd in enumerate(cmds):
            stage = self.fork()
            source = pipes[i - 1] if i else None
            sink = pipes[i] if i < len(pipes) else None
            if source is not None:
                stage.fds[0] = _Reader(source.read)
            if sink is not None:
                stage.fds[1] = sink
            tasks.append(asyncio.ensure_future(stage._stage(cmd, source, sink)))
        statuses = await _join(tasks)
        if "pipefail" in self.flags:
            return next((s for s in reversed(statuses) if s), 0)
        return statuses[-1]

    async def _stage(self, cmd: _Node, source: _Pipe | None, sink: _Pipe | None) -> int:
        try:
            return await self.subshell(cmd)
        finally:
            if sink is not None:
                sink.close_write()  # end of input for the next stage
            if source is not None:
                source.close_read()  # the previous stage's next write breaks

    async def _run_group(self, node: _Group) -> int:
        return await self.run(node.body)

    async def _run_subshell(self, node: _Subshell) -> int:
        status = await self.fork().subshell(node.body)
        self._errexit(status)
        return status

    async def _run_if(self, node: _If) -> int:
        for cond, body in node.branches:
            if await self._condition(cond) == 0:
                return await self.run(body)
        return await self.run(node.orelse) if node.orelse is not None else 0

    async def _run_loop(self, node: _Loop) -> int:
        status = 0
        self.loop_depth += 1
        try:
            while True:
                try:
                    if (await self._condition(node.cond) == 0) == node.until:
                        break
                except _Break as jump:  # `break` in the condition
                    _propagate(jump)
                    status = 0
                    break
                status, broke = await self._iteration(node.body)
                if broke:
                    break
        finally:
            self.loop_depth -= 1
        return status

    async def _iteration(self, body: _Node) -> tuple[int, bool]:
        """One pass of a loop's body: its status, and whether a ``break`` ended the loop."""
        try:
            return await self.run(body), False
        except _Break as jump:
            _propagate(jump)
            return 0, True
        except _Continue as jump:
            _propagate(jump)
            return 0, False

    async def _run_for(self, node: _For) -> int:
        items = list(self.args) if node.items is None else await self.argv(node.items)
        status = 0
        self.loop_depth += 1
        try:
            for item in items:
                self.vars[node.var] = item
                status, broke = await self._iteration(node.body)
                if broke:
                    break
        finally:
            self.loop_depth -= 1
        return status

    async def _run_case(self, node: _Case) -> int:
        value = await self.string(node.word)
        for patterns, body in node.items:
            for pattern in patterns:
                if _glob(await self._pattern(pattern)).fullmatch(value):
                    return await self.run(body) if body is not None else 0
        return 0

    async def _run_funcdef(self, node: _FuncDef) -> int:
        self.functions[node.name] = node.body
        return 0

    async def _run_redirected(self, node: _Redirected) -> int:
        saved = self.fds
        try:
            self.fds = await self._redirect(node.redirs)
        except _RedirError as exc:
            await self.err(f"sh: {exc}")
            return 1
        try:
            return await self.run(node.cmd)
        finally:
            self.fds = saved

    async def _run_simple(self, node: _Simple) -> int:
        session = self.session
        session.ticks += 1
        if not session.ticks % _YIELD_EVERY:
            await asyncio.sleep(0)  # a loop that never blocks must not starve the event loop
        self.subst_status = None
        argv = await self.argv(node.words) if node.words else []
        status = await self._command(argv, node) if argv else await self._assign(node)
        self.status = status
        await self.check_signals()
        self._errexit(status)
        return status

    async def _assign(self, node: _Simple) -> int:
        for name, word in node.assigns:
            self.vars[name] = await self.string(word)
        if node.redirs:
            try:
                await self._redirect(node.redirs)  # `> file` alone creates the file
            except _RedirError as exc:
                await self.err(f"sh: {exc}")
                return 1
        return self.subst_status or 0

    async def _command(self, argv: list[str], node: _Simple) -> int:
        saved_fds = self.fds
        try:
            if node.redirs:
                self.fds = await self._redirect(node.redirs)
        except _RedirError as exc:
            await self.err(f"sh: {exc}")
            return 1
        if argv == ["exec"]:
            return 0  # exec with only redirections: they stay for the rest of the shell
        saved_vars = await self._prefix_assign(node.assigns)
        try:
            if "x" in self.flags:
                await self.err("+ " + " ".join(argv))
            return await self.invoke(argv)
        except _Interrupted:
            return 128 + _SIGNALS["TERM"]
        finally:
            self.fds = saved_fds
            self._restore(saved_vars)

    async def _prefix_assign(
        self, assigns: Sequence[tuple[str, _Word]]
    ) -> dict[str, tuple[str | None, bool]]:
        """X=1 cmd: X is set and exported for the command only; returns what to restore."""
        saved: dict[str, tuple[str | None, bool]] = {}
        for name, word in assigns:
            value = await self.string(word)
            saved.setdefault(name, (self.vars.get(name), name in self.exported))
            self.vars[name] = value
            self.exported.add(name)
        return saved

    def _restore(self, saved: dict[str, tuple[str | None, bool]]) -> None:
        for name, (value, exported) in saved.items():
            if value is None:
                self.vars.pop(name, None)
            else:
                self.vars[name] = value
            if not exported:
                self.exported.discard(name)

    async def invoke(self, argv: list[str], functions: bool = True) -> int:
        """Runs a command by name: a special builtin, a function, or what `external` finds."""
        special = _SPECIAL.get(argv[0])
        if special is not None:
            return await self._builtin(special, argv, "sh: " + argv[0])
        body = self.functions.get(argv[0]) if functions else None
        if body is not None:
            return await self._call_function(body, argv)
        return await self.external(argv)

    async def external(self, argv: list[str]) -> int:
        """What is a program in a real container: an extra command of the caller, a built-in tool
        (also as /bin/NAME), or a shell script of io.fs (by path or on PATH)."""
        name = argv[0]
        base = name.rsplit("/", 1)[-1]
        command = self.io.commands.get(name) or (self.io.commands.get(base) if "/" in name else None)
        if command is not None:
            return await self._call_extra(command, argv)
        tool = _TOOLS.get(base)
        if tool is not None:
            return await self._builtin(tool, argv, base)
        script = self.find_script(name)
        if script is not None:
            return await self._run_script_file(script, argv)
        if self.io.unknown_runs:
            await self.sleep_forever()  # SIGTERM ends it as it ends a sleep
            return 0
        await self.err(f"sh: {name}: not found")
        return 127

    async def _builtin(self, fn: _Builtin, argv: list[str], prefix: str) -> int:
        try:
            return await fn(self, argv)
        except _ToolError as exc:
            await self.err(f"{prefix}: {exc}")
            return exc.code

    async def _call_extra(self, command: Command, argv: list[str]) -> int:
        reader = self.input()

        async def read() -> bytes:
            return await reader.chunk(self.block)

        io = dataclasses.replace(
            self.io,
            env=self.environ(),
            cwd=self.cwd,
            stdin=read,
            stdout=self.writer(1).write,
            stderr=self.writer(2).write,
            term=self.session.term,
        )
        return await command(list(argv), io) & 255

    async def _call_function(self, body: _Node, argv: list[str]) -> int:
        saved_args, saved_loops = self.args, self.loop_depth
        self.args, self.loop_depth = argv[1:], 0
        self.locals.append({})
        try:
            return await self.nested(functools.partial(self.run, body))
        except _Return as exc:
            return exc.code
        finally:
            self._pop_locals()
            self.args, self.loop_depth = saved_args, saved_loops

    def find_script(self, name: str) -> str | None:
        """The path of a file of io.fs that `name` runs: a path, or a name on PATH."""
        fs = self.io.fs
        if "/" in name:
            candidates = [self.abspath(name)]
        else:
            candidates = [
                self.abspath(posixpath.join(d or ".", name)) for d in self.vars.get("PATH", "").split(":")
            ]
        return next((p for p in candidates if fs.exists(p) and not fs.is_dir(p)), None)

    async def _run_script_file(self, path: str, argv: list[str]) -> int:
        try:
            text = _dec(self.io.fs.read(path))
        except OSError as exc:
            await self.err(f"sh: {argv[0]}: {_reason(exc)}")
            return 126
        interpreter = _shebang(text)
        if interpreter not in _SHELLS:
            await self.err(f"sh: {argv[0]}: cannot run a {interpreter} script here")
            return 126
        child = self.program(argv[0], argv[1:])
        return await self.run_program(child, functools.partial(child.run_text, text))

    def describe(self, name: str) -> tuple[str, str] | None:
        """How name would run, for command -v, type and which: (kind, what to print)."""
        if name in _KEYWORDS:
            return "keyword", name
        if name in _SPECIAL:
            return "builtin", name
        if name in self.functions:
            return "function", name
        base = name.rsplit("/", 1)[-1]
        if name in self.io.commands or ("/" in name and base in self.io.commands) or base in _TOOLS:
            return "file", name if "/" in name else "/bin/" + name
        script = self.find_script(name)
        return ("file", script) if script is not None else None

    def processes(self) -> list[str]:
        return self.io.processes() if self.io.processes is not None else []


_RUNNERS: dict[type, Callable[[_Shell, Any], Awaitable[int]]] = {
    _Simple: _Shell._run_simple,
    _Pipeline: _Shell._run_pipeline,
    _AndOr: _Shell._run_and_or,
    _Seq: _Shell._run_seq,
    _Group: _Shell._run_group,
    _Subshell: _Shell._run_subshell,
    _If: _Shell._run_if,
    _Loop: _Shell._run_loop,
    _For: _Shell._run_for,
    _Case: _Shell._run_case,
    _FuncDef: _Shell._run_funcdef,
    _Redirected: _Shell._run_redirected,
}

_SPECIAL_PARAMS: dict[str, Callable[[_Shell], str | None]] = {
    "?": lambda sh: str(sh.status),
    "$": lambda sh: str(sh.io.pid),
    "#": lambda sh: str(len(sh.args)),
    "@": lambda sh: " ".join(sh.args),
    "*": lambda sh: sh.vars.get("IFS", " ")[:1].join(sh.args),
    "!": lambda sh: sh.last_job or None,
    "-": lambda sh: "".join(sorted(f for f in sh.flags if len(f) == 1)),
    "RANDOM": lambda sh: str(random.randrange(32768)),
}


def _shebang(text: str) -> str:
    """The interpreter a script names (its basename; `env X` gives X); "sh" without #!."""
    if not text.startswith("#!"):
        return "sh"
    words = text[2:].split("\n", 1)[0].split()
    if not words:
        return "sh"
    name = words[0].rsplit("/", 1)[-1]
    operands = [w for w in words[1:] if not w.startswith("-")]
    return operands[0] if name == "env" and operands else name


async def _join(tasks: list[asyncio.Task[int]]) -> list[int]:
    """The statuses of a pipeline's stages; if one fails (an unhandled TERM), the others stop."""
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        pending = [t for t in tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
    errors = [t.exception() for t in tasks if not t.cancelled()]
    error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise error
    return [t.result() for t in tasks]


def _root_shell(io: ShellIO) -> _Shell:
    session = _Session(io)
    fds: dict[int, _Fd] = {0: session.stdin, 1: _CallbackWriter(io.stdout), 2: _CallbackWriter(io.stderr)}
    shell = _Shell(session, io.env, "sh", [], fds, _norm(io.cwd))
    shell.vars.setdefault("PATH", _DEFAULT_PATH)
    session.owner = shell
    return shell


# --------------------------------------------------------------------------- builtins

_Builtin: TypeAlias = Callable[[_Shell, list[str]], Awaitable[int]]


def _getopt(argv: list[str], flags: str, valued: str = "") -> tuple[dict[str, str], list[str]]:
    """Short options as POSIX tools take them (-abc, -n5, -n 5) up to "--" or the first operand;
    a repeated valued option keeps every value, newline-separated (grep -e a -e b)."""
    opts: dict[str, str] = {}
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if len(arg) < 2 or arg[0] != "-":
            break
        i += 1
        for j, c in enumerate(arg[1:], 1):
            if c in valued:
                value = arg[j + 1 :]
                if not value:
                    if i >= len(argv):
                        raise _ToolError(f"option requires an argument -- '{c}'")
                    value = argv[i]
                    i += 1
                opts[c] = opts[c] + "\n" + value if c in opts else value
                break
            if c not in flags:
                raise _ToolError(f"invalid option -- '{c}'")
            opts[c] = ""
    return opts, argv[i:]


def _number(text: str, what: str = "number") -> int:
    value = _arith_number(text)
    if value is None:
        raise _ToolError(f"invalid {what} '{text}'")
    return value


async def _s_true(sh: _Shell, argv: list[str]) -> int:
    return 0


async def _s_exit(sh: _Shell, argv: list[str]) -> int:
    if len(argv) < 2:
        raise _Exit(sh.status)
    code = _arith_number(argv[1])
    if code is None:
        await sh.err(f"sh: exit: Illegal number: {argv[1]}")
        raise _Exit(2)
    raise _Exit(code & 255)


async def _s_return(sh: _Shell, argv: list[str]) -> int:
    if not sh.locals and not sh.sourcing:
        raise _ToolError("can only return from a function or a sourced script")
    raise _Return(_number(argv[1]) & 255 if len(argv) > 1 else sh.status)


async def _loop_jump(sh: _Shell, argv: list[str], jump: type[_Break | _Continue]) -> int:
    count = _number(argv[1]) if len(argv) > 1 else 1
    if count < 1:
        raise _ToolError(f"Illegal number: {argv[1]}")
    if not sh.loop_depth:
        return 0  # outside a loop: nothing to leave
    raise jump(min(count, sh.loop_depth))


async def _s_break(sh: _Shell, argv: list[str]) -> int:
    return await _loop_jump(sh, argv, _Break)


async def _s_continue(sh: _Shell, argv: list[str]) -> int:
    return await _loop_jump(sh, argv, _Continue)


async def _s_eval(sh: _Shell, argv: list[str]) -> int:
    text = " ".join(argv[1:])
    return await sh.eval(text) if text.strip() else 0


async def _s_exec(sh: _Shell, argv: list[str]) -> int:
    """exec CMD: the shell becomes CMD, so it ends with CMD's status (a shell CMD takes signals)."""
    if len(argv) < 2:
        return 0
    sh.exec_next = True
    try:
        status = await sh.external(argv[1:])
    finally:
        sh.exec_next = False
    raise _Exit(status)


async def _s_source(sh: _Shell, argv: list[str]) -> int:
    if len(argv) < 2:
        raise _ToolError("filename argument required", 2)
    path = sh.find_script(argv[1]) or sh.abspath(argv[1])
    try:
        node = _parse(_dec(sh.io.fs.read(path)))
    except OSError as exc:
        raise _ToolError(f"can't open '{argv[1]}': {_reason(exc)}", 2) from None
    except _ParseError as exc:
        raise _ToolError(f"{argv[1]}: syntax error: {exc}", 2) from None
    saved_args = sh.args
    if len(argv) > 2:
        sh.args = argv[2:]
    sh.sourcing += 1
    try:
        return await sh.nested(functools.partial(sh.run, node))
    except _Return as exc:
        return exc.code
    finally:
        sh.sourcing -= 1
        sh.args = saved_args


async def _s_export(sh: _Shell, argv: list[str]) -> int:
    items = [a for a in argv[1:] if a != "-p"]
    if not items:
        exported = sorted(n for n in sh.exported if n in sh.vars)
        await sh.out("".join(f"export {n}={_quote(sh.vars[n])}\n" for n in exported))
        return 0
    for item in items:
        sh.exported.add(sh.declare(item))
    return 0


async def _s_readonly(sh: _Shell, argv: list[str]) -> int:
    """readonly NAME=value: assigned; nothing stops a later change here."""
    for item in argv[1:]:
        sh.declare(item)
    return 0


async def _s_local(sh: _Shell, argv: list[str]) -> int:
    if not sh.locals:
        raise _ToolError("not in a function")
    frame = sh.locals[-1]
    for item in argv[1:]:
        name = item.partition("=")[0]
        if _NAME.fullmatch(name) and name not in frame:
            frame[name] = sh.vars.get(name)
        sh.declare(item)
    return 0


async def _s_unset(sh: _Shell, argv: list[str]) -> int:
    opts, names = _getopt(argv, "fv")
    for name in names:
        if "f" in opts:
            sh.functions.pop(name, None)
        else:
            sh.vars.pop(name, None)
            sh.exported.discard(name)
    return 0


_LONG_OPTIONS = {
    "errexit": "e",
    "xtrace": "x",
    "nounset": "u",
    "noglob": "f",
    "verbose": "v",
    "noexec": "n",
    "allexport": "a",
    "pipefail": "pipefail",
}
_SHORT_OPTIONS = "efuvxnaC"


def _option(name: str) -> str:
    flag = _LONG_OPTIONS.get(name)
    if flag is None:
        raise _ToolError(f"illegal option -o {name}", 2)
    return flag


async def _s_set(sh: _Shell, argv: list[str]) -> int:
    """set [-+eux...] [-o NAME] [--] [ARGS]: only -e, -x and -o pipefail change anything."""
    args = argv[1:]
    if not args:
        await sh.out("".join(f"{n}={_quote(v)}\n" for n, v in sorted(sh.vars.items())))
        return 0
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--" or len(arg) < 2 or arg[0] not in "-+":
            sh.args = args[i + 1 :] if arg == "--" else args[i:]
            return 0
        change = sh.flags.add if arg[0] == "-" else sh.flags.discard
        if arg[1:] == "o":
            if i + 1 >= len(args):
                await sh.out(
                    "".join(f"{n:<12}{'on' if f in sh.flags else 'off'}\n" for n, f in _LONG_OPTIONS.items())
                )
                return 0
            change(_option(args[i + 1]))
            i += 2
            continue
        for c in arg[1:]:
            if c not in _SHORT_OPTIONS:
                raise _ToolError(f"illegal option {arg[0]}{c}", 2)
            change(c)
        i += 1
    return 0


async def _s_shift(sh: _Shell, argv: list[str]) -> int:
    count = _number(argv[1]) if len(argv) > 1 else 1
    if not 0 <= count <= len(sh.args):
        raise _ToolError("can't shift that many")
    sh.args = sh.args[count:]
    return 0


def _signal_name(text: str) -> str | None:
    """TERM for TERM, SIGTERM, term or 15."""
    name = text.upper().removeprefix("SIG")
    if name.isdecimal():
        return next((n for n, number in _SIGNALS.items() if number == int(name)), None)
    return name if name in _SIGNALS else None


async def _s_trap(sh: _Shell, argv: list[str]) -> int:
    """trap ACTION SIGNAL...: '' ignores, - resets; EXIT runs when the shell ends, TERM when it is
    signalled; ERR, DEBUG and RETURN are accepted and never run."""
    args = argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or args == ["-p"]:
        await sh.out("".join(f"trap -- {_quote(a)} {n}\n" for n, a in sh.traps.items()))
        return 0
    if args == ["-l"]:
        await sh.out(" ".join(_SIGNALS) + "\n")
        return 0
    action, names = (args[0], args[1:]) if len(args) > 1 else ("-", args)
    status = 0
    for text in names:
        name = _signal_name(text) or (text.upper() if text.upper() in ("ERR", "DEBUG", "RETURN") else None)
        if name is None or name in ("KILL", "STOP"):
            await sh.err(f"sh: trap: {text}: bad trap")
            status = 1
        elif action == "-":
            sh.traps.pop(name, None)
        else:
            sh.traps[name] = action
    return status


async def _s_cd(sh: _Shell, argv: list[str]) -> int:
    args = [a for a in argv[1:] if a not in ("-L", "-P")]
    target = args[0] if args else sh.vars.get("HOME", "/")
    if target == "-":
        target = sh.vars.get("OLDPWD", sh.cwd)
        await sh.out(target + "\n")
    path = sh.abspath(target)
    if not sh.io.fs.is_dir(path):
        why = "Not a directory" if sh.io.fs.exists(path) else "No such file or directory"
        raise _ToolError(f"can't cd to {target}: {why}")
    sh.vars["OLDPWD"], sh.cwd = sh.cwd, path
    sh.vars["PWD"] = path
    return 0


_BACKSLASH = re.compile(r"\\(.)", re.S)


async def _s_read(sh: _Shell, argv: list[str]) -> int:
    """read [-r] [-p PROMPT] [NAME...]: one line of stdin split by IFS; 1 at end of input."""
    opts, names = _getopt(argv, "rs", "ptnud")
    if "p" in opts:
        await sh.writer(2).write(_enc(opts["p"]))
    reader = sh.input()
    line = _dec(await reader.line(sh.block))
    complete = line.endswith("\n")
    text = line.removesuffix("\n")
    while "r" not in opts and complete and text.endswith("\\"):
        more = _dec(await reader.line(sh.block))
        complete = more.endswith("\n")
        text = text[:-1] + more.removesuffix("\n")
    if "r" not in opts:
        text = _BACKSLASH.sub(r"\1", text)
    if not names:
        sh.vars["REPLY"] = text
    else:
        values = _read_fields(text, sh.vars.get("IFS", _IFS), len(names))
        for name, value in itertools.zip_longest(names, values, fillvalue=""):
            sh.vars[name] = value
    return 0 if complete else 1


async def _s_wait(sh: _Shell, argv: list[str]) -> int:
    """wait [PID...]: SIGTERM interrupts it (status 143) so that the trap runs."""
    session = sh.session
    if len(argv) == 1:
        tasks = list(session.jobs.values())
        if tasks:
            await sh.block(asyncio.wait(tasks))
        for pid in [pid for pid, task in session.jobs.items() if task.done()]:
            session.job_status(pid)
        return 0
    status = 0
    for arg in argv[1:]:
        pid = _number(arg, "pid")
        task = session.jobs.get(pid)
        if task is None:
            status = 127
            continue
        await sh.block(asyncio.wait([task]))
        status = session.job_status(pid)
    return status


def _type_line(name: str, kind: str, what: str) -> str:
    if kind == "file":
        return f"{name} is {what}"
    return (
        f"{name} is a "
        + {"keyword": "shell keyword", "builtin": "shell builtin", "function": "function"}[kind]
    )


async def _s_command(sh: _Shell, argv: list[str]) -> int:
    """command [-v|-V] NAME [ARGS]: runs NAME skipping functions, or tells what it is."""
    args = argv[1:]
    while args[:1] == ["-p"]:
        args = args[1:]
    if args[:1] in (["-v"], ["-V"]):
        status = 0
        for name in args[1:]:
            found = sh.describe(name)
            if found is None:
                status = 1
            else:
                await sh.out((_type_line(name, *found) if args[0] == "-V" else found[1]) + "\n")
        return status
    return await sh.invoke(args, functions=False) if args else 0


async def _s_type(sh: _Shell, argv: list[str]) -> int:
    status = 0
    for name in argv[1:]:
        found = sh.describe(name)
        if found is None:
            await sh.err(f"sh: type: {name}: not found")
            status = 1
        else:
            await sh.out(_type_line(name, *found) + "\n")
    return status


async def _s_umask(sh: _Shell, argv: list[str]) -> int:
    """umask: always 0022; setting one changes nothing here."""
    if len(argv) == 1:
        await sh.out("0022\n")
    return 0


# --------------------------------------------------------------------------- tools: text

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
    """The character for one byte value; above 0x7f a surrogate that _enc turns back into the byte."""
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


def _unescape(text: str, printf: bool) -> tuple[str, bool]:
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


async def _t_echo(sh: _Shell, argv: list[str]) -> int:
    """echo [-neE] ARGS: escapes only with -e, as bash and busybox do."""
    args = argv[1:]
    newline, escapes = True, False
    while args and _ECHO_FLAGS.fullmatch(args[0]):
        newline = newline and "n" not in args[0]
        escapes = args[0].rfind("e") > args[0].rfind("E")
        args = args[1:]
    text = " ".join(args)
    if escapes:
        text, stopped = _unescape(text, printf=False)
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
        text, stopped = _unescape(text, printf=True)
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
        value = _arith_number(arg)
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
            text, stopped = _unescape(arg or "", printf=False) if conv == "b" else (arg or "", False)
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


async def _t_printf(sh: _Shell, argv: list[str]) -> int:
    if len(argv) < 2:
        raise _ToolError("usage: printf FORMAT [ARGUMENT]...")
    printf = _Printf(argv[1], argv[2:])
    await sh.out(printf.render())
    for error in printf.errors:
        await sh.err(f"printf: {error}")
    return 1 if printf.errors else 0


async def _t_cat(sh: _Shell, argv: list[str]) -> int:
    """cat [FILE|-]...: copies as it reads, so a `cat` container echoes its stdin live."""
    _, names = _getopt(argv, "u")
    status = 0
    for name in names or ["-"]:
        try:
            reader = sh.open_input(name)
        except OSError as exc:
            await sh.err(f"cat: can't open '{name}': {_reason(exc)}")
            status = 1
            continue
        while chunk := await sh.read(reader):
            await sh.out(chunk)
    return status


def _legacy_count(argv: list[str]) -> list[str]:
    """head -5 / tail -5 as -n 5."""
    if len(argv) > 1 and re.fullmatch(r"-\d+", argv[1]):
        return [argv[0], "-n", argv[1][1:], *argv[2:]]
    return argv


def _count(opts: dict[str, str]) -> tuple[int, bool]:
    """The count of head/tail -n/-c (the last one given), and whether it was +N (tail from N)."""
    text = opts.get("c", opts.get("n", "10")).split("\n")[-1]
    value = _arith_number(text.lstrip("+-"))
    if value is None or value < 0:
        raise _ToolError(f"invalid number '{text}'")
    return value, text.startswith("+")


async def _head_lines(sh: _Shell, reader: _Reader, count: int) -> bytes:
    """The first count lines; what was read past them goes back to the reader."""
    buf = bytearray()
    lines = 0
    while lines < count:
        chunk = await sh.read(reader)
        if not chunk:
            return bytes(buf)
        buf += chunk
        lines += chunk.count(b"\n")
    end = -1
    for _ in range(count):
        end = buf.index(b"\n", end + 1)
    reader.unread(bytes(buf[end + 1 :]))
    return bytes(buf[: end + 1])


async def _head_bytes(sh: _Shell, reader: _Reader, count: int) -> bytes:
    buf = bytearray()
    while len(buf) < count and (chunk := await sh.read(reader)):
        buf += chunk
    reader.unread(bytes(buf[count:]))
    return bytes(buf[:count])


async def _t_head(sh: _Shell, argv: list[str]) -> int:
    """head [-n N|-N|-c N] [FILE...]: stops reading at N, so `yes | head` ends."""
    opts, names = _getopt(_legacy_count(argv), "qv", "nc")
    count, _ = _count(opts)
    take = _head_bytes if "c" in opts else _head_lines
    status = 0
    for k, name in enumerate(names or ["-"]):
        if len(names) > 1:
            await sh.out(f"{chr(10) if k else ''}==> {name} <==\n")
        try:
            reader = sh.open_input(name)
        except OSError as exc:
            await sh.err(f"head: {name}: {_reason(exc)}")
            status = 1
            continue
        await sh.out(await take(sh, reader, count))
    return status


_Items = TypeVar("_Items", bytes, list[bytes])


def _tail_of(items: _Items, count: int, from_start: bool) -> _Items:
    """The last count items, or those from the count-th on (tail -n +N)."""
    if from_start:
        return items[max(count - 1, 0) :]
    return items[len(items) - count :] if count else items[:0]


async def _t_tail(sh: _Shell, argv: list[str]) -> int:
    """tail [-n [+]N|-N|-c N] [-f] [FILE...]; -f prints and then waits until stopped (no following)."""
    opts, names = _getopt(_legacy_count(argv), "fFqv", "nc")
    count, from_start = _count(opts)
    status = 0
    for name in names or ["-"]:
        try:
            data = await sh.read_all(sh.open_input(name))
        except OSError as exc:
            await sh.err(f"tail: {name}: {_reason(exc)}")
            status = 1
            continue
        if "c" in opts:
            await sh.out(_tail_of(data, count, from_start))
        else:
            await sh.out(b"".join(_tail_of(data.splitlines(True), count, from_start)))
    if "f" in opts or "F" in opts:
        await sh.sleep_forever()
    return status


def _wc_count(data: bytes, key: str) -> int:
    if key == "l":
        return data.count(b"\n")
    if key == "w":
        return len(data.split())
    return len(_dec(data)) if key == "m" else len(data)


async def _t_wc(sh: _Shell, argv: list[str]) -> int:
    opts, names = _getopt(argv, "lwcm")
    keys = [k for k in "lwmc" if k in opts] or ["l", "w", "c"]
    rows: list[tuple[list[int], str]] = []
    status = 0
    for name in names or ["-"]:
        try:
            data = await sh.read_all(sh.open_input(name))
        except OSError as exc:
            await sh.err(f"wc: {name}: {_reason(exc)}")
            status = 1
            continue
        rows.append(([_wc_count(data, k) for k in keys], name if names else ""))
    if len(rows) > 1:
        rows.append(([sum(col) for col in zip(*(r[0] for r in rows), strict=True)], "total"))
    width = 7 if len(keys) > 1 and not names else max((len(str(c)) for r in rows for c in r[0]), default=1)
    lines = (
        " ".join(str(c).rjust(width) for c in counts) + (f" {label}" if label else "")
        for counts, label in rows
    )
    await sh.out("".join(line + "\n" for line in lines))
    return status


def _grep_regex(patterns: list[str], opts: dict[str, str]) -> re.Pattern[str]:
    bodies = []
    for pattern in patterns:
        body = re.escape(pattern) if "F" in opts else _posix_regex(pattern, extended="E" in opts)
        if "x" in opts:
            body = f"^(?:{body})$"
        elif "w" in opts:
            body = rf"(?<!\w)(?:{body})(?!\w)"
        bodies.append(f"(?:{body})")
    return re.compile("|".join(bodies), re.I if "i" in opts else 0)


async def _grep_stream(
    sh: _Shell, reader: _Reader, regex: re.Pattern[str], opts: dict[str, str], label: str
) -> int:
    """Matches line by line as input arrives; returns the count of selected lines."""
    limit = _number(opts["m"]) if "m" in opts else -1
    count = number = 0
    while count != limit and (line := await reader.line(sh.block)):
        number += 1
        text = _dec(line).removesuffix("\n")
        if (regex.search(text) is None) != ("v" in opts):
            continue
        count += 1
        if "q" in opts or "l" in opts:
            break
        if "c" in opts:
            continue
        head = label + (f"{number}:" if "n" in opts else "")
        if "o" in opts and "v" not in opts:
            await sh.out("".join(f"{head}{m.group()}\n" for m in regex.finditer(text) if m.group()))
        else:
            await sh.out(f"{head}{text}\n")
    return count


async def _t_grep(sh: _Shell, argv: list[str]) -> int:
    """grep [-qvicnlowxsEFHh] [-e PATTERN|PATTERN] [-m N] [FILE...]: 0 matched, 1 none, 2 error."""
    opts, operands = _getopt(argv, "qvicnlowxsEFHh", "em")
    if "e" in opts:
        patterns = opts["e"].split("\n")
    elif operands:
        patterns, operands = operands[0].split("\n"), operands[1:]
    else:
        raise _ToolError("usage: grep [OPTION]... PATTERN [FILE]...", 2)
    try:
        regex = _grep_regex(patterns, opts)
    except re.error as exc:
        raise _ToolError(f"bad regex '{patterns[0]}': {exc}", 2) from None
    names = operands or ["-"]
    labelled = ("H" in opts or len(names) > 1) and "h" not in opts
    found = failed = False
    for name in names:
        try:
            reader = sh.open_input(name)
        except OSError as exc:
            failed = True
            if "s" not in opts:
                await sh.err(f"grep: {name}: {_reason(exc)}")
            continue
        count = await _grep_stream(sh, reader, regex, opts, f"{name}:" if labelled else "")
        found = found or count > 0
        if found and "q" in opts:
            return 0
        if "c" in opts:
            await sh.out(f"{name + ':' if labelled else ''}{count}\n")
        elif "l" in opts and count:
            await sh.out(name + "\n")
    return 2 if failed else 0 if found else 1


_TR_CLASSES = {
    "lower": string.ascii_lowercase,
    "upper": string.ascii_uppercase,
    "digit": string.digits,
    "alpha": string.ascii_letters,
    "alnum": string.ascii_letters + string.digits,
    "space": " \t\n\r\f\v",
    "blank": " \t",
    "punct": string.punctuation,
    "xdigit": string.hexdigits,
}


def _tr_set(spec: str) -> str:
    """A tr set (escapes, a-z ranges, [:class:] names) as the characters it stands for."""
    text, _ = _unescape(spec, printf=True)
    chars: list[str] = []
    i = 0
    while i < len(text):
        end = text.find(":]", i) if text.startswith("[:", i) else -1
        if end > 0 and text[i + 2 : end] in _TR_CLASSES:
            chars.append(_TR_CLASSES[text[i + 2 : end]])
            i = end + 2
        elif i + 2 < len(text) and text[i + 1] == "-":
            chars.extend(chr(c) for c in range(ord(text[i]), ord(text[i + 2]) + 1))
            i += 3
        else:
            chars.append(text[i])
            i += 1
    return "".join(chars)


def _squeeze(text: str, chars: set[str], last: str) -> tuple[str, str]:
    """tr -s: runs of the same character of chars become one; last carries over between chunks."""
    out = []
    for c in text:
        if c != last or c not in chars:
            out.append(c)
        last = c
    return "".join(out), last


async def _t_tr(sh: _Shell, argv: list[str]) -> int:
    """tr [-d] [-s] SET1 [SET2]: streams, so it works inside an endless pipeline."""
    opts, sets = _getopt(argv, "ds")
    if not sets or len(sets) > 2 or (len(sets) == 1 and not opts):
        raise _ToolError("missing operand")
    source = _tr_set(sets[0])
    target = _tr_set(sets[1]) if len(sets) > 1 else ""
    table: dict[int, int | None]
    if "d" in opts:
        table = dict.fromkeys(map(ord, source))
    elif target:
        table = {ord(c): ord(target[min(i, len(target) - 1)]) for i, c in enumerate(source)}
    else:
        table = {}
    squeeze = set(target or source) if "s" in opts else set()
    decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    reader = sh.input()
    last = ""
    while True:
        chunk = await sh.read(reader)
        text = decoder.decode(chunk, final=not chunk).translate(table)
        if squeeze:
            text, last = _squeeze(text, squeeze, last)
        await sh.out(text)
        if not chunk:
            return 0


async def _t_tee(sh: _Shell, argv: list[str]) -> int:
    opts, names = _getopt(argv, "ai")
    writers: list[_Writer] = []
    status = 0
    for name in names:
        try:
            writers.append(sh.open_output(name, append="a" in opts))
        except OSError as exc:
            await sh.err(f"tee: {name}: {_reason(exc)}")
            status = 1
    reader = sh.input()
    while chunk := await sh.read(reader):
        await sh.out(chunk)
        for writer in writers:
            await writer.write(chunk)
    return status


async def _t_yes(sh: _Shell, argv: list[str]) -> int:
    """yes [STRING]: forever, until its reader goes (SIGPIPE) or the run is cancelled."""
    line = (" ".join(argv[1:]) or "y") + "\n"
    chunk = _enc(line * max(1, 4096 // len(line)))
    while True:
        await sh.out(chunk)
        await asyncio.sleep(0)  # a reader that never makes us wait must not starve the loop


def _seq_value(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise _ToolError(f"invalid floating point argument: '{text}'") from None


async def _t_seq(sh: _Shell, argv: list[str]) -> int:
    """seq [-s SEP] [-w] [FIRST [STEP]] LAST: written as produced, so `seq 1000000 | head` ends."""
    separator, pad, operands = "\n", False, []
    args = iter(argv[1:])
    for arg in args:
        if arg == "-w":
            pad = True
        elif arg.startswith("-s") and not re.fullmatch(r"-[\d.]+", arg):
            separator = arg[2:] or next(args, "\n")
        else:
            operands.append(arg)
    if not 1 <= len(operands) <= 3:
        raise _ToolError("missing operand")
    values = [_seq_value(o) for o in operands]
    first: int | float = values[0] if len(values) > 1 else 1
    step: int | float = values[1] if len(values) == 3 else 1
    last = values[-1]
    if step == 0:
        raise _ToolError("invalid Zero increment value: '0'")
    decimals = max((len(o.partition(".")[2]) for o in operands), default=0)
    width = max(len(f"{v:.{decimals}f}") for v in (first, last)) if pad else 0
    batch: list[str] = []
    for k in itertools.count():
        value = first + k * step
        if (value > last) if step > 0 else (value < last):
            break
        batch.append((separator if k else "") + f"{value:.{decimals}f}".zfill(width))
        if len(batch) == 512:
            await sh.out("".join(batch))
            batch = []
    await sh.out("".join(batch) + ("\n" if k else ""))
    return 0


_LEADING_NUMBER = re.compile(r"\s*[-+]?(?:\d+\.?\d*|\.\d+)")


def _numeric_key(line: str) -> tuple[float, str]:
    """sort -n: by the number a line starts with (0 without one), then by the whole line."""
    m = _LEADING_NUMBER.match(line)
    return (float(m.group()) if m else 0.0), line


async def _t_sort(sh: _Shell, argv: list[str]) -> int:
    """sort [-rnu] [FILE...]: whole lines (env | sort)."""
    opts, names = _getopt(argv, "rnu")
    chunks = []
    for name in names or ["-"]:
        try:
            chunks.append(await sh.read_all(sh.open_input(name)))
        except OSError as exc:
            raise _ToolError(f"{name}: {_reason(exc)}", 2) from None
    numeric = "n" in opts
    lines = sorted(
        _dec(b"".join(chunks)).splitlines(), key=_numeric_key if numeric else None, reverse="r" in opts
    )
    if "u" in opts:  # -u keeps the first of lines that sort equal: the same number for -n
        same = [
            (numeric and _numeric_key(a)[0] == _numeric_key(b)[0]) or a == b
            for a, b in itertools.pairwise(lines)
        ]
        lines = lines[:1] + [line for line, repeated in zip(lines[1:], same, strict=True) if not repeated]
    await sh.out("".join(line + "\n" for line in lines))
    return 0


async def _t_basename(sh: _Shell, argv: list[str]) -> int:
    args = argv[1:] if argv[1:2] != ["--"] else argv[2:]
    if not args:
        raise _ToolError("missing operand")
    stripped = args[0].rstrip("/")
    base = stripped.rsplit("/", 1)[-1] if stripped else "/" if args[0] else ""
    if len(args) > 1 and base != args[1] and base.endswith(args[1]):
        base = base[: -len(args[1])]
    await sh.out(base + "\n")
    return 0


async def _t_dirname(sh: _Shell, argv: list[str]) -> int:
    args = argv[1:] if argv[1:2] != ["--"] else argv[2:]
    if not args:
        raise _ToolError("missing operand")
    stripped = args[0].rstrip("/")
    if not stripped:
        result = "/" if args[0] else "."
    elif "/" not in stripped:
        result = "."
    else:
        result = stripped.rsplit("/", 1)[0].rstrip("/") or "/"
    await sh.out(result + "\n")
    return 0


# --------------------------------------------------------------------------- tools: system

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

    def __init__(self, sh: _Shell, args: list[str]) -> None:
        self.sh = sh
        self.args = args
        self.i = 0

    def evaluate(self) -> bool:
        if len(self.args) <= 1:
            return bool(self.args and self.args[0])
        result = self._or()
        if self.i < len(self.args):
            raise _ToolError(f"{self.args[self.i]}: unexpected operator", 2)
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
            raise _ToolError("argument expected", 2)
        if i + 2 < len(args) and (args[i + 1] in _BINARY_TESTS or args[i + 1] in ("-nt", "-ot", "-ef")):
            self.i += 3
            return self._binary(args[i], args[i + 1], args[i + 2])
        if args[i] == "(" and i + 1 < len(args):
            self.i += 1
            result = self._or()
            if self._peek() != ")":
                raise _ToolError("')' expected", 2)
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
        raise _ToolError(f"{text}: integer expression expected", 2)


async def _t_test(sh: _Shell, argv: list[str]) -> int:
    args = argv[1:]
    if argv[0].rsplit("/", 1)[-1] == "[":
        if not args or args[-1] != "]":
            raise _ToolError("missing ]", 2)
        args = args[:-1]
    return 0 if _Test(sh, args).evaluate() else 1


async def _t_false(sh: _Shell, argv: list[str]) -> int:
    return 1


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smhd]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


async def _t_sleep(sh: _Shell, argv: list[str]) -> int:
    """sleep N[smhd]... | infinity: on io.sleep; SIGTERM interrupts it."""
    if len(argv) < 2:
        raise _ToolError("missing operand")
    total = 0.0
    for arg in argv[1:]:
        if arg in ("infinity", "inf"):
            await sh.sleep_forever()
        m = _DURATION.fullmatch(arg)
        if not m:
            raise _ToolError(f"invalid number '{arg}'")
        total += float(m[1]) * _UNITS[m[2]]
    await sh.block(sh.io.sleep(total))
    return 0


_DATE_DEFAULT = "%a %b %e %H:%M:%S %Z %Y"
_STRFTIME = re.compile(r"%(.)", re.S)


def _strftime(moment: datetime.datetime, fmt: str) -> str:
    """strftime with date's %s, %N and the UTC %Z, %z, %e done here: the same on every platform."""

    def one(m: re.Match[str]) -> str:
        c = m.group(1)
        fixed = {
            "s": str(int(moment.timestamp())),
            "N": f"{moment.microsecond * 1000:09d}",
            "e": f"{moment.day:2d}",
            "Z": "UTC",
            "z": "+0000",
            "%": "%",
        }
        return fixed.get(c) or moment.strftime("%" + c)

    return _STRFTIME.sub(one, fmt)


def _date_value(text: str) -> float:
    if text.startswith("@"):
        try:
            return float(text[1:])
        except ValueError:
            pass
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise _ToolError(f"invalid date '{text}'") from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=datetime.UTC)).timestamp()


async def _t_date(sh: _Shell, argv: list[str]) -> int:
    """date [-u] [-d @N|ISO] [-I[seconds]|-R] [+FORMAT], always in UTC."""
    when, fmt = sh.io.clock(), _DATE_DEFAULT
    args = argv[1:]
    while args:
        arg = args.pop(0)
        if arg.startswith("+"):
            fmt = arg[1:]
        elif arg in ("-d", "--date") and args:
            when = _date_value(args.pop(0))
        elif arg.startswith("--date="):
            when = _date_value(arg[7:])
        elif arg in ("-I", "-Idate", "--iso-8601"):
            fmt = "%Y-%m-%d"
        elif arg.startswith(("-I", "--iso-8601")):
            fmt = "%Y-%m-%dT%H:%M:%S+00:00"
        elif arg in ("-R", "--rfc-2822", "--rfc-email"):
            fmt = "%a, %d %b %Y %H:%M:%S +0000"
        elif arg not in ("-u", "--utc", "--universal"):
            raise _ToolError(f"invalid option '{arg}'")
    await sh.out(_strftime(datetime.datetime.fromtimestamp(when, datetime.UTC), fmt) + "\n")
    return 0


async def _t_hostname(sh: _Shell, argv: list[str]) -> int:
    opts, rest = _getopt(argv, "sfd")
    if rest:
        raise _ToolError("sethostname: Operation not permitted")
    name = sh.io.hostname
    if "s" in opts:
        name = name.split(".")[0]
    elif "d" in opts:
        name = name.partition(".")[2]
    await sh.out(name + "\n")
    return 0


async def _t_env(sh: _Shell, argv: list[str]) -> int:
    """env [-i] [-u NAME] [NAME=VALUE]... [CMD [ARGS]]: prints the environment, or runs CMD in it."""
    env = sh.environ()
    args = argv[1:]
    while args and args[0].startswith("-"):
        arg = args.pop(0)
        if arg in ("-i", "-", "--ignore-environment"):
            env = {}
        elif arg == "-u" and args:
            env.pop(args.pop(0), None)
        elif arg == "--":
            break
        else:
            raise _ToolError(f"invalid option '{arg}'", 125)
    while args and _ASSIGNMENT.match(args[0]):
        name, _, value = args.pop(0).partition("=")
        env[name] = value
    if not args:
        await sh.out("".join(f"{n}={v}\n" for n, v in env.items()))
        return 0
    child = sh.fork()
    child.vars, child.exported = dict(env), set(env)
    return await child.external(args)


async def _t_printenv(sh: _Shell, argv: list[str]) -> int:
    env = sh.environ()
    if len(argv) == 1:
        await sh.out("".join(f"{n}={v}\n" for n, v in env.items()))
        return 0
    values = [env[name] for name in argv[1:] if name in env]
    await sh.out("".join(v + "\n" for v in values))
    return 0 if len(values) == len(argv) - 1 else 1


async def _t_pwd(sh: _Shell, argv: list[str]) -> int:
    await sh.out(sh.cwd + "\n")
    return 0


def _ls_entry(fs: Fs, name: str, path: str, long: bool) -> str:
    if not long:
        return name
    if fs.is_dir(path):
        return f"drwxr-xr-x 2 root root 4096 {name}"
    try:
        size = len(fs.read(path))
    except OSError:
        size = 0
    return f"-rw-r--r-- 1 root root {size} {name}"


async def _t_ls(sh: _Shell, argv: list[str]) -> int:
    """ls [-1aAdlr] [PATH...]: one name per line (-l: a short long format); dot files hidden."""
    opts, names = _getopt(argv, "1aAdlrFhCtS")
    fs, long = sh.io.fs, "l" in opts
    status, lines, dirs = 0, [], []
    for name in names or ["."]:
        path = sh.abspath(name)
        if not fs.exists(path):
            await sh.err(f"ls: {name}: No such file or directory")
            status = 1
        elif fs.is_dir(path) and "d" not in opts:
            dirs.append((name, path))
        else:
            lines.append(_ls_entry(fs, name, path, long))
    for name, path in dirs:
        entries = fs.listdir(path)
        if "a" in opts:
            entries = [".", "..", *entries]
        elif "A" not in opts:
            entries = [e for e in entries if not e.startswith(".")]
        if "r" in opts:
            entries.reverse()
        if len(names) > 1:
            lines.extend([""] if lines else [])
            lines.append(f"{name}:")
        lines.extend(_ls_entry(fs, e, posixpath.join(path, e), long) for e in entries)
    await sh.out("".join(line + "\n" for line in lines))
    return status


async def _per_path(
    sh: _Shell, names: list[str], skip: Callable[[str], bool], act: Callable[[str], None], failed: str
) -> int:
    """Apply ``act`` to each named path not ``skip``-ped; a failure says ``failed`` (with {name})
    and makes the status 1, the rest still go on."""
    status = 0
    for name in names:
        path = sh.abspath(name)
        if skip(path):
            continue
        try:
            act(path)
        except OSError as exc:
            await sh.err(f"{failed.format(name=name)}: {_reason(exc)}")
            status = 1
    return status


async def _t_mkdir(sh: _Shell, argv: list[str]) -> int:
    opts, names = _getopt(argv, "pv", "m")
    if not names:
        raise _ToolError("missing operand")
    parents = "p" in opts
    fs = sh.io.fs
    return await _per_path(
        sh,
        names,
        lambda path: parents and fs.is_dir(path),
        lambda path: fs.mkdir(path, parents=parents),
        "mkdir: can't create directory '{name}'",
    )


async def _t_touch(sh: _Shell, argv: list[str]) -> int:
    """touch FILE...: creates missing files (io.fs has no times to update)."""
    opts, names = _getopt(argv, "acm", "dtr")
    if not names:
        raise _ToolError("missing operand")
    fs = sh.io.fs
    return await _per_path(
        sh,
        names,
        lambda path: "c" in opts or fs.exists(path),
        lambda path: fs.write(path, b"", append=True),
        "touch: {name}",
    )


def _remove_tree(fs: Fs, path: str) -> None:
    if fs.is_dir(path):
        for name in fs.listdir(path):
            _remove_tree(fs, posixpath.join(path, name))
    fs.remove(path)


def _copy_tree(fs: Fs, source: str, target: str) -> None:
    if not fs.is_dir(source):
        fs.write(target, fs.read(source))
        return
    if target == source or target.startswith(source.rstrip("/") + "/"):
        raise OSError(errno.EINVAL, "cannot copy a directory into itself")
    if not fs.is_dir(target):
        fs.mkdir(target)
    for name in fs.listdir(source):
        _copy_tree(fs, posixpath.join(source, name), posixpath.join(target, name))


async def _t_rm(sh: _Shell, argv: list[str]) -> int:
    opts, names = _getopt(argv, "fFrRiIdv")
    force, recursive = "f" in opts, "r" in opts or "R" in opts
    if not names and not force:
        raise _ToolError("missing operand")
    status = 0
    for name in names:
        path = sh.abspath(name)
        if not sh.io.fs.exists(path):
            if not force:
                await sh.err(f"rm: can't remove '{name}': No such file or directory")
                status = 1
            continue
        if sh.io.fs.is_dir(path) and not recursive:
            await sh.err(f"rm: '{name}' is a directory")
            status = 1
            continue
        try:
            _remove_tree(sh.io.fs, path)
        except OSError as exc:
            await sh.err(f"rm: can't remove '{name}': {_reason(exc)}")
            status = 1
    return status


async def _copy_or_move(sh: _Shell, tool: str, names: list[str], recursive: bool, move: bool) -> int:
    if len(names) < 2:
        raise _ToolError("missing file operand")
    fs = sh.io.fs
    *sources, target = names
    destination = sh.abspath(target)
    into = fs.is_dir(destination)
    if len(sources) > 1 and not into:
        raise _ToolError(f"target '{target}' is not a directory")
    status = 0
    for name in sources:
        source = sh.abspath(name)
        to = _norm(posixpath.join(destination, posixpath.basename(source))) if into else destination
        try:
            if fs.is_dir(source) and not recursive:
                raise IsADirectoryError(errno.EISDIR, "omitting directory")
            if to != source:
                _copy_tree(fs, source, to)
                if move:
                    _remove_tree(fs, source)
        except OSError as exc:
            await sh.err(f"{tool}: {name}: {_reason(exc)}")
            status = 1
    return status


async def _t_cp(sh: _Shell, argv: list[str]) -> int:
    opts, names = _getopt(argv, "fpraRdvnLPHT")
    return await _copy_or_move(sh, "cp", names, recursive=bool(set(opts) & set("raR")), move=False)


async def _t_mv(sh: _Shell, argv: list[str]) -> int:
    _, names = _getopt(argv, "fivnT")
    return await _copy_or_move(sh, "mv", names, recursive=True, move=True)


async def _t_id(sh: _Shell, argv: list[str]) -> int:
    """id: root (an extra command named id can tell the image's user instead)."""
    opts, _ = _getopt(argv, "ugGnr")
    if {"u", "g", "G"} & set(opts):
        await sh.out("root\n" if "n" in opts else "0\n")
    else:
        await sh.out("uid=0(root) gid=0(root) groups=0(root)\n")
    return 0


async def _t_whoami(sh: _Shell, argv: list[str]) -> int:
    await sh.out("root\n")
    return 0


_UNAME = {"s": "Linux", "r": "6.6.0-fake", "v": "#1 SMP PREEMPT_DYNAMIC", "m": "x86_64", "p": "unknown"}
_UNAME |= {"i": "unknown", "o": "GNU/Linux"}


async def _t_uname(sh: _Shell, argv: list[str]) -> int:
    opts, _ = _getopt(argv, "asnrvmpio")
    keys = "snrvmo" if "a" in opts else [k for k in "snrvmpio" if k in opts] or ["s"]
    await sh.out(" ".join(sh.io.hostname if k == "n" else _UNAME[k] for k in keys) + "\n")
    return 0


async def _t_kill(sh: _Shell, argv: list[str]) -> int:
    """kill [-s SIG|-SIG] PID...: $$ signals this shell; a background job's pid stops it."""
    args = argv[1:]
    if args == ["-l"]:
        await sh.out(" ".join(n for n in _SIGNALS if n != "EXIT") + "\n")
        return 0
    name: str | None = "TERM"
    if args[:1] == ["-s"] and len(args) > 1:
        name, args = _signal_name(args[1]), args[2:]
    elif args and args[0].startswith("-") and args[0] != "--" and len(args[0]) > 1:
        name, args = _signal_name(args[0][1:]), args[1:]
    args = args[1:] if args[:1] == ["--"] else args
    if name is None:
        raise _ToolError("bad signal name")
    if not args:
        raise _ToolError("usage: kill [-s SIGNAL | -SIGNAL] PID...", 2)
    for arg in args:
        pid = _number(arg, "pid")
        if name != "EXIT":  # signal 0: only asks whether the process exists
            await sh.kill(pid, name)
    return 0


async def _t_pgrep(sh: _Shell, argv: list[str]) -> int:
    """pgrep [-flx] PATTERN over io.processes (PIDs are their positions from 1)."""
    opts, patterns = _getopt(argv, "flxa")
    if len(patterns) != 1:
        raise _ToolError("usage: pgrep [-flx] PATTERN", 2)
    try:
        regex = re.compile(patterns[0])
    except re.error as exc:
        raise _ToolError(f"bad regex: {exc}", 2) from None
    match = regex.fullmatch if "x" in opts else regex.search
    hits = [(pid, name) for pid, name in enumerate(sh.processes(), 1) if match(name)]
    await sh.out("".join(f"{pid} {name}\n" if "l" in opts else f"{pid}\n" for pid, name in hits))
    return 0 if hits else 1


async def _t_ps(sh: _Shell, argv: list[str]) -> int:
    rows = "".join(f"{pid:>5} root      0:00 {name}\n" for pid, name in enumerate(sh.processes(), 1))
    await sh.out("  PID USER     TIME  COMMAND\n" + rows)
    return 0


async def _t_which(sh: _Shell, argv: list[str]) -> int:
    status = 0
    for name in (a for a in argv[1:] if not a.startswith("-")):
        found = sh.describe(name)
        if found is not None and found[0] == "file":
            await sh.out(found[1] + "\n")
        else:
            status = 1
    return status


@dataclasses.dataclass
class _Invocation:
    """How sh was invoked: a -c script, a script file, or commands on stdin."""

    arg0: str
    script: str | None = None
    file: str | None = None
    flags: set[str] = dataclasses.field(default_factory=set)
    args: list[str] = dataclasses.field(default_factory=list)


def _sh_invocation(argv: list[str]) -> _Invocation:
    invocation = _Invocation(argv[0])
    command = False
    i = 1
    while i < len(argv) and argv[i][:1] in ("-", "+") and argv[i] not in ("-", "+"):
        arg = argv[i]
        i += 1
        if arg == "--":
            break
        if arg.startswith("--"):
            continue  # --login, --norc, --posix: nothing to change here
        for c in arg[1:]:
            if c == "c":
                command = True
            elif c == "o" and i < len(argv):
                invocation.flags.add(_option(argv[i]))
                i += 1
            elif c in _SHORT_OPTIONS + "silp":
                invocation.flags.add(c)
            else:
                raise _ToolError(f"-{c}: invalid option", 2)
    rest = argv[i:]
    if command:
        if not rest:
            raise _ToolError("-c requires an argument", 2)
        invocation.script, invocation.args = rest[0], rest[2:]
        invocation.arg0 = rest[1] if len(rest) > 1 else argv[0]
    elif rest:
        invocation.file, invocation.arg0, invocation.args = rest[0], rest[0], rest[1:]
    return invocation


async def _t_sh(sh: _Shell, argv: list[str]) -> int:
    """sh/bash -c SCRIPT [NAME [ARGS]], sh FILE [ARGS] (from io.fs), or sh reading stdin."""
    invocation = _sh_invocation(argv)
    child = sh.program(invocation.arg0, invocation.args)
    child.flags |= invocation.flags & (set(_SHORT_OPTIONS) | {"pipefail"})
    make: Callable[[], Awaitable[int]]
    if invocation.script is not None:
        make = functools.partial(child.run_text, invocation.script)
    elif invocation.file is not None:
        try:
            text = _dec(sh.io.fs.read(sh.abspath(invocation.file)))
        except OSError as exc:
            raise _ToolError(f"can't open '{invocation.file}': {_reason(exc)}", 127) from None
        make = functools.partial(child.run_text, text)
    else:
        make = child.run_stdin
    return await sh.run_program(child, make)


_SPECIAL: dict[str, _Builtin] = {
    ":": _s_true,
    ".": _s_source,
    "source": _s_source,
    "break": _s_break,
    "continue": _s_continue,
    "eval": _s_eval,
    "exec": _s_exec,
    "exit": _s_exit,
    "export": _s_export,
    "readonly": _s_readonly,
    "local": _s_local,
    "return": _s_return,
    "set": _s_set,
    "shift": _s_shift,
    "trap": _s_trap,
    "unset": _s_unset,
    "cd": _s_cd,
    "read": _s_read,
    "wait": _s_wait,
    "command": _s_command,
    "type": _s_type,
    "umask": _s_umask,
}

_TOOLS: dict[str, _Builtin] = {
    "echo": _t_echo,
    "printf": _t_printf,
    "cat": _t_cat,
    "head": _t_head,
    "tail": _t_tail,
    "wc": _t_wc,
    "grep": _t_grep,
    "tr": _t_tr,
    "tee": _t_tee,
    "yes": _t_yes,
    "seq": _t_seq,
    "sort": _t_sort,
    "basename": _t_basename,
    "dirname": _t_dirname,
    "test": _t_test,
    "[": _t_test,
    "true": _s_true,
    "false": _t_false,
    "sleep": _t_sleep,
    "date": _t_date,
    "hostname": _t_hostname,
    "env": _t_env,
    "printenv": _t_printenv,
    "pwd": _t_pwd,
    "ls": _t_ls,
    "mkdir": _t_mkdir,
    "touch": _t_touch,
    "rm": _t_rm,
    "cp": _t_cp,
    "mv": _t_mv,
    "id": _t_id,
    "whoami": _t_whoami,
    "uname": _t_uname,
    "kill": _t_kill,
    "pgrep": _t_pgrep,
    "ps": _t_ps,
    "which": _t_which,
    "sh": _t_sh,
    "bash": _t_sh,
    "ash": _t_sh,
    "dash": _t_sh,
}


def knows(name: str) -> bool:
    """Whether ``name`` (or ``/usr/bin/name``) is a command of this shell: the fake runs a container
    whose command it knows, and lets any other run silently until stopped."""
    base = posixpath.basename(name)
    return base in _SPECIAL or base in _TOOLS
