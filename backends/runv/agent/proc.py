"""Process plumbing for the guest agent.

The agent is PID 1 of its VM (or at least a child subreaper), so it reaps
every process in it itself: asyncio's child watchers wait for one PID each
and would miss or steal statuses, so all spawning goes through here.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
from collections.abc import Callable, Iterator, Sequence

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def sethostname(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    raw = name.encode()
    if libc.sethostname(raw, len(raw)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def reaped() -> Iterator[tuple[int, int]]:
    """Each child that has ended, as (PID, wait status), collected without blocking."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status


class Reaper:
    """Collects exit statuses of all children, by PID."""

    def __init__(self) -> None:
        self._waiters: dict[int, asyncio.Future[int]] = {}
        self._unclaimed: dict[int, int] = {}

    def install(self) -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGCHLD, self.reap)

    def reap(self) -> None:
        for pid, status in reaped():
            code = os.waitstatus_to_exitcode(status)
            fut = self._waiters.pop(pid, None)
            if fut is not None and not fut.done():
                fut.set_result(code)
            else:
                self._unclaimed[pid] = code
                if len(self._unclaimed) > 4096:  # orphans nobody waits for
                    self._unclaimed.pop(next(iter(self._unclaimed)))

    def wait(self, pid: int) -> asyncio.Future[int]:
        """A future with the exit code (negative signal number when killed)."""
        loop = asyncio.get_running_loop()
        fut = self._waiters.get(pid)
        if fut is None:
            fut = loop.create_future()
            if pid in self._unclaimed:
                fut.set_result(self._unclaimed.pop(pid))
            else:
                self._waiters[pid] = fut
        # A SIGCHLD may have arrived before the waiter existed.
        self.reap()
        return fut


def spawn(argv: Sequence[str], stdin: int, stdout: int, stderr: int, setsid: bool = False) -> int:
    actions = [
        (os.POSIX_SPAWN_DUP2, stdin, 0),
        (os.POSIX_SPAWN_DUP2, stdout, 1),
        (os.POSIX_SPAWN_DUP2, stderr, 2),
    ]
    return os.posix_spawnp(argv[0], list(argv), dict(os.environ), file_actions=actions, setsid=setsid)


class PipeReader:
    """Feeds what arrives on a non-blocking fd to a callback; b"" once at EOF."""

    def __init__(self, fd: int, on_data: Callable[[bytes], None]) -> None:
        self.fd = fd
        self._on_data = on_data
        self.done = asyncio.get_running_loop().create_future()
        os.set_blocking(fd, False)
        asyncio.get_running_loop().add_reader(fd, self._ready)

    def _ready(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        except OSError:  # EIO from a pty master once the slave side is gone
            data = b""
        if data:
            self._on_data(data)
            return
        self.close()
        self._on_data(b"")

    def close(self) -> None:
        if self.done.done():
            return
        asyncio.get_running_loop().remove_reader(self.fd)
        os.close(self.fd)
        self.done.set_result(None)


async def run(reaper: Reaper, argv: Sequence[str], stdin_data: bytes = b"") -> tuple[int, bytes, bytes]:
    """Run a helper command (runc, ip) to completion: (exit code, stdout, stderr)."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        pid = spawn(argv, in_r, out_w, err_w)
    finally:
        os.close(in_r)
        os.close(out_w)
        os.close(err_w)
    out = bytearray()
    err = bytearray()
    r1 = PipeReader(out_r, out.extend)
    r2 = PipeReader(err_r, err.extend)
    try:
        if stdin_data:
            os.write(in_w, stdin_data)
    finally:
        os.close(in_w)
    code = await reaper.wait(pid)
    await asyncio.gather(r1.done, r2.done)
    return code, bytes(out), bytes(err)
