"""What a request's header block asks, as a Connection reads it: kept for a block sent again
(Connection.heads), never once the HPACK table has given the same bytes another meaning.

The connection is driven in-process with hand-made header blocks (RFC 7541 representations
written out below), so that which blocks insert into the dynamic table is exact.
"""

from __future__ import annotations

from shim.cri.codes import Code
from shim.transport.native.frames import hpack_int
from tests.transport.h2peer import parse_frames
from tests.transport.inproc import HEADERS, FakeTransport, call, connection


def _string(value: bytes) -> bytes:
    return hpack_int(len(value), 7) + value


def indexed_literal(name_index: int, value: bytes) -> bytes:
    """Literal with incremental indexing, name from the table: the entry goes in at index 62."""
    return hpack_int(name_index, 6, 0x40) + _string(value)


def plain_literal(name_index: int, value: bytes) -> bytes:
    """Literal without indexing, name from the table: no table changes."""
    return hpack_int(name_index, 4) + _string(value)


POST = b"\x83"  # static 3: :method POST
GET = b"\x82"  # static 2: :method GET
PATH = 4  # static 4: :path
CONTENT_TYPE = plain_literal(31, b"application/grpc")


def timeout_field(value: bytes) -> bytes:
    return b"\x00" + _string(b"grpc-timeout") + _string(value)


def _statuses(transport: FakeTransport) -> dict[int, bytes]:
    """grpc-status of each stream's last HEADERS (our blocks are literals without indexing)."""
    frames, _ = parse_frames(transport.data)
    out = {}
    for kind, _, sid, payload in frames:
        if kind == HEADERS and b"grpc-status" in payload:
            at = payload.index(b"grpc-status") + len(b"grpc-status")
            out[sid] = payload[at + 1 : at + 1 + payload[at]]
    return out


def test_a_block_that_only_indexes_means_what_the_table_holds_now() -> None:
    conn, calls, _ = connection()
    again = POST + b"\xbe" + CONTENT_TYPE  # index 62: whatever :path the table's newest entry is
    call(conn, 1, POST + indexed_literal(PATH, b"/svc/A") + CONTENT_TYPE)
    call(conn, 3, again)
    call(conn, 5, again)  # the decoder's memory, and the head kept for it
    call(conn, 7, POST + indexed_literal(PATH, b"/svc/B") + CONTENT_TYPE)  # /svc/A is 63 now
    call(conn, 9, again)
    call(conn, 11, POST + b"\xbf" + CONTENT_TYPE)  # index 63
    call(conn, 13, again)
    a, b = "/svc/A", "/svc/B"
    assert [m for m, _ in calls.seen] == [a, a, a, b, b, a, b]


def test_blocks_that_differ_in_path_or_deadline_are_read_each() -> None:
    conn, calls, _ = connection()
    a = POST + plain_literal(PATH, b"/svc/A") + CONTENT_TYPE
    b = POST + plain_literal(PATH, b"/svc/B") + CONTENT_TYPE
    a_timed = a + timeout_field(b"5S")
    for sid, block in enumerate((a, b, a, a_timed, a, a_timed, b), start=0):
        call(conn, 2 * sid + 1, block)
    assert calls.seen == [
        ("/svc/A", False),
        ("/svc/B", False),
        ("/svc/A", False),
        ("/svc/A", True),
        ("/svc/A", False),
        ("/svc/A", True),
        ("/svc/B", False),
    ]


def test_a_refused_block_is_refused_each_time_it_comes() -> None:
    conn, calls, transport = connection()
    get = GET + plain_literal(PATH, b"/svc/A") + CONTENT_TYPE
    bad_timeout = POST + plain_literal(PATH, b"/svc/A") + CONTENT_TYPE + timeout_field(b"soon")
    for sid, block in ((1, get), (3, get), (5, bad_timeout), (7, bad_timeout)):
        call(conn, sid, block)
    call(conn, 9, POST + plain_literal(PATH, b"/svc/A") + CONTENT_TYPE)
    assert calls.seen == [("/svc/A", False)]
    unimplemented, internal = b"%d" % Code.UNIMPLEMENTED, b"%d" % Code.INTERNAL
    assert _statuses(transport) == {1: unimplemented, 3: unimplemented, 5: internal, 7: internal, 9: b"0"}


def test_only_short_blocks_are_kept() -> None:
    conn, calls, _ = connection()
    short = POST + plain_literal(PATH, b"/svc/A") + CONTENT_TYPE
    long = short + b"\x00" + _string(b"x-pad") + _string(b"p" * 2000)
    for sid, block in ((1, short), (3, long), (5, long)):
        call(conn, sid, block)
    assert [m for m, _ in calls.seen] == ["/svc/A"] * 3
    assert list(conn.heads) == [short]  # a peer's long blocks are read each time, not held
