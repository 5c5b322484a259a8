"""The special builtins: what changes the shell itself (cd, export, set, trap, read, wait, exec...)."""

from __future__ import annotations

import asyncio
import itertools
import re

from backends.fake.shell.arithmetic import arith_number
from backends.fake.shell.control import Break, Continue, Exit, Return, ToolError, reason
from backends.fake.shell.evaluation import Builtin, Shell
from backends.fake.shell.lexer import NAME, ParseError
from backends.fake.shell.options import LONG_OPTIONS, SHORT_OPTIONS, getopt, integer, option
from backends.fake.shell.parser import parse
from backends.fake.shell.process import SIGNALS, signal_name
from backends.fake.shell.streams import dec, enc
from backends.fake.shell.words import IFS, quote, read_fields


async def true(sh: Shell, argv: list[str]) -> int:
    return 0


async def _s_exit(sh: Shell, argv: list[str]) -> int:
    if len(argv) < 2:
        raise Exit(sh.status)
    code = arith_number(argv[1])
    if code is None:
        await sh.err(f"{sh.arg0}: exit: Illegal number: {argv[1]}")
        raise Exit(2)
    raise Exit(code & 255)


async def _s_return(sh: Shell, argv: list[str]) -> int:
    if not sh.locals and not sh.sourcing:
        raise ToolError("can only return from a function or a sourced script")
    raise Return(integer(argv[1]) & 255 if len(argv) > 1 else sh.status)


async def _loop_jump(sh: Shell, argv: list[str], jump: type[Break | Continue]) -> int:
    count = integer(argv[1]) if len(argv) > 1 else 1
    if count < 1:
        raise ToolError(f"Illegal number: {argv[1]}")
    if not sh.loop_depth:
        return 0  # outside a loop: nothing to leave
    raise jump(min(count, sh.loop_depth))


async def _s_break(sh: Shell, argv: list[str]) -> int:
    return await _loop_jump(sh, argv, Break)


async def _s_continue(sh: Shell, argv: list[str]) -> int:
    return await _loop_jump(sh, argv, Continue)


async def _s_eval(sh: Shell, argv: list[str]) -> int:
    text = " ".join(argv[1:])
    return await sh.eval(text) if text.strip() else 0


async def _s_exec(sh: Shell, argv: list[str]) -> int:
    """exec CMD: the shell becomes CMD, so it ends with CMD's status (a shell CMD takes signals)."""
    if len(argv) < 2:
        return 0
    sh.exec_next = True
    try:
        status = await sh.external(argv[1:])
    finally:
        sh.exec_next = False
    raise Exit(status)


async def _s_source(sh: Shell, argv: list[str]) -> int:
    if len(argv) < 2:
        raise ToolError("filename argument required", 2)
    path = sh.find_script(argv[1]) or sh.abspath(argv[1])
    try:
        node = parse(dec(sh.io.fs.read(path)))
    except OSError as exc:
        raise ToolError(f"can't open '{argv[1]}': {reason(exc)}", 2) from None
    except ParseError as exc:
        raise ToolError(f"{argv[1]}: syntax error: {exc}", 2) from None
    saved_args = sh.args
    if len(argv) > 2:
        sh.args = argv[2:]
    sh.sourcing += 1
    try:
        return await sh.call(node)
    finally:
        sh.sourcing -= 1
        sh.args = saved_args


async def _s_export(sh: Shell, argv: list[str]) -> int:
    items = [a for a in argv[1:] if a != "-p"]
    if not items:
        exported = sorted(n for n in sh.exported if n in sh.vars)
        await sh.out("".join(f"export {n}={quote(sh.vars[n])}\n" for n in exported))
        return 0
    for item in items:
        sh.exported.add(sh.declare(item))
    return 0


async def _s_readonly(sh: Shell, argv: list[str]) -> int:
    """readonly NAME=value: assigned; nothing stops a later change here."""
    for item in argv[1:]:
        sh.declare(item)
    return 0


async def _s_local(sh: Shell, argv: list[str]) -> int:
    if not sh.locals:
        raise ToolError("not in a function")
    frame = sh.locals[-1]
    for item in argv[1:]:
        name = item.partition("=")[0]
        if NAME.fullmatch(name) and name not in frame:
            frame[name] = sh.vars.get(name)
        sh.declare(item)
    return 0


async def _s_unset(sh: Shell, argv: list[str]) -> int:
    opts, names = getopt(argv, "fv")
    for name in names:
        if "f" in opts:
            sh.functions.pop(name, None)
        else:
            sh.vars.pop(name, None)
            sh.exported.discard(name)
    return 0


async def _s_set(sh: Shell, argv: list[str]) -> int:
    """set [-+eux...] [-o NAME] [--] [ARGS]: only -e, -x and -o pipefail change anything."""
    args = argv[1:]
    if not args:
        await sh.out("".join(f"{n}={quote(v)}\n" for n, v in sorted(sh.vars.items())))
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
                    "".join(f"{n:<12}{'on' if f in sh.flags else 'off'}\n" for n, f in LONG_OPTIONS.items())
                )
                return 0
            change(option(args[i + 1]))
            i += 2
            continue
        for c in arg[1:]:
            if c not in SHORT_OPTIONS:
                raise ToolError(f"illegal option {arg[0]}{c}", 2)
            change(c)
        i += 1
    return 0


async def _s_shift(sh: Shell, argv: list[str]) -> int:
    count = integer(argv[1]) if len(argv) > 1 else 1
    if not 0 <= count <= len(sh.args):
        raise ToolError("can't shift that many")
    sh.args = sh.args[count:]
    return 0


async def _s_trap(sh: Shell, argv: list[str]) -> int:
    """trap ACTION SIGNAL...: '' ignores, - resets; EXIT runs when the shell ends, TERM when it is
    signalled; ERR, DEBUG and RETURN are accepted and never run."""
    args = argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or args == ["-p"]:
        await sh.out("".join(f"trap -- {quote(a)} {n}\n" for n, a in sh.traps.items()))
        return 0
    if args == ["-l"]:
        await sh.out(" ".join(SIGNALS) + "\n")
        return 0
    action, names = (args[0], args[1:]) if len(args) > 1 else ("-", args)
    status = 0
    for text in names:
        name = signal_name(text) or (text.upper() if text.upper() in ("ERR", "DEBUG", "RETURN") else None)
        if name is None or name in ("KILL", "STOP"):
            await sh.err(f"{sh.arg0}: trap: {text}: bad trap")
            status = 1
        elif action == "-":
            sh.traps.pop(name, None)
        else:
            sh.traps[name] = action
    return status


async def _s_cd(sh: Shell, argv: list[str]) -> int:
    args = [a for a in argv[1:] if a not in ("-L", "-P")]
    target = args[0] if args else sh.vars.get("HOME", "/")
    if target == "-":
        target = sh.vars.get("OLDPWD", sh.cwd)
        await sh.out(target + "\n")
    path = sh.abspath(target)
    if not sh.io.fs.is_dir(path):
        why = "Not a directory" if sh.io.fs.exists(path) else "No such file or directory"
        raise ToolError(f"can't cd to {target}: {why}")
    sh.vars["OLDPWD"], sh.cwd = sh.cwd, path
    sh.vars["PWD"] = path
    return 0


_BACKSLASH = re.compile(r"\\(.)", re.S)


async def _s_read(sh: Shell, argv: list[str]) -> int:
    """read [-r] [-p PROMPT] [NAME...]: one line of stdin split by IFS; 1 at end of input."""
    opts, names = getopt(argv, "rs", "ptnud")
    if "p" in opts:
        await sh.writer(2).write(enc(opts["p"]))
    reader = sh.input()
    line = dec(await reader.line(sh.block))
    complete = line.endswith("\n")
    text = line.removesuffix("\n")
    while "r" not in opts and complete and text.endswith("\\"):
        more = dec(await reader.line(sh.block))
        complete = more.endswith("\n")
        text = text[:-1] + more.removesuffix("\n")
    if "r" not in opts:
        text = _BACKSLASH.sub(r"\1", text)
    if not names:
        sh.vars["REPLY"] = text
    else:
        values = read_fields(text, sh.vars.get("IFS", IFS), len(names))
        for name, value in itertools.zip_longest(names, values, fillvalue=""):
            sh.vars[name] = value
    return 0 if complete else 1


async def _s_wait(sh: Shell, argv: list[str]) -> int:
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
        pid = integer(arg, "pid")
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


async def _s_command(sh: Shell, argv: list[str]) -> int:
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


async def _s_type(sh: Shell, argv: list[str]) -> int:
    status = 0
    for name in argv[1:]:
        found = sh.describe(name)
        if found is None:
            await sh.err(f"{sh.arg0}: type: {name}: not found")
            status = 1
        else:
            await sh.out(_type_line(name, *found) + "\n")
    return status


async def _s_umask(sh: Shell, argv: list[str]) -> int:
    """umask: always 0022; setting one changes nothing here."""
    if len(argv) == 1:
        await sh.out("0022\n")
    return 0


COMMANDS: dict[str, Builtin] = {
    ":": true,
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
