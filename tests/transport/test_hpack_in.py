"""The native transport's HPACK decoder (shim/transport/native/hpack_in.py) against the `hpack`
package's encoder and decoder, and on every malformed block it must refuse."""

from __future__ import annotations

import random

import pytest
from hpack import Decoder, Encoder, HPACKError, NeverIndexedHeaderTuple

from shim.transport.native.hpack_in import BlockDecoder, HeaderBlockError

GRPC_GO = [  # what grpc-go (the kubelet's client) sends on each call: a new grpc-timeout every time
    (b":method", b"POST"),
    (b":scheme", b"http"),
    (b":path", b"/runtime.v1.RuntimeService/ListContainers"),
    (b":authority", b"/run/cri-shim/cri-shim.sock"),
    (b"content-type", b"application/grpc"),
    (b"user-agent", b"grpc-go/1.72.1"),
    (b"te", b"trailers"),
]


def _random_headers(rng: random.Random) -> list[tuple[bytes, bytes]]:
    names = [b":path", b"content-type", b"grpc-timeout", b"x-custom", b"te", b"user-agent", b"a" * 40]
    out = []
    for _ in range(rng.randint(1, 12)):
        name = rng.choice(names) if rng.random() < 0.8 else bytes(rng.randrange(97, 123) for _ in range(8))
        value = rng.choice(
            [b"", b"trailers", b"POST", bytes(rng.randrange(32, 127) for _ in range(rng.randint(0, 300)))]
        )
        out.append((name, value))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_matches_the_hpack_package_over_a_connection(seed: int) -> None:
    """Blocks in sequence (the dynamic table carried across them, evicting as it fills), Huffman or
    not, never-indexed fields, the peer shrinking and growing its table between blocks."""
    rng = random.Random(seed)
    enc = Encoder()
    ref = Decoder(max_header_list_size=1 << 20)
    ours = BlockDecoder(1 << 20)
    for i in range(300):
        if i % 50 == 49:
            enc.header_table_size = rng.choice([0, 256, 1024, 4096])
        headers: list[object] = list(_random_headers(rng))
        if rng.random() < 0.2:
            headers.append(NeverIndexedHeaderTuple(b"authorization", b"secret"))
        block = enc.encode(headers, huffman=rng.random() < 0.5)
        assert ours.decode(block) == [tuple(h) for h in ref.decode(block, raw=True)], i


def test_grpc_go_calls_decode_with_a_new_timeout_each() -> None:
    enc = Encoder()
    ours = BlockDecoder(65536)
    for i in range(500):
        headers = [*GRPC_GO, (b"grpc-timeout", f"{1999000 - i}u".encode())]
        assert ours.decode(enc.encode(headers)) == headers


def test_an_indexed_block_remembered_is_forgotten_when_the_table_changes() -> None:
    """A block of indexes only means something else once a literal has pushed the table down."""
    ours = BlockDecoder(65536)
    add_a = b"\x40\x01x\x01a"  # literal with indexing: x: a -> dynamic index 62
    add_b = b"\x40\x01x\x01b"
    again = b"\xbe"  # index 62
    assert ours.decode(add_a) == [(b"x", b"a")]
    assert ours.decode(again) == [(b"x", b"a")]
    assert ours.decode(again) == [(b"x", b"a")]  # from memory
    assert ours.decode(add_b) == [(b"x", b"b")]
    assert ours.decode(again) == [(b"x", b"b")]
    assert ours.decode(b"\x20") == []  # the peer empties its table: 62 names nothing
    with pytest.raises(HeaderBlockError, match="index 62"):
        ours.decode(again)


@pytest.mark.parametrize(
    ("block", "why"),
    [
        (b"\x80", "index 0"),
        (b"\xbe", "index 62"),  # the dynamic table is empty
        (b"\xff", "cut short in an integer"),
        (b"\xff\xff\xff\xff\xff\xff", "integer too large"),
        (b"\x40", "cut short before a string"),
        (b"\x40\x05ab", "cut short in a string"),
        (b"\x04", "cut short before a string"),  # indexed name (4), no value
        (b"\x7e\x01a", "index 62"),  # a literal's indexed name (grpc-go's timeout) not in the table
        (b"\x44\x05ab", "cut short in a string"),  # :path, 5 bytes said, 2 there
        (b"\x44\x81\xff", "prefix of EOS"),  # :path, one Huffman byte that ends mid-code
        (b"\x82\x20", "size update after a header field"),
        (b"\x3f\xe2\x1f", "table size 4097 over the 4096"),
    ],
)
def test_a_malformed_block_is_refused(block: bytes, why: str) -> None:
    with pytest.raises(HeaderBlockError, match=why):
        BlockDecoder(65536).decode(block)


def test_a_bad_huffman_string_is_an_hpack_error() -> None:
    with pytest.raises(HPACKError):
        BlockDecoder(65536).decode(b"\x40\x81\xff\x01a")  # a name of one byte of EOS bits


def test_a_header_list_over_the_limit_is_refused() -> None:
    block = Encoder().encode([(b"x-big", b"v" * 200)], huffman=False)
    assert BlockDecoder(300).decode(block) == [(b"x-big", b"v" * 200)]
    with pytest.raises(HeaderBlockError, match="over 200 bytes"):
        BlockDecoder(200).decode(block)


def test_an_entry_larger_than_the_table_empties_it() -> None:
    ours = BlockDecoder(65536)
    ours.decode(b"\x40\x01x\x01a")
    ours.decode(b"\x3f\x11")  # table size 48: "x: a" (34) fits
    assert ours.decode(b"\xbe") == [(b"x", b"a")]
    block = Encoder().encode([(b"y", b"z" * 20)], huffman=False)  # 53 > 48
    assert ours.decode(block) == [(b"y", b"z" * 20)]
    assert ours.size == 0 and not ours.table
