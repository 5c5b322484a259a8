"""The guest agent wire protocol: framing plus an asyncio multiplexer.

See PROTOCOL.md next to this file for the byte layout. Both the host side
(the backend) and the guest side (the agent) use :class:`Channel`; only the
host allocates stream IDs, so the two sides never collide.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import itertools
import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

VERSION = 1
# A stamped output frame (`output` with `stamped`): the agent's time of the piece (ns), then its data.
STAMP = struct.Struct(">Q")
PREFIX = struct.Struct(">I")  # length of everything after the prefix
HEAD = struct.Struct(">BBBxII")  # version, kind, channel, reserved, id, header length
MAX_FRAME = 16 * 1024 * 1024
MAX_CHUNK = 64 * 1024  # payload bytes per DATA frame, so one stream cannot starve the others


class Kind(enum.IntEnum):
    REQUEST = 1
    RESPONSE = 2
    DATA = 3
    CLOSE = 4  # half-close of one channel of a stream
    EVENT = 5


class Ch(enum.IntEnum):
    STDIN = 0  # also: host -> guest bytes of a port-forward connection
    STDOUT = 1  # also: guest -> host bytes of a port-forward connection
    STDERR = 2


class ProtocolError(Exception):
    """The peer sent bytes that are not a valid frame."""


class ConnectionLost(Exception):
    """The channel closed while a request was outstanding."""


class AgentError(Exception):
    """The agent answered a request with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclasses.dataclass(frozen=True, slots=True)
class Frame:
    kind: Kind
    id: int
    header: dict[str, Any] = dataclasses.field(default_factory=dict)
    payload: bytes = b""
    channel: int = 0


def encode(frame: Frame) -> bytes:
    header = json.dumps(frame.header, separators=(",", ":")).encode() if frame.header else b""
    body_len = HEAD.size + len(header) + len(frame.payload)
    if body_len > MAX_FRAME:
        raise ProtocolError(f"frame of {body_len} bytes exceeds {MAX_FRAME}")
    return b"".join(
        (
            PREFIX.pack(body_len),
            HEAD.pack(VERSION, int(frame.kind), frame.channel, frame.id, len(header)),
            header,
            frame.payload,
        )
    )


class Decoder:
    """Incremental decoder: feed bytes, get complete frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self._buf += data
        frames: list[Frame] = []
        while len(self._buf) >= PREFIX.size:
            (body_len,) = PREFIX.unpack_from(self._buf)
            if body_len < HEAD.size or body_len > MAX_FRAME:
                raise ProtocolError(f"bad frame length {body_len}")
            if len(self._buf) < PREFIX.size + body_len:
                break
            version, kind, channel, ident, header_len = HEAD.unpack_from(self._buf, PREFIX.size)
            if version != VERSION:
                raise ProtocolError(f"unsupported protocol version {version}")
            try:
                kind_e = Kind(kind)
            except ValueError:
                raise ProtocolError(f"unknown frame kind {kind}") from None
            start = PREFIX.size + HEAD.size
            if header_len > body_len - HEAD.size:
                raise ProtocolError("header longer than frame")
            raw_header = bytes(self._buf[start : start + header_len])
            payload = bytes(self._buf[start + header_len : PREFIX.size + body_len])
            del self._buf[: PREFIX.size + body_len]
            header: dict[str, Any] = {}
            if raw_header:
                try:
                    decoded = json.loads(raw_header)
                except ValueError as exc:
                    raise ProtocolError(f"bad header JSON: {exc}") from None
                if not isinstance(decoded, dict):
                    raise ProtocolError("header is not a JSON object")
                header = decoded
            frames.append(Frame(kind_e, ident, header, payload, channel))
        return frames

    @property
    def pending(self) -> int:
        return len(self._buf)


# --------------------------------------------------------------------------- multiplexer

Handler = Callable[[str, dict[str, Any], bytes], Awaitable[dict[str, Any]]]
EventHandler = Callable[[str, dict[str, Any]], None]


class Stream:
    """One multiplexed stream: incoming (channel, bytes) items, b"" = that channel closed."""

    def __init__(self, channel: Channel, sid: int) -> None:
        self.channel = channel
        self.id = sid
        self._queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
        self.ended = False

    def _push(self, ch: int, data: bytes) -> None:
        self._queue.put_nowait((ch, data))

    async def read(self) -> tuple[int, bytes]:
        """Next (channel, data); data == b"" means that channel was closed by the peer."""
        return await self._queue.get()

    async def received(self) -> AsyncIterator[tuple[int, bytes]]:
        """Each (channel, data) with data, until the peer closes STDOUT (the end of the output)."""
        while True:
            ch, data = await self.read()
            if data:
                yield ch, data
            elif ch == Ch.STDOUT:
                return

    async def write(self, ch: int, data: bytes) -> None:
        await self.channel.send_data(self.id, ch, data)

    async def close(self, ch: int) -> None:
        await self.channel.send_close(self.id, ch)

    def forget(self) -> None:
        self.channel.streams.pop(self.id, None)


class Channel:
    """Request/response, events and streams over one byte stream."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: Handler | None = None,
        on_event: EventHandler | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self._on_event = on_event
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.streams: dict[int, Stream] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._write_lock = asyncio.Lock()
        self.closed = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._runner = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
        for task in list(self._tasks):
            task.cancel()
        self._shutdown()

    # ---- sending
    async def _send(self, frame: Frame) -> None:
        if self.closed.is_set():
            raise ConnectionLost("channel closed")
        data = encode(frame)
        async with self._write_lock:
            try:
                self._writer.write(data)
                await self._writer.drain()
            except (ConnectionError, RuntimeError) as exc:
                self._shutdown()
                raise ConnectionLost(str(exc)) from exc

    async def request(
        self, op: str, args: dict[str, Any] | None = None, payload: bytes = b"", timeout: float | None = None
    ) -> dict[str, Any]:
        rid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            await self._send(Frame(Kind.REQUEST, rid, {"op": op, "args": args or {}}, payload))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(rid, None)

    def new_stream(self) -> Stream:
        """Allocate a stream ID (host side only)."""
        return self.stream(next(self._ids))

    def stream(self, sid: int) -> Stream:
        st = self.streams.get(sid)
        if st is None:
            st = self.streams[sid] = Stream(self, sid)
        return st

    async def send_data(self, sid: int, ch: int, data: bytes) -> None:
        for off in range(0, len(data), MAX_CHUNK):
            await self._send(Frame(Kind.DATA, sid, payload=data[off : off + MAX_CHUNK], channel=ch))

    async def send_close(self, sid: int, ch: int) -> None:
        await self._send(Frame(Kind.CLOSE, sid, channel=ch))

    async def send_event(self, name: str, body: dict[str, Any]) -> None:
        await self._send(Frame(Kind.EVENT, 0, {"event": name, "body": body}))

    # ---- receiving
    async def _run(self) -> None:
        decoder = Decoder()
        try:
            while True:
                data = await self._reader.read(256 * 1024)
                if not data:
                    break
                for frame in decoder.feed(data):
                    self._dispatch(frame)
        except (ConnectionError, ProtocolError):
            pass
        finally:
            self._shutdown()

    def _dispatch(self, frame: Frame) -> None:
        if frame.kind is Kind.REQUEST:
            task = asyncio.get_running_loop().create_task(self._serve(frame))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif frame.kind is Kind.RESPONSE:
            fut = self._pending.get(frame.id)
            if fut is not None and not fut.done():
                if frame.header.get("ok"):
                    fut.set_result(dict(frame.header.get("result") or {}))
                else:
                    err = frame.header.get("error") or {}
                    fut.set_exception(
                        AgentError(str(err.get("code", "internal")), str(err.get("message", "")))
                    )
        elif frame.kind is Kind.DATA:
            self.stream(frame.id)._push(frame.channel, frame.payload)
        elif frame.kind is Kind.CLOSE:
            self.stream(frame.id)._push(frame.channel, b"")
        elif frame.kind is Kind.EVENT and self._on_event is not None:
            self._on_event(str(frame.header.get("event", "")), dict(frame.header.get("body") or {}))

    async def _serve(self, frame: Frame) -> None:
        op = str(frame.header.get("op", ""))
        args = frame.header.get("args") or {}
        header: dict[str, Any]
        try:
            if self._handler is None:
                raise AgentError("unimplemented", "this side serves no requests")
            result = await self._handler(op, dict(args), frame.payload)
            header = {"ok": True, "result": result}
        except AgentError as exc:
            header = {"ok": False, "error": {"code": exc.code, "message": exc.message}}
        except Exception as exc:  # the peer must always get an answer
            header = {"ok": False, "error": {"code": "internal", "message": f"{type(exc).__name__}: {exc}"}}
        with contextlib.suppress(ConnectionLost):
            await self._send(Frame(Kind.RESPONSE, frame.id, header))

    def _shutdown(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionLost("agent channel closed"))
        for st in self.streams.values():
            # Wake every reader: each channel reads as closed.
            for ch in Ch:
                st._push(int(ch), b"")
