"""ExecSync, Exec, Attach, PortForward: byte streams to a container (or the pod's network)
through its VM's agent."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from backends import contract
from backends.contract import errors
from backends.runv.agent import messages as m
from backends.runv.agent.protocol import Ch, ConnectionLost, Stream

from .context import Shared


class Execs:
    def __init__(self, shared: Shared) -> None:
        self._shared = shared

    async def _exec(
        self,
        container: contract.ContainerRecord,
        cmd: Sequence[str],
        stdin: bool,
        tty: bool,
        on_output: Any,
        stdin_source: Any = None,
        resizes: Any = None,
    ) -> int:
        pod = self._shared.pod(container.sandbox_id)
        agent = self._shared.agent(pod)
        stream = agent.stream()
        call = asyncio.ensure_future(
            agent.call(
                m.ExecRequest(id=container.id, stream=stream.id, args=list(cmd), stdin=stdin, tty=tty),
                timeout=None,
            )
        )
        helpers: list[asyncio.Task[None]] = []

        async def read_output() -> None:
            async for ch, data in stream.received():
                await on_output(ch, data)

        if stdin_source is not None:

            async def feed() -> None:
                while data := await stdin_source():
                    await stream.write(Ch.STDIN, data)
                await stream.close(Ch.STDIN)

            helpers.append(asyncio.ensure_future(feed()))
        if resizes is not None:

            async def resize() -> None:
                async for size in resizes:
                    with contextlib.suppress(errors.CriError):
                        await agent.call(
                            m.ResizeRequest(stream=stream.id, width=size.width, height=size.height)
                        )

            helpers.append(asyncio.ensure_future(resize()))
        reader = asyncio.ensure_future(read_output())
        try:
            result = await call
            await reader
            return result.exit_code
        except asyncio.CancelledError:
            # The shim's timeout, or the client gave up (its own deadline, a closed session):
            # the process goes too.
            with contextlib.suppress(errors.CriError):
                await asyncio.shield(agent.call(m.ExecKillRequest(id=container.id, stream=stream.id)))
            raise
        finally:
            for task in (*helpers, reader, call):
                task.cancel()
            await asyncio.gather(*helpers, reader, call, return_exceptions=True)
            stream.forget()

    async def exec_sync(self, container: contract.ContainerRecord, cmd: Sequence[str]) -> contract.ExecResult:
        out = bytearray()
        err = bytearray()

        async def collect(ch: int, data: bytes) -> None:
            (err if ch == Ch.STDERR else out).extend(data)

        code = await self._exec(container, cmd, False, False, collect)
        return contract.ExecResult(code, bytes(out), bytes(err))

    async def exec(
        self, container: contract.ContainerRecord, cmd: Sequence[str], io: contract.StreamIO
    ) -> int:
        async def forward(ch: int, data: bytes) -> None:
            if ch == Ch.STDERR and not io.tty:
                await io.write_stderr(data)
            else:
                await io.write_stdout(data)

        return await self._exec(
            container,
            cmd,
            io.stdin,
            io.tty,
            forward,
            io.read_stdin if io.stdin else None,
            io.resizes() if io.tty else None,
        )

    async def attach(self, container: contract.ContainerRecord, io: contract.StreamIO) -> None:
        pod = self._shared.pod(container.sandbox_id)
        agent = self._shared.agent(pod)
        stream = agent.stream()
        await agent.call(m.AttachRequest(id=container.id, stream=stream.id, stdin=io.stdin))
        tasks: list[asyncio.Task[None]] = []
        if io.stdin:

            async def feed() -> None:
                while data := await io.read_stdin():
                    await stream.write(Ch.STDIN, data)
                await stream.close(Ch.STDIN)

            tasks.append(asyncio.ensure_future(feed()))
        if io.tty:

            async def resize() -> None:
                async for size in io.resizes():
                    await agent.call(m.ResizeRequest(id=container.id, width=size.width, height=size.height))

            tasks.append(asyncio.ensure_future(resize()))
        try:
            async for ch, data in stream.received():
                if ch == Ch.STDERR and io.stderr:
                    await io.write_stderr(data)
                elif io.stdout:
                    await io.write_stdout(data)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            stream.forget()

    async def port_forward(
        self, sandbox: contract.SandboxRecord, port: int, stream: contract.PortStream
    ) -> None:
        pod = self._shared.pod(sandbox.id)
        agent = self._shared.agent(pod)
        st: Stream = agent.stream()
        await agent.call(m.PortForwardRequest(port=port, stream=st.id))

        async def upstream() -> None:
            try:
                while data := await stream.read():
                    await st.write(Ch.STDIN, data)
                await st.close(Ch.STDIN)
            except ConnectionLost:
                pass

        up = asyncio.ensure_future(upstream())
        try:
            async for _ch, data in st.received():
                await stream.write(data)
        finally:
            up.cancel()
            await asyncio.gather(up, return_exceptions=True)
            st.forget()
