"""The entry points: :func:`run` a container's command, :func:`run_script` a script, :func:`knows`.

Here, above the evaluator, its tables of commands are filled: the builtins and the tools are
written on the evaluator, which therefore cannot import them."""

from __future__ import annotations

import functools
import posixpath
from collections.abc import Sequence

from backends.fake.shell import builtins, tools
from backends.fake.shell.caller import ShellIO
from backends.fake.shell.evaluation import SPECIAL, TOOLS, Shell
from backends.fake.shell.fs import norm
from backends.fake.shell.process import Session
from backends.fake.shell.streams import CallbackWriter, Fd
from backends.fake.shell.syntax import Lit, Simple, Word

_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

SPECIAL.update(builtins.COMMANDS)
TOOLS.update(tools.COMMANDS)


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
    command = Simple((), tuple(Word([Lit(arg, True)]) for arg in argv), ())  # as if quoted
    return await shell.main(functools.partial(shell.run, command))


async def run_script(script: str, io: ShellIO) -> int:
    """Runs a shell script as the container's main shell; a syntax error prints and gives 2."""
    shell = _root_shell(io)
    return await shell.main(functools.partial(shell.run_text, script))


def _root_shell(io: ShellIO) -> Shell:
    session = Session(io)
    fds: dict[int, Fd] = {0: session.stdin, 1: CallbackWriter(io.stdout), 2: CallbackWriter(io.stderr)}
    shell = Shell(session, io.env, "sh", [], fds, norm(io.cwd))
    shell.vars.setdefault("PATH", _DEFAULT_PATH)
    session.owner = shell
    return shell


def knows(name: str) -> bool:
    """Whether ``name`` (or ``/usr/bin/name``) is a command of this shell: the fake runs a container
    whose command it knows, and lets any other run silently until stopped."""
    base = posixpath.basename(name)
    return base in SPECIAL or base in TOOLS
