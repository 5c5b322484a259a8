"""A server-side SPDY/3.1 session: stream table, flow control, frame dispatch.

Flow control, both directions:
- receiving: each stream buffers at most one window of unread data; the
  reader stops pulling frames while a stream is full (TCP pushes back on the
  client) and WINDOW_UPDATEs are sent as the consumer reads, so a
  spec-following client never overruns;
- sending: windows are tracked as the spec says, but only enforced once the
  peer shows it does flow control (sends WINDOW_UPDATE or an initial window
  setting). The Go client used by crictl and the kubelet (moby/spdystream)
  neither sends nor honours WINDOW_UPDATE; enforcing windows against it would
  stall every stream after 64 KiB. Against it the TCP send buffer, awaited
  with ``drain``, is the back-pressure.

Against clients that break the rules (they ignore windows, never read, send
garbage or stop half-way through a frame) every buffer stays bounded and every
wait ends:
- what a client sent and nobody read yet is at most ``buffer_limit`` per stream
  and ``max_buffered`` per session; past either, the reader stops reading;
- what the reader itself answers (RST_STREAM for data on unknown streams,
  PING replies) is drained like any output: a client that never reads stops
  being read;
- a frame is judged by its header first (version, length for its type, at
  most ``RECV_WINDOW`` of data), and a frame begun must be complete within
  ``FRAME_TIMEOUT``;
- the reader gives the event loop back every FAIR_SLICE while it works through
  a backlog, and reads tiny frames and junk (frames that give the session
  nothing: PINGs, data for streams that are gone, unknown types) at most at
  their rates (transport.Pacer).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

import structlog

from shim.streaming import spdy
from shim.streaming.transport import TINY_FRAME, ByteTransport, Pacer

log = structlog.get_logger(__name__)

CHUNK = 32 * 1024  # largest DATA frame sent
# What we let a client send ahead, per stream and per session, announced when the
# session opens. SPDY's default of 64 KiB costs two WINDOW_UPDATE frames (two
# system calls) per 32 KiB received; 1 MiB lets port-forward run at full speed.
RECV_WINDOW = 1024 * 1024
PROBE_INTERVAL = 2.0  # seconds between liveness probes while the reader is stalled
# Unread client data a session holds across all its streams (a spec-following client
# stays within RECV_WINDOW; only clients that ignore windows reach this).
SESSION_BUFFER = 2 * RECV_WINDOW
FRAME_TIMEOUT = 30.0  # seconds for the rest of a frame once its first byte came


class SpdyStream:
    """One client-initiated stream."""

    def __init__(self, session: SpdySession, stream_id: int, headers: spdy.Headers) -> None:
        self.session = session
        self.id = stream_id
        self.headers = headers
        self.send_window = session.initial_send_window
        self.replied = False
        self.local_closed = False  # we sent FIN
        self.remote_closed = False  # the peer sent FIN
        self.was_reset = False
        self.done = asyncio.Event()  # both directions closed, or reset
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._unacked = 0
        self._readable = asyncio.Event()
        self._discarding = False

    @property
    def stream_type(self) -> str:
        return self.headers.get("streamtype", "")

    # ---- reading (client -> server)

    async def read(self) -> bytes:
        """The next chunk sent by the client; b"" after its FIN, a reset, or the session's end."""
        while not self._chunks:
            if self.remote_closed or self.was_reset:
                return b""
            self._readable.clear()
            await self._readable.wait()
        # Everything buffered at once: one write downstream instead of one per frame.
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._release(len(data))
        self._ack(len(data))
        return data

    def _release(self, n: int) -> None:
        self._buffered -= n
        self.session.buffered -= n
        self.session.space.set()

    def _ack(self, n: int) -> None:
        self._unacked += n
        if self._unacked >= RECV_WINDOW // 2 and not self.remote_closed and not self.was_reset:
            self.session.send_frame_nowait(spdy.WindowUpdateFrame(self.id, self._unacked))
            self._unacked = 0
        self.session.ack(n)

    def discard(self) -> None:
        """Drop whatever the client still sends on this stream (its reader is gone)."""
        self._discarding = True
        self._chunks.clear()
        self._release(self._buffered)

    async def _push(self, data: bytes) -> None:
        if not data:
            return
        session = self.session
        # Back-pressure for peers that ignore our window: stop reading the socket
        # while this stream or the session holds all it may. While stopped we
        # cannot see the client hang up, so probe.
        while not (self._discarding or self.was_reset) and (
            self._buffered >= session.buffer_limit or session.buffered >= session.max_buffered
        ):
            session.space.clear()
            try:
                async with asyncio.timeout(PROBE_INTERVAL):
                    await session.space.wait()
            except TimeoutError:
                session.probe()
        if self._discarding or self.was_reset:
            session.ack(len(data))
            return
        self._chunks.append(data)
        self._buffered += len(data)
        session.buffered += len(data)
        self._readable.set()

    def _remote_fin(self) -> None:
        self.remote_closed = True
        self._readable.set()
        self._maybe_done()

    # ---- writing (server -> client)

    async def reply(self, headers: spdy.Headers | None = None) -> None:
        if not self.replied and not self.was_reset:
            self.replied = True
            await self.session.send(spdy.SynReplyFrame(self.id, headers or {}))

    async def write(self, data: bytes) -> None:
        """Send ``data``; raises ConnectionResetError if the stream or session is gone."""
        view = memoryview(data)
        while view:
            if self.was_reset or self.local_closed:
                raise ConnectionResetError(f"stream {self.id} is closed")
            n = await self.session.reserve_window(self, min(len(view), CHUNK))
            await self.session.send(spdy.DataFrame(self.id, bytes(view[:n])))
            view = view[n:]

    async def close(self) -> None:
        """Half-close: send FIN. Idempotent; silent if the stream is already gone."""
        if self.local_closed or self.was_reset:
            return
        self.local_closed = True
        with contextlib.suppress(ConnectionError):
            await self.session.send(spdy.DataFrame(self.id, b"", fin=True))
        self._maybe_done()

    def reset(self, status: int = spdy.RstStatus.CANCEL) -> None:
        if self.was_reset:
            return
        with contextlib.suppress(ConnectionError):
            self.session.send_frame_nowait(spdy.RstStreamFrame(self.id, status))
        self._on_reset()

    def _on_reset(self) -> None:
        self.was_reset = True
        self._chunks.clear()
        self._release(self._buffered)
        self._readable.set()
        self.session.forget(self)
        self.done.set()

    def _maybe_done(self) -> None:
        if self.local_closed and self.remote_closed:
            self.session.forget(self)
            self.done.set()


class SpdySession:
    """Reads frames from the client and hands out the streams it opens."""

    def __init__(
        self,
        transport: ByteTransport,
        *,
        max_streams: int = 1000,
        buffer_limit: int = RECV_WINDOW,
        max_buffered: int = SESSION_BUFFER,
    ) -> None:
        self.transport = transport
        self.max_streams = max_streams
        self.buffer_limit = buffer_limit  # unread bytes per stream
        self.max_buffered = max_buffered  # unread bytes in all streams
        self.buffered = 0
        self.space = asyncio.Event()  # set whenever unread bytes were consumed or dropped
        self.initial_send_window = spdy.DEFAULT_WINDOW
        self.send_window = spdy.DEFAULT_WINDOW
        self.peer_flow_control = False
        self.closed = asyncio.Event()
        self.error: str = ""
        self._encoder = spdy.FrameEncoder()
        # No client may send more at once than the window it was given.
        self._decoder = spdy.FrameDecoder(max_data_length=RECV_WINDOW)
        self._streams: dict[int, SpdyStream] = {}
        self._last_stream_id = 0
        self._goaway_sent = False
        self._incoming: asyncio.Queue[SpdyStream | None] = asyncio.Queue()
        self._window_changed = asyncio.Event()
        self._unacked = 0
        self._reader: asyncio.Future[None] | None = None
        self._next_ping = 2  # a server's PING ids are even

    # ---- sending

    def send_frame_nowait(self, frame: spdy.Frame) -> None:
        """Encode and buffer one frame. Encoding and writing are one step (no await
        between them) because the header compressor's state follows the wire order."""
        if self.closed.is_set():
            raise ConnectionResetError("SPDY session closed")
        self.transport.write(self._encoder.encode(frame))

    async def send(self, frame: spdy.Frame) -> None:
        self.send_frame_nowait(frame)
        try:
            await self.transport.drain()
        except OSError as exc:
            raise ConnectionResetError(str(exc)) from exc

    async def reserve_window(self, stream: SpdyStream, want: int) -> int:
        """How many bytes of ``want`` may go out now; waits while a window is closed."""
        while True:
            if stream.was_reset or self.closed.is_set():
                raise ConnectionResetError(f"stream {stream.id} is closed")
            allowed = min(want, stream.send_window, self.send_window)
            if allowed > 0 or not self.peer_flow_control:
                n = want if not self.peer_flow_control else allowed
                stream.send_window -= n
                self.send_window -= n
                return n
            self._window_changed.clear()
            await self._window_changed.wait()

    def probe(self) -> None:
        """Send a PING so a vanished client shows up as a failed write; raises
        ConnectionResetError once the transport is known to be gone."""
        if self.transport.closing:
            raise ConnectionResetError("client went away")
        self.send_frame_nowait(spdy.PingFrame(self._next_ping))
        self._next_ping = (self._next_ping + 2) % (2**32)
        if self.transport.closing:  # the write found the connection reset
            raise ConnectionResetError("client went away")

    def ack(self, n: int) -> None:
        """Data of ``n`` bytes was consumed: reopen the session window."""
        self._unacked += n
        if self._unacked >= RECV_WINDOW // 2:
            with contextlib.suppress(ConnectionError):
                self.send_frame_nowait(spdy.WindowUpdateFrame(0, self._unacked))
            self._unacked = 0

    def forget(self, stream: SpdyStream) -> None:
        self._streams.pop(stream.id, None)

    # ---- receiving

    async def accept(self) -> SpdyStream | None:
        """The next stream the client opened, or None once the session ended."""
        if self.closed.is_set() and self._incoming.empty():
            return None
        return await self._incoming.get()

    async def run(self) -> None:
        """Read frames until EOF or a protocol error; then end every stream."""
        try:
            self.send_frame_nowait(spdy.SettingsFrame(((0, spdy.Setting.INITIAL_WINDOW_SIZE, RECV_WINDOW),)))
            self.send_frame_nowait(spdy.WindowUpdateFrame(0, RECV_WINDOW - spdy.DEFAULT_WINDOW))
            pacer = Pacer()
            while True:
                head, body = await self._read_frame()
                pacer.resume()
                frame = self._decoder.decode(head, body)
                junk = await self._dispatch(frame) if frame is not None else True  # unknown type
                await pacer.checkpoint(tiny=len(body) < TINY_FRAME, junk=junk)
                # What the frame made us send (a reset, a PING reply) waits, like any
                # output, for a client that reads: one that never does stops being read.
                await self.transport.drain()
        except EOFError:
            pass
        except spdy.SpdyProtocolError as exc:
            self.error = str(exc)
            log.info("spdy protocol error", error=str(exc))
            with contextlib.suppress(ConnectionError):
                self.send_frame_nowait(
                    spdy.GoAwayFrame(self._last_stream_id, spdy.GoAwayStatus.PROTOCOL_ERROR)
                )
        except ConnectionError:
            pass
        finally:
            self._shutdown()

    async def _read_frame(self) -> tuple[bytes, bytes]:
        """The next frame's header and body. Waits as long as it takes for a frame to
        begin, FRAME_TIMEOUT for the rest once it has."""
        transport = self.transport
        await transport.fill()
        if transport.buffered >= 8:
            head = await transport.read_exactly(8)
            length = self._decoder.check_header(head)
            if transport.buffered >= length:  # all there: no waiting, no timer
                return head, await transport.read_exactly(length) if length else b""
        else:
            head = b""
        started = time.monotonic()
        try:
            async with asyncio.timeout(FRAME_TIMEOUT):
                if not head:
                    head = await transport.read_exactly(8)
                    length = self._decoder.check_header(head)
                return head, await transport.read_exactly(length) if length else b""
        except TimeoutError:
            waited = time.monotonic() - started
            raise spdy.SpdyProtocolError(f"frame incomplete after {waited:.1f}s") from None

    def _shutdown(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for stream in list(self._streams.values()):
            stream._on_reset()
        self.space.set()
        self._window_changed.set()
        self._incoming.put_nowait(None)

    def start(self) -> None:
        """Start reading frames in a task of its own."""
        self._reader = asyncio.ensure_future(self.run())

    async def aclose(self) -> None:
        """Say GOAWAY, stop reading and close the transport (flushing what is queued).
        Idempotent."""
        if not self.closed.is_set() and not self._goaway_sent:
            self._goaway_sent = True
            with contextlib.suppress(ConnectionError):
                self.send_frame_nowait(spdy.GoAwayFrame(self._last_stream_id, spdy.GoAwayStatus.OK))
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._shutdown()
        await self.transport.aclose()

    async def _dispatch(self, frame: spdy.Frame) -> bool:
        """Act on one frame; True if it gave the session nothing (junk, for the pacer)."""
        match frame:
            case spdy.DataFrame(sid, data, fin):
                stream = self._streams.get(sid)
                if stream is None or stream.remote_closed:
                    # Late data for a stream already gone still used session window.
                    self.ack(len(data))
                    if stream is not None or sid > self._last_stream_id:
                        status = (
                            spdy.RstStatus.STREAM_ALREADY_CLOSED if stream else spdy.RstStatus.INVALID_STREAM
                        )
                        self.send_frame_nowait(spdy.RstStreamFrame(sid, status))
                    return True
                junk = stream._discarding or not (data or fin)
                await stream._push(data)
                if fin:
                    stream._remote_fin()
                return junk
            case spdy.SynStreamFrame(sid, headers, fin=fin, unidirectional=uni):
                if sid % 2 == 0 or sid <= self._last_stream_id:
                    raise spdy.SpdyProtocolError(f"bad client stream id {sid}")
                self._last_stream_id = sid
                if self._goaway_sent or len(self._streams) >= self.max_streams:
                    self.send_frame_nowait(spdy.RstStreamFrame(sid, spdy.RstStatus.REFUSED_STREAM))
                    return True
                stream = SpdyStream(self, sid, headers)
                self._streams[sid] = stream
                if uni:  # we may not send on it
                    stream.local_closed = True
                if fin:
                    stream.remote_closed = True
                    stream._maybe_done()
                self._incoming.put_nowait(stream)
            case spdy.RstStreamFrame(sid, _):
                stream = self._streams.get(sid)
                if stream is None:
                    return True
                stream._on_reset()
            case spdy.SettingsFrame(entries):
                for _, sid, value in entries:
                    if sid == spdy.Setting.INITIAL_WINDOW_SIZE:
                        if value > spdy.MAX_WINDOW:
                            raise spdy.SpdyProtocolError("initial window too large")
                        delta = value - self.initial_send_window
                        self.initial_send_window = value
                        for stream in self._streams.values():
                            stream.send_window += delta
                        self.peer_flow_control = True
                        self._window_changed.set()
            case spdy.PingFrame(ping_id):
                if ping_id % 2 == 1:  # client-initiated: echo it
                    await self.send(frame)
                return True
            case spdy.GoAwayFrame():
                self._goaway_sent = True  # the client opens no more streams
            case spdy.HeadersFrame(sid, _, fin):
                stream = self._streams.get(sid)
                if stream is None:
                    return True
                if fin:
                    stream._remote_fin()
            case spdy.WindowUpdateFrame(sid, delta):
                self.peer_flow_control = True
                if sid == 0:
                    if self.send_window + delta > spdy.MAX_WINDOW:
                        raise spdy.SpdyProtocolError("session window overflow")
                    self.send_window += delta
                else:
                    stream = self._streams.get(sid)
                    if stream is None:
                        return True
                    if stream.send_window + delta > spdy.MAX_WINDOW:
                        stream.reset(spdy.RstStatus.FLOW_CONTROL_ERROR)
                        return False
                    stream.send_window += delta
                self._window_changed.set()
            case spdy.SynReplyFrame():
                # The server opens no streams, so no reply can be due.
                raise spdy.SpdyProtocolError("SYN_REPLY sent to a server")
        return False
