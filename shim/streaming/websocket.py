"""WebSocket connections on the shared listener, through websockets' sans-I/O protocol.

The HTTP request is already parsed by our server (one listener serves SPDY
and WebSocket), so the handshake is driven by hand: build the library's
Request, let ServerProtocol accept it, then pump bytes both ways. The
library does the framing, masking, ping/pong and the closing handshake.

Against abusive clients: the library refuses bad frames (opcode, masking, close
code, size: a close frame with 1002/1007/1009 and the end of the connection);
what it answers by itself (pongs, the close) is drained like our output, so a
client that pings and never reads stops being read; a frame begun must be
complete within ``FRAME_TIMEOUT``; text that is not UTF-8 is closed with 1007;
bytes are handed to the parser a slice at a time, paced like SPDY's frames
(transport.Pacer: the loop is given back every FAIR_SLICE, tiny frames and
pings are read at most at their rates).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from websockets.exceptions import InvalidState
from websockets.frames import CloseCode, Frame, Opcode
from websockets.http11 import Request, Response
from websockets.protocol import State
from websockets.server import ServerProtocol

from shim.streaming.httpio import HttpRequest
from shim.streaming.httpio import response as http_response
from shim.streaming.transport import TINY_FRAME, Pacer, close_writer

Message = bytes | str
PROBE_INTERVAL = 2.0  # seconds between liveness probes while the reader is stalled
READ_SIZE = 64 * 1024
# Bytes handed to the frame parser at a time: a slice of the smallest frames takes the
# library about 2 ms; big frames go through at several hundred MB/s all the same.
PARSE_SLICE = 1024
FRAME_TIMEOUT = 30.0  # seconds for the rest of a frame once its first byte came


class ByteQueue(asyncio.Queue[bytes]):
    """A queue of byte strings bounded by their total size as well as their count
    (one item larger than the bound still goes in, alone)."""

    def __init__(self, maxsize: int, max_bytes: int) -> None:
        super().__init__(maxsize)
        self.max_bytes = max_bytes
        self.nbytes = 0

    def full(self) -> bool:
        return super().full() or self.nbytes >= self.max_bytes

    def _put(self, item: bytes) -> None:
        self.nbytes += len(item)
        super()._put(item)

    def _get(self) -> bytes:
        item = super()._get()
        self.nbytes -= len(item)
        return item


class WsConnection:
    """An accepted WebSocket: whole messages in, whole messages out."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        protocol: ServerProtocol,
        subprotocol: str,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.protocol = protocol
        self.subprotocol = subprotocol
        self.last_activity = time.monotonic()
        self._parts: list[bytes] = []
        self._text = False
        self._pending: list[Message] = []
        self._pacer = Pacer()

    def _flush(self) -> None:
        chunks = self.protocol.data_to_send()
        if not chunks or self.writer.is_closing():
            return
        # One write for all (a burst of pings makes as many pongs: one system call each, else).
        data = b"".join(chunks)
        if data:
            self.writer.write(data)
        if not chunks[-1] and self.writer.can_write_eof():  # b"": the library ends the stream
            with contextlib.suppress(OSError):
                self.writer.write_eof()

    async def recv(self) -> Message | None:
        """The next message, or None once the connection is closed or broken."""
        while not self._pending:
            if self.protocol.state is not State.OPEN:
                return None
            try:
                data = await self._read()
            except TimeoutError:
                self.protocol.fail(CloseCode.PROTOCOL_ERROR, f"frame incomplete after {FRAME_TIMEOUT:g}s")
                self._flush()
                return None
            if data:
                self.last_activity = time.monotonic()
                self._pacer.resume()
                for start in range(0, len(data), PARSE_SLICE):
                    if self.writer.is_closing():
                        # The connection broke while we worked through its backlog:
                        # what is left of it is moot.
                        data = b""
                        break
                    self.protocol.receive_data(data[start : start + PARSE_SLICE])
                    tiny, junk = self._take_events()
                    self._flush()
                    if self.protocol.state is not State.OPEN:
                        break  # failed or closing: the rest is not parsed
                    await self._pacer.checkpoint(tiny, junk)
            if not data:
                self.protocol.receive_eof()
                self._take_events()
            self._flush()
            # What the library answered by itself (pongs, the close) waits, like any
            # output, for a client that reads: one that never does stops being read.
            with contextlib.suppress(OSError):
                await self.writer.drain()
            if not self._pending and (not data or self.protocol.state is not State.OPEN):
                # EOF, or a closing handshake / protocol error: no more messages.
                return None
        return self._pending.pop(0)

    async def _read(self) -> bytes:
        """The next bytes, b"" at EOF or on a broken connection. With part of a frame
        already in, the rest must come within FRAME_TIMEOUT (else TimeoutError)."""
        if not self.protocol.reader.buffer:
            return await self._read_some()
        async with asyncio.timeout(FRAME_TIMEOUT):  # its TimeoutError is no OSError of ours
            return await self._read_some()

    async def _read_some(self) -> bytes:
        try:
            return await self.reader.read(READ_SIZE)
        except OSError:
            return b""

    def _take_events(self) -> tuple[int, int]:
        """Collect the frames parsed; how many were tiny, and how many were control
        frames (pings, pongs: junk), for the pacer."""
        tiny = junk = 0
        for event in self.protocol.events_received():
            if isinstance(event, Frame):
                tiny += len(event.data) < TINY_FRAME
                junk += event.opcode in (Opcode.PING, Opcode.PONG)
                try:
                    self._collect(event)
                except UnicodeDecodeError as exc:
                    # RFC 6455, 8.1: text that is not UTF-8 fails the connection.
                    self.protocol.fail(
                        CloseCode.INVALID_DATA, f"invalid UTF-8 in a text message: {exc.reason}"
                    )
                    break
        return tiny, junk

    def _collect(self, frame: Frame) -> None:
        if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
            self._text = frame.opcode is Opcode.TEXT
            self._parts = [bytes(frame.data)]
        elif frame.opcode is Opcode.CONT:
            self._parts.append(bytes(frame.data))
        else:
            return  # ping/pong/close are answered by the protocol itself
        if frame.fin:
            data = b"".join(self._parts)
            self._parts = []
            self._pending.append(data.decode("utf-8") if self._text else data)

    @property
    def open(self) -> bool:
        return self.protocol.state is State.OPEN and not self.writer.is_closing()

    def send_nowait(self, message: Message) -> None:
        """Buffer one message; raises ConnectionResetError once the connection is not open."""
        if not self.open:
            raise ConnectionResetError("websocket closed")
        try:
            if isinstance(message, str):
                self.protocol.send_text(message.encode())
            else:
                self.protocol.send_binary(message)
        except InvalidState as exc:
            raise ConnectionResetError("websocket closed") from exc
        self._flush()
        self.last_activity = time.monotonic()

    def probe(self) -> None:
        """Send a ping so a vanished client shows up as a failed write; raises
        ConnectionResetError once the connection is known to be gone."""
        if not self.open:
            raise ConnectionResetError("client went away")
        with contextlib.suppress(InvalidState):
            self.protocol.send_ping(b"")
        self._flush()

    async def put_probing(self, queue: asyncio.Queue[bytes], item: bytes) -> None:
        """``queue.put``, probing the client while the queue stays full: the reader
        is stalled then, and a client that hung up would go unnoticed."""
        while True:
            try:
                async with asyncio.timeout(PROBE_INTERVAL):
                    await queue.put(item)
                return
            except TimeoutError:
                self.probe()

    async def drain(self) -> None:
        try:
            await self.writer.drain()
        except OSError as exc:
            raise ConnectionResetError(str(exc)) from exc

    async def send(self, message: Message) -> None:
        """Send one message, waiting while the client reads slowly."""
        self.send_nowait(message)
        await self.drain()

    async def aclose(self, code: int = CloseCode.NORMAL_CLOSURE, reason: str = "") -> None:
        """Start the closing handshake, wait briefly for the client's close, end the TCP connection."""
        if self.protocol.state is State.OPEN and not self.writer.is_closing():
            with contextlib.suppress(InvalidState):
                self.protocol.send_close(code, reason)
            self._flush()
            with contextlib.suppress(TimeoutError, OSError):
                async with asyncio.timeout(2.0):
                    await self.writer.drain()
                    while await self.recv() is not None:
                        pass  # discard what the client still had in flight
        await close_writer(self.writer, reader=self.reader)

    def abort(self) -> None:
        self.writer.transport.abort()

    @contextlib.asynccontextmanager
    async def reading(self, reader: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
        """A channel session: ``reader`` takes the client's messages while the body answers;
        then it is stopped and the connection closed. A client gone (ConnectionError) ends
        the body quietly."""
        read_task = asyncio.ensure_future(reader)
        try:
            yield
        except ConnectionError:
            pass
        finally:
            read_task.cancel()
            await asyncio.gather(read_task, return_exceptions=True)
            await self.aclose()


async def accept(
    request: HttpRequest,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    subprotocol: str | None,
    max_size: int = 1024 * 1024,
) -> WsConnection | None:
    """Complete the handshake with ``subprotocol`` chosen already; None if it failed
    (the error response has then been sent)."""
    protocol = ServerProtocol(max_size=max_size)
    # The library's parser starts with the HTTP request: replay the head we
    # parsed, minus the subprotocol offer, which we negotiated already (and
    # which the library would reject: "SPDY/3.1+portforward.k8s.io" is not an
    # RFC 7230 token, yet it is what client-go sends).
    lines = [f"{request.method} {request.target} {request.version}"]
    lines += [f"{k}: {v}" for k, v in request.headers if k.lower() != "sec-websocket-protocol"]
    protocol.receive_data(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    events = protocol.events_received()
    if not events or not isinstance(events[0], Request):
        writer.write(http_response(400, body=b"malformed websocket handshake\n"))
        await writer.drain()
        return None
    response: Response = protocol.accept(events[0])
    if response.status_code == 101 and subprotocol:
        response.headers["Sec-WebSocket-Protocol"] = subprotocol
    protocol.send_response(response)
    for chunk in protocol.data_to_send():
        writer.write(chunk)
    await writer.drain()
    if response.status_code != 101:
        return None
    return WsConnection(reader, writer, protocol, subprotocol or "")


# --------------------------------------------------------------------------- channel framing


class ChannelCodec:
    """Kubernetes channel framing: one byte of channel, then the payload.

    The ``base64.`` protocols send text messages with the channel as an ASCII
    digit and the payload base64-encoded.
    """

    def __init__(self, base64_mode: bool) -> None:
        self.base64 = base64_mode

    def encode(self, channel: int, data: bytes) -> Message:
        if self.base64:
            return chr(ord("0") + channel) + base64.b64encode(data).decode()
        return bytes((channel,)) + data

    async def received(self, ws: WsConnection) -> AsyncIterator[tuple[int, bytes]]:
        """(channel, payload) of each message ``ws`` receives until it closes; empty or
        undecodable messages are passed over."""
        while (message := await ws.recv()) is not None:
            decoded = self.decode(message)
            if decoded is not None:
                yield decoded

    def decode(self, message: Message) -> tuple[int, bytes] | None:
        """(channel, payload), or None for an empty or undecodable message."""
        if isinstance(message, str):
            if not message:
                return None
            channel = ord(message[0]) - ord("0")
            try:
                return channel, base64.b64decode(message[1:], validate=True)
            except ValueError:
                return None
        if not message:
            return None
        return message[0], message[1:]
