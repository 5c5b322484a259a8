"""HTTP/1.1 framing of the engine's answers: the status line and headers, chunked bodies,
error messages, and a response read incrementally (logs, events, pull progress, hijacked streams).

Split from :mod:`.engine`, which sends the requests; nothing here knows what a call means.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any


def parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    status_line, *header_lines = raw.decode("latin-1").split("\r\n")
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    for line in header_lines:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return status, headers


async def read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while True:
        size_line = await reader.readline()
        if not size_line.endswith(b"\n"):
            raise asyncio.IncompleteReadError(bytes(size_line), None)
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            # Trailers, if any, then the empty line.
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass
            return bytes(out)
        out += await reader.readexactly(size)
        await reader.readexactly(2)


def message_of(text: str) -> str:
    try:
        return str(json.loads(text).get("message", text))
    except (ValueError, AttributeError):
        return text


class RawResponse:
    """An HTTP response whose body is read incrementally (chunked, sized or raw)."""

    def __init__(
        self,
        status: int,
        headers: dict[str, str],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        raw: bool,
    ) -> None:
        self.status = status
        self.headers = headers
        self.reader = reader
        self.writer = writer
        self._chunked = not raw and "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self._remaining: int | None = None if raw or self._chunked or length is None else int(length)
        self._chunk_left = 0
        self._eof = False
        self._buf = bytearray()

    async def _next(self) -> bytes:
        """The next piece of body, b"" at its end."""
        if self._eof:
            return b""
        if self._chunked:
            if self._chunk_left == 0:
                size_line = await self.reader.readline()
                if not size_line:
                    self._eof = True
                    return b""
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self._eof = True
                    return b""
                self._chunk_left = size
            data = await self.reader.read(min(self._chunk_left, 65536))
            if not data:
                self._eof = True
                return b""
            self._chunk_left -= len(data)
            if self._chunk_left == 0:
                await self.reader.readexactly(2)  # CRLF after the chunk
            return data
        if self._remaining is not None:
            if self._remaining <= 0:
                self._eof = True
                return b""
            data = await self.reader.read(min(self._remaining, 65536))
            self._remaining -= len(data)
        else:
            data = await self.reader.read(65536)
        if not data:
            self._eof = True
        return data

    async def read_some(self) -> bytes:
        if self._buf:
            data = bytes(self._buf)
            self._buf.clear()
            return data
        try:
            return await self._next()
        except (asyncio.IncompleteReadError, ConnectionError):
            self._eof = True
            return b""

    async def read_exactly(self, n: int) -> bytes | None:
        """n bytes, or None when the body ends first."""
        while len(self._buf) < n:
            try:
                data = await self._next()
            except (asyncio.IncompleteReadError, ConnectionError):
                data = b""
            if not data:
                return None
            self._buf += data
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def read_line(self) -> bytes:
        """One line (with its newline), or what is left at the end."""
        while b"\n" not in self._buf:
            try:
                data = await self._next()
            except (asyncio.IncompleteReadError, ConnectionError):
                data = b""
            if not data:
                out = bytes(self._buf)
                self._buf.clear()
                return out
            self._buf += data
        nl = self._buf.index(b"\n") + 1
        out = bytes(self._buf[:nl])
        del self._buf[:nl]
        return out

    async def read_all(self, limit: int = 1 << 24) -> bytes:
        out = bytearray()
        while len(out) < limit:
            data = await self.read_some()
            if not data:
                break
            out += data
        return bytes(out)

    async def json_lines(self) -> AsyncIterator[dict[str, Any]]:
        while True:
            line = await self.read_line()
            if not line:
                return
            line = line.strip()
            if line:
                with contextlib.suppress(ValueError):
                    yield json.loads(line)

    async def frames(self, tty: bool) -> AsyncIterator[tuple[str, bytes]]:
        """The engine's stdout/stderr stream: raw with a TTY, else 8-byte framed."""
        if tty:
            while data := await self.read_some():
                yield "stdout", data
            return
        while True:
            header = await self.read_exactly(8)
            if header is None:
                return
            size = int.from_bytes(header[4:8], "big")
            payload = await self.read_exactly(size) if size else b""
            if payload is None:
                return
            yield ("stderr" if header[0] == 2 else "stdout"), payload

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def close_input(self) -> None:
        if self.writer.can_write_eof():
            self.writer.write_eof()

    def close(self) -> None:
        self.writer.close()
