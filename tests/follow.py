"""A backend's containers followed as the shim follows them, for tests that drive a backend directly.

:class:`Follower` is the backends' ``EventSink`` of such a test, and it
follows each started container's process with the shim's own
:class:`~shim.cri.container_io.ContainerIO`: output into a sink (memory or a CRI log
file), the exit recorded once the output is drained.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from backends.contract import ContainerRecord, ExitInfo, Lifecycle, LogMarks, SandboxRecord
from shim.cri.container_io import ContainerIO, LogWriter


class MemoryLog:
    """Output by stream, in memory; ``closed`` is set when the shim would close the log."""

    def __init__(self) -> None:
        self.data: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self.closed = asyncio.Event()

    def write(self, stream: str, data: bytes, at: int = 0) -> None:
        self.data[stream] += data

    def flush_partial(self) -> None:
        pass

    def close(self, flush: bool = True) -> None:
        self.closed.set()


class Follower:
    """An EventSink recording what a backend reports, and the shim's IO path for its containers."""

    def __init__(self) -> None:
        self.exits: dict[str, ExitInfo] = {}
        self.not_ready: dict[str, str] = {}
        self.changed = asyncio.Event()
        self.io = ContainerIO(self.container_exited)

    # ---- EventSink
    def sandbox_not_ready(self, sandbox_id: str, reason: str) -> None:
        self.not_ready[sandbox_id] = reason
        self.changed.set()

    # ---- the shim's side of a container's process
    def container_exited(self, container_id: str, info: ExitInfo) -> None:
        """An exit, as the shim records it: once, then its log is closed."""
        self.exits.setdefault(container_id, info)
        self.io.close(container_id)
        self.changed.set()

    async def start(
        self, backend: Lifecycle, ct: ContainerRecord, sb: SandboxRecord, log: LogWriter | None = None
    ) -> int:
        """StartContainer: start it and follow its process; the start time."""
        started = await backend.start_container(ct, sb)
        self.io.follow(ct.id, started.process, log)
        return started.started_at

    async def reattach(
        self,
        backend: Lifecycle,
        ct: ContainerRecord,
        log: LogWriter | None = None,
        after: LogMarks | None = None,
    ) -> bool:
        """What a restarted shim does for a container recovery found running."""
        process = await backend.reattach(ct, after)
        if process is None:
            return False
        self.io.follow(ct.id, process, log)
        return True

    async def stop(self, backend: Lifecycle, ct: ContainerRecord, timeout: int) -> ExitInfo:
        """StopContainer: the exit is recorded once the output is in."""
        info = await backend.stop_container(ct, timeout)
        await self.io.drain(ct.id)
        self.container_exited(ct.id, info)
        return info

    async def close(self) -> None:
        """The shim goes away: nothing is followed any more (the runtime keeps its containers)."""
        await self.io.aclose()

    async def wait_for(self, cond: Callable[[], object], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            self.changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("timed out waiting for an event")
            try:
                await asyncio.wait_for(self.changed.wait(), left)
            except TimeoutError:
                pass

    async def exit_of(self, container_id: str, timeout: float = 20) -> ExitInfo:
        await self.wait_for(lambda: container_id in self.exits, timeout)
        return self.exits[container_id]
