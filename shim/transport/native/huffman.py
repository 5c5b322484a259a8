"""Huffman-coded header strings in (RFC 7541 section 5.2, the code of its Appendix B).

The code's tree is built once from the RFC's table (the ``hpack`` package spells
it out as two lists, each symbol's code and its length). Decoding walks that
tree bit by bit only the first time a (tree node, input byte) pair is met: the
symbols that byte completes and the node it leaves the walk at are kept, so a
string already seen in its parts is one dict lookup a byte. A gRPC client's
strings are few (paths, an authority, digits of grpc-timeout): ~900 pairs
after 50,000 timeouts. The pairs are at most 256 nodes x 256 bytes; past
``STEPS_MAX`` kept (a peer sending every byte after every node) they are
computed and not kept.

A string must end on a prefix of EOS (all ones) of at most 7 bits, and EOS
itself must not appear (section 5.2): either raises :class:`HuffmanError`.
"""

from __future__ import annotations

from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH

EOS = 256
STEPS_MAX = 16_384  # (node, byte) pairs kept: 2.6 MB when full (tracemalloc)


class HuffmanError(ValueError):
    """A string that is not valid Huffman code (EOS in it, or bad padding)."""


def _tree() -> list[list[int]]:
    """Each internal node's two children, the root first: a child >= 0 is a node, -1 - s symbol s."""
    kids = [[0, 0]]
    for symbol, (code, length) in enumerate(zip(REQUEST_CODES, REQUEST_CODES_LENGTH, strict=True)):
        node = 0
        for shift in range(length - 1, 0, -1):
            bit = (code >> shift) & 1
            if kids[node][bit] == 0:
                kids.append([0, 0])
                kids[node][bit] = len(kids) - 1
            node = kids[node][bit]
        kids[node][code & 1] = -1 - symbol
    return kids


_KIDS = _tree()


def _padding_ends() -> frozenset[int]:
    """The nodes a string may end on: the root, or 1 to 7 one-bits below it (EOS's prefix)."""
    ends = {0}
    node = 0
    for _ in range(7):
        node = _KIDS[node][1]
        ends.add(node)
    return frozenset(ends)


ENDS = _padding_ends()
_STEPS: dict[int, tuple[int, bytes]] = {}


def _step(key: int) -> tuple[int, bytes]:
    """Walk byte ``key & 0xFF`` from node ``key >> 8``: the node it ends on and the symbols it completes."""
    node = key >> 8
    byte = key & 0xFF
    out = bytearray()
    for shift in range(7, -1, -1):
        nxt = _KIDS[node][(byte >> shift) & 1]
        if nxt < 0:
            if nxt == -1 - EOS:
                raise HuffmanError("EOS in a Huffman-coded string")
            out.append(-1 - nxt)
            node = 0
        else:
            node = nxt
    step = (node, bytes(out))
    if len(_STEPS) < STEPS_MAX:
        _STEPS[key] = step
    return step


def decode(raw: bytes) -> bytes:
    """The string that ``raw`` codes."""
    node = 0
    out = []
    get = _STEPS.get
    for byte in raw:
        key = node << 8 | byte
        step = get(key) or _step(key)
        node = step[0]
        if step[1]:
            out.append(step[1])
    if node not in ENDS:
        raise HuffmanError("Huffman-coded string not padded with a prefix of EOS")
    return b"".join(out)
