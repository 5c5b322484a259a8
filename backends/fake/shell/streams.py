"""Descriptors: readers with pushback, writers (the caller's streams, a buffer, a file, /dev/null),
and the bounded pipe between pipeline stages."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeAlias

from backends.fake.shell.control import BrokenPipe
from backends.fake.shell.fs import Fs

_PIPE_LIMIT = 65536  # bytes a pipe holds before its writer waits


Block: TypeAlias = Callable[[Awaitable[bytes]], Awaitable[bytes]]


class Reader:
    """A descriptor open for reading, with the pushback that line readers (read, head) need so
    that what they did not consume stays for the next command."""

    def __init__(self, source: Callable[[], Awaitable[bytes]] | None = None, data: bytes = b"") -> None:
        self._source = source  # None once at end of input
        self._buf = data

    async def chunk(self, block: Block) -> bytes:
        """Some data, b"" at end of input; block makes the wait interruptible."""
        if self._buf:
            data, self._buf = self._buf, b""
            return data
        if self._source is None:
            return b""
        data = await block(self._source())
        if not data:
            self._source = None
        return data

    async def line(self, block: Block) -> bytes:
        """One line with its newline (without one at end of input), b"" at end of input."""
        while b"\n" not in self._buf and self._source is not None:
            data = await block(self._source())
            if data:
                self._buf += data
            else:
                self._source = None
        end = self._buf.find(b"\n") + 1 or len(self._buf)
        line, self._buf = self._buf[:end], self._buf[end:]
        return line

    async def rest(self, block: Block) -> bytes:
        chunks = []
        while chunk := await self.chunk(block):
            chunks.append(chunk)
        return b"".join(chunks)

    def unread(self, data: bytes) -> None:
        self._buf = data + self._buf


class Writer:
    """A descriptor open for writing; this base one is /dev/null."""

    async def write(self, data: bytes) -> None:
        """Discards data."""


NULL = Writer()


class CallbackWriter(Writer):
    """The caller's stdout or stderr."""

    def __init__(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        self._send = send

    async def write(self, data: bytes) -> None:
        if data:
            await self._send(data)


class BufferWriter(Writer):
    """The output of a command substitution."""

    def __init__(self) -> None:
        self.data = bytearray()

    async def write(self, data: bytes) -> None:
        self.data += data


class FileWriter(Writer):
    """Output redirected to a file of io.fs: each write appends to what the redirection opened."""

    def __init__(self, fs: Fs, path: str) -> None:
        self._fs = fs
        self._path = path

    async def write(self, data: bytes) -> None:
        # The directory may have gone since: the data is lost, as it is for an unlinked file.
        with contextlib.suppress(OSError):
            self._fs.write(self._path, data, append=True)


class Pipe(Writer):
    """A bounded pipe between two pipeline stages: the writer waits while it is full and breaks
    (SIGPIPE) once the reader is gone, which is what ends `yes | head -n1`."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._write_closed = False
        self._read_closed = False
        self._changed = asyncio.Event()

    async def write(self, data: bytes) -> None:
        while not self._read_closed and len(self._buf) >= _PIPE_LIMIT:
            await self._wait()
        if self._read_closed:
            raise BrokenPipe
        self._buf += data
        self._changed.set()

    async def read(self) -> bytes:
        while not self._buf and not self._write_closed:
            await self._wait()
        data = bytes(self._buf)
        self._buf.clear()
        self._changed.set()
        return data

    def close_write(self) -> None:
        self._write_closed = True
        self._changed.set()

    def close_read(self) -> None:
        self._read_closed = True
        self._buf.clear()
        self._changed.set()

    async def _wait(self) -> None:
        self._changed.clear()
        await self._changed.wait()


Fd: TypeAlias = Reader | Writer


def enc(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def dec(data: bytes) -> str:
    """Bytes as text; undecodable bytes survive the round trip back through enc."""
    return data.decode("utf-8", "surrogateescape")
