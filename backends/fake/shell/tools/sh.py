"""sh, bash, ash and dash: a new shell, for -c SCRIPT, a script file or the commands of stdin."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable

from backends.fake.shell.control import ToolError, reason
from backends.fake.shell.evaluation import Builtin, Shell
from backends.fake.shell.options import SHORT_OPTIONS, option
from backends.fake.shell.streams import dec


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
                invocation.flags.add(option(argv[i]))
                i += 1
            elif c in SHORT_OPTIONS + "silp":
                invocation.flags.add(c)
            else:
                raise ToolError(f"-{c}: invalid option", 2)
    rest = argv[i:]
    if command:
        if not rest:
            raise ToolError("-c requires an argument", 2)
        invocation.script, invocation.args = rest[0], rest[2:]
        invocation.arg0 = rest[1] if len(rest) > 1 else argv[0]
    elif rest:
        invocation.file, invocation.arg0, invocation.args = rest[0], rest[0], rest[1:]
    return invocation


async def _t_sh(sh: Shell, argv: list[str]) -> int:
    """sh/bash -c SCRIPT [NAME [ARGS]], sh FILE [ARGS] (from io.fs), or sh reading stdin."""
    invocation = _sh_invocation(argv)
    child = sh.program(invocation.arg0, invocation.args)
    child.flags |= invocation.flags & (set(SHORT_OPTIONS) | {"pipefail"})
    make: Callable[[], Awaitable[int]]
    if invocation.script is not None:
        make = functools.partial(child.run_text, invocation.script)
    elif invocation.file is not None:
        try:
            text = dec(sh.io.fs.read(sh.abspath(invocation.file)))
        except OSError as exc:
            raise ToolError(f"can't open '{invocation.file}': {reason(exc)}", 127) from None
        make = functools.partial(child.run_text, text)
    else:
        make = child.run_stdin
    return await sh.run_program(child, make)


COMMANDS: dict[str, Builtin] = {
    "sh": _t_sh,
    "bash": _t_sh,
    "ash": _t_sh,
    "dash": _t_sh,
}
