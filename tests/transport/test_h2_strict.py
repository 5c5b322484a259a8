"""The native transport against a strict HTTP/2 peer that is not ours (python-hyper's h2).

Every frame the server sends passes h2's state machine, which raises on the
first that breaks RFC 9113: a DATA frame past a window, a frame larger than
the peer allows, anything on a stream after its END_STREAM, a malformed
header block. The tests drive the cases where a hand-written server goes
wrong: flow control both ways with windows that shrink and grow mid-reply,
header blocks in many frames, streams reset mid-reply, GOAWAY, PING, deadlines,
and unary and streaming calls interleaved on one connection.

Waits are bounded (h2peer.WAIT) but nothing is timed: a PING round trip is
the barrier that says the server has answered every frame sent before it.
"""

from __future__ import annotations

import asyncio
import gc
import random
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import h2.errors
import pytest
from h2.settings import SettingCodes

from cri_api import api_pb2 as pb
from shim.transport.native.connection import Connection, Stream
from shim.transport.native.frames import Chunk
from tests.criutil import until
from tests.transport.conftest import Native, pod_request, start_native
from tests.transport.h2peer import (
    IMAGE,
    RUNTIME,
    WAIT,
    Peer,
    Reply,
    frame,
    grpc_frame,
    request_headers,
    split_headers,
)

LIST = RUNTIME + "ListPodSandbox"
STREAM_LIST = RUNTIME + "StreamPodSandboxes"
OK = grpc.StatusCode.OK.value[0]


async def make_pods(native: Native, count: int, note: int = 100) -> set[str]:
    """``count`` pods with a ``note`` annotation that many bytes long; their IDs."""
    ids: set[str] = set()
    for first in range(0, count, 50):
        replies = await asyncio.gather(
            *(
                native.rt.RunPodSandbox(pod_request(f"pod-{i:04d}", note="n" * note))
                for i in range(first, min(count, first + 50))
            )
        )
        ids.update(r.pod_sandbox_id for r in replies)
    return ids


def listed(reply: Reply) -> set[str]:
    """The pod IDs of a ListPodSandbox reply, which must be OK and hold exactly one message."""
    assert reply.ended and reply.status == OK, (reply.status, reply.detail)
    [message] = reply.messages()
    return {p.id for p in pb.ListPodSandboxResponse.FromString(message).items}


def streamed(reply: Reply) -> list[str]:
    """The pod IDs of a StreamPodSandboxes reply, in order, over all its messages."""
    return [p.id for m in reply.messages() for p in pb.StreamPodSandboxesResponse.FromString(m).pod_sandboxes]


OpenPeer = Callable[..., Awaitable[Peer]]


@pytest.fixture
async def peers(native: Native) -> AsyncIterator[OpenPeer]:
    """Opens h2 peers on the native server and closes them after the test."""
    opened: list[Peer] = []

    async def open_peer(settings: dict[int, int] | None = None, auto_ack: bool = True) -> Peer:
        peer = await Peer.open(native.sock, settings, auto_ack)
        opened.append(peer)
        return peer

    yield open_peer
    for peer in opened:
        await peer.close()


# ---------------------------------------------------------------------- flow control
async def test_a_reply_longer_than_a_frame_within_the_windows_goes_out_at_once(
    native: Native, peers: OpenPeer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Open windows and 16 KiB frames: the answer is cut into frames of the peer's size in the
    one piece reply() writes (not queued), and h2 takes every frame of it."""
    pods = await make_pods(native, 400)
    peer = await peers({SettingCodes.INITIAL_WINDOW_SIZE: 1 << 22})
    peer.grant(1 << 24)
    await peer.ping()
    queued: list[int] = []
    original = Connection.send_message

    def counting(self: Connection, st: Stream, message: bytes, out: list[Chunk] | None = None) -> None:
        queued.append(st.sid)
        original(self, st, message, out)

    monkeypatch.setattr(Connection, "send_message", counting)
    sid = await peer.start(LIST, pb.ListPodSandboxRequest())
    reply = await peer.reply(sid)
    assert listed(reply) == pods
    sizes = [n for kind, _, s, n in peer.frames if kind == 0 and s == sid]
    assert len(sizes) > 3 and set(sizes[:-1]) == {16384} and 0 < sizes[-1] <= 16384
    assert sid not in queued
    # A window that cannot take the whole answer: queued, and still whole.
    small = await peers({SettingCodes.INITIAL_WINDOW_SIZE: 20_000})
    small.grant(1 << 24)
    sid2 = await small.start(LIST, pb.ListPodSandboxRequest())
    await small.ping()
    assert sid2 in queued and small.received(sid2) == 20_000
    small.grant(1 << 24, sid2)
    assert listed(await small.reply(sid2)) == pods


async def test_a_tiny_client_window_is_filled_exactly_never_overrun(native: Native, peers: OpenPeer) -> None:
    pods = await make_pods(native, 500)
    peer = await peers({SettingCodes.INITIAL_WINDOW_SIZE: 300}, auto_ack=False)
    sid = await peer.start(LIST, pb.ListPodSandboxRequest())
    rng = random.Random(7)
    stream_granted, conn_granted = 300, 65535
    rounds = 0
    while True:
        await peer.ping()
        reply = peer.replies[sid]
        if reply.done:
            break
        # Blocked: the server has sent all the windows allow, and h2 saw it send no more.
        assert peer.received(sid) == min(stream_granted, conn_granted)
        if rng.random() < 0.5:
            inc = rng.randint(1, 3000)
            peer.grant(inc, sid)
            stream_granted += inc
        else:
            inc = rng.randint(1, 3000)
            peer.grant(inc)
            conn_granted += inc
        rounds += 1
    assert listed(reply) == pods
    assert peer.received(sid) == len(reply.data) > 65535
    assert rounds > 50  # it did wait, many times


async def test_the_connection_window_bounds_all_streams_together(native: Native, peers: OpenPeer) -> None:
    pods = await make_pods(native, 300)
    peer = await peers({SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20}, auto_ack=False)
    sids = [await peer.start(LIST, pb.ListPodSandboxRequest()) for _ in range(4)]
    granted = 65535
    while not all(peer.replies[s].done for s in sids):
        await peer.ping()
        total = sum(peer.received(s) for s in sids)
        if all(peer.replies[s].done for s in sids):
            break
        assert total == granted
        peer.grant(10_000)
        granted += 10_000
    for s in sids:
        assert listed(peer.replies[s]) == pods


async def test_a_request_larger_than_the_servers_window(short_tmp: str) -> None:
    # The server gives each stream 16 MiB of window: a bigger request needs its WINDOW_UPDATEs.
    native = await start_native(short_tmp, max_message_bytes=40 << 20)
    peer = await Peer.open(native.sock)
    try:
        rng = random.Random(3)
        # 18 MiB of text, no two stretches alike, in annotations of 256 KiB (the most one may hold)
        blobs = {f"blob-{i:02d}": rng.randbytes(128 << 10).hex() for i in range(72)}
        req = pod_request("big", **blobs)
        reply = await peer.call(RUNTIME + "RunPodSandbox", req)
        assert reply.status == OK, reply.detail
        sid = max(peer.replies)
        assert peer.window_updates.get(sid, 0) >= 1  # the server opened the stream's window as it read
        assert peer.window_updates.get(0, 0) >= 18  # and the connection's, a MiB at a time
        pod = pb.RunPodSandboxResponse.FromString(reply.messages()[0]).pod_sandbox_id
        status = await native.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod))
        assert dict(status.status.annotations) == blobs
    finally:
        await peer.close()
        await native.channel.close()
        await native.server.stop(0)


async def test_small_calls_leave_the_connections_window_alone(short_tmp: str) -> None:
    """A GiB of connection window is not given back a frame per call: 200 calls, and no
    WINDOW_UPDATE on the connection but the one that opened its window at the start."""
    native = await start_native(short_tmp)
    peer = await Peer.open(native.sock)
    try:
        for _ in range(200):
            reply = await peer.call(RUNTIME + "Version", pb.VersionRequest())
            assert reply.status == OK, reply.detail
        assert peer.window_updates.get(0, 0) == 1
    finally:
        await peer.close()
        await native.channel.close()
        await native.server.stop(0)


async def test_what_was_on_its_way_on_a_stream_the_server_cut_short_is_ignored(short_tmp: str) -> None:
    # The server answers a request over the size limit before it ends and resets the stream; the
    # DATA and trailers the client had sent by then are ignored (RFC 9113 section 5.1), not taken
    # for a reused stream that costs the whole connection.
    native = await start_native(short_tmp, max_message_bytes=20_000)
    peer = await Peer.open(native.sock)
    try:
        sid = peer.conn.get_next_available_stream_id()
        peer.conn.send_headers(sid, request_headers(RUNTIME + "RunPodSandbox"))
        body = grpc_frame(pod_request("big", blob="z" * 50_000))
        for i in range(0, len(body), 16384):
            peer.conn.send_data(sid, body[i : i + 16384])
        peer.conn.send_headers(sid, [(b"x-checksum", b"none")], end_stream=True)
        peer.replies[sid] = Reply()
        peer.flush()  # all in one write, before the server's answer can be read
        reply = await peer.reply(sid)
        assert reply.status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert listed(await peer.call(LIST, pb.ListPodSandboxRequest())) == set()
    finally:
        await peer.close()
        await native.channel.close()
        await native.server.stop(0)


# ---------------------------------------------------------------------- header blocks
@pytest.mark.parametrize(
    ("size", "pad", "priority"),
    [(1, 0, False), (7, 0, False), (5, 13, True), (100, 255, False), (3, 0, True)],
    ids=["1-byte pieces", "7-byte pieces", "padded+priority", "full padding", "priority"],
)
async def test_request_headers_over_headers_and_continuations(
    native: Native,
    peers: OpenPeer,
    size: int,
    pad: int,
    priority: bool,
) -> None:
    pods = await make_pods(native, 3)
    peer = await peers()
    first = await peer.call(LIST, pb.ListPodSandboxRequest())  # the HPACK tables now hold entries
    sid = peer.open_stream(
        LIST, extra=[(b"x-meta", b"v" * 300)], rewrite=lambda data: split_headers(data, size, pad, priority)
    )
    await peer.send(sid, grpc_frame(pb.ListPodSandboxRequest()))
    assert [k for k, _, s, _ in peer.sent if s == sid][:3] == [1, 9, 9]
    assert listed(await peer.reply(sid)) == listed(first) == pods
    assert (await peer.call(LIST, pb.ListPodSandboxRequest())).status == OK  # the tables stayed in step


async def test_a_header_block_larger_than_a_frame(native: Native, peers: OpenPeer) -> None:
    peer = await peers()
    # 40 KB of metadata: h2 itself sends HEADERS and CONTINUATIONs of 16 KiB.
    sid = peer.open_stream(
        RUNTIME + "Version", extra=[(b"x-big", random.Random(5).randbytes(20_000).hex().encode())]
    )
    await peer.send(sid, grpc_frame(pb.VersionRequest()))
    reply = await peer.reply(sid)
    assert reply.status == OK
    assert pb.VersionResponse.FromString(reply.messages()[0]).runtime_api_version == "v1"
    kinds = [k for k, _, s, _ in peer.sent if s == sid]
    assert kinds[0] == 1 and set(kinds[1:-1]) == {9} and kinds[-1] == 0, kinds


# ---------------------------------------------------------------------- reset, goaway, ping
async def test_a_stream_reset_mid_reply_stops_and_its_neighbours_finish(
    native: Native, peers: OpenPeer
) -> None:
    pods = await make_pods(native, 300)
    peer = await peers({SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20}, auto_ack=False)
    events = await peer.start(RUNTIME + "GetContainerEvents", pb.GetEventsRequest())
    lists = [await peer.start(LIST, pb.ListPodSandboxRequest()) for _ in range(4)]
    stream = await peer.start(STREAM_LIST, pb.ListPodSandboxRequest())
    await peer.until(lambda: peer.received(stream) > 0 or sum(map(peer.received, lists)) >= 65535)
    await peer.ping()
    assert sum(peer.received(s) for s in [*lists, stream]) == 65535  # all blocked on the connection
    cut = [lists[1], stream]
    for s in cut:
        peer.conn.reset_stream(s, h2.errors.ErrorCodes.CANCEL)
    peer.flush()
    mark = len(peer.frames)
    peer.grant(1 << 24)
    kept = [s for s in lists if s not in cut]
    await peer.until(lambda: all(peer.replies[s].done for s in kept))
    for s in kept:
        assert listed(peer.replies[s]) == pods
    await peer.ping()
    assert [f for f in peer.frames[mark:] if f[2] in cut] == []  # nothing more on the reset streams
    assert not peer.replies[events].done  # the events stream is still open
    await until(lambda: native.tasks == 1, WAIT)  # only the events stream's task is left
    peer.conn.reset_stream(events)
    peer.flush()
    await until(lambda: native.tasks == 0, WAIT)


@pytest.mark.parametrize("method", ["Version", "RunPodSandbox"])
async def test_a_stream_reset_in_the_read_that_starts_its_call(
    native: Native, peers: OpenPeer, method: str
) -> None:
    # The call's task is made and reset before it ever ran: its coroutines must still be run
    # (and so cancelled, and logged), not dropped unawaited.
    native.fake.set_latency("run_sandbox", 30.0)
    peer = await peers()
    request = pod_request("never") if method == "RunPodSandbox" else pb.VersionRequest()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            sid = peer.conn.get_next_available_stream_id()
            peer.conn.send_headers(sid, request_headers(RUNTIME + method))
            peer.conn.send_data(sid, grpc_frame(request), end_stream=True)
            peer.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
            peer.replies[sid] = Reply()
            peer.flush()  # one write: the server reads the three frames at once
            await peer.ping()
        await until(lambda: native.tasks == 0, WAIT)
        gc.collect()
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []
    native.fake.set_latency("run_sandbox", 0.0)
    assert listed(await peer.call(LIST, pb.ListPodSandboxRequest())) == set()


async def test_ping_is_answered_while_replies_wait_for_window(native: Native, peers: OpenPeer) -> None:
    await make_pods(native, 200)
    peer = await peers({SettingCodes.INITIAL_WINDOW_SIZE: 100}, auto_ack=False)
    sid = await peer.start(LIST, pb.ListPodSandboxRequest())
    for _ in range(3):
        await peer.ping()  # PING is not flow-controlled: the ACK passes the blocked reply
    assert peer.received(sid) == 100
    assert peer.pings == [i.to_bytes(8, "big") for i in (1, 2, 3)]
    # An ACK from the client is not answered.
    peer.write_raw(frame(6, 0x1, 0, b"ackackac"))
    await peer.ping()
    assert b"ackackac" not in peer.pings


async def test_goaway_from_the_client_lets_calls_under_way_finish(native: Native, peers: OpenPeer) -> None:
    pods = await make_pods(native, 200)
    peer = await peers({SettingCodes.INITIAL_WINDOW_SIZE: 1000}, auto_ack=False)
    blocked = await peer.start(LIST, pb.ListPodSandboxRequest())
    native.fake.set_latency("run_sandbox", 0.3)
    slow = await peer.start(RUNTIME + "RunPodSandbox", pod_request("slow"))
    await peer.ping()
    # h2 would refuse to read after its own GOAWAY: this one goes past it.
    peer.write_raw(frame(7, 0, 0, bytes(8) + b"client leaving"))
    peer.grant(1 << 20, blocked)
    peer.grant(1 << 20)
    assert listed(await peer.reply(blocked)) == pods
    reply = await peer.reply(slow)
    assert reply.status == OK
    before = native.connections
    await peer.close()
    await until(lambda: native.connections == before - 1, WAIT)
    assert native.tasks == 0


async def test_the_servers_goaway_on_stop_names_the_last_stream_and_lets_it_finish(short_tmp: str) -> None:
    native = await start_native(short_tmp)
    peer = await Peer.open(native.sock)
    try:
        native.fake.set_latency("run_sandbox", 0.3)
        sid = await peer.start(RUNTIME + "RunPodSandbox", pod_request("late"))
        await peer.ping()
        stopping = asyncio.ensure_future(native.server.stop(5))
        await peer.until(lambda: peer.goaway is not None)
        assert peer.goaway == (sid, 0)
        assert (await peer.reply(sid)).status == OK
        await stopping
    finally:
        await peer.close()
        await native.channel.close()


# ---------------------------------------------------------------------- settings mid-stream
async def test_initial_window_size_shrinks_below_zero_and_grows_mid_reply(
    native: Native, peers: OpenPeer
) -> None:
    pods = await make_pods(native, 500)
    peer = await peers({SettingCodes.INITIAL_WINDOW_SIZE: 40_000}, auto_ack=False)
    peer.grant(1 << 24)  # the connection's window is not the subject here
    sid = await peer.start(LIST, pb.ListPodSandboxRequest())
    await peer.ping()
    assert peer.received(sid) == 40_000
    # 40 000 -> 1 000: the stream's window is now 1 000 - 40 000 = -39 000.
    acks = peer.settings_acks
    peer.conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 1000})
    peer.flush()
    await peer.until(lambda: peer.settings_acks > acks)
    peer.grant(20_000, sid)  # -19 000: still shut
    await peer.ping()
    assert peer.received(sid) == 40_000
    peer.grant(20_000, sid)  # 1 000
    await peer.ping()
    assert peer.received(sid) == 41_000
    # A second stream opened now starts with the new, small window.
    other = await peer.start(LIST, pb.ListPodSandboxRequest())
    await peer.ping()
    assert peer.received(other) == 1000
    # 1 000 -> 1 MiB: both windows grow by the difference and the replies run to the end.
    peer.conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
    peer.flush()
    assert listed(await peer.reply(sid)) == pods
    assert listed(await peer.reply(other)) == pods


async def test_max_frame_size_grows_and_shrinks_mid_reply(native: Native, peers: OpenPeer) -> None:
    pods = await make_pods(native, 1500)
    peer = await peers({SettingCodes.INITIAL_WINDOW_SIZE: 1 << 22}, auto_ack=False)
    big = 1 << 20
    sid = await peer.start(LIST, pb.ListPodSandboxRequest())
    await peer.ping()  # blocked on the connection window, in 16 KiB frames
    acks = peer.settings_acks
    peer.conn.update_settings({SettingCodes.MAX_FRAME_SIZE: big})
    peer.flush()
    await peer.until(lambda: peer.settings_acks > acks)
    mark = len(peer.frames)
    peer.grant(100_000)
    await peer.ping()
    sizes = [n for kind, _, s, n in peer.frames[mark:] if kind == 0 and s == sid]
    assert sizes == [100_000]  # one frame: the window, not 16 KiB, was the limit
    peer.conn.update_settings({SettingCodes.MAX_FRAME_SIZE: 16384})
    peer.flush()
    await peer.until(lambda: peer.settings_acks > acks + 1)
    mark = len(peer.frames)
    peer.grant(1 << 24)
    reply = await peer.reply(sid)
    assert max(n for kind, _, s, n in peer.frames[mark:] if kind == 0 and s == sid) == 16384
    assert listed(reply) == pods


async def test_header_table_sizes_change_mid_connection(native: Native, peers: OpenPeer) -> None:
    pods = await make_pods(native, 5)
    peer = await peers()
    events = await peer.start(RUNTIME + "GetContainerEvents", pb.GetEventsRequest())
    # Our decoder's table: 0 bytes, then back to 4096 (the server must not index into it).
    for size in (0, 4096, 64):
        acks = peer.settings_acks
        peer.conn.update_settings({SettingCodes.HEADER_TABLE_SIZE: size})
        peer.flush()
        await peer.until(lambda: peer.settings_acks > acks)  # noqa: B023
        assert listed(await peer.call(LIST, pb.ListPodSandboxRequest())) == pods
    # The server's decoder: our encoder shrinks and regrows its table (size updates in the blocks),
    # with headers that would otherwise be indexed and evicted.
    for size in (0, 100, 4096, 300, 4096):
        peer.conn.encoder.header_table_size = size
        for i in range(5):
            reply = await peer.call(LIST, pb.ListPodSandboxRequest(), extra=[(b"x-n", str(i).encode() * 50)])
            assert listed(reply) == pods
    assert not peer.replies[events].done


# ---------------------------------------------------------------------- calls interleaved
async def test_unary_and_streaming_calls_interleave_on_one_connection(
    native: Native, peers: OpenPeer
) -> None:
    pods = await make_pods(native, 600, note=60)
    peer = await peers({SettingCodes.INITIAL_WINDOW_SIZE: 20_000})
    events = await peer.start(RUNTIME + "GetContainerEvents", pb.GetEventsRequest())
    pull = await peer.call(IMAGE + "PullImage", pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
    assert pull.status == OK
    sandbox = pod_request("holder")
    holder = await peer.call(RUNTIME + "RunPodSandbox", sandbox)
    holder_id = pb.RunPodSandboxResponse.FromString(holder.messages()[0]).pod_sandbox_id
    pods.add(holder_id)

    def create(i: int) -> pb.CreateContainerRequest:
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=f"c{i}"), image=pb.ImageSpec(image="busybox")
        )
        return pb.CreateContainerRequest(
            pod_sandbox_id=holder_id, config=config, sandbox_config=sandbox.config
        )

    rng = random.Random(11)
    kinds = ["list"] * 15 + ["stream"] * 5 + ["version"] * 20 + ["create"] * 10
    rng.shuffle(kinds)
    started = await asyncio.gather(
        *(
            peer.start(
                {
                    "list": LIST,
                    "stream": STREAM_LIST,
                    "version": RUNTIME + "Version",
                    "create": RUNTIME + "CreateContainer",
                }[k],
                {
                    "list": pb.ListPodSandboxRequest(),
                    "stream": pb.ListPodSandboxRequest(),
                    "version": pb.VersionRequest(),
                    "create": create(i),
                }[k],
            )
            for i, k in enumerate(kinds)
        )
    )
    created = []
    for kind, sid in zip(kinds, started, strict=True):
        reply = await peer.reply(sid)
        assert reply.status == OK, (kind, reply.detail)
        if kind == "list":
            assert listed(reply) == pods
        elif kind == "stream":
            got = streamed(reply)
            assert sorted(got) == sorted(pods) and len(got) == len(pods)
        elif kind == "version":
            assert pb.VersionResponse.FromString(reply.messages()[0]).runtime_api_version == "v1"
        else:
            created.append(pb.CreateContainerResponse.FromString(reply.messages()[0]).container_id)

    def seen() -> list[str]:
        return [
            e.container_id
            for e in map(pb.ContainerEventResponse.FromString, peer.replies[events].messages())
            if e.container_event_type == pb.CONTAINER_CREATED_EVENT
        ]

    await peer.until(lambda: len(seen()) >= len(created))
    assert sorted(seen()) == sorted(created)
    assert not peer.replies[events].done


# ---------------------------------------------------------------------- deadlines
async def test_a_deadline_ends_a_unary_call_with_a_trailers_only_answer(
    native: Native, peers: OpenPeer
) -> None:
    peer = await peers()
    native.fake.set_latency("run_sandbox", 5.0)
    reply = await peer.call(RUNTIME + "RunPodSandbox", pod_request("slow"), timeout="100m")
    assert reply.status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert reply.trailers is None and reply.data == b""  # Trailers-Only: one HEADERS frame
    native.fake.set_latency("run_sandbox", 0.0)
    ok = await peer.call(RUNTIME + "RunPodSandbox", pod_request("quick"), timeout="10S")
    assert ok.status == OK
    bad = await peer.call(RUNTIME + "Version", pb.VersionRequest(), timeout="soon")
    assert bad.status == grpc.StatusCode.INTERNAL.value[0] and "grpc-timeout" in bad.detail
    await until(lambda: native.tasks == 0, WAIT)


async def test_a_deadline_ends_a_stream_that_waits_for_window(native: Native, peers: OpenPeer) -> None:
    await make_pods(native, 300, note=5000)  # two messages of up to 1 MiB: the first one waits
    peer = await peers({SettingCodes.INITIAL_WINDOW_SIZE: 1000}, auto_ack=False)
    sid = await peer.start(STREAM_LIST, pb.ListPodSandboxRequest(), timeout="300m")
    await peer.until(lambda: peer.received(sid) == 1000)
    await until(lambda: native.tasks == 0, WAIT)  # the deadline cancelled the call while it waited
    peer.grant(1 << 24, sid)
    peer.grant(1 << 24)
    reply = await peer.reply(sid)
    assert reply.status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert reply.trailers is not None  # after the data it had queued, whole messages only
    assert 0 < len(streamed(reply)) < 300
