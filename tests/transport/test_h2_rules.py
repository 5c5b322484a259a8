"""What RFC 9113 tells a server to do with a client's bad frames, one rule a row.

h2 checks what the server sends; here raw frames check what it accepts: the
error it answers with (a stream error, RST_STREAM, ends one call; a
connection error, GOAWAY, ends them all) and that a stream error leaves the
connection serving. Each row cites the section of RFC 9113 it comes from.
"""

from __future__ import annotations

import asyncio

import pytest
from hpack import Encoder

from cri_api import api_pb2 as pb
from tests.transport.conftest import Native
from tests.transport.h2peer import RUNTIME, frame, grpc_frame, parse_frames, request_headers

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST, SETTINGS, PUSH, PING, GOAWAY, WINDOW, CONTINUATION = range(10)
NO_ERROR, PROTOCOL, FLOW_CONTROL, STREAM_CLOSED, FRAME_SIZE = 0, 1, 3, 5, 6
MAX_WINDOW = (1 << 31) - 1
BARRIER = b"barrier!"


def u32(value: int) -> bytes:
    return value.to_bytes(4, "big")


def setting(key: int, value: int) -> bytes:
    return frame(SETTINGS, 0, 0, key.to_bytes(2, "big") + u32(value))


def opened(sid: int = 1, method: str = "ListPodSandbox") -> bytes:
    """A request's headers, its body still to come: the stream is open."""
    return frame(HEADERS, 0x4, sid, bytes(Encoder().encode(request_headers(RUNTIME + method))))


async def exchange(path: str, frames: bytes) -> list[tuple[int, int, int, bytes]]:
    """Send ``frames`` then a PING; the server's frames until it answers that PING or closes."""
    reader, writer = await asyncio.open_unix_connection(path)
    got = bytearray()
    try:
        writer.write(PREFACE + frame(SETTINGS, 0, 0) + frames + frame(PING, 0, 0, BARRIER))
        async with asyncio.timeout(15):
            while True:
                data = await reader.read(65536)
                got += data
                seen = parse_frames(got)[0]
                if not data or any(k == PING and f & 1 and p == BARRIER for k, f, _, p in seen):
                    return seen
    finally:
        writer.close()


def outcome(frames: list[tuple[int, int, int, bytes]]) -> tuple[str, int, int]:
    """("goaway", 0, code), ("rst", stream, code) or ("alive", 0, 0): what the server did."""
    for kind, _, sid, payload in frames:
        if kind == GOAWAY:
            return ("goaway", 0, int.from_bytes(payload[4:8], "big"))
        if kind == RST:
            return ("rst", sid, int.from_bytes(payload, "big"))
    return ("alive", 0, 0)


RULES = [
    # 6.9: an increment of 0 is a stream error PROTOCOL_ERROR on a stream, a connection error on 0.
    ("window update of 0 on a stream", opened() + frame(WINDOW, 0, 1, u32(0)), ("rst", 1, PROTOCOL)),
    ("window update of 0 on the connection", frame(WINDOW, 0, 0, u32(0)), ("goaway", 0, PROTOCOL)),
    # 6.9.1: a window past 2^31-1 is a FLOW_CONTROL_ERROR: of the stream, or of the connection.
    ("stream window past 2^31-1", opened() + frame(WINDOW, 0, 1, u32(MAX_WINDOW)), ("rst", 1, FLOW_CONTROL)),
    ("connection window past 2^31-1", frame(WINDOW, 0, 0, u32(MAX_WINDOW)), ("goaway", 0, FLOW_CONTROL)),
    # 6.9.2: so is a SETTINGS_INITIAL_WINDOW_SIZE change that takes an open stream's window past it.
    (
        "initial window change past 2^31-1",
        opened() + frame(WINDOW, 0, 1, u32(MAX_WINDOW - 65535)) + setting(0x4, 65536),
        ("goaway", 0, FLOW_CONTROL),
    ),
    ("initial window over 2^31-1", setting(0x4, MAX_WINDOW + 1), ("goaway", 0, FLOW_CONTROL)),
    # 6.5.2: ENABLE_PUSH is 0 or 1; MAX_FRAME_SIZE is 2^14..2^24-1.
    ("enable push of 2", setting(0x2, 2), ("goaway", 0, PROTOCOL)),
    ("max frame size under 2^14", setting(0x5, 16383), ("goaway", 0, PROTOCOL)),
    ("unknown setting", setting(0x99, 7), ("alive", 0, 0)),
    # 6.4, 6.7: RST_STREAM is 4 bytes, PING 8: other lengths are FRAME_SIZE_ERROR.
    ("RST_STREAM of 3 bytes", opened() + frame(RST, 0, 1, b"\x00\x00\x08"), ("goaway", 0, FRAME_SIZE)),
    ("PING of 7 bytes", frame(PING, 0, 0, b"1234567"), ("goaway", 0, FRAME_SIZE)),
    # 6.3, 6.8: PRIORITY names a stream; GOAWAY is the connection's.
    ("PRIORITY on stream 0", frame(PRIORITY, 0, 0, bytes(5)), ("goaway", 0, PROTOCOL)),
    ("PRIORITY on an idle stream", frame(PRIORITY, 0, 9, u32(0) + b"\x10"), ("alive", 0, 0)),
    ("GOAWAY on a stream", frame(GOAWAY, 0, 1, bytes(8)), ("goaway", 0, PROTOCOL)),
    # 5.1: on an idle stream only HEADERS and PRIORITY may come.
    ("RST_STREAM on an idle stream", frame(RST, 0, 5, u32(8)), ("goaway", 0, PROTOCOL)),
    ("WINDOW_UPDATE on an idle stream", frame(WINDOW, 0, 5, u32(100)), ("goaway", 0, PROTOCOL)),
    ("DATA on an idle stream", frame(DATA, 0, 5, b"x"), ("goaway", 0, PROTOCOL)),
    # 6.10: a header block is HEADERS and CONTINUATIONs of its stream, nothing between.
    ("CONTINUATION alone", frame(CONTINUATION, 0x4, 1, b"\x82"), ("goaway", 0, PROTOCOL)),
    (
        "header block interrupted",
        frame(HEADERS, 0, 1, b"\x83") + frame(PING, 0, 0, bytes(8)),
        ("goaway", 0, PROTOCOL),
    ),
]


@pytest.mark.parametrize(("frames", "expected"), [r[1:] for r in RULES], ids=[r[0] for r in RULES])
async def test_a_bad_frame_gets_the_error_rfc_9113_names(
    native: Native, frames: bytes, expected: tuple[str, int, int]
) -> None:
    got = outcome(await exchange(native.sock, frames))
    assert got == expected
    if expected[0] != "goaway":  # a stream error leaves the connection serving: the PING came back
        request = opened(3) + frame(DATA, 0x1, 3, grpc_frame(pb.ListPodSandboxRequest()))
        answer = await exchange(native.sock, frames + request)
        assert any(k == HEADERS and s == 3 and f & 0x1 for k, f, s, _ in answer)
