"""A native Connection driven in-process: fed bytes as reads, its writes gathered, its calls recorded."""

from __future__ import annotations

from typing import Any, cast

from shim.transport.native.calls import Calls
from shim.transport.native.connection import Connection
from shim.transport.native.frames import PREFACE, encode_frame
from shim.transport.native.stream import Stream
from tests.transport.h2peer import grpc_frame

DATA, HEADERS, SETTINGS = 0, 1, 4
END_STREAM, END_HEADERS = 0x1, 0x4


class FakeCalls:
    """Calls that record each request's method and whether it has a deadline, and answer it empty."""

    stopping = False
    max_message_bytes = 1 << 20

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []
        self.messages: list[bytes] = []

    def dispatch(self, conn: Connection, st: Stream, message: bytes, out: list[Any]) -> None:
        self.seen.append((st.method, st.deadline > 0))
        self.messages.append(message)
        conn.reply(st, message[::-1], out)


class FakeTransport:
    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return False


def connection(preface: bool = True) -> tuple[Connection, FakeCalls, FakeTransport]:
    """A connection made, and unless ``preface`` is False given the client's preface and SETTINGS."""
    calls = FakeCalls()
    conn = Connection(cast(Calls, calls), set())
    transport = FakeTransport()
    conn.connection_made(cast(Any, transport))
    if preface:
        conn.data_received(PREFACE + encode_frame(SETTINGS, 0, 0))
    return conn, calls, transport


def request(sid: int, block: bytes, message: bytes = b"") -> bytes:
    """The frames of a unary call on ``sid``: its headers' ``block``, then ``message`` in one DATA frame."""
    return encode_frame(HEADERS, END_HEADERS, sid, block) + encode_frame(
        DATA, END_STREAM, sid, grpc_frame(message)
    )


def call(conn: Connection, sid: int, block: bytes) -> None:
    conn.data_received(request(sid, block))
