"""A gRPC client on python-hyper's h2: a strict HTTP/2 peer for the native transport's tests.

h2's state machine checks every frame the server sends (flow-control windows,
frame sizes, stream states, header blocks and their fields) and raises on the
first one that breaks RFC 9113. The peer keeps that error and raises it from
every wait, so a test fails at the frame that was wrong, not at a timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import urllib.parse
from collections.abc import Callable, Iterable

import h2.config
import h2.connection
import h2.events
import h2.settings
from google.protobuf.message import Message

RUNTIME = "/runtime.v1.RuntimeService/"
IMAGE = "/runtime.v1.ImageService/"
WAIT = 15.0  # seconds one wait may take before the test fails: a bound, not a measure of speed

Header = tuple[bytes, bytes]


def grpc_frame(message: Message | bytes) -> bytes:
    """One length-prefixed, uncompressed gRPC message."""
    data = message if isinstance(message, bytes) else message.SerializeToString()
    return b"\x00" + len(data).to_bytes(4, "big") + data


def request_headers(path: str, timeout: str | None = None, extra: Iterable[Header] = ()) -> list[Header]:
    headers = [
        (b":method", b"POST"),
        (b":scheme", b"http"),
        (b":path", path.encode()),
        (b":authority", b"localhost"),
        (b"content-type", b"application/grpc"),
        (b"te", b"trailers"),
    ]
    if timeout is not None:
        headers.append((b"grpc-timeout", timeout.encode()))
    return headers + list(extra)


def split_headers(data: bytes, size: int, pad: int = 0, priority: bool = False) -> bytes:
    """``data`` (frames h2 would send) with each HEADERS block re-cut into HEADERS + CONTINUATIONs of
    ``size`` bytes; the HEADERS frame optionally PADDED with ``pad`` bytes and carrying PRIORITY fields."""
    out = bytearray()
    for kind, flags, sid, payload in parse_frames(data)[0]:
        if kind != 1:
            out += frame(kind, flags, sid, payload)
            continue
        assert not flags & 0x28, "h2 sent padding or priority itself"
        first, rest = payload[:size], payload[size:]
        head_flags = flags & 0x1  # END_STREAM stays on HEADERS
        prefix = b""
        if pad:
            head_flags |= 0x8
            prefix += bytes((pad,))
        if priority:
            head_flags |= 0x20
            prefix += (sid - 2 if sid > 2 else 0).to_bytes(4, "big") + b"\x0f"
        pieces = [rest[i : i + size] for i in range(0, len(rest), size)]
        if not pieces:
            head_flags |= 0x4
        out += frame(1, head_flags, sid, prefix + first + bytes(pad))
        for i, piece in enumerate(pieces):
            out += frame(9, 0x4 if i == len(pieces) - 1 else 0, sid, piece)
    return bytes(out)


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + sid.to_bytes(4, "big") + payload


def parse_frames(data: bytes | bytearray) -> tuple[list[tuple[int, int, int, bytes]], int]:
    """The whole frames at the start of ``data`` as (type, flags, stream, payload), and the bytes they take."""
    frames, pos = [], 0
    while len(data) - pos >= 9:
        length = int.from_bytes(data[pos : pos + 3], "big")
        if len(data) - pos < 9 + length:
            break
        sid = int.from_bytes(data[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
        frames.append((data[pos + 3], data[pos + 4], sid, bytes(data[pos + 9 : pos + 9 + length])))
        pos += 9 + length
    return frames, pos


class Reply:
    """What the server sent on one stream."""

    def __init__(self) -> None:
        self.headers: list[Header] | None = None
        self.data = bytearray()
        self.trailers: list[Header] | None = None
        self.ended = False
        self.reset: int | None = None  # the code of the server's RST_STREAM

    @property
    def done(self) -> bool:
        return self.ended or self.reset is not None

    def _field(self, name: bytes) -> bytes | None:
        # A Trailers-Only answer carries the status in its one HEADERS frame.
        block = self.trailers if self.trailers is not None else self.headers
        return next((v for k, v in block or () if k == name), None)

    @property
    def status(self) -> int:
        value = self._field(b"grpc-status")
        assert value is not None, f"no grpc-status in {self.headers} / {self.trailers} (reset {self.reset})"
        return int(value)

    @property
    def detail(self) -> str:
        return urllib.parse.unquote((self._field(b"grpc-message") or b"").decode("ascii"))

    def messages(self) -> list[bytes]:
        """The gRPC messages of the reply; each must be whole."""
        out, pos, data = [], 0, bytes(self.data)
        while pos < len(data):
            assert data[pos] == 0 and len(data) - pos >= 5, f"bad message prefix at {pos}"
            end = pos + 5 + int.from_bytes(data[pos + 1 : pos + 5], "big")
            assert end <= len(data), "a message cut short"
            out.append(data[pos + 5 : end])
            pos = end
        return out


class Peer:
    """One HTTP/2 connection to the server, driven by h2; received frames are also logged raw."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        conn: h2.connection.H2Connection,
        auto_ack: bool,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.conn = conn
        self.auto_ack = auto_ack  # give back received data at once; else the test grants window itself
        self.replies: dict[int, Reply] = {}
        self.frames: list[tuple[int, int, int, int]] = []  # (type, flags, stream, length) as received
        self.sent: list[tuple[int, int, int, int]] = []  # the same of what the peer sent, after SETTINGS
        self.pings: list[bytes] = []
        self.settings_acks = 0
        self.remote_settings = False
        self.window_updates: dict[int, int] = {}  # stream (0: the connection) -> WINDOW_UPDATEs received
        self.goaway: tuple[int, int] | None = None  # the server's GOAWAY: (last stream, error code)
        self.error: BaseException | None = None
        self.eof = False
        self._raw = bytearray()
        self._ping_ids = itertools.count(1)
        self._changed = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._pump())

    @classmethod
    async def open(cls, path: str, settings: dict[int, int] | None = None, auto_ack: bool = True) -> Peer:
        """Connect, exchange SETTINGS; ``settings`` are the client's first ones (in force at once)."""
        reader, writer = await asyncio.open_unix_connection(path)
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        if settings:
            conn.local_settings = h2.settings.Settings(client=True, initial_values=settings)
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        peer = cls(reader, writer, conn, auto_ack)
        await peer.until(lambda: peer.remote_settings and peer.settings_acks > 0)
        return peer

    async def close(self) -> None:
        self._task.cancel()
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except OSError:
            pass

    # ------------------------------------------------------------ receiving
    async def _pump(self) -> None:
        try:
            while True:
                data = await self.reader.read(65536)
                if not data:
                    break
                for event in self.conn.receive_data(self._log(data)):
                    self._on(event)
                self.flush()
                self._changed.set()
        except Exception as exc:  # h2 found a frame wrong, or the socket broke: every wait raises it
            self.error = exc
        finally:
            self.eof = True
            self._changed.set()

    def _log(self, data: bytes) -> bytes:
        """Logs the whole frames received so far; returns them for h2, less GOAWAY.

        h2 takes a GOAWAY as the end of the connection and refuses the frames
        after it, but RFC 9113 section 6.8 lets the streams it names finish:
        the peer keeps GOAWAY to itself and checks it here.
        """
        self._raw += data
        frames, used = parse_frames(self._raw)
        whole = bytes(self._raw[:used])
        del self._raw[:used]
        self.frames += [(kind, flags, sid, len(payload)) for kind, flags, sid, payload in frames]
        if not any(kind == 7 for kind, _, _, _ in frames):
            return whole
        out = bytearray()
        for kind, flags, sid, payload in frames:
            if kind != 7:
                out += frame(kind, flags, sid, payload)
                continue
            assert sid == 0 and len(payload) >= 8, "malformed GOAWAY"
            last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            assert self.goaway is None or last <= self.goaway[0], "a later GOAWAY named a higher stream"
            self.goaway = (last, int.from_bytes(payload[4:8], "big"))
        return bytes(out)

    def _on(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            self.replies[event.stream_id].headers = list(event.headers)  # type: ignore[arg-type]
        elif isinstance(event, h2.events.DataReceived):
            self.replies[event.stream_id].data += event.data
            if self.auto_ack:
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.TrailersReceived):
            self.replies[event.stream_id].trailers = list(event.headers)  # type: ignore[arg-type]
        elif isinstance(event, h2.events.StreamEnded):
            self.replies[event.stream_id].ended = True
        elif isinstance(event, h2.events.StreamReset):
            if event.stream_id in self.replies:
                self.replies[event.stream_id].reset = event.error_code
        elif isinstance(event, h2.events.WindowUpdated):
            self.window_updates[event.stream_id] = self.window_updates.get(event.stream_id, 0) + 1
        elif isinstance(event, h2.events.PingAckReceived):
            self.pings.append(event.ping_data)
        elif isinstance(event, h2.events.SettingsAcknowledged):
            self.settings_acks += 1
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            self.remote_settings = True

    async def until(self, cond: Callable[[], object], seconds: float = WAIT) -> None:
        """Until ``cond`` holds; raises what h2 found wrong, or if the server closes first."""
        async with asyncio.timeout(seconds):
            while not cond():
                if self.error is not None:
                    raise self.error
                if self.eof:
                    raise ConnectionError("the server closed the connection")
                self._changed.clear()
                await self._changed.wait()
        if self.error is not None:
            raise self.error

    async def ping(self) -> None:
        """A PING and its ACK: the server has answered every frame sent before it (it reads in order)."""
        data = next(self._ping_ids).to_bytes(8, "big")
        self.conn.ping(data)
        self.flush()
        await self.until(lambda: data in self.pings)

    async def reply(self, sid: int) -> Reply:
        await self.until(lambda: self.replies[sid].done)
        return self.replies[sid]

    # ------------------------------------------------------------ sending
    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.write_raw(data)

    def write_raw(self, data: bytes) -> None:
        """Whole frames; those h2 does not know of too: frames it would not send, or would send otherwise."""
        frames, used = parse_frames(data)
        assert used == len(data)
        self.sent += [(kind, flags, sid, len(payload)) for kind, flags, sid, payload in frames]
        self.writer.write(data)

    def open_stream(
        self,
        path: str,
        timeout: str | None = None,
        extra: Iterable[Header] = (),
        end: bool = False,
        rewrite: Callable[[bytes], bytes] | None = None,
    ) -> int:
        """A new stream's request headers; ``rewrite`` changes the frames h2 made of them before they go."""
        sid: int = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, request_headers(path, timeout, extra), end_stream=end)
        self.replies[sid] = Reply()
        if rewrite is not None:
            self.write_raw(rewrite(self.conn.data_to_send()))
        self.flush()
        return sid

    async def send(self, sid: int, data: bytes, end: bool = True) -> None:
        """``data`` on ``sid`` in the frames the windows allow, waiting for WINDOW_UPDATE when they are shut."""
        view = memoryview(data)
        pos = 0
        while True:
            room = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size)
            take = min(room, len(data) - pos)
            if take <= 0 and pos < len(data):
                await self.until(lambda: self.conn.local_flow_control_window(sid) > 0)
                continue
            last = pos + take == len(data)
            self.conn.send_data(sid, view[pos : pos + take], end_stream=end and last)
            pos += take
            self.flush()
            await self.writer.drain()
            if last:
                return

    async def start(
        self, path: str, request: Message | bytes, timeout: str | None = None, extra: Iterable[Header] = ()
    ) -> int:
        sid = self.open_stream(path, timeout, extra)
        await self.send(sid, grpc_frame(request))
        return sid

    async def call(
        self, path: str, request: Message | bytes, timeout: str | None = None, extra: Iterable[Header] = ()
    ) -> Reply:
        return await self.reply(await self.start(path, request, timeout, extra))

    def grant(self, increment: int, sid: int | None = None) -> None:
        """WINDOW_UPDATE by ``increment`` on ``sid`` (None: the connection)."""
        self.conn.increment_flow_control_window(increment, sid)
        self.flush()

    def received(self, sid: int) -> int:
        """DATA payload bytes received on ``sid`` so far (all flow-controlled: the server never pads)."""
        return sum(length for kind, _, s, length in self.frames if kind == 0 and s == sid)
