"""The server: a listening unix socket, a :class:`Connection` per client, and a graceful stop."""

from __future__ import annotations

import asyncio
import contextvars
import socket

from shim.cri.servicer import CriServicer
from shim.transport.native.calls import Calls, cancel
from shim.transport.native.connection import Connection


class NativeServer:
    """The CRI (and grpc.health.v1 Check) over HTTP/2 on one unix socket, on the running loop."""

    def __init__(self, servicer: CriServicer, max_message_bytes: int) -> None:
        self.calls = Calls(servicer, max_message_bytes)
        self.connections: set[Connection] = set()
        self._server: asyncio.AbstractServer | None = None

    async def start(self, sock: socket.socket) -> None:
        """Serve on ``sock``, a listening unix socket (``listen_socket``, or systemd's)."""
        loop = asyncio.get_running_loop()
        self.calls.context = contextvars.copy_context()  # the caller's: its tasks log as it does
        self._server = await loop.create_unix_server(
            lambda: Connection(self.calls, self.connections), sock=sock
        )

    async def stop(self, grace: float | None) -> None:
        """No new calls; calls under way get ``grace`` seconds, then are cancelled."""
        self.calls.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.goaway()
            if not conn.streams:
                conn.close()
        tasks = self.calls.tasks
        if tasks and grace:
            await asyncio.wait(list(tasks), timeout=grace)
        for task in list(tasks):
            cancel(task)
        if tasks:
            await asyncio.wait(list(tasks), timeout=1.0)
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            self._server.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            except TimeoutError:
                pass


def listen_socket(path: str) -> socket.socket:
    """A listening unix socket at ``path`` (what the caller chmods and hands to NativeServer)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock
