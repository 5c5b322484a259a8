"""SPDY/3.1 framer and header compression, against byte-level vectors."""

from __future__ import annotations

import struct
import zlib

import pytest

from shim.streaming import spdy

# A SYN_STREAM for the error stream exactly as crictl (Go, moby/spdystream) sends
# it as the first frame of a session: stream 1, priority 0, {"streamtype": "error"}.
GO_SYN_STREAM = bytes.fromhex(
    "80030001000000290000000100000000000078f9e3c6a7c26260606004a7b392a2d4c45c6851c29a0a0a6800000000ffff"
)


def decode(data: bytes, decoder: spdy.FrameDecoder | None = None) -> spdy.Frame | None:
    decoder = decoder or spdy.FrameDecoder()
    return decoder.decode(data[:8], data[8:])


def test_dictionary_is_the_spdy3_dictionary() -> None:
    assert len(spdy.DICTIONARY) == 1423
    # The dictionary id a zlib stream preset with it carries (also in GO_SYN_STREAM).
    assert zlib.adler32(spdy.DICTIONARY) == 0xE3C6A7C2
    assert spdy.DICTIONARY.startswith(b"\x00\x00\x00\x07options\x00\x00\x00\x04head")
    assert spdy.DICTIONARY.endswith(b"charset=iso-8859-1,utf-,*,enq=0.")


def test_decodes_a_syn_stream_from_go() -> None:
    assert decode(GO_SYN_STREAM) == spdy.SynStreamFrame(1, {"streamtype": "error"})


@pytest.mark.parametrize(
    ("frame", "wire"),
    [
        (spdy.DataFrame(1, b"abc"), "0000000100000003616263"),
        (spdy.DataFrame(5, b"", fin=True), "0000000501000000"),
        (spdy.RstStreamFrame(3, spdy.RstStatus.CANCEL), "80030003000000080000000300000005"),
        (spdy.PingFrame(7), "800300060000000400000007"),
        (spdy.GoAwayFrame(9, spdy.GoAwayStatus.PROTOCOL_ERROR), "80030007000000080000000900000001"),
        (spdy.WindowUpdateFrame(0, 0x10000), "80030009000000080000000000010000"),
        (
            spdy.SettingsFrame(((0, spdy.Setting.INITIAL_WINDOW_SIZE, 0x20000), (1, 4, 100))),
            "80030004000000140000000200000007000200000100000400000064",
        ),
    ],
    ids=["data", "data-fin", "rst", "ping", "goaway", "window-update", "settings"],
)
def test_frame_vectors(frame: spdy.Frame, wire: str) -> None:
    assert spdy.FrameEncoder().encode(frame).hex() == wire
    assert decode(bytes.fromhex(wire)) == frame


def test_header_block_layout() -> None:
    block = spdy.encode_header_block({"streamtype": "data", "port": "80"})
    assert block == (
        b"\x00\x00\x00\x02"
        b"\x00\x00\x00\x0astreamtype\x00\x00\x00\x04data"
        b"\x00\x00\x00\x04port\x00\x00\x00\x0280"
    )
    assert spdy.decode_header_block(block) == {"streamtype": "data", "port": "80"}


def test_syn_reply_layout_and_compression() -> None:
    wire = spdy.FrameEncoder().encode(spdy.SynReplyFrame(3, {"a": "b"}, fin=True))
    ctype, flags_len, sid = struct.unpack(">III", wire[:12])
    assert ctype == 0x80030002
    assert flags_len >> 24 == spdy.FLAG_FIN and flags_len & 0xFFFFFF == len(wire) - 8
    assert sid == 3
    # zlib header with FDICT set and the SPDY dictionary's id, then a sync flush.
    block = wire[12:]
    assert block[0] == 0x78 and block[1] & 0x20
    assert block[2:6] == bytes.fromhex("e3c6a7c2")
    assert block.endswith(b"\x00\x00\xff\xff")
    z = zlib.decompressobj(zdict=spdy.DICTIONARY)
    assert z.decompress(block) == spdy.encode_header_block({"a": "b"})


def test_compression_context_spans_the_connection() -> None:
    encoder, decoder = spdy.FrameEncoder(), spdy.FrameDecoder()
    frames = [
        spdy.SynStreamFrame(i, {"streamtype": t}) for i, t in ((1, "error"), (3, "stdout"), (5, "stdout"))
    ]
    wires = [encoder.encode(f) for f in frames]
    # Later blocks refer back to earlier ones: the third repeats the second.
    assert len(wires[2]) < len(wires[1])
    assert [decode(w, decoder) for w in wires] == frames
    # Without the earlier context a later block cannot be decoded.
    with pytest.raises(spdy.SpdyProtocolError):
        decode(wires[2])


def test_syn_stream_flags_priority() -> None:
    frame = spdy.SynStreamFrame(7, {"x": "y"}, associated_id=0, priority=3, fin=True, unidirectional=True)
    wire = spdy.FrameEncoder().encode(frame)
    assert wire[4] == spdy.FLAG_FIN | spdy.FLAG_UNIDIRECTIONAL
    assert wire[16] == 3 << 5
    assert decode(wire) == frame


def test_unknown_control_frame_is_ignored() -> None:
    assert decode(bytes.fromhex("8003000a00000000")) is None


def _control(ftype: int, body: bytes, version: int = 3, flags: int = 0) -> bytes:
    return struct.pack(">HHI", 0x8000 | version, ftype, flags << 24 | len(body)) + body


def _compressed(block: bytes) -> bytes:
    z = zlib.compressobj(zdict=spdy.DICTIONARY)
    return z.compress(block) + z.flush(zlib.Z_SYNC_FLUSH)


@pytest.mark.parametrize(
    "wire",
    [
        _control(1, b"\x00" * 10, version=2),
        _control(3, b"\x00\x00\x00\x01"),  # RST_STREAM too short
        _control(6, b"\x00\x00\x00\x01\x00"),  # PING too long
        _control(9, struct.pack(">II", 1, 0)),  # zero window delta
        _control(1, struct.pack(">IIBB", 0, 0, 0, 0) + _compressed(b"\x00\x00\x00\x00")),  # stream 0
        _control(1, struct.pack(">IIBB", 1, 0, 0, 0) + b"not zlib at all"),
        _control(1, struct.pack(">IIBB", 1, 0, 0, 0) + _compressed(b"\x00\x00\x00\x05")),  # truncated block
        _control(
            1, struct.pack(">IIBB", 1, 0, 0, 0) + _compressed(spdy.encode_header_block({"a": "1"})[:-1])
        ),
        _control(
            1,
            struct.pack(">IIBB", 1, 0, 0, 0)
            + _compressed(b"\x00\x00\x00\x01\x00\x00\x00\x01A\x00\x00\x00\x00"),  # upper-case name
        ),
        _control(
            1,
            struct.pack(">IIBB", 1, 0, 0, 0)
            + _compressed(b"\x00\x00\x00\x02" + b"\x00\x00\x00\x01a\x00\x00\x00\x00" * 2),  # duplicate
        ),
        _control(4, b"\x00\x00\x00\x02" + b"\x00" * 8),  # SETTINGS count beyond the body
        _control(2, b"\x00\x00"),  # SYN_REPLY without a stream id
    ],
    ids=[
        "version-2",
        "short-rst",
        "long-ping",
        "zero-window-delta",
        "stream-zero",
        "garbage-compression",
        "truncated-block",
        "cut-pair",
        "uppercase-name",
        "duplicate-name",
        "settings-count",
        "short-syn-reply",
    ],
)
def test_malformed_frames_raise(wire: bytes) -> None:
    with pytest.raises(spdy.SpdyProtocolError):
        decode(wire)


def test_header_bomb_is_refused() -> None:
    block = spdy.encode_header_block({"a": "x" * 300_000})
    wire = _control(1, struct.pack(">IIBB", 1, 0, 0, 0) + _compressed(block))
    assert len(wire) < 5000  # tiny on the wire, large once inflated
    with pytest.raises(spdy.SpdyProtocolError, match="too large"):
        decode(wire)
