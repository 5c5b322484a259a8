"""Exec and attach sessions over SPDY and WebSocket.

Either way the runtime's coroutine runs as a task that is cancelled as
soon as the client goes away, so the backend can kill what it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from collections.abc import AsyncIterator, Awaitable, Callable

import structlog

from backends.contract import StreamIO, TerminalSize
from cri_api import api_pb2 as pb
from shim.cri.errors import CriError
from shim.streaming import protocols as proto
from shim.streaming.config import StreamingRuntime
from shim.streaming.session import SpdySession, SpdyStream
from shim.streaming.spdy import RstStatus
from shim.streaming.websocket import ByteQueue, ChannelCodec, WsConnection

log = structlog.get_logger(__name__)

ExecOrAttach = pb.ExecRequest | pb.AttachRequest

RESIZE_QUEUE = 8  # only the latest sizes matter: older ones are dropped
STDIN_QUEUE = 16  # WebSocket stdin messages buffered before we stop reading
STDIN_BYTES = 1024 * 1024  # and bytes (a message may be up to 1 MiB)


class SessionIO:
    """The StreamIO handed to the runtime; transports fill in the I/O callables."""

    def __init__(
        self,
        req: ExecOrAttach,
        read_stdin: Callable[[], Awaitable[bytes]],
        write_stdout: Callable[[bytes], Awaitable[None]],
        write_stderr: Callable[[bytes], Awaitable[None]],
    ) -> None:
        self.tty = req.tty
        self.stdin = req.stdin
        self.stdout = req.stdout
        self.stderr = req.stderr and not req.tty
        self._read_stdin = read_stdin
        self._write_stdout = write_stdout
        self._write_stderr = write_stderr
        self._resizes: asyncio.Queue[TerminalSize | None] = asyncio.Queue(RESIZE_QUEUE)
        self.client_lost = False  # a write failed: the client's connection is gone

    async def read_stdin(self) -> bytes:
        if not self.stdin:
            return b""
        return await self._read_stdin()

    async def write_stdout(self, data: bytes) -> None:
        if self.stdout and data:
            await self._write(self._write_stdout, data)

    async def write_stderr(self, data: bytes) -> None:
        if not data:
            return
        if self.tty:  # one terminal: stderr shares stdout
            await self.write_stdout(data)
        elif self.stderr:
            await self._write(self._write_stderr, data)

    async def _write(self, write: Callable[[bytes], Awaitable[None]], data: bytes) -> None:
        try:
            await write(data)
        except ConnectionError:
            self.client_lost = True
            raise

    def push_resize(self, size: TerminalSize | None) -> None:
        if self._resizes.full():
            self._resizes.get_nowait()
        self._resizes.put_nowait(size)

    async def resizes(self) -> AsyncIterator[TerminalSize]:
        while (size := await self._resizes.get()) is not None:
            yield size


def _check(io: SessionIO) -> StreamIO:
    return io  # SessionIO satisfies the backend's StreamIO protocol (checked by mypy)


def describe(req: ExecOrAttach) -> str:
    if isinstance(req, pb.ExecRequest):
        return shlex.join(req.cmd)
    return ""


async def run_runtime(
    runtime: StreamingRuntime, req: ExecOrAttach, io: SessionIO, client_gone: asyncio.Event
) -> tuple[int, str | None] | None:
    """(exit code, error message) of the runtime call; None if the client went away first
    (the call is then cancelled)."""

    async def call() -> int:
        if isinstance(req, pb.ExecRequest):
            return await runtime.exec(req.container_id, list(req.cmd), _check(io))
        await runtime.attach(req.container_id, _check(io))
        return 0

    task = asyncio.ensure_future(call())
    gone = asyncio.ensure_future(client_gone.wait())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    io.push_resize(None)
    if task.cancelled():
        return None
    exc = task.exception()
    if exc is None:
        return task.result(), None
    if isinstance(exc, CriError):
        return 0, exc.message
    if io.client_lost and isinstance(exc, ConnectionError):
        # The client hung up while the process wrote to it: an end, not a failure.
        log.info("streaming client gone", container_id=req.container_id, error=str(exc))
        return None
    log.error("streaming runtime call failed", exc_info=exc, container_id=req.container_id)
    return 0, "internal error"


# --------------------------------------------------------------------------- SPDY


async def serve_spdy(
    session: SpdySession,
    protocol: str,
    req: ExecOrAttach,
    runtime: StreamingRuntime,
    creation_timeout: float,
) -> None:
    expected = {proto.STREAM_ERROR}
    if req.stdin:
        expected.add(proto.STREAM_STDIN)
    if req.stdout:
        expected.add(proto.STREAM_STDOUT)
    if req.stderr and not req.tty:
        expected.add(proto.STREAM_STDERR)
    if req.tty and proto.spdy_has_resize(protocol):
        expected.add(proto.STREAM_RESIZE)
    known = {proto.STREAM_ERROR, proto.STREAM_STDIN, proto.STREAM_STDOUT, proto.STREAM_STDERR}
    if proto.spdy_has_resize(protocol):
        known.add(proto.STREAM_RESIZE)

    streams: dict[str, SpdyStream] = {}

    async def take(stream: SpdyStream) -> None:
        kind = stream.stream_type
        if kind not in known or kind in streams:
            stream.reset(RstStatus.PROTOCOL_ERROR)
            return
        await stream.reply()
        streams[kind] = stream

    try:
        async with asyncio.timeout(creation_timeout):
            while not expected <= streams.keys():
                stream = await session.accept()
                if stream is None:
                    return  # the client left before opening its streams
                await take(stream)
    except TimeoutError:
        if proto.STREAM_ERROR in streams:
            with contextlib.suppress(ConnectionError):
                await streams[proto.STREAM_ERROR].write(b"timed out waiting for client to create streams")
        await session.aclose()
        return

    async def refuse_more() -> None:
        while (stream := await session.accept()) is not None:
            stream.reset(RstStatus.PROTOCOL_ERROR)

    async def nothing() -> bytes:
        return b""

    async def discard(_: bytes) -> None:
        return None

    stdin, stdout, stderr = (
        streams.get(k) for k in (proto.STREAM_STDIN, proto.STREAM_STDOUT, proto.STREAM_STDERR)
    )
    # Input nobody will read must not fill its buffer: a full buffer stops the
    # session's reader, and with it the detection of a client that hangs up.
    for kind, stream in streams.items():
        if kind not in expected or kind in (proto.STREAM_ERROR, proto.STREAM_STDOUT, proto.STREAM_STDERR):
            stream.discard()
    io = SessionIO(
        req,
        stdin.read if stdin else nothing,
        stdout.write if stdout else discard,
        stderr.write if stderr else discard,
    )
    helpers = [asyncio.ensure_future(refuse_more())]
    if (resize := streams.get(proto.STREAM_RESIZE)) is not None:
        helpers.append(asyncio.ensure_future(_pump_resizes(resize.read, io)))
    try:
        outcome = await run_runtime(runtime, req, io, session.closed)
        if outcome is None:
            return
        code, error = outcome
        if stdin is not None:
            stdin.discard()  # the process is gone: drop input still arriving
        for out in (stdout, stderr):
            if out is not None:
                await out.close()
        err_stream = streams[proto.STREAM_ERROR]
        status = proto.status_json if proto.spdy_status(protocol) else proto.status_text
        payload = status(code, error, describe(req))
        with contextlib.suppress(ConnectionError):
            if payload:
                await err_stream.write(payload)
            await err_stream.close()
        # Let the client read everything and hang up first (closing with unread
        # input would make our kernel reset the connection under its feet).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await session.closed.wait()
    finally:
        for helper in helpers:
            helper.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        await session.aclose()


async def _pump_resizes(read: Callable[[], Awaitable[bytes]], io: SessionIO) -> None:
    decoder = proto.ResizeDecoder()
    while data := await read():
        for size in decoder.feed(data):
            io.push_resize(size)


# --------------------------------------------------------------------------- WebSocket


async def serve_websocket(
    ws: WsConnection,
    protocol: proto.WsProtocol,
    req: ExecOrAttach,
    runtime: StreamingRuntime,
) -> None:
    codec = ChannelCodec(protocol.base64)
    stdin_queue: asyncio.Queue[bytes] = ByteQueue(STDIN_QUEUE, STDIN_BYTES)
    client_gone = asyncio.Event()
    stdin_done = False

    async def read_stdin() -> bytes:
        if stdin_done and stdin_queue.empty():
            return b""
        return await stdin_queue.get()

    def writer(channel: int) -> Callable[[bytes], Awaitable[None]]:
        async def write(data: bytes) -> None:
            await ws.send(codec.encode(channel, data))

        return write

    io = SessionIO(req, read_stdin, writer(proto.CH_STDOUT), writer(proto.CH_STDERR))
    resize = proto.ResizeDecoder()

    async def reader() -> None:
        nonlocal stdin_done
        try:
            async for channel, data in codec.received(ws):
                if channel == proto.CH_STDIN and req.stdin and not stdin_done:
                    if data:
                        await ws.put_probing(stdin_queue, data)
                elif channel == proto.CH_RESIZE and req.tty:
                    for size in resize.feed(data):
                        io.push_resize(size)
                elif (
                    channel == proto.CH_CLOSE
                    and protocol.close_signal
                    and data[:1] == bytes((proto.CH_STDIN,))
                ):
                    _end_stdin()
        except ConnectionError:
            pass
        except Exception:
            log.exception("websocket reader failed")
        finally:
            client_gone.set()
            _end_stdin()

    def _end_stdin() -> None:
        nonlocal stdin_done
        if not stdin_done:
            stdin_done = True
            if not stdin_queue.full():  # else read_stdin sees stdin_done once it drained
                stdin_queue.put_nowait(b"")

    # An empty message on the lowest writable channel tells the client the streams are up.
    first = (
        proto.CH_STDOUT if req.stdout else proto.CH_STDERR if (req.stderr and not req.tty) else proto.CH_ERROR
    )
    async with ws.reading(reader()):
        await ws.send(codec.encode(first, b""))
        outcome = await run_runtime(runtime, req, io, client_gone)
        if outcome is not None:
            code, error = outcome
            status = proto.status_json if protocol.status_json else proto.status_text
            payload = status(code, error, describe(req))
            with contextlib.suppress(ConnectionError):
                if payload:
                    await ws.send(codec.encode(proto.CH_ERROR, payload))
