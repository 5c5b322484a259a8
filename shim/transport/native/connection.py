"""One HTTP/2 connection (RFC 9113): frames in, streams, SETTINGS, flow control both ways, frames out.

A :class:`Connection` is the asyncio protocol of one client socket. Frames are
read from its data callback; what they answer is gathered in a list and
written once per read. A peer that breaks the protocol gets GOAWAY and the
connection is closed. The gRPC side of a stream is :mod:`.calls`: a connection is
given its server's :class:`.calls.Calls` and set of open connections, and knows
nothing else of the server.
"""

from __future__ import annotations

import asyncio
import struct
import time
from typing import cast

import structlog
from hpack import HPACKError

from shim.cri.codes import Code
from shim.transport.native.calls import (
    OK_TRAILERS,
    RESPONSE_HEADERS,
    Abort,
    Calls,
    RequestHead,
    cancel,
    frame_message,
    request_head,
    request_message,
    status_block,
    unary_answer,
)
from shim.transport.native.frames import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    DEFAULT_TABLE,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    FLOW_CONTROL_ERROR,
    FRAME_HEAD,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    INTERNAL_ERROR,
    MAX_WINDOW,
    NO_ERROR,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_HEADER_TABLE_SIZE,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    Chunk,
    ProtocolViolation,
    data_head,
    encode_frame,
    hpack_int,
    unpad,
)
from shim.transport.native.hpack_in import BlockDecoder, Header
from shim.transport.native.stream import Stream

log = structlog.get_logger("transport.native")

FRAME_MAX = 16384  # what we accept; we never raise it
RECV_WINDOW = 1 << 24  # per stream, advertised in our SETTINGS
CONN_RECV_WINDOW = 1 << 30  # the connection's, raised by a WINDOW_UPDATE at start
CONN_REFILL = 1 << 20  # DATA bytes read before the connection's window is given back in one WINDOW_UPDATE
MAX_STREAMS = 1000
RESET_MEMORY = 1024  # streams we reset while the peer's half was open, remembered to ignore their frames
MAX_HEADER_LIST = 64 * 1024
HEADS_KEPT = 64  # header blocks whose request head is kept (as many as the decoder's memo)
HEAD_BLOCK_KEPT = 1024  # the longest block kept: a client's call is ~100 bytes; a peer's 128 KiB are not
CONN_BUFFER_MAX = 64 << 20  # unfinished request bytes one connection may hold
# Bytes still to read in a read after an answer, over which that answer is sent before them:
# more than the control frames a call brings along (WINDOW_UPDATEs, a PING), less than a request.
EARLY_REST = 64


def _frame_cut_short(buf: bytearray) -> bool:
    """``buf`` holds less than its first frame, one of a length we take (a longer one is an error now)."""
    if len(buf) < 9:
        return True
    length = buf[0] << 16 | buf[1] << 8 | buf[2]
    return length <= FRAME_MAX and len(buf) < 9 + length


class Connection(asyncio.Protocol):
    """One client's HTTP/2 connection: the asyncio protocol of its socket."""

    def __init__(self, calls: Calls, connections: set[Connection]) -> None:
        # The server's calls (their dispatch, limits, stopping flag) and its open connections,
        # which this one joins while its socket is open.
        self.calls = calls
        self.connections = connections
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.preface = False
        self.decoder = BlockDecoder(MAX_HEADER_LIST)
        self.streams: dict[int, Stream] = {}
        self.last_sid = 0
        self.reset_sids: dict[int, None] = {}  # insertion-ordered: the oldest is forgotten first
        self.send_window = DEFAULT_WINDOW
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = FRAME_MAX
        self.table_size = DEFAULT_TABLE  # the most of the peer's HPACK table we may use (we use none)
        self.table_update = b""  # a size update owed at the start of our next header block
        self.blocked: dict[int, Stream] = {}  # streams with data waiting for window
        self.headers_in: tuple[int, int, bytearray] | None = None  # (sid, flags, block) until END_HEADERS
        self.going_away = False
        self.closed = False
        self.paused: asyncio.Future[None] | None = None
        self.buffered = 0  # bytes of requests not yet complete, over all streams
        self.conn_unacked = 0  # DATA bytes read since the connection's last WINDOW_UPDATE
        self.heads: dict[bytes, tuple[list[Header], RequestHead]] = {}  # header block: what it asks

    # ------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass
        self.connections.add(self)
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
        self.connections.discard(self)
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
        if buf:
            # The rest of an earlier read waits: this read goes after it. Frames are read from
            # bytes, whose slices are the payloads at one copy (a bytearray's take two).
            buf += data
            if self.preface and _frame_cut_short(buf):
                return  # a frame that comes in many reads is not copied out again for each
            data = bytes(buf)
            buf.clear()
        elif type(data) is not bytes:  # (a loop may hand a bytearray: its slices could not be dict keys)
            data = bytes(data)
        try:
            if not self.preface:
                if len(data) < len(PREFACE):
                    if not PREFACE.startswith(data):
                        raise ProtocolViolation(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    buf += data
                    return
                if not data.startswith(PREFACE):
                    raise ProtocolViolation(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                data = data[len(PREFACE) :]
                self.preface = True
            self._frames(data)
        except ProtocolViolation as exc:
            self._fail(exc.code, str(exc))
        except HPACKError as exc:
            self._fail(COMPRESSION_ERROR, f"bad header block: {exc}")
        except Exception as exc:  # a bug: this connection goes, the process stays
            log.exception("h2.bug", error=repr(exc))
            self._fail(INTERNAL_ERROR, "internal error")

    # ------------------------------------------------------------ frames in
    def _frames(self, buf: bytes) -> None:
        """The frames of ``buf``; a frame it holds only the start of waits in ``self.buf``."""
        pos = 0
        size = len(buf)
        out: list[Chunk] = []
        early = True
        head = FRAME_HEAD.unpack_from
        try:
            while not self.closed:
                if early and out and size - pos > EARLY_REST:
                    # More requests wait in this read: what is answered goes now, so that the
                    # client works on it while we answer the rest (once a read: a write each).
                    early = False
                    if self.transport is not None:
                        self.transport.write(b"".join(out))
                    out = []
                # frames.next_frame written out here: a call brings 2 to 4 frames, and the
                # function call and its tuple were ~0.2 us of each.
                if size - pos < 9:
                    break
                high, low, kind, flags, sid = head(buf, pos)
                length = high << 8 | low
                if length > FRAME_MAX:
                    raise ProtocolViolation(FRAME_SIZE_ERROR, f"frame of {length} bytes (max {FRAME_MAX})")
                end = pos + 9 + length
                if size < end:
                    break
                payload = buf[pos + 9 : end]
                pos = end
                sid &= 0x7FFFFFFF
                if self.headers_in is not None and kind != CONTINUATION:
                    raise ProtocolViolation(PROTOCOL_ERROR, "header block interrupted by another frame")
                if kind == DATA:
                    self._on_data(sid, flags, payload, out)
                elif kind == HEADERS:
                    self._on_headers(sid, flags, payload, out)
                elif kind == WINDOW_UPDATE:  # next to a call's own frames: grpc clients send them often
                    self._on_window_update(sid, payload, out)
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
            if pos < size:
                self.buf += memoryview(buf)[pos:]
            self.write(out)

    def write(self, out: list[Chunk]) -> None:
        """Send ``out``; a connection told to go away closes once its last stream has ended."""
        if self.transport is None or self.closed:
            return
        if out:
            self.transport.write(b"".join(out))
        if self.going_away and self.calls.stopping and not self.streams:
            self.close()

    def _idle(self, sid: int) -> bool:
        """Never opened (RFC 9113 section 5.1): past the client's last stream, or even (we push none)."""
        return sid > self.last_sid or not sid & 1

    def _on_settings(self, sid: int, flags: int, payload: bytes, out: list[Chunk]) -> None:
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
                self.table_update = hpack_int(value, 5, 0x20)
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not FRAME_MAX <= value <= (1 << 24) - 1:
                    raise ProtocolViolation(PROTOCOL_ERROR, f"max frame size {value} out of range")
                self.peer_max_frame = value
        out.append(encode_frame(SETTINGS, ACK, 0))
        if self.blocked:
            self._flush_blocked(out)

    def _on_window_update(self, sid: int, payload: bytes, out: list[Chunk]) -> None:
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

    def _on_headers(self, sid: int, flags: int, payload: bytes, out: list[Chunk]) -> None:
        if sid == 0 or not sid & 1:
            raise ProtocolViolation(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        if flags & PADDED:
            payload = unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise ProtocolViolation(PROTOCOL_ERROR, "HEADERS priority fields cut short")
            payload = payload[5:]
        if flags & END_HEADERS:
            self._on_header_block(sid, flags, payload, out)
        else:
            self.headers_in = (sid, flags, bytearray(payload))

    def _on_continuation(self, sid: int, flags: int, payload: bytes, out: list[Chunk]) -> None:
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

    def _on_header_block(self, sid: int, flags: int, block: bytes, out: list[Chunk]) -> None:
        headers = self.decoder.decode(block)  # always, to keep the table in step
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
        if self.going_away or self.calls.stopping or len(self.streams) >= MAX_STREAMS:
            self._send_reset(sid, REFUSED_STREAM, out)
            return
        # A client sends the same block for each call of a method: the decoder gives back the same
        # list for it while its table does not change, and what that list asks is kept with it
        # (~1 us a call). A list made anew (the table changed, or the block changed it) is read
        # anew, and kept only if the decoder keeps the list (grpc-go's blocks, each indexing a
        # new grpc-timeout, never come back).
        known = self.heads.get(block) if self.decoder.kept else None
        if known is not None and known[0] is headers:
            head = known[1]
        else:
            head = request_head(headers)
            if self.decoder.kept and len(block) <= HEAD_BLOCK_KEPT:
                if len(self.heads) >= HEADS_KEPT:
                    self.heads.clear()
                self.heads[block] = (headers, head)
        path, error, seconds = head
        st = Stream(sid, path, self.peer_initial_window)
        self.streams[sid] = st
        if error is not None:
            self.trailers_only(st, error[0], error[1], out)
            return
        if seconds is not None:
            st.deadline = time.monotonic() + seconds
        if flags & END_STREAM:
            self._end_request(st, out)

    def _on_data(self, sid: int, flags: int, payload: bytes, out: list[Chunk]) -> None:
        if sid == 0:
            raise ProtocolViolation(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)
        # The connection's window is given back a MiB at a time (of a GiB), not a frame for each
        # DATA frame: each is a frame the client reads and accounts on every call.
        self.conn_unacked += size
        if self.conn_unacked >= CONN_REFILL:
            out.append(encode_frame(WINDOW_UPDATE, 0, 0, self.conn_unacked.to_bytes(4, "big")))
            self.conn_unacked = 0
        st = self.streams.get(sid)
        if st is None or st.ended:
            if self._idle(sid):
                raise ProtocolViolation(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return  # a stream we reset or answered: its data is dropped
        data = unpad(flags, payload) if flags & PADDED else payload
        st.received += len(data)
        if st.received > self.calls.max_message_bytes + 5:
            why = f"received a message larger than the maximum ({self.calls.max_message_bytes} bytes)"
            self.trailers_only(st, Code.RESOURCE_EXHAUSTED, why, out)
            return
        if flags & END_STREAM and not st.body:
            # The whole request in one frame (a unary call's usual case): read it from here.
            self._end_request(st, out, data)
            return
        if self.buffered + len(data) > CONN_BUFFER_MAX:
            why = f"more than {CONN_BUFFER_MAX >> 20} MiB of unfinished requests on this connection"
            self.trailers_only(st, Code.RESOURCE_EXHAUSTED, why, out)
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
    def _end_request(self, st: Stream, out: list[Chunk], whole: bytes | None = None) -> None:
        """The peer's half has ended: its request is ``whole``, or what the stream gathered."""
        if st.ended:
            return
        st.ended = True
        if st.trailers is not None or st.task is not None or st.sid not in self.streams:
            return  # already answered (an early error)
        if whole is not None:
            body: bytes | bytearray = whole
        else:
            body = st.body
            st.body = bytearray()
            self.buffered -= len(body)
        try:
            message = request_message(body)
        except Abort as exc:
            self.trailers_only(st, exc.code, exc.detail, out)
            return
        self.calls.dispatch(self, st, message, out)

    def _release(self, st: Stream) -> None:
        """What the stream holds of the connection: its unread request, its wait for window, its deadline."""
        if st.body:  # (a unary request read whole from its one frame left none)
            self.buffered -= len(st.body)
            st.body = bytearray()
        if self.blocked:
            self.blocked.pop(st.sid, None)
        if st.timer is not None:
            st.timer.cancel()
            st.timer = None

    def _drop(self, st: Stream) -> None:
        """The stream is gone (reset, or the connection): stop its work."""
        self._release(st)
        if st.task is not None and not st.task.done():
            cancel(st.task)
        if st.drained is not None:
            st.drained.set()

    def _reset(self, st: Stream, code: int, out: list[Chunk]) -> None:
        """A stream error (RFC 9113 section 5.4.2): RST_STREAM with ``code``, and the call stops."""
        self.streams.pop(st.sid, None)
        self._drop(st)
        self._send_reset(st.sid, code, out)

    def _send_reset(self, sid: int, code: int, out: list[Chunk]) -> None:
        out.append(encode_frame(RST_STREAM, 0, sid, code.to_bytes(4, "big")))
        self.reset_sids[sid] = None
        if len(self.reset_sids) > RESET_MEMORY:
            del self.reset_sids[next(iter(self.reset_sids))]

    def trailers_only(self, st: Stream, code: Code, detail: str, out: list[Chunk]) -> None:
        """Answer ``st`` with its status alone (gRPC's Trailers-Only: one HEADERS, END_STREAM)."""
        block = RESPONSE_HEADERS + status_block(code, detail)
        out.append(self._headers(END_HEADERS | END_STREAM, st.sid, block))
        st.trailers = b""
        self._close_stream(st, out)

    def _close_stream(self, st: Stream, out: list[Chunk]) -> None:
        self.streams.pop(st.sid, None)
        self._release(st)
        if not st.ended:
            # We answered before the request ended: tell the peer to stop sending.
            st.ended = True
            self._send_reset(st.sid, NO_ERROR, out)

    # ------------------------------------------------------------ frames out
    def send_message(self, st: Stream, message: bytes, out: list[Chunk] | None = None) -> None:
        """Queue one gRPC message on ``st`` (headers first if not sent) and send what the windows allow."""
        if st.sid not in self.streams:
            return
        own = out is None
        frames: list[Chunk] = [] if out is None else out
        if not st.headers_sent:
            st.headers_sent = True
            frames.append(self._headers(END_HEADERS, st.sid, RESPONSE_HEADERS))
        st.outq.append(frame_message(message))
        self._flush(st, frames)
        if own:
            self.write(frames)

    def reply(self, st: Stream, message: bytes, out: list[Chunk]) -> None:
        """A unary call's answer: headers, ``message`` and OK trailers, in one piece
        (:func:`.calls.unary_answer`) when the windows take the message at once (the usual
        case), else queued like any other."""
        size = len(message) + 5
        if (
            st.headers_sent
            or st.outq
            or st.sid not in self.streams
            or st.trailers is not None
            or self.table_update  # owed at the start of the next header block: _headers() adds it
            or size > self.send_window
            or size > st.window
        ):
            self.send_message(st, message, out)
            self.finish(st, Code.OK, "", out)
            return
        self.send_window -= size
        st.window -= size
        out.append(unary_answer(st.sid, message, self.peer_max_frame))
        st.headers_sent = True
        st.trailers = OK_TRAILERS
        self._close_stream(st, out)

    def finish(self, st: Stream, code: Code, detail: str, out: list[Chunk] | None = None) -> None:
        """End ``st`` with its status, after any data still waiting for window."""
        if st.sid not in self.streams or st.trailers is not None:
            return
        frames: list[Chunk] = [] if out is None else out
        if not st.headers_sent:
            self.trailers_only(st, code, detail, frames)
        else:
            st.trailers = OK_TRAILERS if code == Code.OK else status_block(code, detail)
            self._flush(st, frames)
        if out is None:
            self.write(frames)

    def _flush(self, st: Stream, out: list[Chunk]) -> None:
        q = st.outq
        sid = st.sid.to_bytes(4, "big")
        while q:
            room = min(self.send_window, st.window, self.peer_max_frame)
            if room <= 0:
                self.blocked[st.sid] = st
                return
            data = q[0]
            n = len(data)
            if n <= room:
                q.popleft()
            else:
                # Cut without copying: the rest waits as a view of the same message.
                view = data if isinstance(data, memoryview) else memoryview(data)
                q[0] = view[room:]
                data, n = view[:room], room
            self.send_window -= n
            st.window -= n
            out += (data_head(n, sid), data)
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

    def _flush_blocked(self, out: list[Chunk]) -> None:
        for st in list(self.blocked.values()):
            if self.send_window <= 0:
                break
            self._flush(st, out)

    async def wait_sent(self, st: Stream) -> None:
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
