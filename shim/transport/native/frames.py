"""HTTP/2 on the wire (RFC 9113): the codes a frame carries, its header read and written.

Also the little HPACK (RFC 7541) the server writes itself: literal headers
that never touch the peer's table, and a table size update. Header blocks
are decoded by the ``hpack`` package.
"""

from __future__ import annotations

import struct

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
# A frame's 9-byte head: the 24-bit length as 16 + 8 bits, type, flags, R bit + stream ID.
FRAME_HEAD = struct.Struct(">HBBBI")


class ProtocolViolation(Exception):
    """The peer broke the protocol: GOAWAY with ``code``, then close."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


# What an outgoing list holds until one join sends it: frames, or parts of them cut from a
# message without copying.
Chunk = bytes | memoryview


def data_head(length: int, sid: bytes) -> bytes:
    """The 9-byte head of a DATA frame of ``length`` bytes on stream ``sid`` (4 bytes, big-endian)."""
    return bytes((length >> 16, (length >> 8) & 0xFF, length & 0xFF, DATA, 0)) + sid


def encode_frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return bytes((n >> 16, (n >> 8) & 0xFF, n & 0xFF, kind, flags)) + sid.to_bytes(4, "big") + payload


def next_frame(buf: bytearray, pos: int, limit: int) -> tuple[int, int, int, bytes, int] | None:
    """The frame at ``pos``: (type, flags, stream ID, payload, where the next one starts), None if cut short.

    A frame longer than ``limit`` is the peer's error (FRAME_SIZE_ERROR).
    """
    if len(buf) - pos < 9:
        return None
    high, low, kind, flags, sid = FRAME_HEAD.unpack_from(buf, pos)
    length = high << 8 | low
    if length > limit:
        raise ProtocolViolation(FRAME_SIZE_ERROR, f"frame of {length} bytes (max {limit})")
    end = pos + 9 + length
    if len(buf) < end:
        return None
    return kind, flags, sid & 0x7FFFFFFF, bytes(buf[pos + 9 : end]), end


def unpad(flags: int, payload: bytes) -> bytes:
    """A DATA or HEADERS payload without its padding (RFC 9113 section 6.1)."""
    if flags & PADDED:
        if not payload or payload[0] >= len(payload):
            raise ProtocolViolation(PROTOCOL_ERROR, "padding longer than the frame")
        return payload[1 : len(payload) - payload[0]]
    return payload


def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
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
    return b"\x00" + hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value
