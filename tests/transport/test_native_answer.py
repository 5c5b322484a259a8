"""An OK unary answer's bytes (calls.unary_answer, packed for speed) are the frames written out one by one."""

from __future__ import annotations

import pytest

from shim.transport.native.calls import OK_TRAILERS, RESPONSE_HEADERS, unary_answer
from shim.transport.native.frames import DATA, END_HEADERS, END_STREAM, HEADERS, encode_frame


def _expected(sid: int, message: bytes, limit: int) -> bytes:
    body = b"\x00" + len(message).to_bytes(4, "big") + message
    out = encode_frame(HEADERS, END_HEADERS, sid, RESPONSE_HEADERS)
    for at in range(0, len(body), limit):
        out += encode_frame(DATA, 0, sid, body[at : at + limit])
    return out + encode_frame(HEADERS, END_HEADERS | END_STREAM, sid, OK_TRAILERS)


@pytest.mark.parametrize("sid", [1, 255, 257, 65_537, (1 << 31) - 1])
@pytest.mark.parametrize("size", [0, 1, 250, 16_379, 16_380, 70_000, 100_000])
@pytest.mark.parametrize("limit", [16_384, 65_536])
def test_the_packed_answer_is_its_frames(sid: int, size: int, limit: int) -> None:
    message = bytes(i * 7 % 251 for i in range(size))
    assert unary_answer(sid, message, limit) == _expected(sid, message, limit)
