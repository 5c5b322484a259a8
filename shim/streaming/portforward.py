"""Port-forward sessions: SPDY stream pairs, WebSocket channels, SPDY tunnelled in WebSocket."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time

import structlog

from cri_api import api_pb2 as pb
from shim.cri.errors import CriError
from shim.streaming import protocols as proto
from shim.streaming.config import StreamingRuntime
from shim.streaming.session import SpdySession, SpdyStream
from shim.streaming.spdy import RstStatus
from shim.streaming.websocket import ByteQueue, ChannelCodec, WsConnection

log = structlog.get_logger(__name__)

WS_DATA_QUEUE = 16  # WebSocket messages buffered per port before we stop reading
WS_DATA_BYTES = 1024 * 1024  # and bytes


def error_message(req: pb.PortForwardRequest, port: int, exc: BaseException) -> str:
    if isinstance(exc, CriError):
        detail = exc.message
    elif isinstance(exc, OSError):  # e.g. nothing listens on the port
        detail = exc.strerror or str(exc)
    else:
        detail = "internal error"
    return f"error forwarding port {port} to pod {req.pod_sandbox_id}, uid : {detail}"


async def forward(
    runtime: StreamingRuntime,
    req: pb.PortForwardRequest,
    port: int,
    stream: _SpdyPortStream | _WsPortStream,
    stop: list[asyncio.Event],
) -> str | None:
    """Run the runtime's port_forward until it returns or one of ``stop`` is set
    (then it is cancelled). The error message for the client, if any."""
    task = asyncio.ensure_future(runtime.port_forward(req.pod_sandbox_id, port, stream))
    waiters = [asyncio.ensure_future(event.wait()) for event in stop]
    try:
        await asyncio.wait({task, *waiters}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        return None
    exc = task.exception()
    if exc is None:
        return None
    if not isinstance(exc, CriError | OSError):
        log.error("port forward failed", exc_info=exc, sandbox_id=req.pod_sandbox_id, port=port)
    return error_message(req, port, exc)


# --------------------------------------------------------------------------- SPDY


class _SpdyPortStream:
    def __init__(self, stream: SpdyStream) -> None:
        self._stream = stream

    async def read(self) -> bytes:
        return await self._stream.read()

    async def write(self, data: bytes) -> None:
        await self._stream.write(data)


class _Pair:
    def __init__(self, request_id: str, port: int) -> None:
        self.request_id = request_id
        self.port = port
        self.created = time.monotonic()
        self.data: SpdyStream | None = None
        self.error: SpdyStream | None = None


def _request_id(stream: SpdyStream) -> str:
    request_id = stream.headers.get("requestid", "")
    if request_id:
        return request_id
    # Clients before requestID existed open error then data: pair them by stream id.
    return str(stream.id if stream.stream_type == proto.STREAM_ERROR else stream.id - 2)


async def serve_spdy(
    session: SpdySession,
    req: pb.PortForwardRequest,
    runtime: StreamingRuntime,
    creation_timeout: float,
) -> None:
    pairs: dict[str, _Pair] = {}
    tasks: set[asyncio.Task[None]] = set()

    async def run_pair(pair: _Pair) -> None:
        assert pair.data is not None and pair.error is not None
        data, error = pair.data, pair.error
        try:
            message = await forward(
                runtime, req, pair.port, _SpdyPortStream(data), [data.done, error.done, session.closed]
            )
            if message:
                with contextlib.suppress(ConnectionError):
                    await error.write(message.encode())
        finally:
            await data.close()
            await error.close()

    async def expire() -> None:
        # A pair whose partner never came is reset, like the kubelet does.
        while True:
            await asyncio.sleep(min(creation_timeout, 5.0))
            now = time.monotonic()
            for rid, pair in list(pairs.items()):
                if now - pair.created > creation_timeout:
                    del pairs[rid]
                    for stream in (pair.data, pair.error):
                        if stream is not None:
                            stream.reset(RstStatus.CANCEL)

    expirer = asyncio.ensure_future(expire())
    try:
        while (stream := await session.accept()) is not None:
            kind = stream.stream_type
            try:
                port = int(stream.headers.get("port", ""))
            except ValueError:
                port = 0
            if kind not in (proto.STREAM_DATA, proto.STREAM_ERROR) or not 0 < port < 65536:
                stream.reset(RstStatus.PROTOCOL_ERROR)
                continue
            rid = _request_id(stream)
            pair = pairs.setdefault(rid, _Pair(rid, port))
            slot = "data" if kind == proto.STREAM_DATA else "error"
            if getattr(pair, slot) is not None or pair.port != port:
                stream.reset(RstStatus.PROTOCOL_ERROR)
                continue
            setattr(pair, slot, stream)
            await stream.reply()
            if pair.data is not None and pair.error is not None:
                del pairs[rid]
                task = asyncio.ensure_future(run_pair(pair))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
    finally:
        expirer.cancel()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(expirer, *tasks, return_exceptions=True)
        await session.aclose()


# --------------------------------------------------------------------------- WebSocket channels


class _WsPortStream:
    def __init__(self, ws: WsConnection, codec: ChannelCodec, channel: int) -> None:
        self._ws = ws
        self._codec = codec
        self._channel = channel
        self.queue: asyncio.Queue[bytes] = ByteQueue(WS_DATA_QUEUE, WS_DATA_BYTES)
        self.eof = False

    async def read(self) -> bytes:
        if self.eof and self.queue.empty():
            return b""
        return await self.queue.get()

    def end(self) -> None:
        if not self.eof:
            self.eof = True
            if not self.queue.full():
                self.queue.put_nowait(b"")

    async def write(self, data: bytes) -> None:
        if data:
            await self._ws.send(self._codec.encode(self._channel, data))


def ws_ports(req: pb.PortForwardRequest, query: dict[str, list[str]]) -> list[int] | None:
    """The ports of a WebSocket port-forward: the CRI request's, else the URL's ``port``
    parameters. None if absent or invalid."""
    ports = list(req.port)
    if not ports:
        try:
            ports = [int(p) for value in query.get("port", []) for p in value.split(",") if p]
        except ValueError:
            return None
    if not ports or any(not 0 < p < 65536 for p in ports):
        return None
    return ports


async def serve_websocket(
    ws: WsConnection,
    protocol: proto.WsProtocol,
    req: pb.PortForwardRequest,
    ports: list[int],
    runtime: StreamingRuntime,
) -> None:
    codec = ChannelCodec(protocol.base64)
    streams = [_WsPortStream(ws, codec, 2 * i) for i in range(len(ports))]
    client_gone = asyncio.Event()

    async def reader() -> None:
        try:
            async for channel, data in codec.received(ws):
                if channel % 2 == 0 and channel // 2 < len(streams) and data:
                    await ws.put_probing(streams[channel // 2].queue, data)
        finally:
            client_gone.set()
            for stream in streams:
                stream.end()

    async def run_port(index: int) -> None:
        message = await forward(runtime, req, ports[index], streams[index], [client_gone])
        if message:
            with contextlib.suppress(ConnectionError):
                await ws.send(codec.encode(2 * index + 1, message.encode()))

    async with ws.reading(reader()):
        # The first message on every channel is its port, 2 bytes little-endian.
        for index, port in enumerate(ports):
            await ws.send(codec.encode(2 * index, struct.pack("<H", port)))
            await ws.send(codec.encode(2 * index + 1, struct.pack("<H", port)))
        await asyncio.gather(*(run_port(i) for i in range(len(ports))))


# --------------------------------------------------------------------------- SPDY tunnelled in WebSocket


class WsByteTransport:
    """A byte stream over binary WebSocket messages, for the SPDY tunnel."""

    def __init__(self, ws: WsConnection) -> None:
        self.ws = ws
        self._buf = bytearray()
        self._eof = False

    @property
    def last_activity(self) -> float:
        return self.ws.last_activity

    @property
    def closing(self) -> bool:
        return not self.ws.open

    @property
    def buffered(self) -> int:
        return len(self._buf)

    async def fill(self) -> None:
        await self._receive(1)

    async def read_exactly(self, n: int) -> bytes:
        await self._receive(n)
        data = bytes(self._buf[:n])
        del self._buf[:n]
        return data

    async def _receive(self, n: int) -> None:
        while len(self._buf) < n:
            if self._eof:
                raise EOFError
            message = await self.ws.recv()
            if message is None:
                self._eof = True
                raise EOFError
            if isinstance(message, bytes):
                self._buf += message

    def write(self, data: bytes) -> None:
        self.ws.send_nowait(data)

    async def drain(self) -> None:
        await self.ws.drain()

    async def aclose(self) -> None:
        await self.ws.aclose()

    def abort(self) -> None:
        self.ws.abort()
