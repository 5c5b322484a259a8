"""Words expanded: to one string (assignments, redirections, case), to fields (arguments), to a pattern."""

from __future__ import annotations

from collections.abc import Sequence

from backends.fake.shell.arithmetic import arith_compile, wrap
from backends.fake.shell.control import ShellError
from backends.fake.shell.lexer import NAME, TRIMS
from backends.fake.shell.patterns import glob, glob_escape, trim
from backends.fake.shell.process import ShellProcess
from backends.fake.shell.streams import BufferWriter, dec
from backends.fake.shell.syntax import EMPTY_WORD, Lit, Node, Param, Part, Subst, Word
from backends.fake.shell.words import IFS, IFS_RUN, Fields


async def string(sh: ShellProcess, word: Word) -> str:
    """A word expanded without field splitting: assignments, redirections, case, here-documents."""
    if word.static is not None:
        return word.static
    return "".join([await _expand(sh, part) for part in word.parts])


async def argv(sh: ShellProcess, words: Sequence[Word]) -> list[str]:
    argv: list[str] = []
    for word in words:
        if word.fields is not None:
            argv.extend(word.fields)
        elif word.variable is not None and "IFS" not in sh.vars:  # $name, the common case
            value = sh.get(word.variable)
            argv.extend(IFS_RUN.split(value.strip(IFS)) if value and value.strip(IFS) else ())
        else:
            argv.extend(await _fields(sh, word))
    return argv


async def _fields(sh: ShellProcess, word: Word) -> list[str]:
    """A word expanded into fields: unquoted expansions split on IFS, "$@" one per argument."""
    fields = Fields()
    ifs = sh.vars.get("IFS", IFS)
    for part in word.parts:
        if isinstance(part, Lit):
            fields.add(part.text, part.quoted or bool(part.text))
        elif part.quoted and isinstance(part, Param) and part.name == "@" and not part.op:
            for i, arg in enumerate(sh.args):
                if i:
                    fields.end()
                fields.add(arg)
        elif part.quoted or not word.split:
            fields.add(await _expand(sh, part))
        else:
            fields.split(await _expand(sh, part), ifs)
    fields.end()
    return fields.done


async def _expand(sh: ShellProcess, part: Part) -> str:
    if isinstance(part, Lit):
        return part.text
    if isinstance(part, Param):
        return await _param(sh, part)
    if isinstance(part, Subst):
        return await _substitute(sh, part.body)
    try:
        return str(wrap(arith_compile(await string(sh, part.expr))(sh)))
    except ValueError:
        raise ShellError("arithmetic: negative shift") from None


async def _param(sh: ShellProcess, part: Param) -> str:
    value = sh.get(part.name)
    op, arg = part.op, part.arg or EMPTY_WORD
    if not op:
        return value or ""
    if op == "len":
        return str(len(value or ""))
    if op in TRIMS:
        return trim(value or "", glob(await pattern(sh, arg)), op)
    unset = value is None or (op[0] == ":" and not value)
    kind = op[-1]
    if kind == "-":
        return await string(sh, arg) if unset else value or ""
    if kind == "+":
        return "" if unset else await string(sh, arg)
    if not unset:
        return value or ""
    if kind == "=":
        if not NAME.fullmatch(part.name):
            raise ShellError(f"{part.name}: cannot assign in this way")
        sh.vars[part.name] = await string(sh, arg)
        return sh.vars[part.name]
    message = await string(sh, arg) or ("parameter not set" if value is None else "parameter null or not set")
    raise ShellError(f"{part.name}: {message}")


async def pattern(sh: ShellProcess, word: Word) -> str:
    """A word as a shell pattern: its quoted characters match themselves."""
    texts = []
    for part in word.parts:
        text = await _expand(sh, part)
        texts.append(glob_escape(text) if part.quoted else text)
    return "".join(texts)


async def _substitute(sh: ShellProcess, body: Node) -> str:
    child = sh.fork()
    buffer = BufferWriter()
    child.fds[1] = buffer
    sh.subst_status = await child.subshell(body)
    return dec(bytes(buffer.data)).rstrip("\n")
