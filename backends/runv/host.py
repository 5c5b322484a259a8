"""Host commands the runv backend runs (ip, iptables, the share helper), and what their failures say.

A failed command reaches the client as INTERNAL naming the command, how it
ended (exit status or signal) and what it printed, never as an empty message.
"""

from __future__ import annotations

import asyncio
import shlex
import signal

from backends.contract import errors


def ending(code: int) -> str:
    """How a process ended, from an asyncio return code (negative: killed by that signal)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


def describe(argv: tuple[str, ...] | list[str], code: int, output: str) -> str:
    return f"`{shlex.join(argv)}` {ending(code)}: {output.strip() or '(no output)'}"


async def run(*argv: str) -> tuple[int, str]:
    """Run a host command; its return code and its stdout and stderr together."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
    except OSError as exc:
        raise errors.InternalError(f"cannot run `{shlex.join(argv)}`: {exc}") from exc
    out, _ = await proc.communicate()
    code = proc.returncode if proc.returncode is not None else -1
    return code, out.decode(errors="replace").strip()


async def must(what: str, *argv: str) -> str:
    """Run a host command that has to succeed; InternalError saying ``what`` failed and how."""
    code, out = await run(*argv)
    if code != 0:
        raise errors.InternalError(f"{what}: {describe(argv, code, out)}")
    return out
