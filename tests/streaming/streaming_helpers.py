"""Test clients for the streaming server (SPDY and WebSocket, client role) and a fake runtime."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import socket
import struct
import urllib.parse
from collections.abc import Callable, Sequence

from websockets.client import ClientProtocol
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.uri import parse_uri

from backends.contract import PortStream, StreamIO, TerminalSize
from shim.cri.errors import NotFoundError
from shim.streaming import StreamingServer, spdy


class FakeRuntime:
    """Scripted exec programs, an echoing attach, port-forward to 127.0.0.1."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple[str, ...]]] = []
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.io: StreamIO | None = None

    async def exec(self, container_id: str, cmd: Sequence[str], io: StreamIO) -> int:
        self.calls.append(("exec", container_id, tuple(cmd)))
        self.io = io
        self.started.set()
        match cmd[0]:
            case "echo":
                await io.write_stdout(" ".join(cmd[1:]).encode())
                return 0
            case "both":
                await io.write_stdout(b"to stdout")
                await io.write_stderr(b"to stderr")
                return 0
            case "exit":
                return int(cmd[1])
            case "cat":
                while data := await io.read_stdin():
                    await io.write_stdout(data)
                return 0
            case "big":
                await io.write_stdout(b"x" * int(cmd[1]))
                return 0
            case "resize":
                sizes: list[TerminalSize] = []
                async for size in io.resizes():
                    sizes.append(size)
                    if len(sizes) == int(cmd[1]):
                        break
                await io.write_stdout(repr([(s.width, s.height) for s in sizes]).encode())
                return 0
            case "sleep":
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    self.cancelled.set()
                    raise
                return 0
            case "missing":
                raise NotFoundError("container gone")
        return 127

    async def attach(self, container_id: str, io: StreamIO) -> None:
        self.calls.append(("attach", container_id, ()))
        self.started.set()
        await io.write_stdout(b"attached;")
        try:
            while data := await io.read_stdin():
                await io.write_stdout(data)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def port_forward(self, sandbox_id: str, port: int, stream: PortStream) -> None:
        self.calls.append(("port_forward", sandbox_id, (str(port),)))
        self.started.set()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)

        async def upstream() -> None:
            while data := await stream.read():
                writer.write(data)
                await writer.drain()
            writer.write_eof()

        up = asyncio.ensure_future(upstream())
        try:
            while data := await reader.read(65536):
                await stream.write(data)
            await up
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        finally:
            up.cancel()
            with contextlib.suppress(BaseException):
                await up
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


# --------------------------------------------------------------------------- HTTP


async def http_request(
    url: str, method: str = "POST", headers: Sequence[tuple[str, str]] = ()
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int, list[tuple[str, str]], bytes]:
    """Send a request head; (reader, writer, status, response headers, body-if-not-101)."""
    parts = urllib.parse.urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", *(f"{k}: {v}" for k, v in headers)]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split(" ")[1])
    resp_headers = [(k, v.strip()) for k, _, v in (line.partition(":") for line in head[1:] if line)]
    body = b""
    if status != 101:
        body = await reader.read()
    return reader, writer, status, resp_headers, body


def header(headers: list[tuple[str, str]], name: str) -> list[str]:
    return [v for k, v in headers if k.lower() == name.lower()]


# --------------------------------------------------------------------------- SPDY client


class SpdyClient:
    """The client role of a SPDY session, built on the server's own codec."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.encoder = spdy.FrameEncoder()
        self.decoder = spdy.FrameDecoder()
        self.next_id = 1
        self.data: dict[int, bytearray] = {}
        self.fins: set[int] = set()
        self.replies: set[int] = set()
        self.resets: dict[int, int] = {}
        self.other: list[spdy.Frame] = []

    @classmethod
    async def connect(
        cls, url: str, protocols: Sequence[str] = ("v4.channel.k8s.io",)
    ) -> tuple[SpdyClient, list[tuple[str, str]]]:
        headers = [("Connection", "Upgrade"), ("Upgrade", "SPDY/3.1")]
        headers += [("X-Stream-Protocol-Version", p) for p in protocols]
        reader, writer, status, resp, body = await http_request(url, "POST", headers)
        assert status == 101, (status, body)
        return cls(reader, writer), resp

    def send(self, frame: spdy.Frame) -> None:
        self.writer.write(self.encoder.encode(frame))

    def open(self, headers: dict[str, str], fin: bool = False) -> int:
        sid = self.next_id
        self.next_id += 2
        self.send(spdy.SynStreamFrame(sid, headers, fin=fin))
        return sid

    def write(self, sid: int, data: bytes, fin: bool = False) -> None:
        self.send(spdy.DataFrame(sid, data, fin))

    async def frame(self) -> spdy.Frame | None:
        """The next frame, or None at EOF."""
        try:
            head = await self.reader.readexactly(8)
            _, _, _, length = spdy.parse_frame_header(head)
            body = await self.reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        frame = self.decoder.decode(head, body)
        match frame:
            case spdy.DataFrame(sid, data, fin):
                self.data.setdefault(sid, bytearray()).extend(data)
                if fin:
                    self.fins.add(sid)
            case spdy.SynReplyFrame(sid):
                self.replies.add(sid)
            case spdy.RstStreamFrame(sid, status):
                self.resets[sid] = status
            case _ if frame is not None:
                self.other.append(frame)
        return frame

    async def until(self, predicate: object, timeout: float = 10.0) -> None:
        """Read frames until ``predicate()`` holds; fails at EOF first."""
        assert callable(predicate)
        async with asyncio.timeout(timeout):
            while not predicate():
                if await self.frame() is None:
                    raise AssertionError("connection closed before the condition held")

    async def until_eof(self, timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while await self.frame() is not None:
                pass

    def got(self, sid: int) -> bytes:
        return bytes(self.data.get(sid, b""))

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


# --------------------------------------------------------------------------- WebSocket client


class WsClient:
    """A WebSocket client with a hand-made handshake (any subprotocol string goes),
    websockets' sans-I/O protocol for the framing."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, uri: str, subprotocol: str
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.subprotocol = subprotocol
        self.protocol = ClientProtocol(parse_uri(uri), state=State.OPEN)
        self._pending: list[bytes | str] = []
        self._parts: list[bytes] = []
        self._text = False

    @classmethod
    async def connect(
        cls, url: str, subprotocols: Sequence[str]
    ) -> tuple[WsClient | None, int, list[tuple[str, str]], bytes]:
        headers = [
            ("Connection", "Upgrade"),
            ("Upgrade", "websocket"),
            ("Sec-WebSocket-Version", "13"),
            ("Sec-WebSocket-Key", base64.b64encode(os.urandom(16)).decode()),
        ]
        if subprotocols:
            headers.append(("Sec-WebSocket-Protocol", ", ".join(subprotocols)))
        reader, writer, status, resp, body = await http_request(url, "GET", headers)
        if status != 101:
            writer.close()
            return None, status, resp, body
        chosen = (header(resp, "Sec-WebSocket-Protocol") or [""])[0]
        return cls(reader, writer, url.replace("http://", "ws://"), chosen), status, resp, body

    def _flush(self) -> None:
        for chunk in self.protocol.data_to_send():
            if chunk:
                self.writer.write(chunk)

    async def send(self, message: bytes | str) -> None:
        if isinstance(message, str):
            self.protocol.send_text(message.encode())
        else:
            self.protocol.send_binary(message)
        self._flush()
        await self.writer.drain()

    async def recv(self, timeout: float = 10.0) -> bytes | str | None:
        """The next message; None once the server closed."""
        async with asyncio.timeout(timeout):
            while not self._pending:
                if self.protocol.state is State.CLOSED:
                    return None
                data = await self.reader.read(65536)
                if data:
                    self.protocol.receive_data(data)
                else:
                    self.protocol.receive_eof()
                for event in self.protocol.events_received():
                    if isinstance(event, Frame) and event.opcode in (Opcode.TEXT, Opcode.BINARY, Opcode.CONT):
                        if event.opcode is not Opcode.CONT:
                            self._text = event.opcode is Opcode.TEXT
                            self._parts = []
                        self._parts.append(bytes(event.data))
                        if event.fin:
                            joined = b"".join(self._parts)
                            self._pending.append(joined.decode() if self._text else joined)
                self._flush()
                if not data and not self._pending:
                    return None
            return self._pending.pop(0)

    async def messages(self, timeout: float = 10.0) -> list[bytes | str]:
        """Every message until the server closes."""
        out: list[bytes | str] = []
        while (message := await self.recv(timeout)) is not None:
            out.append(message)
        return out

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.protocol.send_close(1000)
            self._flush()
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


async def sessions_drained(server: StreamingServer, timeout: float = 5.0) -> None:
    """Wait until the server counts no open session (it has no event for that)."""
    async with asyncio.timeout(timeout):
        while server.open_sessions:  # noqa: ASYNC110 - polling a counter
            await asyncio.sleep(0.01)


async def echo_server() -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def task_origin(task: asyncio.Task[object]) -> str:
    """The file of a task's top coroutine (to tell the server's tasks apart)."""
    coro = task.get_coro()
    code = getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None)
    return code.co_filename if code is not None else ""


# --------------------------------------------------------------------------- abuse: raw bytes


async def raw_upgrade(
    url: str,
    method: str,
    headers: Sequence[tuple[str, str]],
    rcvbuf: int = 0,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int, list[tuple[str, str]], bytes]:
    """Like ``http_request``, optionally with a small client receive buffer (set before
    connecting, so the kernel advertises a small window and the server's output stays in
    the server)."""
    parts = urllib.parse.urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (parts.hostname or "", parts.port or 80))
    reader, writer = await asyncio.open_connection(sock=sock)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", *(f"{k}: {v}" for k, v in headers)]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split(" ")[1])
    resp_headers = [(k, v.strip()) for k, _, v in (line.partition(":") for line in head[1:] if line)]
    body = b"" if status == 101 else await reader.read()
    return reader, writer, status, resp_headers, body


SPDY_UPGRADE_HEADERS = (
    ("Connection", "Upgrade"),
    ("Upgrade", "SPDY/3.1"),
    ("X-Stream-Protocol-Version", "v4.channel.k8s.io"),
)


def ws_upgrade_headers(subprotocol: str) -> list[tuple[str, str]]:
    return [
        ("Connection", "Upgrade"),
        ("Upgrade", "websocket"),
        ("Sec-WebSocket-Version", "13"),
        ("Sec-WebSocket-Key", base64.b64encode(os.urandom(16)).decode()),
        ("Sec-WebSocket-Protocol", subprotocol),
    ]


def control_frame(
    ftype: int, body: bytes, flags: int = 0, version: int = 3, length: int | None = None
) -> bytes:
    """A SPDY control frame as sent, any field as wrong as asked."""
    size = len(body) if length is None else length
    return struct.pack(">HHI", 0x8000 | version, ftype, (flags << 24) | size) + body


def data_frame_header(stream_id: int, length: int, flags: int = 0) -> bytes:
    return struct.pack(">II", stream_id & 0x7FFFFFFF, (flags << 24) | length)


def ws_frame(
    opcode: int,
    payload: bytes,
    *,
    fin: bool = True,
    masked: bool = True,
    rsv: int = 0,
    length: int | None = None,
) -> bytes:
    """A client WebSocket frame as sent, any field as wrong as asked. The mask key is
    zero, so the payload goes as is."""
    size = len(payload) if length is None else length
    first = (0x80 if fin else 0) | (rsv << 4) | opcode
    mask_bit = 0x80 if masked else 0
    if size < 126:
        head = struct.pack(">BB", first, mask_bit | size)
    elif size < 2**16:
        head = struct.pack(">BBH", first, mask_bit | 126, size)
    else:
        head = struct.pack(">BBQ", first, mask_bit | 127, size)
    return head + (b"\x00\x00\x00\x00" if masked else b"") + payload


def ws_server_frames(data: bytes) -> list[tuple[int, bytes]]:
    """(opcode, payload) of each complete frame a server sent (unmasked), in order."""
    frames: list[tuple[int, bytes]] = []
    pos = 0
    while pos + 2 <= len(data):
        opcode, size = data[pos] & 0x0F, data[pos + 1] & 0x7F
        pos += 2
        if size == 126:
            (size,) = struct.unpack_from(">H", data, pos)
            pos += 2
        elif size == 127:
            (size,) = struct.unpack_from(">Q", data, pos)
            pos += 8
        if pos + size > len(data):
            break
        frames.append((opcode, data[pos : pos + size]))
        pos += size
    return frames


def ws_close_code(data: bytes) -> int | None:
    """The code of the close frame among what a server sent, if any."""
    for opcode, payload in ws_server_frames(data):
        if opcode == Opcode.CLOSE.value and len(payload) >= 2:
            return int(struct.unpack(">H", payload[:2])[0])
    return None


def spdy_server_frames(data: bytes) -> list[spdy.Frame]:
    """The frames of a server's byte stream (a fresh decoder: its header compression
    context starts with the connection)."""
    decoder = spdy.FrameDecoder()
    frames: list[spdy.Frame] = []
    pos = 0
    while pos + 8 <= len(data):
        _, _, _, length = spdy.parse_frame_header(data[pos : pos + 8])
        if pos + 8 + length > len(data):
            break
        frame = decoder.decode(data[pos : pos + 8], data[pos + 8 : pos + 8 + length])
        if frame is not None:
            frames.append(frame)
        pos += 8 + length
    return frames


async def read_to_eof(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """Everything until the server ends the connection; TimeoutError if it does not."""
    out = bytearray()
    async with asyncio.timeout(timeout):
        while True:
            try:
                chunk = await reader.read(65536)
            except ConnectionError:
                break
            if not chunk:
                break
            out += chunk
    return bytes(out)


class LogRecorder:
    """Stands in for a module's structlog logger: records (level, event, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, object]]] = []

    def bind(self, **_: object) -> LogRecorder:
        return self

    def __getattr__(self, level: str) -> Callable[..., None]:
        def record(event: str = "", *args: object, **fields: object) -> None:
            self.events.append((level, event, fields))

        return record

    def failures(self) -> list[tuple[str, str, dict[str, object]]]:
        """Events at error level or carrying a traceback."""
        return [
            e
            for e in self.events
            if e[0] in ("error", "exception", "critical", "fatal") or e[2].get("exc_info")
        ]


def live_tasks(
    under: Sequence[str], exclude: set[asyncio.Task[object]] | None = None
) -> list[asyncio.Task[object]]:
    """Unfinished tasks whose top coroutine lives in one of the ``under`` folders."""
    return [
        t
        for t in asyncio.all_tasks()
        if not t.done()
        and (exclude is None or t not in exclude)
        and any(f"/{folder}/" in task_origin(t) for folder in under)
    ]
