"""Request header blocks in: an HPACK decoder (RFC 7541) built for what gRPC clients send.

The `hpack` package's Decoder spends about 20 µs on a block of nine indexed
fields (a tuple subclass, a memoryview slice and a debug log call per field):
as much as the rest of a small call's HTTP/2 work. A gRPC client sends the same
few headers on every call, and after the first call nearly all of them are
indexed: grpcio's second and later blocks are 9 bytes, each byte one index.
This decoder:

- reads each representation (indexed, literal with or without indexing, never
  indexed, table size update) with plain integer arithmetic over the bytes;
- keeps the dynamic table as a deque, newest first, evicting by the RFC's
  entry size (name + value + 32) down to the size the peer set;
- remembers the answer for a block that only indexes (it changes no table), for
  as long as the table does not change: a grpcio client's next call with the
  same method is one dict lookup. A literal with indexing (grpc-go indexes a new
  `grpc-timeout` on every call) or a size update forgets them all.

Huffman-coded strings are read by ``huffman`` (a byte at a time); the static
table is the `hpack` package's (the RFC's). Every malformed block raises
:class:`HeaderBlockError`, an `hpack.HPACKError`: the connection answers it with
COMPRESSION_ERROR (RFC 9113 section 4.3), the table being out of step from there.
"""

from __future__ import annotations

from collections import deque

from hpack import HPACKError
from hpack.table import HeaderTable

from shim.transport.native.huffman import HuffmanError, decode

STATIC = HeaderTable.STATIC_TABLE  # RFC 7541 Appendix A: index 1 is STATIC[0]
STATIC_LEN = len(STATIC)
DYNAMIC_FIRST = STATIC_LEN + 1  # the index of the dynamic table's newest entry
ENTRY_OVERHEAD = 32  # RFC 7541 section 4.1
MAX_INT_BYTES = 4  # continuation bytes after a prefix: up to 2**28, beyond any size here
MEMO_MAX = 64  # indexed-only blocks remembered at once

Header = tuple[bytes, bytes]


class HeaderBlockError(HPACKError):
    """A header block that is not valid HPACK or breaks a limit."""


class BlockDecoder:
    """One connection's decoding context: its dynamic table and limits."""

    __slots__ = ("kept", "max_list", "max_table", "memo", "size", "table", "table_max")

    def __init__(self, max_header_list_size: int, max_table_size: int = 4096) -> None:
        self.max_list = max_header_list_size
        self.max_table = max_table_size  # what our SETTINGS allow the peer (the default: we send none)
        self.table_max = max_table_size  # what the peer set with size updates
        self.table: deque[Header] = deque()
        self.size = 0
        self.memo: dict[bytes, list[Header]] = {}
        self.kept = False  # the last list handed out is remembered: the same block gets it again

    def decode(self, block: bytes) -> list[Header]:
        """The (name, value) pairs of ``block``, in order; the list is shared: do not change it."""
        got = self.memo.get(block)
        if got is not None:
            self.kept = True
            return got
        # Indexed fields, the most of every block, are read here without a call each (a
        # grpc-go block, its table changed by every call's grpc-timeout, is read in full).
        headers: list[Header] = []
        table = self.table
        pos = 0
        end = len(block)
        only_indexed = True
        while pos < end:
            b = block[pos]
            if b & 0x80:  # indexed field
                idx = b & 0x7F
                if idx == 0x7F:
                    idx, pos = _integer(block, pos, 0x7F)
                else:
                    pos += 1
                if idx > STATIC_LEN:
                    try:
                        headers.append(table[idx - DYNAMIC_FIRST])
                    except IndexError:
                        raise HeaderBlockError(f"index {idx} is in neither table") from None
                elif idx:
                    headers.append(STATIC[idx - 1])
                else:
                    raise HeaderBlockError("index 0 is in neither table")
            elif b & 0x40:  # literal with incremental indexing
                idx = b & 0x3F
                short = block[pos + 1] & 0x7F if pos + 1 < end else 0x7F
                if 0 < idx < 0x3F and short < 0x7F and pos + 2 + short <= end:
                    # grpc-go's new grpc-timeout on every call: an indexed name, a value under
                    # 127 bytes, read here (the general path is five calls).
                    if idx > STATIC_LEN:
                        try:
                            name = table[idx - DYNAMIC_FIRST][0]
                        except IndexError:
                            raise HeaderBlockError(f"index {idx} is in neither table") from None
                    else:
                        name = STATIC[idx - 1][0]
                    stop = pos + 2 + short
                    raw = block[pos + 2 : stop]
                    if block[pos + 1] & 0x80:
                        try:
                            raw = decode(raw)
                        except HuffmanError as exc:
                            raise HeaderBlockError(str(exc)) from None
                    header = (name, raw)
                    pos = stop
                else:
                    header, pos = self._literal(block, pos, 0x3F)
                self._add(header)
                headers.append(header)
                only_indexed = False
            elif b & 0x20:  # dynamic table size update
                if headers:
                    raise HeaderBlockError("table size update after a header field")
                new_max, pos = _integer(block, pos, 0x1F)
                if new_max > self.max_table:
                    raise HeaderBlockError(f"table size {new_max} over the {self.max_table} allowed")
                self.table_max = new_max
                self._evict()
                only_indexed = False
            else:  # literal without indexing (0000) or never indexed (0001)
                header, pos = self._literal(block, pos, 0x0F)
                headers.append(header)
        # The list's size is counted once it is read: until then it holds only references to
        # table entries and to strings of this block, so its memory is bounded by the block's.
        total = ENTRY_OVERHEAD * len(headers)
        for name, value in headers:
            total += len(name) + len(value)
        if total > self.max_list:
            raise HeaderBlockError(f"header list over {self.max_list} bytes")
        if only_indexed:
            if len(self.memo) >= MEMO_MAX:
                self.memo.clear()
            self.memo[bytes(block)] = headers
        else:
            self.memo.clear()
        self.kept = only_indexed
        return headers

    def _entry(self, idx: int) -> Header:
        if 0 < idx <= STATIC_LEN:
            return STATIC[idx - 1]
        dyn = idx - DYNAMIC_FIRST
        if 0 <= dyn < len(self.table):
            return self.table[dyn]
        raise HeaderBlockError(f"index {idx} is in neither table")

    def _literal(self, block: bytes, pos: int, mask: int) -> tuple[Header, int]:
        if block[pos] & mask:
            idx, pos = _integer(block, pos, mask)
            name = self._entry(idx)[0]
        else:
            name, pos = _string(block, pos + 1)
        value, pos = _string(block, pos)
        return (name, value), pos

    def _add(self, header: Header) -> None:
        size = len(header[0]) + len(header[1]) + ENTRY_OVERHEAD
        if size > self.table_max:  # an entry larger than the table empties it (RFC 7541 section 4.4)
            self.table.clear()
            self.size = 0
            return
        self.table.appendleft(header)
        self.size += size
        self._evict()

    def _evict(self) -> None:
        while self.size > self.table_max:
            name, value = self.table.pop()
            self.size -= len(name) + len(value) + ENTRY_OVERHEAD


def _integer(block: bytes, pos: int, mask: int) -> tuple[int, int]:
    """The integer at ``pos`` with a prefix of ``mask``'s bits (RFC 7541 section 5.1), and where it ends."""
    value = block[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    for _ in range(MAX_INT_BYTES):
        if pos >= len(block):
            raise HeaderBlockError("header block cut short in an integer")
        b = block[pos]
        pos += 1
        value += (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos
    raise HeaderBlockError("integer too large in a header block")


def _string(block: bytes, pos: int) -> tuple[bytes, int]:
    """The string literal at ``pos`` (RFC 7541 section 5.2), Huffman-decoded if so marked."""
    if pos >= len(block):
        raise HeaderBlockError("header block cut short before a string")
    huffman = block[pos] & 0x80
    length, pos = _integer(block, pos, 0x7F)
    stop = pos + length
    if stop > len(block):
        raise HeaderBlockError("header block cut short in a string")
    raw = block[pos:stop]
    if not huffman:
        return bytes(raw), stop
    try:
        return decode(raw), stop
    except HuffmanError as exc:
        raise HeaderBlockError(str(exc)) from None
