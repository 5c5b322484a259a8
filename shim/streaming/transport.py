"""Byte transports a SPDY session runs on: a TCP stream or a WebSocket tunnel."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol


class ByteTransport(Protocol):
    @property
    def last_activity(self) -> float:
        """Monotonic time of the last byte in either direction."""

    @property
    def closing(self) -> bool:
        """Whether the connection is closed or failed (a write would be lost)."""

    async def read_exactly(self, n: int) -> bytes:
        """``n`` bytes; raises EOFError at end of input."""

    def write(self, data: bytes) -> None:
        """Buffer ``data`` for sending; raises ConnectionError once closed."""

    async def drain(self) -> None:
        """Wait until the send buffer is below its high-water mark."""

    async def aclose(self) -> None:
        """Flush what is buffered (briefly) and close."""

    def abort(self) -> None:
        """Close now, dropping buffered data."""


class TcpTransport:
    """A connection the HTTP server accepted (after the upgrade response)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.last_activity = time.monotonic()

    @property
    def closing(self) -> bool:
        return self.writer.is_closing()

    async def read_exactly(self, n: int) -> bytes:
        try:
            data = await self.reader.readexactly(n)
        except asyncio.IncompleteReadError as exc:
            raise EOFError from exc
        except OSError as exc:  # reset by peer
            raise EOFError from exc
        self.last_activity = time.monotonic()
        return data

    def write(self, data: bytes) -> None:
        if self.writer.is_closing():
            raise ConnectionResetError("connection closed")
        self.writer.write(data)
        self.last_activity = time.monotonic()

    async def drain(self) -> None:
        await self.writer.drain()

    async def aclose(self) -> None:
        await close_writer(self.writer, reader=self.reader)

    def abort(self) -> None:
        self.writer.transport.abort()


async def close_writer(
    writer: asyncio.StreamWriter,
    timeout: float = 5.0,
    reader: asyncio.StreamReader | None = None,
    linger: float = 2.0,
) -> None:
    """Close, giving a slow peer ``timeout`` seconds for the unsent tail.

    With ``reader``, the close lingers: our side is shut down first (FIN), and
    what the peer still sends is read and dropped until it closes too (at most
    ``linger`` seconds). Closing with unread input makes the kernel answer the
    peer's next segment with a reset, and a reset makes the peer's kernel
    discard what it received and its program has not read yet: through a
    proxy (the kubelet's), the end of the output and the exit status.
    """
    if writer.is_closing():
        return
    try:
        async with asyncio.timeout(timeout):
            with contextlib.suppress(OSError):
                await writer.drain()
    except TimeoutError:
        writer.transport.abort()
        return
    if reader is not None and writer.can_write_eof():
        with contextlib.suppress(OSError, TimeoutError):
            writer.write_eof()
            async with asyncio.timeout(linger):
                while await reader.read(65536):
                    pass
    writer.close()
    try:
        async with asyncio.timeout(timeout):
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    except TimeoutError:
        writer.transport.abort()
