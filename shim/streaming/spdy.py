"""SPDY/3.1 framing: frame types, the wire codec and header-block compression.

Only what the Kubernetes streaming protocols use (draft 3.1 minus server
push and CREDENTIAL). Every frame is a plain frozen dataclass; the codec is
sans-I/O so the session layer and the tests drive it with bytes.

A header block is compressed with one zlib context per direction for the
whole connection (preset with the SPDY/3 dictionary) and flushed with
Z_SYNC_FLUSH after each block, so the two codecs are stateful and must see
every frame of their direction in order.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import zlib

VERSION = 3
DEFAULT_WINDOW = 64 * 1024  # SPDY/3.1 initial stream and session window
MAX_WINDOW = 2**31 - 1
MAX_LENGTH = 2**24 - 1  # the 24-bit length field

FLAG_FIN = 0x01
FLAG_UNIDIRECTIONAL = 0x02
FLAG_SETTINGS_CLEAR = 0x01


class FrameType(enum.IntEnum):
    SYN_STREAM = 1
    SYN_REPLY = 2
    RST_STREAM = 3
    SETTINGS = 4
    PING = 6
    GOAWAY = 7
    HEADERS = 8
    WINDOW_UPDATE = 9


class RstStatus(enum.IntEnum):
    PROTOCOL_ERROR = 1
    INVALID_STREAM = 2
    REFUSED_STREAM = 3
    UNSUPPORTED_VERSION = 4
    CANCEL = 5
    INTERNAL_ERROR = 6
    FLOW_CONTROL_ERROR = 7
    STREAM_IN_USE = 8
    STREAM_ALREADY_CLOSED = 9
    FRAME_TOO_LARGE = 11


class GoAwayStatus(enum.IntEnum):
    OK = 0
    PROTOCOL_ERROR = 1
    INTERNAL_ERROR = 2


class Setting(enum.IntEnum):
    UPLOAD_BANDWIDTH = 1
    DOWNLOAD_BANDWIDTH = 2
    ROUND_TRIP_TIME = 3
    MAX_CONCURRENT_STREAMS = 4
    CURRENT_CWND = 5
    DOWNLOAD_RETRANS_RATE = 6
    INITIAL_WINDOW_SIZE = 7
    CLIENT_CERTIFICATE_VECTOR_SIZE = 8


class SpdyProtocolError(Exception):
    """The peer sent bytes that are not valid SPDY/3.1: the session must end."""


Headers = dict[str, str]
"""Lower-case names; several values of one name are joined with NUL, as on the wire."""


# --------------------------------------------------------------------------- frames


@dataclasses.dataclass(frozen=True, slots=True)
class DataFrame:
    stream_id: int
    data: bytes
    fin: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class SynStreamFrame:
    stream_id: int
    headers: Headers
    associated_id: int = 0
    priority: int = 0
    slot: int = 0
    fin: bool = False
    unidirectional: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class SynReplyFrame:
    stream_id: int
    headers: Headers
    fin: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class RstStreamFrame:
    stream_id: int
    status: int


@dataclasses.dataclass(frozen=True, slots=True)
class SettingsFrame:
    # (flags, id, value) triples, in wire order
    entries: tuple[tuple[int, int, int], ...] = ()
    clear: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class PingFrame:
    ping_id: int


@dataclasses.dataclass(frozen=True, slots=True)
class GoAwayFrame:
    last_good_stream_id: int
    status: int = GoAwayStatus.OK


@dataclasses.dataclass(frozen=True, slots=True)
class HeadersFrame:
    stream_id: int
    headers: Headers
    fin: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class WindowUpdateFrame:
    stream_id: int
    delta: int


Frame = (
    DataFrame
    | SynStreamFrame
    | SynReplyFrame
    | RstStreamFrame
    | SettingsFrame
    | PingFrame
    | GoAwayFrame
    | HeadersFrame
    | WindowUpdateFrame
)


# --------------------------------------------------------------------------- dictionary


def _build_dictionary() -> bytes:
    # The SPDY/3 zlib dictionary (draft 3, section 2.6.10.1): length-prefixed
    # header names and values, then raw common strings. Built from its parts
    # so it can be read; tests pin its length and checksum.
    words = (
        "options head post put delete trace accept accept-charset accept-encoding accept-language "
        "accept-ranges age allow authorization cache-control connection content-base "
        "content-encoding content-language content-length content-location content-md5 "
        "content-range content-type date etag expect expires from host if-match "
        "if-modified-since if-none-match if-range if-unmodified-since last-modified location "
        "max-forwards pragma proxy-authenticate proxy-authorization range referer retry-after "
        "server te trailer transfer-encoding upgrade user-agent vary via warning "
        "www-authenticate method get status"
    ).split()
    words += ["200 OK", "version", "HTTP/1.1", "url", "public", "set-cookie", "keep-alive", "origin"]
    prefix = b"".join(struct.pack(">I", len(w)) + w.encode() for w in words)
    tail = (
        "100101201202205206300302303304305306307402405406407408409410411412413414415416417"
        "502504505203 Non-Authoritative Information204 No Content301 Moved Permanently"
        "400 Bad Request401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error"
        "501 Not Implemented503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug Sept Oct "
        "Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,image/png,"
        "image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,text/javascript,"
        "publicprivatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0."
    )
    return prefix + tail.encode()


DICTIONARY = _build_dictionary()


# --------------------------------------------------------------------------- header blocks


def encode_header_block(headers: Headers) -> bytes:
    """The uncompressed name/value block."""
    out = [struct.pack(">I", len(headers))]
    for name, value in headers.items():
        n, v = name.lower().encode(), value.encode()
        out.append(struct.pack(">I", len(n)) + n + struct.pack(">I", len(v)) + v)
    return b"".join(out)


def decode_header_block(block: bytes) -> Headers:
    try:
        (count,) = struct.unpack_from(">I", block, 0)
        pos = 4
        headers: Headers = {}
        for _ in range(count):
            (n_len,) = struct.unpack_from(">I", block, pos)
            name = block[pos + 4 : pos + 4 + n_len]
            pos += 4 + n_len
            (v_len,) = struct.unpack_from(">I", block, pos)
            value = block[pos + 4 : pos + 4 + v_len]
            pos += 4 + v_len
            if len(name) != n_len or len(value) != v_len or pos > len(block):
                raise SpdyProtocolError("truncated header block")
            if not name:
                raise SpdyProtocolError("empty header name")
            key = name.decode("latin-1")
            if key != key.lower():
                raise SpdyProtocolError(f"header name not lower case: {key!r}")
            if key in headers:
                raise SpdyProtocolError(f"duplicate header {key!r}")
            headers[key] = value.decode("utf-8", errors="replace")
    except struct.error as exc:
        raise SpdyProtocolError("truncated header block") from exc
    if pos != len(block):
        raise SpdyProtocolError("trailing bytes after header block")
    return headers


class HeaderCompressor:
    def __init__(self) -> None:
        self._z = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, 15, 8, zdict=DICTIONARY)

    def compress(self, headers: Headers) -> bytes:
        return self._z.compress(encode_header_block(headers)) + self._z.flush(zlib.Z_SYNC_FLUSH)


class HeaderDecompressor:
    def __init__(self, max_size: int = 256 * 1024) -> None:
        self._z = zlib.decompressobj(zdict=DICTIONARY)
        self._max = max_size

    def decompress(self, data: bytes) -> Headers:
        try:
            block = self._z.decompress(data, self._max)
        except zlib.error as exc:
            raise SpdyProtocolError(f"bad header compression: {exc}") from exc
        if self._z.unconsumed_tail:
            raise SpdyProtocolError("header block too large")
        return decode_header_block(block)


# --------------------------------------------------------------------------- codec


def _control_header(ftype: int, flags: int, length: int) -> bytes:
    if length > MAX_LENGTH:
        raise ValueError("frame too large")
    return struct.pack(">HHI", 0x8000 | VERSION, ftype, (flags << 24) | length)


class FrameEncoder:
    """Serialises frames; owns the outgoing header compression context."""

    def __init__(self) -> None:
        self._headers = HeaderCompressor()

    def encode(self, frame: Frame) -> bytes:
        match frame:
            case DataFrame(stream_id, data, fin):
                if len(data) > MAX_LENGTH:
                    raise ValueError("frame too large")
                flags = FLAG_FIN if fin else 0
                return struct.pack(">II", stream_id & 0x7FFFFFFF, (flags << 24) | len(data)) + data
            case SynStreamFrame(stream_id, headers, associated_id, priority, slot, fin, uni):
                block = self._headers.compress(headers)
                flags = (FLAG_FIN if fin else 0) | (FLAG_UNIDIRECTIONAL if uni else 0)
                body = struct.pack(">IIBB", stream_id, associated_id, (priority & 7) << 5, slot) + block
                return _control_header(FrameType.SYN_STREAM, flags, len(body)) + body
            case SynReplyFrame(stream_id, headers, fin):
                body = struct.pack(">I", stream_id) + self._headers.compress(headers)
                return _control_header(FrameType.SYN_REPLY, FLAG_FIN if fin else 0, len(body)) + body
            case HeadersFrame(stream_id, headers, fin):
                body = struct.pack(">I", stream_id) + self._headers.compress(headers)
                return _control_header(FrameType.HEADERS, FLAG_FIN if fin else 0, len(body)) + body
            case RstStreamFrame(stream_id, status):
                return _control_header(FrameType.RST_STREAM, 0, 8) + struct.pack(">II", stream_id, status)
            case SettingsFrame(entries, clear):
                body = struct.pack(">I", len(entries)) + b"".join(
                    struct.pack(">II", (flags << 24) | sid, value) for flags, sid, value in entries
                )
                flags = FLAG_SETTINGS_CLEAR if clear else 0
                return _control_header(FrameType.SETTINGS, flags, len(body)) + body
            case PingFrame(ping_id):
                return _control_header(FrameType.PING, 0, 4) + struct.pack(">I", ping_id)
            case GoAwayFrame(last, status):
                return _control_header(FrameType.GOAWAY, 0, 8) + struct.pack(">II", last, status)
            case WindowUpdateFrame(stream_id, delta):
                return _control_header(FrameType.WINDOW_UPDATE, 0, 8) + struct.pack(">II", stream_id, delta)
        raise TypeError(f"not a SPDY frame: {frame!r}")


def parse_frame_header(head: bytes) -> tuple[bool, int, int, int]:
    """(is_control, type_or_stream_id, flags, length) of an 8-byte frame header.

    For control frames the version is checked here, before the body is read.
    """
    first, second = struct.unpack(">II", head)
    flags, length = second >> 24, second & 0xFFFFFF
    if first & 0x80000000:
        version = (first >> 16) & 0x7FFF
        if version != VERSION:
            raise SpdyProtocolError(f"unsupported SPDY version {version}")
        return True, first & 0xFFFF, flags, length
    return False, first & 0x7FFFFFFF, flags, length


# Control frames whose length is fixed, and the least the others need (draft 3, 2.6).
_FIXED_LENGTH: dict[int, int] = {
    FrameType.RST_STREAM: 8,
    FrameType.PING: 4,
    FrameType.GOAWAY: 8,
    FrameType.WINDOW_UPDATE: 8,
}
_MIN_LENGTH: dict[int, int] = {
    FrameType.SYN_STREAM: 10,
    FrameType.SYN_REPLY: 4,
    FrameType.HEADERS: 4,
    FrameType.SETTINGS: 4,
}


class FrameDecoder:
    """Parses frames; owns the incoming header decompression context."""

    def __init__(self, max_control_length: int = 1024 * 1024, max_data_length: int = MAX_LENGTH) -> None:
        self._headers = HeaderDecompressor()
        self.max_control_length = max_control_length
        self.max_data_length = max_data_length

    def check_header(self, head: bytes) -> int:
        """The body length an 8-byte frame header announces, once the header alone shows
        nothing wrong: a bad version, a length its type cannot have, more than we take.
        A reader calls this before waiting for a body that may never come."""
        control, kind, _, length = parse_frame_header(head)
        if not control:
            if length > self.max_data_length:
                raise SpdyProtocolError(f"DATA frame of {length} bytes (at most {self.max_data_length})")
            return length
        if length > self.max_control_length:
            raise SpdyProtocolError(f"control frame of {length} bytes")
        fixed = _FIXED_LENGTH.get(kind)
        if fixed is not None and length != fixed:
            raise SpdyProtocolError(f"bad {FrameType(kind).name} frame length {length}, want {fixed}")
        least = _MIN_LENGTH.get(kind)
        if least is not None and length < least:
            raise SpdyProtocolError(f"short {FrameType(kind).name} frame: {length} bytes")
        return length

    def decode(self, head: bytes, body: bytes) -> Frame | None:
        """The frame, or None for a control frame type that must be ignored."""
        control, kind, flags, length = parse_frame_header(head)
        if len(body) != length:
            raise SpdyProtocolError("short frame body")
        if not control:
            return DataFrame(kind, body, bool(flags & FLAG_FIN))
        fin = bool(flags & FLAG_FIN)
        try:
            match kind:
                case FrameType.SYN_STREAM:
                    sid, assoc, pri, slot = struct.unpack_from(">IIBB", body)
                    sid &= 0x7FFFFFFF
                    self._require_stream(sid)
                    headers = self._headers.decompress(body[10:])
                    uni = bool(flags & FLAG_UNIDIRECTIONAL)
                    return SynStreamFrame(sid, headers, assoc & 0x7FFFFFFF, pri >> 5, slot, fin, uni)
                case FrameType.SYN_REPLY | FrameType.HEADERS:
                    (sid,) = struct.unpack_from(">I", body)
                    sid &= 0x7FFFFFFF
                    self._require_stream(sid)
                    headers = self._headers.decompress(body[4:])
                    if kind == FrameType.SYN_REPLY:
                        return SynReplyFrame(sid, headers, fin)
                    return HeadersFrame(sid, headers, fin)
                case FrameType.RST_STREAM:
                    self._require_length(length, 8)
                    sid, status = struct.unpack(">II", body)
                    self._require_stream(sid & 0x7FFFFFFF)
                    return RstStreamFrame(sid & 0x7FFFFFFF, status)
                case FrameType.SETTINGS:
                    (count,) = struct.unpack_from(">I", body)
                    self._require_length(length, 4 + 8 * count)
                    entries = []
                    for i in range(count):
                        fid, value = struct.unpack_from(">II", body, 4 + 8 * i)
                        entries.append((fid >> 24, fid & 0xFFFFFF, value))
                    return SettingsFrame(tuple(entries), bool(flags & FLAG_SETTINGS_CLEAR))
                case FrameType.PING:
                    self._require_length(length, 4)
                    return PingFrame(struct.unpack(">I", body)[0])
                case FrameType.GOAWAY:
                    self._require_length(length, 8)
                    last, status = struct.unpack(">II", body)
                    return GoAwayFrame(last & 0x7FFFFFFF, status)
                case FrameType.WINDOW_UPDATE:
                    self._require_length(length, 8)
                    sid, delta = struct.unpack(">II", body)
                    delta &= 0x7FFFFFFF
                    if delta == 0:
                        raise SpdyProtocolError("WINDOW_UPDATE with a zero delta")
                    return WindowUpdateFrame(sid & 0x7FFFFFFF, delta)
        except struct.error as exc:
            raise SpdyProtocolError(f"short {FrameType(kind).name} frame") from exc
        return None  # unknown control frame types are ignored (draft 3, 2.2.1)

    @staticmethod
    def _require_length(length: int, want: int) -> None:
        if length != want:
            raise SpdyProtocolError(f"bad control frame length {length}, want {want}")

    @staticmethod
    def _require_stream(sid: int) -> None:
        if sid == 0:
            raise SpdyProtocolError("stream id 0 on a stream frame")
