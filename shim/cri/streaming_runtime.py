"""Exec, attach and port-forward behind the streaming URLs, for the streaming server.

:class:`StreamTarget` is the :class:`~shim.streaming.StreamingRuntime` it calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backends.contract import Exec, PortStream, StreamIO
from shim.cri.errors import FailedPreconditionError, NotFoundError, UnimplementedError
from shim.cri.state import Shim


class StreamTarget:
    """What the streaming server calls: CRI IDs → records → the owning backend."""

    def __init__(self, shim: Shim) -> None:
        self.shim = shim

    def _running(self, container_id: str) -> Any:
        c = self.shim.store.containers.get(container_id)
        if c is None:
            raise NotFoundError(f"container {container_id} not found")
        return c

    def _exec(self, handler: str, what: str) -> Exec:
        streams = self.shim.backend(handler).exec
        if streams is None:
            raise UnimplementedError(f"runtime handler {handler!r} does not support {what}")
        return streams

    async def exec(self, container_id: str, cmd: Sequence[str], io: StreamIO) -> int:
        c = self._running(container_id)
        return await self._exec(c.backend, "Exec").exec(c, cmd, io)

    async def attach(self, container_id: str, io: StreamIO) -> None:
        c = self._running(container_id)
        await self._exec(c.backend, "Attach").attach(c, io)

    async def port_forward(self, sandbox_id: str, port: int, stream: PortStream) -> None:
        sb = self.shim.store.sandboxes.get(sandbox_id)
        if sb is None:
            raise NotFoundError(f"pod sandbox {sandbox_id} not found")
        if not sb.status.ready:
            raise FailedPreconditionError(f"pod sandbox {sandbox_id} is not ready")
        await self._exec(sb.backend, "PortForward").port_forward(sb, port, stream)
