"""Requests that arrive together: the first answer leaves before the rest are worked on.

When one read brings several requests (a client with many calls in flight on
one connection, as a kubelet's goroutines share its one), the native transport
writes what it has answered as soon as more requests are waiting behind it, so
that the client works on that answer while the server answers the others; the
rest go in one write at the end of the read. A read with one request and only
control frames after it (grpc's WINDOW_UPDATEs) is still answered in one write.
Every frame passes h2's state machine (tests/transport/h2peer.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from cri_api import api_pb2 as pb
from shim.transport.native.connection import Connection
from tests.transport.conftest import Native
from tests.transport.h2peer import RUNTIME, Peer, Reply, grpc_frame, parse_frames, request_headers

VERSION = RUNTIME + "Version"
OK = grpc.StatusCode.OK.value[0]


class Recorder:
    """Stands in for a connection's transport: keeps each write's bytes, passes everything on."""

    def __init__(self, inner: asyncio.Transport) -> None:
        self.inner = inner
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.inner.write(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


@pytest.fixture
async def peer(native: Native) -> AsyncIterator[tuple[Peer, Recorder]]:
    """An h2 peer whose connection's writes on the server side are recorded."""
    assert native.server.native is not None
    before = set(native.server.native.connections)
    p = await Peer.open(native.sock)
    [conn] = set(native.server.native.connections) - before
    assert isinstance(conn, Connection) and conn.transport is not None
    rec = Recorder(conn.transport)
    conn.transport = rec  # type: ignore[assignment]
    try:
        yield p, rec
    finally:
        await p.close()


def streams_of(write: bytes) -> list[int]:
    """The streams the frames of one write are on, in order (0 for the connection's)."""
    frames, used = parse_frames(write)
    assert used == len(write)
    return [sid for _, _, sid, _ in frames]


def queue_versions(p: Peer, count: int) -> list[int]:
    """``count`` Version calls made ready to go in one write."""
    sids = []
    for _ in range(count):
        sid = p.conn.get_next_available_stream_id()
        p.conn.send_headers(sid, request_headers(VERSION))
        p.conn.send_data(sid, grpc_frame(pb.VersionRequest()), end_stream=True)
        p.replies[sid] = Reply()
        sids.append(sid)
    return sids


async def test_the_first_of_many_answers_goes_before_the_rest(peer: tuple[Peer, Recorder]) -> None:
    p, rec = peer
    sids = queue_versions(p, 8)
    rec.writes.clear()
    p.flush()  # one write: the server reads the eight requests at once
    replies = [await p.reply(sid) for sid in sids]
    assert all(r.ended and r.status == OK for r in replies)
    assert [pb.VersionResponse.FromString(r.messages()[0]).runtime_api_version for r in replies] == ["v1"] * 8
    answers = [w for w in rec.writes if any(streams_of(w))]
    # The first stream's answer alone (its HEADERS, DATA and trailers), then the other seven in one.
    assert [set(streams_of(w)) for w in answers] == [{sids[0]}, set(sids[1:])]
    assert streams_of(answers[0]) == [sids[0]] * 3


async def test_one_request_with_window_updates_after_it_is_one_write(peer: tuple[Peer, Recorder]) -> None:
    p, rec = peer
    [sid] = queue_versions(p, 1)
    p.conn.increment_flow_control_window(1 << 20)  # what grpc's clients send with their calls
    p.conn.increment_flow_control_window(1 << 20, sid)
    rec.writes.clear()
    p.flush()
    reply = await p.reply(sid)
    assert reply.ended and reply.status == OK
    assert [streams_of(w) for w in rec.writes if any(streams_of(w))] == [[sid] * 3]
