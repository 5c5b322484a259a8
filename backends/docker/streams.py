"""Exec and attach over the engine's hijacked connection, and the process-tree kill."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Awaitable, Callable

from backends.contract import StreamIO, TerminalSize
from backends.linux import procfs

from .engine_api import EngineStream


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants (an exec'd shell's children too)."""
    if pid <= 0:
        return
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        st = procfs.stat(int(entry)) if entry.isdigit() else None
        if st is not None:
            children.setdefault(st.ppid, []).append(int(entry))
    todo, seen = [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        todo += children.get(p, [])
    for p in seen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


async def pump(
    resp: EngineStream,
    io: StreamIO,
    resize: Callable[[TerminalSize], Awaitable[None]],
) -> None:
    """Copy between a hijacked engine connection and a client session until the output ends."""

    async def output() -> None:
        async for stream, data in resp.frames(io.tty):
            if stream == "stderr" and io.stderr and not io.tty:
                await io.write_stderr(data)
            elif io.stdout or io.tty:
                await io.write_stdout(data)

    async def stdin() -> None:
        while data := await io.read_stdin():
            await resp.send(data)
        # Half-close: the process sees end of input, its output still flows back.
        resp.close_input()

    async def resizes() -> None:
        async for size in io.resizes():
            with contextlib.suppress(Exception):
                await resize(size)

    helpers = []
    if io.stdin:
        helpers.append(asyncio.create_task(stdin()))
    if io.tty:
        helpers.append(asyncio.create_task(resizes()))
    try:
        await output()
    finally:
        for t in helpers:
            t.cancel()
        for t in helpers:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
