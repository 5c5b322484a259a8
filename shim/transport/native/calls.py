"""gRPC over the HTTP/2 streams (gRPC's "PROTOCOL-HTTP2"): messages, status, deadlines, the servicer.

A request's stream carries one length-prefixed message; :meth:`Calls.dispatch`
hands it to the CRI servicer (or answers grpc.health.v1 Check itself) and the
outcome goes back as a message and ``grpc-status`` / ``grpc-message``
trailers, or as Trailers-Only for an error.
"""

from __future__ import annotations

import asyncio
import contextvars
import struct
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Any, Protocol

from grpc_health.v1 import health_pb2

from shim.cri.codes import Code
from shim.cri.servicer import IMAGE_SERVICE, RUNTIME_SERVICE, CriServicer, Rpc
from shim.transport.native.frames import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    Chunk,
    data_head,
    hpack_int,
    literal_header,
)

if TYPE_CHECKING:
    from shim.transport.native.stream import Stream

_OK = Code.OK  # read off the enum class on each call it was ~80 ns
MAX_DETAIL = 4096  # bytes of grpc-message before it is cut

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
_HEALTHY = frozenset({"", RUNTIME_SERVICE, IMAGE_SERVICE})
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}

# ":status: 200" is entry 8 of the static table; "content-type" is entry 31.
RESPONSE_HEADERS = b"\x88" + hpack_int(31, 4) + hpack_int(16, 7) + b"application/grpc"
OK_TRAILERS = literal_header(b"grpc-status", b"0")

# The first 5 bytes (length, type, flags) of the two HEADERS frames of every OK unary answer.
_REPLY_HEADERS = len(RESPONSE_HEADERS).to_bytes(3, "big") + bytes((HEADERS, END_HEADERS))
_REPLY_TRAILERS = len(OK_TRAILERS).to_bytes(3, "big") + bytes((HEADERS, END_HEADERS | END_STREAM))
# An OK unary answer in one frame each: what comes before the message (its HEADERS frame, the
# head of its DATA frame, its gRPC prefix) and after it (the trailers' frame), packed at once.
_BEFORE = struct.Struct(f">5sI{len(RESPONSE_HEADERS)}sBHBBIBI")
_AFTER = struct.Struct(f">5sI{len(OK_TRAILERS)}s")
_MESSAGE_HEAD = struct.Struct(">BI")  # a gRPC message's prefix: compressed flag, length


def percent(detail: str) -> bytes:
    """grpc-message: printable ASCII but "%" as is, every other byte as %XX (of its UTF-8)."""
    data = detail.encode("utf-8", "replace")[:MAX_DETAIL]
    out = bytearray()
    for b in data:
        if 0x20 <= b <= 0x7E and b != 0x25:
            out.append(b)
        else:
            out += b"%%%02X" % b
    return bytes(out)


def status_block(code: Code, detail: str) -> bytes:
    block = literal_header(b"grpc-status", b"%d" % code)
    if detail:
        block += literal_header(b"grpc-message", percent(detail))
    return block


def timeout(value: bytes) -> float | None:
    """``grpc-timeout`` (digits and a unit) in seconds, None if it is not one."""
    if not 2 <= len(value) <= 9 or not value[:-1].isdigit():
        return None
    unit = _TIMEOUT_UNITS.get(value[-1:])
    return None if unit is None else int(value[:-1]) * unit


# What a request's header block asks: the method's path, the error that answers it at once
# ((code, detail), None if it is a gRPC request), its deadline in seconds from now (None if none).
RequestHead = tuple[str, tuple[Code, str] | None, float | None]


def request_head(headers: list[tuple[bytes, bytes]]) -> RequestHead:
    """What ``headers`` (a request's, decoded) ask of a gRPC server; its last of a repeated field counts."""
    path = b""
    method = b""
    ctype = b""
    grpc_timeout = b""
    for name, value in headers:
        if name == b":path":
            path = value
        elif name == b":method":
            method = value
        elif name == b"content-type":
            ctype = value
        elif name == b"grpc-timeout":
            grpc_timeout = value
    error: tuple[Code, str] | None = None
    seconds = None
    if method != b"POST":
        error = Code.UNIMPLEMENTED, f"method {method.decode('latin-1')!r}: gRPC needs POST"
    elif not ctype.startswith(b"application/grpc"):
        error = Code.UNKNOWN, f"content-type {ctype.decode('latin-1')!r} is not gRPC"
    elif grpc_timeout:
        seconds = timeout(grpc_timeout)
        if seconds is None:
            error = Code.INTERNAL, f"malformed grpc-timeout {grpc_timeout.decode('latin-1')!r}"
    return path.decode("latin-1"), error, seconds


def frame_message(message: bytes) -> bytes:
    """One gRPC message as it goes in DATA: not compressed, its length, itself."""
    return b"\x00" + len(message).to_bytes(4, "big") + message


def unary_answer(sid: int, message: bytes, limit: int) -> bytes:
    """The frames of an OK unary answer on stream ``sid`` in one piece: headers, ``message`` in
    DATA frames of at most ``limit`` bytes, OK trailers. A message longer than one frame is cut
    without copying it before the one join (a List of 110 kubelet containers is ~70 KB)."""
    n = len(message)
    size = n + 5
    if size <= limit:
        # Two packs, not the pieces joined one by one: ~0.25 us less a call.
        return b"".join(
            (
                _BEFORE.pack(
                    _REPLY_HEADERS, sid, RESPONSE_HEADERS, size >> 16, size & 0xFFFF, DATA, 0, sid, 0, n
                ),
                message,
                _AFTER.pack(_REPLY_TRAILERS, sid, OK_TRAILERS),
            )
        )
    sid4 = sid.to_bytes(4, "big")
    view = memoryview(message)
    first = limit - 5
    pieces: list[Chunk] = [
        _REPLY_HEADERS,
        sid4,
        RESPONSE_HEADERS,
        data_head(limit, sid4),
        b"\x00",
        n.to_bytes(4, "big"),
        view[:first],
    ]
    for at in range(first, n, limit):
        part = view[at : at + limit]
        pieces += (data_head(len(part), sid4), part)
    pieces += (_REPLY_TRAILERS, sid4, OK_TRAILERS)
    return b"".join(pieces)


def request_message(body: bytes | bytearray) -> bytes:
    """The one message of a unary or server-streaming request's whole body; Abort if it is not one."""
    if len(body) < 5:
        raise Abort(Code.INTERNAL, "request without a complete gRPC message")
    compressed, length = _MESSAGE_HEAD.unpack_from(body)
    if compressed:
        raise Abort(Code.UNIMPLEMENTED, "compressed messages are not supported")
    if len(body) != 5 + length:
        raise Abort(Code.INTERNAL, "a unary request must carry exactly one whole message")
    return bytes(body[5:])


def _serialized(message: Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def cancel(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` after its first step: one cancelled before it ever ran would drop the
    servicer's coroutine it was given unawaited (never run, never settled, a RuntimeWarning)."""
    asyncio.get_running_loop().call_soon(task.cancel)


class Abort(Exception):
    """The call ends with ``code`` and ``detail``."""

    def __init__(self, code: Code, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


class _Context:
    """The servicer's stream handlers' context (:class:`shim.cri.servicer.AbortContext`)."""

    __slots__ = ()

    async def abort(self, code: Code, details: str = "") -> None:
        raise Abort(code, details)


_CONTEXT = _Context()


class Connection(Protocol):
    """What a call needs of its HTTP/2 connection (:class:`.connection.Connection`, which imports
    this module: this one does not import it back)."""

    streams: dict[int, Stream]

    def write(self, out: list[Chunk]) -> None: ...

    def trailers_only(self, st: Stream, code: Code, detail: str, out: list[Chunk]) -> None: ...

    def reply(self, st: Stream, message: bytes, out: list[Chunk]) -> None: ...

    def send_message(self, st: Stream, message: bytes, out: list[Chunk] | None = None) -> None: ...

    def finish(self, st: Stream, code: Code, detail: str, out: list[Chunk] | None = None) -> None: ...

    async def wait_sent(self, st: Stream) -> None: ...


class Calls:
    """One server's calls: its methods, the servicer behind them, the tasks of those under way."""

    def __init__(self, servicer: CriServicer, max_message_bytes: int) -> None:
        self.servicer = servicer
        self.max_message_bytes = max_message_bytes
        self.methods: dict[str, Rpc] = {}
        for service, rpcs in ((RUNTIME_SERVICE, servicer.runtime_rpcs), (IMAGE_SERVICE, servicer.image_rpcs)):
            for rpc in rpcs:
                self.methods[f"/{service}/{rpc.name}"] = rpc
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = False  # no new calls; health checks answer NOT_SERVING
        self.context: contextvars.Context = contextvars.copy_context()

    def dispatch(self, conn: Connection, st: Stream, message: bytes, out: list[Chunk]) -> None:
        rpc = self.methods.get(st.method)
        if rpc is None:
            if st.method == HEALTH_CHECK:
                self._health(conn, st, message, out)
                return
            conn.trailers_only(st, Code.UNIMPLEMENTED, f"Method not found: {st.method}", out)
            return
        req = rpc.decode(message)
        if rpc.stream:
            self._spawn(conn, st, self._run_stream(conn, st, rpc, req))
            return
        outcome = self.context.run(self.servicer.begin, rpc, req)
        if isinstance(outcome, tuple):
            self._reply(conn, st, outcome, out)
        else:
            self._spawn(conn, st, self._run_unary(conn, st, outcome))

    def _reply(self, conn: Connection, st: Stream, outcome: Any, out: list[Chunk] | None) -> None:
        code, detail, resp = outcome
        if code == _OK:
            data = resp if isinstance(resp, bytes) else resp.SerializeToString()  # _serialized, inline
            if len(data) > self.max_message_bytes:
                conn.finish(
                    st,
                    Code.RESOURCE_EXHAUSTED,
                    f"response of {len(data)} bytes is larger than the maximum ({self.max_message_bytes})",
                    out,
                )
                return
            frames: list[Chunk] = [] if out is None else out
            conn.reply(st, data, frames)
            if out is None:
                conn.write(frames)
            return
        conn.finish(st, code, detail, out)

    def _spawn(self, conn: Connection, st: Stream, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro, context=self.context)
        st.task = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if st.deadline:
            delay = max(0.0, st.deadline - time.monotonic())
            st.timer = asyncio.get_running_loop().call_later(delay, self._expire, conn, st)

    @staticmethod
    def _expire(conn: Connection, st: Stream) -> None:
        st.timer = None
        st.timed_out = True
        if st.task is not None and not st.task.done():
            cancel(st.task)

    @staticmethod
    def _settle_cancelled(conn: Connection, st: Stream) -> None:
        """The call's task was cancelled: by its deadline (say so), or with its stream (nothing to say)."""
        if st.timed_out:
            conn.finish(st, Code.DEADLINE_EXCEEDED, "Deadline Exceeded")

    async def _run_unary(self, conn: Connection, st: Stream, pending: Awaitable[Any]) -> None:
        try:
            outcome = await pending
        except asyncio.CancelledError:
            self._settle_cancelled(conn, st)
            return
        self._reply(conn, st, outcome, None)

    async def _run_stream(self, conn: Connection, st: Stream, rpc: Rpc, req: Any) -> None:
        gen: AsyncIterator[Any] = self.servicer.stream_handler(rpc)(req, _CONTEXT)
        try:
            async for item in gen:
                conn.send_message(st, _serialized(item))
                await conn.wait_sent(st)
                if st.sid not in conn.streams:
                    return
        except Abort as exc:
            conn.finish(st, exc.code, exc.detail)
            return
        except asyncio.CancelledError:
            self._settle_cancelled(conn, st)
            return
        finally:
            aclose = getattr(gen, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except (Exception, asyncio.CancelledError):
                    pass
        conn.finish(st, Code.OK, "")

    def _health(self, conn: Connection, st: Stream, message: bytes, out: list[Chunk]) -> None:
        try:
            service = health_pb2.HealthCheckRequest.FromString(message).service
        except Exception:
            conn.trailers_only(st, Code.INVALID_ARGUMENT, "malformed HealthCheckRequest", out)
            return
        if service not in _HEALTHY:
            conn.trailers_only(st, Code.NOT_FOUND, f"unknown service {service!r}", out)
            return
        status = (
            health_pb2.HealthCheckResponse.NOT_SERVING
            if self.stopping
            else health_pb2.HealthCheckResponse.SERVING
        )
        conn.send_message(st, health_pb2.HealthCheckResponse(status=status).SerializeToString(), out)
        conn.finish(st, Code.OK, "", out)
