"""The shell under test: a container's io with collected output, a scripted stdin and a fake clock,
and the tables of scripts that the test modules run."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeAlias

import pytest

from backends.fake.shell import MemoryFs, ShellIO, run

NOW = datetime.datetime(2026, 12, 1, 12, tzinfo=datetime.UTC).timestamp()
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/root", "HOSTNAME": "pod-1", "GREETING": "hello world"}


@dataclasses.dataclass
class Result:
    stdout: bytes
    stderr: bytes
    code: int


class Harness:
    """One container's io for the shell: collected output, a scripted stdin and a fake clock."""

    def __init__(
        self,
        stdin: Iterable[bytes] | None = (),
        fs: MemoryFs | None = None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
    ) -> None:
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.slept: list[float] = []
        self.term = asyncio.Event()
        self.fs = fs if fs is not None else default_fs()
        self._chunks = list(stdin) if stdin is not None else None
        self.io = ShellIO(
            self.fs,
            dict(ENV),
            hostname="pod-1",
            stdin=self._read if stdin is not None else None,
            stdout=self._out,
            stderr=self._err,
            term=self.term,
            sleep=sleep or self._sleep,
            processes=lambda: [(1, "sh"), (7, "nginx")],
            clock=lambda: NOW,
        )

    async def _read(self) -> bytes:
        assert self._chunks is not None
        return self._chunks.pop(0) if self._chunks else b""

    async def _out(self, data: bytes) -> None:
        self.stdout += data

    async def _err(self, data: bytes) -> None:
        self.stderr += data

    async def _sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        await asyncio.sleep(0)

    async def run(self, argv: list[str]) -> Result:
        code = await asyncio.wait_for(run(argv, self.io), 10)
        return Result(bytes(self.stdout), bytes(self.stderr), code)


def default_fs() -> MemoryFs:
    fs = MemoryFs(
        {
            "/etc/hostname": "pod-1\n",
            "/etc/passwd": "root:x:0:0:root:/root:/bin/sh\n",
            "/etc/group": "root:x:0:\n",
            "/data/in.txt": "one\ntwo\nthree\n",
            "/data/empty": "",
            "/data/lib.sh": "LIBVAR=from-lib\nlibf() { echo libf $1; }\n",
        }
    )
    fs.mkdir("/tmp")
    return fs


async def blocked_forever(seconds: float) -> None:
    """A sleep that only SIGTERM (or cancellation) ends: TERM tests need no real time."""
    await asyncio.Event().wait()


async def settle() -> None:
    """Lets the shell run until it blocks."""
    for _ in range(20):
        await asyncio.sleep(0)


Row: TypeAlias = tuple[str, str, str, "str | None", int]
"""(script, stdin, stdout, a substring of stderr or None for no stderr at all, exit code)"""


def script_table(table: list[Row]) -> pytest.MarkDecorator:
    """Parametrizes a test over a table of scripts, each row's id its number and its script's start."""
    return pytest.mark.parametrize(
        ("script", "stdin", "stdout", "stderr", "code"),
        table,
        ids=[f"{i:03d}-{row[0][:40]}" for i, row in enumerate(table)],
    )


async def check_script(script: str, stdin: str, stdout: str, stderr: str | None, code: int) -> None:
    """Runs ``sh -c script`` with stdin and checks its stdout, stderr and exit code."""
    result = await Harness([stdin.encode()] if stdin else []).run(["sh", "-c", script])
    assert result.stdout.decode() == stdout
    if stderr is None:
        assert result.stderr == b""
    else:
        assert stderr in result.stderr.decode()
    assert result.code == code
