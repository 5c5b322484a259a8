"""Bytes in reads cut anywhere: a Connection hears the same frames and answers the same, whether a
read holds many frames, part of one, or a byte (its buffer of a frame cut short across reads)."""

from __future__ import annotations

import random

import pytest

from shim.transport.native.frames import PREFACE, encode_frame, hpack_int
from tests.transport.h2peer import parse_frames
from tests.transport.inproc import DATA, END_STREAM, HEADERS, SETTINGS, connection, request

GOAWAY, WINDOW_UPDATE = 7, 8
FRAME_SIZE_ERROR = 6


def _block(path: bytes) -> bytes:
    # :method POST, :path (literal without indexing), content-type application/grpc (the same)
    return b"\x83" + hpack_int(4, 4) + hpack_int(len(path), 7) + path + b"\x0f\x10\x10application/grpc"


def _conversation() -> bytes:
    out = PREFACE + encode_frame(SETTINGS, 0, 0)
    for i in range(12):
        sid = 2 * i + 1
        message = bytes(range(256)) * (i * 13) + b"m%d" % i  # up to ~36 KB: DATA frames of 16 KiB
        if i % 3 == 2:
            # the body in several DATA frames, the last one ending the stream
            body = b"\x00" + len(message).to_bytes(4, "big") + message
            out += encode_frame(HEADERS, 0x4, sid, _block(b"/svc/M%d" % i))
            pieces = [body[at : at + 16384] for at in range(0, len(body), 16384)]
            for n, piece in enumerate(pieces):
                out += encode_frame(DATA, END_STREAM if n == len(pieces) - 1 else 0, sid, piece)
        elif len(message) + 5 <= 16384:
            out += request(sid, _block(b"/svc/M%d" % i), message)
        else:
            continue
        out += encode_frame(WINDOW_UPDATE, 0, 0, (1000).to_bytes(4, "big"))
    return out


def _fed(cuts: list[int]) -> tuple[bytes, list[tuple[str, bool]], list[bytes]]:
    conn, calls, transport = connection(preface=False)
    data = _conversation()
    at = 0
    for cut in [*cuts, len(data)]:
        if cut > at:
            conn.data_received(data[at:cut])
            at = cut
    assert not conn.closed
    return bytes(transport.data), calls.seen, calls.messages


@pytest.mark.parametrize("seed", range(4))
def test_reads_cut_anywhere_give_the_same_calls_and_answers(seed: int) -> None:
    whole = _fed([])
    assert len(whole[1]) == 8 and all(whole[2])
    size = len(_conversation())
    rng = random.Random(seed)
    assert _fed(sorted(rng.sample(range(1, size), 200))) == whole
    assert _fed(sorted(rng.sample(range(1, size), size // 50))) == whole


def test_reads_of_one_byte_give_the_same_calls_and_answers() -> None:
    data = _conversation()
    assert _fed(list(range(1, len(data)))) == _fed([])


def test_a_frame_too_long_is_refused_from_its_head_though_its_payload_never_comes() -> None:
    conn, _, transport = connection()
    head = (1 << 20).to_bytes(3, "big") + bytes((DATA, 0)) + (1).to_bytes(4, "big")
    conn.data_received(head[:4])
    assert not conn.closed
    conn.data_received(head[4:])  # the head whole, in a second read: refused now
    frames, _ = parse_frames(transport.data)
    assert conn.closed and transport.closed
    goaway = [payload for kind, _, _, payload in frames if kind == GOAWAY]
    assert len(goaway) == 1 and int.from_bytes(goaway[0][4:8], "big") == FRAME_SIZE_ERROR


def test_reads_handed_as_bytearrays_give_the_same_calls_and_answers() -> None:
    conn, calls, transport = connection(preface=False)
    data = _conversation()
    for at in range(0, len(data), 5000):
        conn.data_received(bytearray(data[at : at + 5000]))  # type: ignore[arg-type]
    assert not conn.closed
    assert (bytes(transport.data), calls.seen, calls.messages) == _fed([])
