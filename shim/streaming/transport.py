"""Byte transports a SPDY session runs on: a TCP stream or a WebSocket tunnel."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import Protocol

# Longest a connection's reader works through already-received bytes before it lets
# the other tasks of the loop (other sessions, every gRPC call) run: a flood of tiny
# frames, all in the socket buffer, would otherwise hold the loop for as long as it
# takes to parse them (about 100 ms per 64 KiB of empty WebSocket pings).
FAIR_SLICE = 0.0005
# Frames with less payload than TINY_FRAME cost a connection's reader about as much as
# big ones and carry next to nothing. A client may send TINY_FRAME_RATE of them a second,
# and JUNK_FRAME_RATE of those that give the session nothing (pings, data for streams
# that are gone, frame types nobody uses: what only costs the server), each in bursts of
# as many; beyond that its socket is read more slowly. Typing, resizes, keep-alive pings
# and small requests through a port-forward stay below; a flood is held to a few percent
# of a core per connection instead of all of it.
TINY_FRAME = 1024
TINY_FRAME_RATE = 10_000.0
JUNK_FRAME_RATE = 250.0
# Seconds a closing connection gets for the peer to take what is still buffered for it
# (the end of the output, the exit status); a peer that does not read is then cut off.
FLUSH_TIMEOUT = 5.0
READ_SIZE = 64 * 1024  # bytes taken from the socket at a time


class _Bucket:
    __slots__ = ("rate", "refilled", "tokens")

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = rate  # a second's worth of burst
        self.refilled = time.monotonic()

    def take(self, n: int, now: float) -> float:
        """Spend ``n``; the seconds to wait before going on (0 while within the rate)."""
        self.tokens = min(self.rate, self.tokens + (now - self.refilled) * self.rate) - n
        self.refilled = now
        if self.tokens >= 0:
            return 0.0
        # Wait until a tenth of a second's worth is due, not one frame's worth: a
        # few wake-ups a second instead of one per frame.
        return (self.rate / 10 - self.tokens) / self.rate


class Pacer:
    """Paces a connection's reader. The reader calls ``resume`` when it has data to
    work on (after waiting for it) and ``checkpoint`` between frames: once it worked
    FAIR_SLICE seconds in all (waits not counted), it yields to the event loop; while
    its tiny or junk frames are over their rates, it sleeps (the socket is not read
    meanwhile, so TCP pushes back on the client)."""

    __slots__ = ("_busy", "_junk", "_resumed", "_tiny")

    def __init__(self) -> None:
        self._busy = 0.0
        self._resumed = time.monotonic()
        self._tiny = _Bucket(TINY_FRAME_RATE)
        self._junk = _Bucket(JUNK_FRAME_RATE)

    def resume(self) -> None:
        self._resumed = time.monotonic()

    async def checkpoint(self, tiny: int = 0, junk: int = 0) -> None:
        now = time.monotonic()
        self._busy += now - self._resumed
        wait = max(self._tiny.take(tiny, now) if tiny else 0.0, self._junk.take(junk, now) if junk else 0.0)
        if wait > 0:
            await asyncio.sleep(wait)
        elif self._busy >= FAIR_SLICE:
            await asyncio.sleep(0)
        else:
            self._resumed = now
            return
        self._busy = 0.0
        self._resumed = time.monotonic()


class ByteTransport(Protocol):
    @property
    def last_activity(self) -> float:
        """Monotonic time of the last byte in either direction."""

    @property
    def closing(self) -> bool:
        """Whether the connection is closed or failed (a write would be lost)."""

    @property
    def buffered(self) -> int:
        """Bytes received and not read yet: what ``read_exactly`` returns without waiting."""

    async def fill(self) -> None:
        """Wait until at least one byte is buffered; raises EOFError at end of input."""

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
        self._buf = bytearray()

    @property
    def closing(self) -> bool:
        return self.writer.is_closing()

    @property
    def buffered(self) -> int:
        return len(self._buf)

    async def fill(self) -> None:
        if not self._buf:
            await self._read_more(READ_SIZE)

    async def read_exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            await self._read_more(max(READ_SIZE, n - len(self._buf)))
        data = bytes(self._buf[:n])
        del self._buf[:n]
        return data

    async def _read_more(self, size: int) -> None:
        """Up to ``size`` more bytes into the buffer; EOFError at the end or on a reset."""
        try:
            data = await self.reader.read(size)
        except OSError as exc:  # reset by peer
            raise EOFError from exc
        if not data:
            raise EOFError
        self._buf += data
        self.last_activity = time.monotonic()

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
    timeout: float | None = None,
    reader: asyncio.StreamReader | None = None,
    linger: float = 2.0,
) -> None:
    """Close, giving a slow peer ``timeout`` seconds (FLUSH_TIMEOUT) for the unsent tail.

    With ``reader``, the close lingers: our side is shut down first (FIN), and
    what the peer still sends is read and dropped until it closes too (at most
    ``linger`` seconds). Closing with unread input makes the kernel answer the
    peer's next segment with a reset, and a reset makes the peer's kernel
    discard what it received and its program has not read yet: through a
    proxy (the kubelet's), the end of the output and the exit status.
    """
    if writer.is_closing():
        return
    if timeout is None:
        timeout = FLUSH_TIMEOUT
    if not await _in_time_or_abort(writer, writer.drain(), timeout):
        return
    if reader is not None and writer.can_write_eof():
        with contextlib.suppress(OSError, TimeoutError):
            writer.write_eof()
            async with asyncio.timeout(linger):
                while await reader.read(65536):
                    pass
    writer.close()
    await _in_time_or_abort(writer, writer.wait_closed(), timeout)


async def _in_time_or_abort(writer: asyncio.StreamWriter, step: Awaitable[None], timeout: float) -> bool:
    """Await ``step`` (an OSError is as good as done); past ``timeout``, abort the
    connection and return False."""
    try:
        async with asyncio.timeout(timeout):
            with contextlib.suppress(OSError):
                await step
    except TimeoutError:
        writer.transport.abort()
        return False
    return True
