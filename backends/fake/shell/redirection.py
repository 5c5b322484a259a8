"""Redirections: a command's descriptors with its redirections opened, left to right."""

from __future__ import annotations

from collections.abc import Sequence

from backends.fake.shell import expansion
from backends.fake.shell.control import reason
from backends.fake.shell.process import ShellProcess
from backends.fake.shell.streams import NULL, Fd, Reader, enc
from backends.fake.shell.syntax import Redir


class _RedirError(Exception):
    """A redirection that cannot be opened."""


async def redirect(sh: ShellProcess, redirs: Sequence[Redir]) -> dict[int, Fd] | None:
    """The descriptors of a command with its redirections applied, left to right; None once the
    error of one that cannot be opened is printed (the command then does not run: status 1)."""
    try:
        return await _apply(sh, redirs)
    except _RedirError as exc:
        await sh.err(f"{sh.arg0}: {exc}")
        return None


async def _apply(sh: ShellProcess, redirs: Sequence[Redir]) -> dict[int, Fd]:
    saved = sh.fds
    sh.fds = dict(saved)
    try:
        for r in redirs:
            sh.fds[r.fd] = await _open(sh, r)
        return sh.fds
    finally:
        sh.fds = saved


async def _open(sh: ShellProcess, r: Redir) -> Fd:
    if r.heredoc is not None:
        return Reader(data=enc(await expansion.string(sh, r.heredoc.body)))
    target = await expansion.string(sh, r.target) if r.target is not None else ""
    if r.op == "<<<":  # bash's here-string
        return Reader(data=enc(target + "\n"))
    if r.op in (">&", "<&"):
        if target == "-":
            return Reader() if r.op == "<&" else NULL
        fd = sh.fds.get(int(target)) if target.isdecimal() else None
        if fd is None:
            raise _RedirError(f"{target}: bad file descriptor")
        return fd
    try:
        if r.op in ("<", "<>"):
            return sh.open_input(target)
        return sh.open_output(target, append=r.op == ">>")
    except OSError as exc:
        verb = "open" if r.op in ("<", "<>") else "create"
        raise _RedirError(f"can't {verb} {target}: {reason(exc)}") from None
