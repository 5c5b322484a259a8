"""NRI's two small wire protocols, over one plugin connection (a unix stream).

The multiplexer (NRI's pkg/net/multiplex): the stream is a sequence of frames, each
an 8-byte header — logical connection ID and payload length, both big-endian
uint32 — and that many bytes of the logical connection's byte stream. ID 0 is
reserved; on ID 1 the plugin is the ttrpc server (``PLUGIN_CONN``), on ID 2 the
runtime is (``RUNTIME_CONN``). A payload is at most a ttrpc header plus 4 MiB.

ttrpc (containerd/ttrpc, PROTOCOL.md): each logical byte stream is a sequence of
messages, each a 10-byte header — data length (uint32), stream ID (uint32, odd when
the client opened the stream), message type (1 request, 2 response, 3 data) and
flags (one byte each) — and the data: a ``ttrpc.Request`` or ``ttrpc.Response``.
Only unary calls are used by NRI: one request, one response per stream.

``Channel`` is one plugin connection: it calls the plugin's methods (client on
``PLUGIN_CONN``) and hands the plugin's own requests to a handler (server on
``RUNTIME_CONN``). Whatever a plugin sends that breaks these rules ends the
connection with a ``ProtocolError``, never the shim.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Awaitable, Callable

import structlog
from google.protobuf.message import DecodeError, Message

from cri_api import ttrpc_pb2

log = structlog.get_logger("nri")

PLUGIN_CONN = 1
RUNTIME_CONN = 2
MUX_HEADER = struct.Struct(">II")
TTRPC_HEADER = struct.Struct(">IIBB")
MAX_MESSAGE = 4 << 20  # ttrpc's limit on a message's data
MAX_MUX_PAYLOAD = TTRPC_HEADER.size + MAX_MESSAGE
# What may wait unsent for a plugin that does not read before its connection is ended.
MAX_UNSENT = 4 * MAX_MESSAGE
TYPE_REQUEST, TYPE_RESPONSE, TYPE_DATA = 1, 2, 3

# gRPC status codes a ttrpc Response carries.
CODE_OK, CODE_UNKNOWN, CODE_INVALID_ARGUMENT, CODE_DEADLINE_EXCEEDED, CODE_UNIMPLEMENTED = 0, 2, 3, 4, 12

Handler = Callable[[str, str, bytes], Awaitable[bytes]]


class ProtocolError(Exception):
    """The peer broke the multiplexer's or ttrpc's framing."""


class CallError(Exception):
    """The plugin answered a call with an error status."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class ClosedError(Exception):
    """The connection ended before the answer came."""


class _Stream:
    """One logical connection's inbound bytes, cut into ttrpc messages."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, int, bytes]]:
        self.buf += data
        out = []
        while len(self.buf) >= TTRPC_HEADER.size:
            length, stream_id, kind, flags = TTRPC_HEADER.unpack_from(self.buf)
            if length > MAX_MESSAGE:
                raise ProtocolError(f"ttrpc message of {length} bytes (at most {MAX_MESSAGE})")
            end = TTRPC_HEADER.size + length
            if len(self.buf) < end:
                break
            out.append((stream_id, kind, flags, bytes(self.buf[TTRPC_HEADER.size : end])))
            del self.buf[:end]
        return out


class Channel:
    """One plugin connection: NRI's multiplexer carrying ttrpc both ways."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        handler: Handler,
        *,
        calls_on: int = PLUGIN_CONN,
        serves_on: int = RUNTIME_CONN,
    ) -> None:
        """The runtime's end by default; a plugin's end (tests) with the two swapped."""
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self._calls_on, self._serves_on = calls_on, serves_on
        self._streams = {calls_on: _Stream(), serves_on: _Stream()}
        self._pending: dict[int, asyncio.Future[bytes]] = {}
        self._next_id = 1
        self._served: set[asyncio.Task[None]] = set()
        self.closed = asyncio.Event()
        self.error = ""

    # ------------------------------------------------------------------ reading
    async def run(self) -> None:
        """Read until the peer goes or breaks the protocol; then fail every pending call."""
        try:
            while True:
                header = await self._reader.readexactly(MUX_HEADER.size)
                conn, length = MUX_HEADER.unpack(header)
                if conn not in self._streams:
                    raise ProtocolError(f"multiplexer frame for connection {conn} (only 1 and 2 are used)")
                if length > MAX_MUX_PAYLOAD:
                    raise ProtocolError(f"multiplexer frame of {length} bytes (at most {MAX_MUX_PAYLOAD})")
                payload = await self._reader.readexactly(length)
                for stream_id, kind, _flags, data in self._streams[conn].feed(payload):
                    if conn == self._calls_on:
                        self._on_response(stream_id, kind, data)
                    else:
                        self._on_request(stream_id, kind, data)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.error = self.error or "connection closed"
        except ProtocolError as exc:
            self.error = str(exc)
        finally:
            self.close()

    def _on_response(self, stream_id: int, kind: int, data: bytes) -> None:
        if kind != TYPE_RESPONSE:
            raise ProtocolError(f"ttrpc message type {kind} from the peer's server (only responses expected)")
        future = self._pending.pop(stream_id, None)
        if future is not None and not future.done():  # else: an answer too late, to a call given up
            future.set_result(data)

    def _on_request(self, stream_id: int, kind: int, data: bytes) -> None:
        if kind != TYPE_REQUEST or stream_id % 2 == 0:
            raise ProtocolError(f"ttrpc message type {kind} on stream {stream_id} to our server")
        try:
            req = ttrpc_pb2.Request.FromString(data)
        except DecodeError:
            raise ProtocolError("a ttrpc request that does not decode") from None
        task = asyncio.ensure_future(self._serve(stream_id, req))
        self._served.add(task)
        task.add_done_callback(self._served.discard)

    async def _serve(self, stream_id: int, req: ttrpc_pb2.Request) -> None:
        resp = ttrpc_pb2.Response()
        try:
            resp.payload = await self._handler(req.service, req.method, req.payload)
        except CallError as exc:
            resp.status.code, resp.status.message = exc.code, str(exc)
        except DecodeError:
            resp.status.code = CODE_INVALID_ARGUMENT
            resp.status.message = f"{req.service}/{req.method}: the request does not decode"
        with contextlib.suppress(ClosedError, CallError):
            self._send(self._serves_on, stream_id, TYPE_RESPONSE, resp.SerializeToString())

    # ------------------------------------------------------------------ calling
    async def call(self, service: str, method: str, request: Message, timeout: float) -> bytes:
        """Call one of the plugin's methods; its response payload. Raises CallError for an
        error status, ClosedError if the connection ends, TimeoutError past ``timeout``."""
        if self.closed.is_set():
            raise ClosedError(self.error or "connection closed")
        stream_id = self._next_id
        self._next_id += 2
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[stream_id] = future
        req = ttrpc_pb2.Request(
            service=service,
            method=method,
            payload=request.SerializeToString(),
            timeout_nano=int(timeout * 1e9),
        )
        try:
            self._send(self._calls_on, stream_id, TYPE_REQUEST, req.SerializeToString())
            async with asyncio.timeout(timeout):
                data = await future
        finally:
            self._pending.pop(stream_id, None)
        try:
            resp = ttrpc_pb2.Response.FromString(data)
        except DecodeError:
            self._fail("a ttrpc response that does not decode")
            raise ClosedError(self.error) from None
        if resp.status.code != CODE_OK:
            raise CallError(resp.status.code, resp.status.message or f"status {resp.status.code}")
        return resp.payload

    # ------------------------------------------------------------------ writing
    def _send(self, conn: int, stream_id: int, kind: int, data: bytes) -> None:
        if len(data) > MAX_MESSAGE:
            raise CallError(
                CODE_INVALID_ARGUMENT, f"a ttrpc message of {len(data)} bytes (at most {MAX_MESSAGE})"
            )
        if self.closed.is_set():
            raise ClosedError(self.error or "connection closed")
        if self._writer.transport.get_write_buffer_size() > MAX_UNSENT:
            self._fail(f"the plugin left more than {MAX_UNSENT} bytes unread")
            raise ClosedError(self.error)
        message = TTRPC_HEADER.pack(len(data), stream_id, kind, 0) + data
        self._writer.write(MUX_HEADER.pack(conn, len(message)) + message)

    def _fail(self, why: str) -> None:
        self.error = why
        self.close()

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ClosedError(self.error or "connection closed"))
        self._pending.clear()
        for task in self._served:
            task.cancel()
        with contextlib.suppress(Exception):
            self._writer.close()
