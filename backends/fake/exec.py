"""Commands in a fake container and streams to it: ExecSync, exec, attach, port-forward.

Commands answer from the handler's ``exec`` rules, then run in the built-in
shell (:mod:`backends.fake.shell`) over the container's files; an
interactive ``sh`` reads its commands from stdin, through a TTY's echo when
the session has one. Attached stdin goes to the shell running the
container's command (a scripted program echoes it, as ``cat`` would). A
forwarded port reaches the server that listens on it in the pod
(:mod:`backends.fake.ports`: a container's ``httpd``, a scripted server of
:mod:`backends.fake.servers`), else answers with the handler's
``port_responses`` for it, else echoes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from backends.contract import ContainerRecord, ExecResult, PortStream, SandboxRecord, StreamIO, errors
from backends.fake import shell
from backends.fake.lifecycle import FakeLifecycle, send
from backends.fake.program import Programs


class FakeExec:
    """The Exec protocol over the fake's containers: the handler's exec rules, else the built-in shell."""

    def __init__(self, options: Mapping[str, Any], lifecycle: FakeLifecycle, programs: Programs) -> None:
        self.lifecycle = lifecycle
        self.programs = programs
        self._port_responses = dict(options.get("port_responses", {}))

    async def exec_sync(self, container: ContainerRecord, cmd: Sequence[str]) -> ExecResult:
        rule = self.programs.exec_rule(cmd)
        if rule is not None:
            result, delay = rule
            if delay:
                await asyncio.sleep(delay)
            return result
        out, err = bytearray(), bytearray()

        async def to_out(data: bytes) -> None:
            out.extend(data)

        async def to_err(data: bytes) -> None:
            err.extend(data)

        code = await shell.run(cmd, self.lifecycle.shell_io(container, to_out, to_err))
        return ExecResult(exit_code=code, stdout=bytes(out), stderr=bytes(err))

    async def exec(self, container: ContainerRecord, cmd: Sequence[str], io: StreamIO) -> int:
        rule = self.programs.exec_rule(cmd)
        if rule is not None:
            result, delay = rule
            if result.stdout:
                await send(io, "stdout", result.stdout)
            if result.stderr:
                await send(io, "stderr", result.stderr)
            if delay:
                await asyncio.sleep(delay)
            return result.exit_code
        term = _Terminal(io) if io.tty else None

        async def to_out(data: bytes) -> None:
            await send(io, "stdout", term.output(data) if term else data)

        async def to_err(data: bytes) -> None:
            await send(io, "stderr", term.output(data) if term else data)

        stdin = (term.read if term else io.read_stdin) if io.stdin else None
        return await shell.run(cmd, self.lifecycle.shell_io(container, to_out, to_err, stdin))

    async def attach(self, container: ContainerRecord, io: StreamIO) -> None:
        run = self.lifecycle.running.get(container.id)
        if run is None:
            raise errors.FailedPreconditionError(f"container {container.id} is not running")
        run.attached.append(io)
        try:
            if io.stdin and run.stdin is not None:
                # The shell running the container's command reads what the session sends.
                feeder = asyncio.ensure_future(self._feed(io, run.stdin, container.config.stdin_once))
                try:
                    await run.exited()
                finally:
                    feeder.cancel()
            elif io.stdin and container.config.stdin:
                # A scripted program with stdin: it echoes, as `cat` would.
                while data := await io.read_stdin():
                    await send(io, "stdout", data)
                    if container.config.stdin_once:
                        break
            else:
                await run.exited()
        finally:
            run.attached.remove(io)

    @staticmethod
    async def _feed(io: StreamIO, stdin: asyncio.Queue[bytes], once: bool) -> None:
        while data := await io.read_stdin():
            stdin.put_nowait(data)
        if once:
            stdin.put_nowait(b"")  # stdin_once: the container's stdin closes with the session's

    async def port_forward(self, sandbox: SandboxRecord, port: int, stream: PortStream) -> None:
        if await self.lifecycle.ports.connect(sandbox.id, port, stream):
            return
        responder = self._port_responses.get(str(port))
        if responder is not None:
            await stream.write(str(responder).encode())
            return
        # Echo, by default: what is sent comes back.
        while data := await stream.read():
            await stream.write(data)


class _Terminal:
    """What a TTY does to a session's bytes: input echoed and CR read as NL, NL written as CR NL."""

    def __init__(self, io: StreamIO) -> None:
        self._io = io

    async def read(self) -> bytes:
        data = await self._io.read_stdin()
        if data:
            await self._io.write_stdout(data.replace(b"\r", b"\r\n"))
        return data.replace(b"\r", b"\n")

    @staticmethod
    def output(data: bytes) -> bytes:
        return data.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")
