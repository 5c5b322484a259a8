"""A gRPC server on the event loop itself: HTTP/2 over a unix socket, no threads.

``[server] transport = "native"`` (the default of ``cri-shim hollow``) serves
the CRI with this module instead of grpcio. Each grpcio call crosses threads
several times (grpc's event engine, its completion-queue poller, the event
loop); on a small VM that is about a millisecond of CPU per call, mostly
context switches. Here a call is parsed, answered and written from the
socket's read callback: a fake node's List call costs tens of microseconds,
and a hundred hollow nodes polled once a second stay within a few percent of
one core (bench/hollow_bench.py prints both transports side by side).

What it implements, from RFC 9113 (HTTP/2), RFC 7541 (HPACK, decoded by the
``hpack`` package) and gRPC's "PROTOCOL-HTTP2" document:

- the connection preface, SETTINGS (and their ACK), PING, GOAWAY,
  RST_STREAM, WINDOW_UPDATE, PRIORITY (ignored), CONTINUATION;
- flow control both ways: the peer's windows bound what is sent (a reply
  larger than the window waits for WINDOW_UPDATE), and what is received is
  given back as it is read;
- gRPC unary and server-streaming calls: length-prefixed messages,
  ``grpc-timeout`` deadlines, ``grpc-status`` / percent-encoded
  ``grpc-message`` trailers, Trailers-Only answers for errors;
- the CRI services (through :class:`shim.cri.servicer.CriServicer`, the same
  code as the grpcio transport) and ``grpc.health.v1.Health/Check``.

Compressed messages are refused (UNIMPLEMENTED); nothing in the CRI sends
them. A peer that breaks the protocol gets GOAWAY with the error code and the
connection is closed; the process and other connections carry on.
"""

from __future__ import annotations

import asyncio
import contextvars
import socket
import struct
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable
from typing import Any, cast

import grpc
import structlog
from grpc_health.v1 import health_pb2
from hpack import Decoder, HPACKError

from shim.cri.servicer import IMAGE_SERVICE, RUNTIME_SERVICE, CriServicer, Rpc

log = structlog.get_logger("transport.native")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9

SETTINGS_HEADER_TABLE_SIZE = 0x1
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
SETTINGS_MAX_HEADER_LIST_SIZE = 0x6

DEFAULT_TABLE = 4096  # HPACK dynamic table size until the peer's SETTINGS say otherwise
DEFAULT_WINDOW = 65535
MAX_WINDOW = (1 << 31) - 1
FRAME_MAX = 16384  # what we accept; we never raise it
RECV_WINDOW = 1 << 24  # per stream, advertised in our SETTINGS
CONN_RECV_WINDOW = 1 << 30  # the connection's, raised by a WINDOW_UPDATE at start
MAX_STREAMS = 1000
RESET_MEMORY = 1024  # streams we reset while the peer's half was open, remembered to ignore their frames
MAX_HEADER_LIST = 64 * 1024
CONN_BUFFER_MAX = 64 << 20  # unfinished request bytes one connection may hold
MAX_DETAIL = 4096  # bytes of grpc-message before it is cut

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
_HEALTHY = frozenset({"", RUNTIME_SERVICE, IMAGE_SERVICE})
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


class ProtocolViolation(Exception):
    """The peer broke the protocol: GOAWAY with ``code``, then close."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


# ---------------------------------------------------------------------- encoding
def encode_frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return bytes((n >> 16, (n >> 8) & 0xFF, n & 0xFF, kind, flags)) + sid.to_bytes(4, "big") + payload


def next_frame(buf: bytearray, pos: int, limit: int) -> tuple[int, int, int, bytes, int] | None:
    """The frame at ``pos``: (type, flags, stream ID, payload, where the next one starts), None if cut short.

    A frame longer than ``limit`` is the peer's error (FRAME_SIZE_ERROR).
    """
    if len(buf) - pos < 9:
        return None
    length = (buf[pos] << 16) | (buf[pos + 1] << 8) | buf[pos + 2]
    if length > limit:
        raise ProtocolViolation(FRAME_SIZE_ERROR, f"frame of {length} bytes (max {limit})")
    end = pos + 9 + length
    if len(buf) < end:
        return None
    sid = int.from_bytes(buf[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
    return buf[pos + 3], buf[pos + 4], sid, bytes(buf[pos + 9 : end]), end


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal_header(name: bytes, value: bytes) -> bytes:
    """A header as "literal without indexing, new name": the peer's table is never touched."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


# ":status: 200" is entry 8 of the static table; "content-type" is entry 31.
RESPONSE_HEADERS = b"\x88" + _hpack_int(31, 4) + _hpack_int(16, 7) + b"application/grpc"
OK_TRAILERS = literal_header(b"grpc-status", b"0")


def _percent(detail: str) -> bytes:
    """grpc-message: printable ASCII but "%" as is, every other byte as %XX (of its UTF-8)."""
    data = detail.encode("utf-8", "replace")[:MAX_DETAIL]
    out = bytearray()
    for b in data:
        if 0x20 <= b <= 0x7E and b != 0x25:
            out.append(b)
        else:
            out += b"%%%02X" % b
    return bytes(out)


def _status_block(code: grpc.StatusCode, detail: str) -> bytes:
    block = literal_header(b"grpc-status", str(code.value[0]).encode())
    if detail:
        block += literal_header(b"grpc-message", _percent(detail))
    return block


def _timeout(value: bytes) -> float | None:
    """``grpc-timeout`` (digits and a unit) in seconds, None if it is not one."""
    if not 2 <= len(value) <= 9 or not value[:-1].isdigit():
        return None
    unit = _TIMEOUT_UNITS.get(value[-1:])
    return None if unit is None else int(value[:-1]) * unit


def _cancel(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` after its first step: one cancelled before it ever ran would drop the
    servicer's coroutine it was given unawaited (never run, never settled, a RuntimeWarning)."""
    asyncio.get_running_loop().call_soon(task.cancel)


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


class _Context:
    """What the servicer's stream handlers use of grpc.aio.ServicerContext."""

    __slots__ = ()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Abort(code, details)


_CONTEXT = _Context()


# ---------------------------------------------------------------------- streams
class _Stream:
    __slots__ = (
        "body",
        "deadline",
        "drained",
        "ended",
        "headers_sent",
        "method",
        "outq",
        "received",
        "sid",
        "task",
        "timed_out",
        "timer",
        "trailers",
        "unacked",
        "window",
    )

    def __init__(self, sid: int, method: str, window: int) -> None:
        self.sid = sid
        self.method = method
        self.window = window  # what we may still send on it
        self.body = bytearray()
        self.received = 0
        self.unacked = 0
        self.ended = False  # the peer's half is closed
        self.headers_sent = False
        self.outq: deque[bytes] = deque()  # DATA payloads waiting for window
        self.trailers: bytes | None = None  # sent once outq is empty
        self.drained: asyncio.Event | None = None
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.deadline = 0.0
        self.timed_out = False


class _Connection(asyncio.Protocol):
    def __init__(self, server: NativeServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.preface = False
        self.decoder = Decoder(max_header_list_size=MAX_HEADER_LIST)
        self.streams: dict[int, _Stream] = {}
        self.last_sid = 0
        self.reset_sids: dict[int, None] = {}  # insertion-ordered: the oldest is forgotten first
        self.send_window = DEFAULT_WINDOW
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = FRAME_MAX
        self.table_size = DEFAULT_TABLE  # the most of the peer's HPACK table we may use (we use none)
        self.table_update = b""  # a size update owed at the start of our next header block
        self.blocked: dict[int, _Stream] = {}  # streams with data waiting for window
        self.headers_in: tuple[int, int, bytearray] | None = None  # (sid, flags, block) until END_HEADERS
        self.going_away = False
        self.closed = False
        self.paused: asyncio.Future[None] | None = None
        self.buffered = 0  # bytes of requests not yet complete, over all streams

    # ------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass
        self.server.connections.add(self)
        settings = struct.pack(
            ">HIHIHI",
            SETTINGS_MAX_CONCURRENT_STREAMS,
            MAX_STREAMS,
            SETTINGS_INITIAL_WINDOW_SIZE,
            RECV_WINDOW,
            SETTINGS_MAX_HEADER_LIST_SIZE,
            MAX_HEADER_LIST,
        )
        self.transport.write(
            encode_frame(SETTINGS, 0, 0, settings)
            + encode_frame(WINDOW_UPDATE, 0, 0, (CONN_RECV_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big"))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        for st in list(self.streams.values()):
            self._drop(st)
        self.streams.clear()
        self.blocked.clear()
        if self.paused is not None and not self.paused.done():
            self.paused.set_result(None)

    def pause_writing(self) -> None:
        if self.paused is None or self.paused.done():
            self.paused = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.paused is not None and not self.paused.done():
            self.paused.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        buf = self.buf
        buf += data
        try:
            if not self.preface:
                if len(buf) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buf)):
                        raise ProtocolViolation(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                if buf[: len(PREFACE)] != PREFACE:
                    raise ProtocolViolation(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                del buf[: len(PREFACE)]
                self.preface = True
            self._frames(buf)
        except ProtocolViolation as exc:
            self._fail(exc.code, str(exc))
        except HPACKError as exc:
            self._fail(COMPRESSION_ERROR, f"bad header block: {exc}")
        except Exception as exc:  # a bug: this connection goes, the process stays
            log.exception("h2.bug", error=repr(exc))
            self._fail(INTERNAL_ERROR, "internal error")

    # ------------------------------------------------------------ frames in
    def _frames(self, buf: bytearray) -> None:
        pos = 0
        out: list[bytes] = []
        try:
            while not self.closed:
                frame = next_frame(buf, pos, FRAME_MAX)
                if frame is None:
                    break
                kind, flags, sid, payload, pos = frame
                length = len(payload)
                if self.headers_in is not None and kind != CONTINUATION:
                    raise ProtocolViolation(PROTOCOL_ERROR, "header block interrupted by another frame")
                if kind == DATA:
                    self._on_data(sid, flags, payload, out)
                elif kind == HEADERS:
                    self._on_headers(sid, flags, payload, out)
                elif kind == CONTINUATION:
                    self._on_continuation(sid, flags, payload, out)
                elif kind == SETTINGS:
                    self._on_settings(sid, flags, payload, out)
                elif kind == PING:
                    if sid:
                        raise ProtocolViolation(PROTOCOL_ERROR, "PING on a stream")
                    if length != 8:
                        raise ProtocolViolation(FRAME_SIZE_ERROR, "PING not 8 bytes")
                    if not flags & ACK:
                        out.append(encode_frame(PING, ACK, 0, payload))
                elif kind == WINDOW_UPDATE:
                    self._on_window_update(sid, payload, out)
                elif kind == RST_STREAM:
                    if self._idle(sid):
                        raise ProtocolViolation(PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
                    if length != 4:
                        raise ProtocolViolation(FRAME_SIZE_ERROR, "RST_STREAM not 4 bytes")
                    st = self.streams.pop(sid, None)
                    if st is not None:
                        self._drop(st)
                elif kind == GOAWAY:
                    if sid:
                        raise ProtocolViolation(PROTOCOL_ERROR, "GOAWAY on a stream")
                    self.going_away = True
                elif kind == PUSH_PROMISE:
                    raise ProtocolViolation(PROTOCOL_ERROR, "a client cannot push")
                elif kind == PRIORITY:
                    if not sid:
                        raise ProtocolViolation(PROTOCOL_ERROR, "PRIORITY on stream 0")
                    if length != 5:
                        raise ProtocolViolation(FRAME_SIZE_ERROR, "PRIORITY frame not 5 bytes")
                # other frame types are ignored (RFC 9113 section 5.5)
        finally:
            del buf[:pos]
            self.write(out)

    def write(self, out: list[bytes]) -> None:
        """Send ``out``; a connection told to go away closes once its last stream has ended."""
        if self.transport is None or self.closed:
            return
        if out:
            self.transport.write(b"".join(out))
        if self.going_away and self.server.stopping and not self.streams:
            self.close()

    def _idle(self, sid: int) -> bool:
        """Never opened (RFC 9113 section 5.1): past the client's last stream, or even (we push none)."""
        return sid > self.last_sid or not sid & 1

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if flags & PADDED:
            if not payload or payload[0] >= len(payload):
                raise ProtocolViolation(PROTOCOL_ERROR, "padding longer than the frame")
            return payload[1 : len(payload) - payload[0]]
        return payload

    def _on_settings(self, sid: int, flags: int, payload: bytes, out: list[bytes]) -> None:
        if sid:
            raise ProtocolViolation(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ProtocolViolation(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise ProtocolViolation(FRAME_SIZE_ERROR, "SETTINGS not a multiple of 6 bytes")
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolViolation(FLOW_CONTROL_ERROR, "initial window over 2^31-1")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for st in self.streams.values():
                    st.window += delta
                    if st.window > MAX_WINDOW:
                        raise ProtocolViolation(FLOW_CONTROL_ERROR, f"stream {st.sid}'s window over 2^31-1")
            elif key == SETTINGS_ENABLE_PUSH and value > 1:
                raise ProtocolViolation(PROTOCOL_ERROR, f"enable push {value} not 0 or 1")
            elif key == SETTINGS_HEADER_TABLE_SIZE and value < self.table_size:
                # RFC 7541 section 4.2: our next header block must first shrink the table to fit.
                self.table_size = value
                self.table_update = _hpack_int(value, 5, 0x20)
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not FRAME_MAX <= value <= (1 << 24) - 1:
                    raise ProtocolViolation(PROTOCOL_ERROR, f"max frame size {value} out of range")
                self.peer_max_frame = value
        out.append(encode_frame(SETTINGS, ACK, 0))
        if self.blocked:
            self._flush_blocked(out)

    def _on_window_update(self, sid: int, payload: bytes, out: list[bytes]) -> None:
        if len(payload) != 4:
            raise ProtocolViolation(FRAME_SIZE_ERROR, "WINDOW_UPDATE not 4 bytes")
        inc = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if sid == 0:
            if inc == 0:
                raise ProtocolViolation(PROTOCOL_ERROR, "WINDOW_UPDATE of 0 on the connection")
            self.send_window += inc
            if self.send_window > MAX_WINDOW:
                raise ProtocolViolation(FLOW_CONTROL_ERROR, "connection window over 2^31-1")
        else:
            st = self.streams.get(sid)
            if st is None:
                if self._idle(sid):
                    raise ProtocolViolation(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
                return
            if inc == 0:
                self._reset(st, PROTOCOL_ERROR, out)
                return
            st.window += inc
            if st.window > MAX_WINDOW:
                self._reset(st, FLOW_CONTROL_ERROR, out)
                return
        if self.blocked:
            # Into this read's frames, after what they already hold for the same streams.
            self._flush_blocked(out)

    def _on_headers(self, sid: int, flags: int, payload: bytes, out: list[bytes]) -> None:
        if sid == 0 or not sid & 1:
            raise ProtocolViolation(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        payload = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise ProtocolViolation(PROTOCOL_ERROR, "HEADERS priority fields cut short")
            payload = payload[5:]
        if flags & END_HEADERS:
            self._on_header_block(sid, flags, payload, out)
        else:
            self.headers_in = (sid, flags, bytearray(payload))

    def _on_continuation(self, sid: int, flags: int, payload: bytes, out: list[bytes]) -> None:
        if self.headers_in is None or self.headers_in[0] != sid:
            raise ProtocolViolation(PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        block = self.headers_in[2]
        block += payload
        if len(block) > MAX_HEADER_LIST * 2:
            raise ProtocolViolation(PROTOCOL_ERROR, "header block too large")
        if flags & END_HEADERS:
            first_flags = self.headers_in[1]
            self.headers_in = None
            self._on_header_block(sid, first_flags, bytes(block), out)

    def _on_header_block(self, sid: int, flags: int, block: bytes, out: list[bytes]) -> None:
        headers = self.decoder.decode(block, raw=True)  # always, to keep the table in step
        if sid in self.streams:
            # Trailers from the client: its half ends here.
            if flags & END_STREAM:
                self._end_request(self.streams[sid], out)
            return
        if sid <= self.last_sid:
            if sid in self.reset_sids:
                return  # sent before our RST_STREAM reached the peer: ignored (RFC 9113 section 5.1)
            raise ProtocolViolation(
                STREAM_CLOSED if sid in self.streams else PROTOCOL_ERROR, f"stream {sid} reused"
            )
        self.last_sid = sid
        if self.going_away or self.server.stopping or len(self.streams) >= MAX_STREAMS:
            self._send_reset(sid, REFUSED_STREAM, out)
            return
        path = b""
        method = b""
        ctype = b""
        timeout = b""
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b":method":
                method = value
            elif name == b"content-type":
                ctype = value
            elif name == b"grpc-timeout":
                timeout = value
        st = _Stream(sid, path.decode("latin-1"), self.peer_initial_window)
        self.streams[sid] = st
        if method != b"POST":
            self._trailers_only(
                st,
                grpc.StatusCode.UNIMPLEMENTED,
                f"method {method.decode('latin-1')!r}: gRPC needs POST",
                out,
            )
            return
        if not ctype.startswith(b"application/grpc"):
            self._trailers_only(
                st, grpc.StatusCode.UNKNOWN, f"content-type {ctype.decode('latin-1')!r} is not gRPC", out
            )
            return
        if timeout:
            seconds = _timeout(timeout)
            if seconds is None:
                self._trailers_only(
                    st, grpc.StatusCode.INTERNAL, f"malformed grpc-timeout {timeout.decode('latin-1')!r}", out
                )
                return
            st.deadline = time.monotonic() + seconds
        if flags & END_STREAM:
            self._end_request(st, out)

    def _on_data(self, sid: int, flags: int, payload: bytes, out: list[bytes]) -> None:
        if sid == 0:
            raise ProtocolViolation(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        if size:
            out.append(encode_frame(WINDOW_UPDATE, 0, 0, size.to_bytes(4, "big")))
        st = self.streams.get(sid)
        if st is None or st.ended:
            if self._idle(sid):
                raise ProtocolViolation(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return  # a stream we reset or answered: its data is dropped
        data = self._unpad(flags, payload)
        st.received += len(data)
        if st.received > self.server.max_message_bytes + 5:
            why = f"received a message larger than the maximum ({self.server.max_message_bytes} bytes)"
            self._trailers_only(st, grpc.StatusCode.RESOURCE_EXHAUSTED, why, out)
            return
        if self.buffered + len(data) > CONN_BUFFER_MAX:
            why = f"more than {CONN_BUFFER_MAX >> 20} MiB of unfinished requests on this connection"
            self._trailers_only(st, grpc.StatusCode.RESOURCE_EXHAUSTED, why, out)
            return
        st.body += data
        self.buffered += len(data)
        st.unacked += size
        if flags & END_STREAM:
            self._end_request(st, out)
        elif st.unacked >= RECV_WINDOW // 2:
            out.append(encode_frame(WINDOW_UPDATE, 0, sid, st.unacked.to_bytes(4, "big")))
            st.unacked = 0

    # ------------------------------------------------------------ calls
    def _end_request(self, st: _Stream, out: list[bytes]) -> None:
        if st.ended:
            return
        st.ended = True
        if st.trailers is not None or st.task is not None or st.sid not in self.streams:
            return  # already answered (an early error)
        body = st.body
        st.body = bytearray()
        self.buffered -= len(body)
        if len(body) < 5:
            self._trailers_only(st, grpc.StatusCode.INTERNAL, "request without a complete gRPC message", out)
            return
        compressed = body[0]
        length = int.from_bytes(body[1:5], "big")
        if compressed:
            self._trailers_only(
                st, grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not supported", out
            )
            return
        if len(body) != 5 + length:
            self._trailers_only(
                st, grpc.StatusCode.INTERNAL, "a unary request must carry exactly one whole message", out
            )
            return
        message = bytes(body[5:])
        self.server.dispatch(self, st, message, out)

    def _drop(self, st: _Stream) -> None:
        """The stream is gone (reset, or the connection): stop its work."""
        self.buffered -= len(st.body)
        st.body = bytearray()
        self.blocked.pop(st.sid, None)
        if st.timer is not None:
            st.timer.cancel()
            st.timer = None
        if st.task is not None and not st.task.done():
            _cancel(st.task)
        if st.drained is not None:
            st.drained.set()

    def _reset(self, st: _Stream, code: int, out: list[bytes]) -> None:
        """A stream error (RFC 9113 section 5.4.2): RST_STREAM with ``code``, and the call stops."""
        self.streams.pop(st.sid, None)
        self._drop(st)
        self._send_reset(st.sid, code, out)

    def _send_reset(self, sid: int, code: int, out: list[bytes]) -> None:
        out.append(encode_frame(RST_STREAM, 0, sid, code.to_bytes(4, "big")))
        self.reset_sids[sid] = None
        if len(self.reset_sids) > RESET_MEMORY:
            del self.reset_sids[next(iter(self.reset_sids))]

    def _trailers_only(self, st: _Stream, code: grpc.StatusCode, detail: str, out: list[bytes]) -> None:
        block = RESPONSE_HEADERS + _status_block(code, detail)
        out.append(self._headers(END_HEADERS | END_STREAM, st.sid, block))
        st.trailers = b""
        self._close_stream(st, out)

    def _close_stream(self, st: _Stream, out: list[bytes]) -> None:
        self.buffered -= len(st.body)
        st.body = bytearray()
        self.streams.pop(st.sid, None)
        self.blocked.pop(st.sid, None)
        if st.timer is not None:
            st.timer.cancel()
            st.timer = None
        if not st.ended:
            # We answered before the request ended: tell the peer to stop sending.
            st.ended = True
            self._send_reset(st.sid, NO_ERROR, out)

    # ------------------------------------------------------------ frames out
    def send_message(self, st: _Stream, message: bytes, out: list[bytes] | None = None) -> None:
        """Queue one gRPC message on ``st`` (headers first if not sent) and send what the windows allow."""
        if st.sid not in self.streams:
            return
        chunk = bytearray(b"\x00")
        chunk += len(message).to_bytes(4, "big")
        chunk += message
        own = out is None
        frames: list[bytes] = [] if out is None else out
        if not st.headers_sent:
            st.headers_sent = True
            frames.append(self._headers(END_HEADERS, st.sid, RESPONSE_HEADERS))
        st.outq.append(bytes(chunk))
        self._flush(st, frames)
        if own:
            self.write(frames)

    def finish(self, st: _Stream, code: grpc.StatusCode, detail: str, out: list[bytes] | None = None) -> None:
        """End ``st`` with its status, after any data still waiting for window."""
        if st.sid not in self.streams or st.trailers is not None:
            return
        frames: list[bytes] = [] if out is None else out
        if not st.headers_sent:
            self._trailers_only(st, code, detail, frames)
        else:
            st.trailers = OK_TRAILERS if code == grpc.StatusCode.OK else _status_block(code, detail)
            self._flush(st, frames)
        if out is None:
            self.write(frames)

    def _flush(self, st: _Stream, out: list[bytes]) -> None:
        q = st.outq
        while q:
            room = min(self.send_window, st.window, self.peer_max_frame)
            if room <= 0:
                self.blocked[st.sid] = st
                return
            data = q[0]
            if len(data) <= room:
                q.popleft()
            else:
                q[0] = data[room:]
                data = data[:room]
            self.send_window -= len(data)
            st.window -= len(data)
            out.append(encode_frame(DATA, 0, st.sid, data))
        self.blocked.pop(st.sid, None)
        if st.drained is not None:
            st.drained.set()
        if st.trailers is not None:
            out.append(self._headers(END_HEADERS | END_STREAM, st.sid, st.trailers))
            self._close_stream(st, out)

    def _headers(self, flags: int, sid: int, block: bytes) -> bytes:
        """A HEADERS frame; frames are written in the order they are made, so this one is next."""
        if self.table_update:
            block = self.table_update + block
            self.table_update = b""
        return encode_frame(HEADERS, flags, sid, block)

    def _flush_blocked(self, out: list[bytes]) -> None:
        for st in list(self.blocked.values()):
            if self.send_window <= 0:
                break
            self._flush(st, out)

    async def wait_sent(self, st: _Stream) -> None:
        """Until ``st``'s queued data is out (or the stream is gone) and the socket takes more."""
        while st.outq and st.sid in self.streams and not self.closed:
            if st.drained is None:
                st.drained = asyncio.Event()
            st.drained.clear()
            await st.drained.wait()
        if self.paused is not None and not self.paused.done():
            await self.paused

    # ------------------------------------------------------------ ending
    def goaway(self, code: int = NO_ERROR, why: str = "") -> None:
        if self.transport is None or self.closed:
            return
        self.going_away = True
        payload = self.last_sid.to_bytes(4, "big") + code.to_bytes(4, "big") + why.encode()[:256]
        self.transport.write(encode_frame(GOAWAY, 0, 0, payload))

    def _fail(self, code: int, why: str) -> None:
        log.warning("h2.protocol_error", error=why, code=code)
        self.goaway(code, why)
        self.close()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()


class NativeServer:
    """The CRI (and grpc.health.v1 Check) over HTTP/2 on one unix socket, on the running loop."""

    def __init__(self, servicer: CriServicer, max_message_bytes: int) -> None:
        self.servicer = servicer
        self.max_message_bytes = max_message_bytes
        self.methods: dict[str, Rpc] = {}
        for service, rpcs in ((RUNTIME_SERVICE, servicer.runtime_rpcs), (IMAGE_SERVICE, servicer.image_rpcs)):
            for rpc in rpcs:
                self.methods[f"/{service}/{rpc.name}"] = rpc
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self._context: contextvars.Context = contextvars.copy_context()

    async def start(self, sock: socket.socket) -> None:
        """Serve on ``sock``, a listening unix socket (``listen_socket``, or systemd's)."""
        loop = asyncio.get_running_loop()
        self._context = contextvars.copy_context()  # the caller's: its tasks log as it does
        self._server = await loop.create_unix_server(lambda: _Connection(self), sock=sock)

    async def stop(self, grace: float | None) -> None:
        """No new calls; calls under way get ``grace`` seconds, then are cancelled."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.goaway()
            if not conn.streams:
                conn.close()
        if self.tasks and grace:
            await asyncio.wait(list(self.tasks), timeout=grace)
        for task in list(self.tasks):
            _cancel(task)
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=1.0)
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            self._server.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            except TimeoutError:
                pass

    # ------------------------------------------------------------ one call
    def dispatch(self, conn: _Connection, st: _Stream, message: bytes, out: list[bytes]) -> None:
        rpc = self.methods.get(st.method)
        if rpc is None:
            if st.method == HEALTH_CHECK:
                self._health(conn, st, message, out)
                return
            conn._trailers_only(st, grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {st.method}", out)
            return
        req = rpc.decode(message)
        if rpc.stream:
            self._spawn(conn, st, self._run_stream(conn, st, rpc, req))
            return
        outcome = self._context.run(self.servicer.begin, rpc, req)
        if isinstance(outcome, tuple):
            self._reply(conn, st, outcome, out)
        else:
            self._spawn(conn, st, self._run_unary(conn, st, outcome))

    def _reply(self, conn: _Connection, st: _Stream, outcome: Any, out: list[bytes] | None) -> None:
        code, detail, resp = outcome
        if code == grpc.StatusCode.OK:
            data = resp if isinstance(resp, bytes) else resp.SerializeToString()
            if len(data) > self.max_message_bytes:
                conn.finish(
                    st,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"response of {len(data)} bytes is larger than the maximum ({self.max_message_bytes})",
                    out,
                )
                return
            conn.send_message(st, data, out)
        conn.finish(st, code, detail, out)

    def _spawn(self, conn: _Connection, st: _Stream, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro, context=self._context)
        st.task = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if st.deadline:
            delay = max(0.0, st.deadline - time.monotonic())
            st.timer = asyncio.get_running_loop().call_later(delay, self._expire, conn, st)

    @staticmethod
    def _expire(conn: _Connection, st: _Stream) -> None:
        st.timer = None
        st.timed_out = True
        if st.task is not None and not st.task.done():
            _cancel(st.task)

    async def _run_unary(self, conn: _Connection, st: _Stream, pending: Awaitable[Any]) -> None:
        try:
            outcome = await pending
        except asyncio.CancelledError:
            if st.timed_out:
                conn.finish(st, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            return
        self._reply(conn, st, outcome, None)

    async def _run_stream(self, conn: _Connection, st: _Stream, rpc: Rpc, req: Any) -> None:
        gen: AsyncIterator[Any] = self.servicer.stream_handler(rpc)(req, _CONTEXT)
        try:
            async for item in gen:
                data = item if isinstance(item, bytes) else item.SerializeToString()
                conn.send_message(st, data)
                await conn.wait_sent(st)
                if st.sid not in conn.streams:
                    return
        except _Abort as exc:
            conn.finish(st, exc.code, exc.detail)
            return
        except asyncio.CancelledError:
            if st.timed_out:
                conn.finish(st, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            return
        finally:
            aclose = getattr(gen, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except (Exception, asyncio.CancelledError):
                    pass
        conn.finish(st, grpc.StatusCode.OK, "")

    def _health(self, conn: _Connection, st: _Stream, message: bytes, out: list[bytes]) -> None:
        try:
            service = health_pb2.HealthCheckRequest.FromString(message).service
        except Exception:
            conn._trailers_only(st, grpc.StatusCode.INVALID_ARGUMENT, "malformed HealthCheckRequest", out)
            return
        if service not in _HEALTHY:
            conn._trailers_only(st, grpc.StatusCode.NOT_FOUND, f"unknown service {service!r}", out)
            return
        status = (
            health_pb2.HealthCheckResponse.NOT_SERVING
            if self.stopping
            else health_pb2.HealthCheckResponse.SERVING
        )
        conn.send_message(st, health_pb2.HealthCheckResponse(status=status).SerializeToString(), out)
        conn.finish(st, grpc.StatusCode.OK, "", out)


def listen_socket(path: str) -> socket.socket:
    """A listening unix socket at ``path`` (what the caller chmods and hands to NativeServer)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


__all__ = ["PREFACE", "NativeServer", "encode_frame", "listen_socket", "literal_header", "next_frame"]
