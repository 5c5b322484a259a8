"""ExecSync / Exec / Attach / PortForward: processes in a container and streams to it."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence
from typing import Any

from backends.contract import ContainerRecord, ExecResult, PortStream, SandboxRecord, StreamIO, TerminalSize
from backends.contract.errors import CriError, FailedPreconditionError

from . import streams
from .context import PID, Shared, engine_id
from .netns import NetnsSocketFactory


class Execs:
    def __init__(self, shared: Shared) -> None:
        self._shared = shared
        self._netns = NetnsSocketFactory()

    def close(self) -> None:
        self._netns.close()

    async def _exec_exit(self, exec_id: str) -> int:
        for _ in range(50):
            info = await self._shared.engine.exec_inspect(exec_id)
            if not info.get("Running") and info.get("ExitCode") is not None:
                return int(info["ExitCode"])
            await asyncio.sleep(0.02)
        return int(info.get("ExitCode") or 0)

    async def _exec_kill(self, exec_id: str) -> None:
        with contextlib.suppress(CriError):
            info = await self._shared.engine.exec_inspect(exec_id)
            pid = int(info.get("Pid") or 0)
            if info.get("Running") and pid:
                await self._shared.engine.run(lambda: streams.kill_tree(pid))

    async def exec_sync(self, container: ContainerRecord, cmd: Sequence[str]) -> ExecResult:
        eid = engine_id(container)
        exec_id = await self._shared.engine.exec_create(eid, list(cmd), stdin=False, tty=False, stderr=True)
        resp = await self._shared.engine.exec_start(exec_id, tty=False)
        out, err = bytearray(), bytearray()

        async def collect() -> None:
            async for stream, data in resp.frames(False):
                (err if stream == "stderr" else out).extend(data)

        try:
            await collect()
        except BaseException:
            # Cancelled: the shim's timeout, or the client gave up. The process goes too.
            await asyncio.shield(self._exec_kill(exec_id))
            raise
        finally:
            resp.close()
        return ExecResult(exit_code=await self._exec_exit(exec_id), stdout=bytes(out), stderr=bytes(err))

    async def exec(self, container: ContainerRecord, cmd: Sequence[str], io: StreamIO) -> int:
        eid = engine_id(container)
        exec_id = await self._shared.engine.exec_create(
            eid, list(cmd), stdin=io.stdin, tty=io.tty, stderr=io.stderr and not io.tty
        )
        resp = await self._shared.engine.exec_start(exec_id, tty=io.tty)

        async def resize(size: TerminalSize) -> None:
            await self._shared.engine.exec_resize(exec_id, size.height, size.width)

        try:
            await streams.pump(resp, io, resize)
        except BaseException:
            # The client went away: the process must not outlive its session.
            await asyncio.shield(self._exec_kill(exec_id))
            raise
        finally:
            resp.close()
        return await self._exec_exit(exec_id)

    async def attach(self, container: ContainerRecord, io: StreamIO) -> None:
        eid = engine_id(container)
        resp = await self._shared.engine.attach_container(eid, io.stdin, io.stdout, io.stderr)

        async def resize(size: TerminalSize) -> None:
            await self._shared.engine.resize_container(eid, size.height, size.width)

        tty = bool((await self._shared.engine.inspect_container(eid))["Config"].get("Tty"))
        io_view = _TtyView(io, tty)
        try:
            await streams.pump(resp, io_view, resize)
        finally:
            resp.close()

    async def port_forward(self, sandbox: SandboxRecord, port: int, stream: PortStream) -> None:
        eid = engine_id(sandbox)
        pid = int(sandbox.backend_data.get(PID) or 0)
        if not pid or not await self._shared.engine.run(lambda: os.path.exists(f"/proc/{pid}/ns/net")):
            info = await self._shared.engine.inspect_container(eid)
            pid = int(info["State"].get("Pid") or 0)
            if not pid:
                raise FailedPreconditionError(f"sandbox {sandbox.id} is not running")
            sandbox.backend_data[PID] = pid
        sock = await asyncio.wrap_future(self._netns.submit(pid))
        loop = asyncio.get_running_loop()
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", port))
        except OSError as exc:
            sock.close()
            raise FailedPreconditionError(
                f"port {port} in sandbox {sandbox.id}: {exc.strerror or exc}"
            ) from exc
        reader, writer = await asyncio.open_connection(sock=sock)

        async def to_pod() -> None:
            while data := await stream.read():
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        async def from_pod() -> None:
            while data := await reader.read(65536):
                await stream.write(data)

        up = asyncio.create_task(to_pod())
        try:
            await from_pod()
        finally:
            if not up.done():
                up.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await up
            writer.close()


class _TtyView:
    """A StreamIO whose tty flag is the container's (attach follows how it was created)."""

    def __init__(self, io: StreamIO, tty: bool) -> None:
        self._io = io
        self.stdin = io.stdin
        self.stdout = io.stdout
        self.stderr = io.stderr
        self.tty = tty

    async def read_stdin(self) -> bytes:
        return await self._io.read_stdin()

    async def write_stdout(self, data: bytes) -> None:
        await self._io.write_stdout(data)

    async def write_stderr(self, data: bytes) -> None:
        await self._io.write_stderr(data)

    def resizes(self) -> Any:
        return self._io.resizes()
