"""Commands in a fake container and streams to it: ExecSync, exec, attach, port-forward.

Commands answer from the handler's ``exec`` rules, then from the built-in
shell of :mod:`backends.fake.program`; an interactive ``sh`` reads lines
from stdin. Attached stdin is echoed, as ``cat`` would do as the
container's program; a forwarded port echoes too, unless
``port_responses`` gives its answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from backends.contract import ContainerRecord, ExecResult, PortStream, SandboxRecord, StreamIO, errors
from backends.fake.lifecycle import FakeLifecycle, send
from backends.fake.program import Programs, run_shell

_SHELLS = (["sh"], ["/bin/sh"], ["bash"], ["/bin/bash"])


class FakeExec:
    """The Exec protocol over the fake's containers."""

    def __init__(self, options: Mapping[str, Any], lifecycle: FakeLifecycle, programs: Programs) -> None:
        self.lifecycle = lifecycle
        self.programs = programs
        self._port_responses = dict(options.get("port_responses", {}))

    def _exec(self, container: ContainerRecord, cmd: Sequence[str]) -> tuple[ExecResult, float]:
        return self.programs.exec(cmd, self.lifecycle.shell_context(container))

    async def exec_sync(self, container: ContainerRecord, cmd: Sequence[str]) -> ExecResult:
        result, delay = self._exec(container, cmd)
        if delay:
            await asyncio.sleep(delay)
        return result

    async def exec(self, container: ContainerRecord, cmd: Sequence[str], io: StreamIO) -> int:
        if list(cmd) in _SHELLS and io.stdin:
            return await self._interactive_shell(container, io)
        result, delay = self._exec(container, cmd)
        shell = run_shell(cmd, self.lifecycle.shell_context(container))
        if result.stdout:
            await send(io, "stdout", result.stdout)
        if result.stderr:
            await send(io, "stderr", result.stderr)
        if shell.reads_stdin and io.stdin:
            while data := await io.read_stdin():
                await send(io, "stdout", data)
        if delay:
            await asyncio.sleep(delay)
        return result.exit_code

    async def _interactive_shell(self, container: ContainerRecord, io: StreamIO) -> int:
        buf = b""
        code = 0
        while True:
            data = await io.read_stdin()
            if not data:
                return code
            if io.tty:
                await send(io, "stdout", data.replace(b"\r", b"\r\n"))
            buf += data.replace(b"\r", b"\n")
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                text = line.decode(errors="replace").strip()
                if not text:
                    continue
                res, delay = self._exec(container, ["sh", "-c", text])
                if delay:
                    await asyncio.sleep(delay)
                out = res.stdout.replace(b"\n", b"\r\n") if io.tty else res.stdout
                if out:
                    await send(io, "stdout", out)
                if res.stderr:
                    await send(io, "stdout" if io.tty else "stderr", res.stderr)
                code = res.exit_code
                if text.split()[0] == "exit":
                    return code

    async def attach(self, container: ContainerRecord, io: StreamIO) -> None:
        run = self.lifecycle.running.get(container.id)
        if run is None:
            raise errors.FailedPreconditionError(f"container {container.id} is not running")
        run.attached.append(io)
        try:
            if io.stdin and container.config.stdin:
                # Attached stdin is echoed back, as `cat` would do as the container's program.
                while data := await io.read_stdin():
                    await send(io, "stdout", data)
                    if container.config.stdin_once:
                        break
            else:
                await run.exited.wait()
        finally:
            run.attached.remove(io)

    async def port_forward(self, sandbox: SandboxRecord, port: int, stream: PortStream) -> None:
        responder = self._port_responses.get(str(port))
        if responder is not None:
            await stream.write(str(responder).encode())
            return
        # Echo, by default: what is sent comes back.
        while data := await stream.read():
            await stream.write(data)
