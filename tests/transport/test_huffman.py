"""The native transport's Huffman decoder (shim/transport/native/huffman.py): against the `hpack`
package's encoder, the RFC's example, and every malformed string it must refuse."""

from __future__ import annotations

import random

import pytest
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH

from shim.transport.native import huffman
from shim.transport.native.huffman import HuffmanError, decode

ENCODER = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)


def test_every_byte_value_alone_and_in_runs() -> None:
    for value in range(256):
        for n in (1, 2, 3, 9):
            text = bytes([value]) * n
            assert decode(ENCODER.encode(text)) == text


@pytest.mark.parametrize("seed", range(5))
def test_random_strings_match_the_encoder(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(500):
        text = bytes(rng.randrange(256) for _ in range(rng.randrange(60)))
        assert decode(ENCODER.encode(text)) == text


def test_the_rfc_example_and_a_grpc_timeout() -> None:
    # RFC 7541 C.4.1: "www.example.com" coded.
    assert decode(bytes.fromhex("f1e3c2e5f23a6ba0ab90f4ff")) == b"www.example.com"
    assert decode(ENCODER.encode(b"1999873u")) == b"1999873u"
    assert decode(b"") == b""


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"\xff\xff\xff\xff", "EOS"),  # 30 ones are EOS, which a string must not hold
        (b"\x1f\xff", "padded"),  # "a" (00011) then 11 one-bits: padding over 7 bits
        (b"\x18", "padded"),  # "a" then 000: padding that is not a prefix of EOS
        (b"\xfe", "padded"),  # 8 bits inside one long code: ends mid-symbol
    ],
)
def test_a_malformed_string_is_refused(raw: bytes, why: str) -> None:
    with pytest.raises(HuffmanError, match=why):
        decode(raw)


def test_steps_past_the_bound_are_computed_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huffman, "_STEPS", {})
    monkeypatch.setattr(huffman, "STEPS_MAX", 3)
    rng = random.Random(7)
    for _ in range(200):
        text = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 30)))
        assert decode(ENCODER.encode(text)) == text
    assert len(huffman._STEPS) == 3
