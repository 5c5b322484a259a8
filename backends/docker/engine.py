"""The Docker Engine connection: SDK calls in worker threads, raw streams on the loop.

Short calls (create, inspect, stop, ...) go through ``docker.APIClient`` in a
dedicated thread pool, each under a timeout. Long-lived streams (logs
follow, events, pull progress, the hijacked exec/attach connections) use a
small HTTP/1.1 client on asyncio, so a hundred followed containers cost no
hundred threads and a stream can be half-closed.

Every engine error is translated into a :mod:`shim.errors` condition here,
once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import os
import urllib.parse
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import docker
import docker.errors
import requests.exceptions

from shim.errors import (
    AlreadyExistsError,
    CriError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)

API_VERSION = "1.41"  # Docker 20.10; newer engines still accept it
T = TypeVar("T")


def translate(exc: BaseException) -> CriError:
    """One engine/transport error as the CRI condition it means."""
    if isinstance(exc, CriError):
        return exc
    if isinstance(exc, docker.errors.NotFound):
        return NotFoundError(_explain(exc))
    if isinstance(exc, docker.errors.APIError):
        status = exc.status_code or 0
        if status == 409:
            msg = _explain(exc)
            if "already in use" in msg:
                return AlreadyExistsError(msg)
            return FailedPreconditionError(msg)
        if status == 400:
            return InvalidArgumentError(_explain(exc))
        if status == 503:
            return UnavailableError(_explain(exc))
        return InternalError(_explain(exc))
    if isinstance(exc, requests.exceptions.Timeout | TimeoutError):
        return DeadlineExceededError(f"docker engine did not answer in time: {exc}")
    if isinstance(exc, requests.exceptions.ConnectionError | ConnectionError | FileNotFoundError | OSError):
        return UnavailableError(f"docker engine unreachable: {exc}")
    if isinstance(exc, docker.errors.DockerException):
        return InternalError(str(exc))
    return InternalError(f"{type(exc).__name__}: {exc}")


def _explain(exc: docker.errors.APIError) -> str:
    return str(exc.explanation or exc)


class EngineClient:
    """Async access to one Docker Engine endpoint."""

    def __init__(self, endpoint: str, call_timeout: float = 60.0, workers: int = 32) -> None:
        self.endpoint = endpoint
        self.call_timeout = call_timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="docker-api")
        url = urllib.parse.urlsplit(endpoint)
        self._socket_path = url.path if url.scheme in ("unix", "http+unix") else ""
        # Constructing APIClient with a fixed version makes no request, so the
        # backend can start while dockerd is down.
        self.api = docker.APIClient(
            base_url=endpoint, version=API_VERSION, timeout=int(call_timeout), max_pool_size=workers
        )

    async def call(self, fn: Callable[..., T], *args: Any, deadline: float | None = None, **kwargs: Any) -> T:
        """Run a blocking SDK call in the pool; engine errors become CRI conditions."""
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._pool, functools.partial(self._guarded, fn, *args, **kwargs))
        try:
            return await asyncio.wait_for(fut, deadline or self.call_timeout + 5)
        except TimeoutError as exc:
            raise DeadlineExceededError(
                f"docker engine call {getattr(fn, '__name__', fn)} timed out"
            ) from exc
        except CriError:
            raise
        except Exception as exc:
            raise translate(exc) from exc

    def _guarded(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        # A stopped dockerd removes its socket. Checking first answers at once
        # and avoids the SDK's unix adapter, which leaks the socket of a
        # failed connect.
        if self._socket_path and not os.path.exists(self._socket_path):
            raise UnavailableError(f"docker engine socket {self._socket_path} does not exist")
        return fn(*args, **kwargs)

    async def run(self, fn: Callable[[], T]) -> T:
        """Run an arbitrary blocking function in the pool (no engine translation)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def close(self) -> None:
        self.api.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- raw HTTP

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        url = urllib.parse.urlsplit(self.endpoint)
        try:
            if url.scheme in ("unix", "http+unix", ""):
                return await asyncio.open_unix_connection(url.path or self.endpoint, limit=1 << 20)
            if url.scheme in ("tcp", "http"):
                return await asyncio.open_connection(url.hostname, url.port or 2375, limit=1 << 20)
        except OSError as exc:
            raise UnavailableError(f"docker engine unreachable: {exc}") from exc
        raise InvalidArgumentError(f"unsupported docker endpoint {self.endpoint!r}")

    async def stream(
        self,
        method: str,
        path: str,
        query: dict[str, Any] | None = None,
        body: Any = None,
        headers: dict[str, str] | None = None,
        upgrade: bool = False,
        connect_timeout: float = 10.0,
    ) -> RawResponse:
        """Send one request on a fresh connection and return the open response.

        With ``upgrade`` the connection is hijacked (exec/attach): after the
        101 answer it carries the raw, bidirectional stream.
        """
        reader, writer = await asyncio.wait_for(self._connect(), connect_timeout)
        try:
            target = f"/v{API_VERSION}{path}"
            if query:
                target += "?" + urllib.parse.urlencode(
                    {k: v for k, v in query.items() if v is not None}, quote_via=urllib.parse.quote
                )
            payload = b"" if body is None else json.dumps(body).encode()
            lines = [f"{method} {target} HTTP/1.1", "Host: docker"]
            if payload or method == "POST":
                lines += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
            if upgrade:
                lines += ["Connection: Upgrade", "Upgrade: tcp"]
            lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), connect_timeout)
            status_line, *header_lines = head.decode("latin-1").split("\r\n")
            status = int(status_line.split()[1])
            resp_headers: dict[str, str] = {}
            for line in header_lines:
                if ":" in line:
                    k, v = line.split(":", 1)
                    resp_headers[k.strip().lower()] = v.strip()
            resp = RawResponse(status, resp_headers, reader, writer, raw=upgrade and status == 101)
            if status >= 400:
                text = (await resp.read_all(limit=64 * 1024)).decode("utf-8", "replace")
                resp.close()
                raise translate(_api_error(status, text))
            return resp
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError, IndexError) as exc:
            writer.close()
            raise UnavailableError(f"docker engine stream {path}: {exc!r}") from exc
        except BaseException:
            writer.close()
            raise


def _api_error(status: int, text: str) -> docker.errors.APIError:
    try:
        message = json.loads(text).get("message", text)
    except ValueError:
        message = text
    response = requests.Response()
    response.status_code = status
    if status == 404:
        return docker.errors.NotFound(message, response=response, explanation=message)
    return docker.errors.APIError(message, response=response, explanation=message)


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

    def close(self) -> None:
        self.writer.close()
