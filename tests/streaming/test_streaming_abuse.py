"""Streaming abuse against real servers: every case gets a clear refusal or close,
nothing is buffered without bound, nothing hangs or leaks, and the gRPC API stays quick.

Two kinds of server: the streaming server alone over the scripted ``FakeRuntime``
(protocol cases), and the whole shim, gRPC and streaming, over the fake backend,
whose built-in shell runs the execs (`sh -c yes`, an interactive `sh`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import math
import os
import random
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from backends.fake import FakeBackend
from cri_api import api_pb2 as pb
from shim.server import Server
from shim.streaming import StreamingConfig, StreamingServer, spdy
from shim.streaming import portforward as portforward_module
from shim.streaming import remotecommand as remotecommand_module
from shim.streaming import server as server_module
from shim.streaming import session as session_module
from shim.streaming import transport as transport_module
from shim.streaming import websocket as websocket_module
from tests.conftest import Running, make_ids, server_config
from tests.criutil import container_config, sandbox_config
from tests.streaming.streaming_helpers import (
    SPDY_UPGRADE_HEADERS,
    FakeRuntime,
    LogRecorder,
    SpdyClient,
    control_frame,
    data_frame_header,
    header,
    http_request,
    live_tasks,
    raw_upgrade,
    read_to_eof,
    sessions_drained,
    spdy_server_frames,
    ws_close_code,
    ws_frame,
    ws_server_frames,
    ws_upgrade_headers,
)

V5 = "v5.channel.k8s.io"
OURS = ("shim", "backends")  # folders whose tasks must not outlive a session
PER_CONNECTION_BOUND = 256 * 1024  # what the server may hold for one connection
SMALL_RCVBUF = 8192  # a client's receive buffer, so that its server's output stays in the server


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
async def no_tracebacks(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> AsyncIterator[LogRecorder]:
    """Every streaming module's log, asyncio's unhandled errors and the websockets
    library's log: none may report an error or carry a traceback."""
    recorder = LogRecorder()
    for module in (server_module, session_module, remotecommand_module, portforward_module):
        monkeypatch.setattr(module, "log", recorder)
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    caplog.set_level("ERROR", logger="websockets")
    caplog.set_level("ERROR", logger="asyncio")
    try:
        yield recorder
    finally:
        loop.set_exception_handler(previous)
    assert not recorder.failures(), recorder.failures()
    assert not unhandled, unhandled
    assert not [r for r in caplog.records if r.name.startswith(("websockets", "asyncio"))], caplog.text


@pytest.fixture
def quick_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame begun must be complete within 0.5 s (30 s in service), and a closing
    connection's peer gets 0.5 s to take what is buffered for it (5 s in service)."""
    monkeypatch.setattr(session_module, "FRAME_TIMEOUT", 0.5)
    monkeypatch.setattr(websocket_module, "FRAME_TIMEOUT", 0.5)
    monkeypatch.setattr(transport_module, "FLUSH_TIMEOUT", 0.5)


@contextlib.asynccontextmanager
async def whole_shim(tmp: str, **streaming: object) -> AsyncIterator[tuple[Running, StreamingServer, str]]:
    """The shim on a real socket, fake backend, streaming settings as given; and one
    running container whose execs run in the fake's shell."""
    base = server_config(tmp)
    config = dataclasses.replace(base, streaming=dataclasses.replace(base.streaming, **streaming))
    fake = FakeBackend("fake", {"state_dir": os.path.join(tmp, "fake")})
    server = Server(config, backends={"fake": fake}, id_factory=make_ids("abuse"))
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix://{tmp}/cri.sock")
    try:
        r = Running(server, channel, fake)
        await r.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
        sc = sandbox_config(log_directory=os.path.join(tmp, "logs"))
        pod = (await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
        cc = container_config(log_path="c.log")
        req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
        cid = (await r.rt.CreateContainer(req)).container_id
        await r.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
        streaming_server = server.streaming
        assert isinstance(streaming_server, StreamingServer)
        yield r, streaming_server, cid
    finally:
        await channel.close()
        await server.stop(0)


# --------------------------------------------------------------------------- helpers


async def eventually(predicate: Callable[[], object], timeout: float = 5.0, what: str = "") -> None:
    try:
        async with asyncio.timeout(timeout):
            while not predicate():  # noqa: ASYNC110 - polling server state
                await asyncio.sleep(0.01)
    except TimeoutError:
        stacks = []
        for task in live_tasks(OURS):
            out = io.StringIO()
            task.print_stack(file=out)
            stacks.append(out.getvalue())
        raise AssertionError(
            f"not within {timeout}s: {what or predicate}; our tasks:\n" + "\n".join(stacks)
        ) from None


async def nothing_left(server: StreamingServer, before: set[asyncio.Task[object]]) -> None:
    """No session, no connection, and no task of ours started since ``before``: the
    session's runtime call (the exec's shell runs in it) ended with it."""
    await eventually(lambda: server.open_sessions == 0, what="sessions ended")
    await eventually(lambda: server.open_connections == 0, what="connections closed")
    await eventually(lambda: not live_tasks(OURS, before), what="tasks ended")


def exec_req(cmd: list[str], stdin: bool = False) -> pb.ExecRequest:
    return pb.ExecRequest(container_id="c1", cmd=cmd, stdin=stdin, stdout=True, stderr=True)


def open_exec_streams(client: SpdyClient, stdin: bool = False) -> dict[str, int]:
    kinds = ["error", *(["stdin"] if stdin else []), "stdout", "stderr"]
    return {kind: client.open({"streamtype": kind}) for kind in kinds}


def goaway_status(data: bytes) -> int | None:
    for frame in spdy_server_frames(data):
        if isinstance(frame, spdy.GoAwayFrame):
            return frame.status
    return None


def rss() -> int:
    """This process's resident memory, bytes (shim and test clients: one process)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def p99(samples: list[float]) -> float:
    return sorted(samples)[math.ceil(0.99 * len(samples)) - 1]


# --------------------------------------------------------------------------- 1. the session limit


async def test_session_limit_with_clients_that_never_read(short_tmp: str) -> None:
    """max_streams sessions, three of them `yes` into clients that never read: the next
    dial is refused at once with 503 and a reason, the session that is read is served,
    the shim holds a bounded amount for the stuck ones, and closing them frees slots."""
    async with whole_shim(short_tmp, max_streams=4) as (r, streaming, cid):
        before = set(asyncio.all_tasks())
        rss_before = rss()
        yes = pb.ExecRequest(container_id=cid, cmd=["sh", "-c", "yes"], stdout=True, stderr=True)
        hogs = []
        for transport in ("spdy", "spdy", "ws"):
            url = (await r.rt.Exec(yes)).url
            if transport == "spdy":
                reader, writer, status, _, _ = await raw_upgrade(
                    url, "POST", SPDY_UPGRADE_HEADERS, SMALL_RCVBUF
                )
                open_exec_streams(SpdyClient(reader, writer))
            else:
                reader, writer, status, _, _ = await raw_upgrade(
                    url, "GET", ws_upgrade_headers(V5), SMALL_RCVBUF
                )
            assert status == 101
            hogs.append(writer)
        shell = pb.ExecRequest(container_id=cid, cmd=["sh"], stdin=True, stdout=True, stderr=True)
        good, _ = await SpdyClient.connect((await r.rt.Exec(shell)).url)
        ids = open_exec_streams(good, stdin=True)
        await good.until(lambda: ids["stdin"] in good.replies)
        assert streaming.open_sessions == 4

        # `yes` has filled every buffer between it and its clients: what the shim holds stays bounded.
        await asyncio.sleep(0.5)
        held = [streaming.buffered_bytes()]
        await asyncio.sleep(0.5)
        held.append(streaming.buffered_bytes())
        grown = rss() - rss_before
        print(f"\nbuffered by the shim with 3 stuck `yes` sessions: {held} bytes; RSS grew {grown >> 10} KiB")
        assert max(held) <= 3 * PER_CONNECTION_BOUND
        assert grown < 64 << 20  # loose: the process holds the test's clients too

        # A fifth dial: refused at once, with the reason; its token is not spent.
        url = (await r.rt.Exec(pb.ExecRequest(container_id=cid, cmd=["echo", "later"], stdout=True))).url
        started = time.monotonic()
        _, writer, status, headers, body = await http_request(url, "POST", SPDY_UPGRADE_HEADERS)
        elapsed = time.monotonic() - started
        writer.close()
        assert (status, header(headers, "Retry-After")) == (503, ["1"])
        assert b"too many streaming sessions (at most 4); try again later" in body
        assert elapsed < 1.0

        # The session whose client reads is served as before.
        good.write(ids["stdin"], b"echo still served\n")
        await good.until(lambda: b"still served\n" in good.got(ids["stdout"]), timeout=2)

        # The stuck clients go: their slots come back, the refused URL now works.
        for writer in hogs:
            writer.transport.abort()
        await eventually(lambda: streaming.open_sessions == 1, what="stuck sessions ended")
        late, _ = await SpdyClient.connect(url)
        late_ids = {kind: late.open({"streamtype": kind}) for kind in ("error", "stdout")}
        await late.until(lambda: late_ids["error"] in late.fins)
        assert late.got(late_ids["stdout"]) == b"later\n"
        await late.close()
        good.write(ids["stdin"], b"exit 0\n", fin=True)
        await good.until(lambda: ids["error"] in good.fins)
        await good.close()
        await nothing_left(streaming, before)


@pytest.mark.parametrize(
    ("transport", "frame"),
    [
        # DATA on a stream never opened: each 8-byte frame is answered with a 16-byte RST_STREAM.
        ("spdy", data_frame_header(999, 0)),
        # client PINGs: each answered with a PING
        ("spdy", control_frame(spdy.FrameType.PING, struct.pack(">I", 1))),
        # WebSocket pings: each answered by the library with a pong
        ("ws", ws_frame(0x9, b"p" * 125)),
    ],
    ids=["spdy-data-on-unknown-streams", "spdy-pings", "ws-pings"],
)
async def test_a_client_that_never_reads_cannot_make_the_server_queue_answers(
    server: StreamingServer,
    runtime: FakeRuntime,
    transport: str,
    frame: bytes,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client floods frames the server answers by itself and never reads the answers:
    the server stops reading it instead of queueing answers. The kernel buffers on both
    sides are made small, so that what the server holds shows in its own buffers, and
    the pacing of tiny frames is off, so that the server answers as fast as it can."""
    monkeypatch.setattr(transport_module, "TINY_FRAME_RATE", 1e9)
    monkeypatch.setattr(transport_module, "JUNK_FRAME_RATE", 1e9)
    before = set(asyncio.all_tasks())
    url = server.exec_url(exec_req(["sleep"]))
    if transport == "spdy":
        _, writer, _, _, _ = await raw_upgrade(url, "POST", SPDY_UPGRADE_HEADERS, SMALL_RCVBUF)
    else:
        _, writer, _, _, _ = await raw_upgrade(url, "GET", ws_upgrade_headers(V5), SMALL_RCVBUF)
    (server_side,) = server._connections.values()
    server_side.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024)
    chunk = frame * (64 * 1024 // len(frame))
    sent = 0
    while sent < 2 * 1024 * 1024:
        writer.write(chunk)
        sent += len(chunk)
        try:
            async with asyncio.timeout(0.5):
                await writer.drain()
        except TimeoutError:
            break  # the server stopped reading us
    held = []
    for _ in range(20):  # while the server works through what it read
        await asyncio.sleep(0.04)
        held.append(server.buffered_bytes())
    print(
        f"\n{transport}: sent {sent} bytes of {len(frame)}-byte frames, never read; server held at most {max(held)}"
    )
    assert max(held) <= PER_CONNECTION_BOUND
    writer.transport.abort()
    await nothing_left(server, before)


async def test_unread_input_is_bounded_per_session(
    server: StreamingServer, echo_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port-forward client that opens data streams without their error streams (so
    nothing consumes them) and ignores its windows: the server stops reading once the
    session holds SESSION_BUFFER, however many streams share it; stopped, it still sees
    the client go (it probes with PING every PROBE_INTERVAL)."""
    monkeypatch.setattr(session_module, "PROBE_INTERVAL", 0.1)
    before = set(asyncio.all_tasks())
    client, _ = await SpdyClient.connect(
        server.portforward_url(pb.PortForwardRequest(pod_sandbox_id="s1")), []
    )
    payload = b"u" * (32 * 1024)
    for rid in range(16):
        sid = client.open({"streamtype": "data", "port": str(echo_port), "requestid": str(rid)})
        for _ in range(16):  # 512 KiB per stream, 8 MiB in all
            client.write(sid, payload)
            try:
                async with asyncio.timeout(0.2):
                    await client.writer.drain()
            except TimeoutError:
                break
    await asyncio.sleep(0.3)
    held = server.buffered_bytes()
    print(f"\nunconsumed port-forward input held: {held} bytes")
    assert held <= session_module.SESSION_BUFFER + session_module.RECV_WINDOW
    client.writer.transport.abort()
    await nothing_left(server, before)


# --------------------------------------------------------------------------- 2. garbage


def _spdy_garbage(client: SpdyClient, ids: dict[str, int]) -> dict[str, bytes]:
    """Frames that must each end a SPDY session with GOAWAY(PROTOCOL_ERROR)."""
    return {
        "random-1": random.Random(1).randbytes(4096),
        "random-2": random.Random(2).randbytes(4096),
        "random-3": random.Random(3).randbytes(4096),
        "version-2": control_frame(spdy.FrameType.SYN_STREAM, bytes(10), version=2),
        "syn-reply-from-client": client.encoder.encode(spdy.SynReplyFrame(ids["stdout"], {})),
        "stream-id-reused": client.encoder.encode(spdy.SynStreamFrame(ids["error"], {"streamtype": "x"})),
        "rst-length-4": control_frame(spdy.FrameType.RST_STREAM, b"\x00\x00\x00\x01"),
        "ping-announcing-100-bytes": control_frame(spdy.FrameType.PING, b"", length=100),
        "settings-count-beyond-body": control_frame(
            spdy.FrameType.SETTINGS, struct.pack(">I", 1000) + bytes(8)
        ),
        "window-update-zero": control_frame(spdy.FrameType.WINDOW_UPDATE, struct.pack(">II", 1, 0)),
        "header-block-not-zlib": control_frame(
            spdy.FrameType.SYN_STREAM, struct.pack(">IIBB", 101, 0, 0, 0) + b"not zlib at all"
        ),
        "header-block-bomb": client.encoder.encode(spdy.SynStreamFrame(101, {"a": "x" * 300_000})),
        "control-length-16MiB": control_frame(spdy.FrameType.SYN_STREAM, b"", length=spdy.MAX_LENGTH),
        "data-length-16MiB": data_frame_header(ids["stdout"], spdy.MAX_LENGTH),
        "data-beyond-the-window": data_frame_header(ids["stdout"], session_module.RECV_WINDOW + 1),
    }


SPDY_GARBAGE = [
    "random-1",
    "random-2",
    "random-3",
    "version-2",
    "syn-reply-from-client",
    "stream-id-reused",
    "rst-length-4",
    "ping-announcing-100-bytes",
    "settings-count-beyond-body",
    "window-update-zero",
    "header-block-not-zlib",
    "header-block-bomb",
    "control-length-16MiB",
    "data-length-16MiB",
    "data-beyond-the-window",
]


@pytest.mark.usefixtures("quick_frames")
@pytest.mark.parametrize("case", SPDY_GARBAGE)
async def test_spdy_garbage_is_a_protocol_error(
    server: StreamingServer, runtime: FakeRuntime, case: str
) -> None:
    before = set(asyncio.all_tasks())
    client, _ = await SpdyClient.connect(server.exec_url(exec_req(["sleep"])))
    ids = open_exec_streams(client)
    await asyncio.wait_for(runtime.started.wait(), 5)
    started = time.monotonic()
    garbage = _spdy_garbage(client, ids)
    assert list(garbage) == SPDY_GARBAGE
    client.writer.write(garbage[case])
    data = await read_to_eof(client.reader, timeout=3)  # the server ends the connection
    elapsed = time.monotonic() - started
    assert goaway_status(data) == spdy.GoAwayStatus.PROTOCOL_ERROR
    assert elapsed < 1.0
    await asyncio.wait_for(runtime.cancelled.wait(), 2)  # the exec is stopped
    await client.close()
    await nothing_left(server, before)


async def test_spdy_unknown_control_frame_types_are_ignored(server: StreamingServer) -> None:
    """SPDY/3 (2.2.1) says a control frame of an unknown type must be ignored: it is,
    its body read and dropped, and the session goes on."""
    client, _ = await SpdyClient.connect(server.exec_url(exec_req(["sleep"])))
    for kind in (0, 5, 10, 0x7FFF):
        client.writer.write(control_frame(kind, b"whatever"))
    client.send(spdy.PingFrame(7))
    await client.until(lambda: spdy.PingFrame(7) in client.other, timeout=2)
    assert not any(isinstance(f, spdy.GoAwayFrame) for f in client.other)
    await client.close()


WS_GARBAGE: dict[str, tuple[bytes, int]] = {
    "random": (random.Random(1).randbytes(4096), 1002),
    "reserved-opcode-3": (ws_frame(0x3, b"x"), 1002),
    "reserved-opcode-11": (ws_frame(0xB, b"x"), 1002),
    "unmasked": (ws_frame(0x2, b"\x00hello", masked=False), 1002),
    "rsv-bits": (ws_frame(0x2, b"\x00x", rsv=0b100), 1002),
    "length-2**62": (ws_frame(0x2, b"", length=2**62), 1009),
    "close-code-999": (ws_frame(0x8, struct.pack(">H", 999)), 1002),
    "close-code-1005": (ws_frame(0x8, struct.pack(">H", 1005)), 1002),
    "close-one-byte": (ws_frame(0x8, b"\x03"), 1002),
    "ping-126-bytes": (ws_frame(0x9, b"p" * 126), 1002),
    "fragmented-ping": (ws_frame(0x9, b"p", fin=False), 1002),
    "continuation-first": (ws_frame(0x0, b"x"), 1002),
    "text-not-utf8": (ws_frame(0x1, b"\xff\xfe"), 1007),
    "fragments-beyond-1MiB": (
        ws_frame(0x2, bytes(600_000), fin=False) + ws_frame(0x0, bytes(600_000), fin=False),
        1009,
    ),
    "half-a-header-then-silence": (b"\x82", 1002),
    "half-a-payload-then-silence": (ws_frame(0x2, bytes(500), length=1000), 1002),
}


@pytest.mark.usefixtures("quick_frames")
@pytest.mark.parametrize("case", list(WS_GARBAGE))
async def test_websocket_garbage_is_closed_with_a_code(
    server: StreamingServer, runtime: FakeRuntime, case: str
) -> None:
    before = set(asyncio.all_tasks())
    garbage, code = WS_GARBAGE[case]
    reader, writer, status, _, _ = await raw_upgrade(
        server.exec_url(exec_req(["sleep"])), "GET", ws_upgrade_headers(V5)
    )
    assert status == 101
    await asyncio.wait_for(runtime.started.wait(), 5)
    started = time.monotonic()
    writer.write(garbage)
    data = await read_to_eof(reader, timeout=3)
    elapsed = time.monotonic() - started
    assert ws_close_code(data) == code, ws_server_frames(data)
    assert elapsed < 1.5
    await asyncio.wait_for(runtime.cancelled.wait(), 2)
    writer.close()
    await nothing_left(server, before)


async def test_garbage_in_the_spdy_websocket_tunnel(server: StreamingServer, echo_port: int) -> None:
    before = set(asyncio.all_tasks())
    url = server.portforward_url(pb.PortForwardRequest(pod_sandbox_id="s1"))
    headers = ws_upgrade_headers("SPDY/3.1+portforward.k8s.io")
    reader, writer, status, _, _ = await raw_upgrade(url, "GET", headers)
    assert status == 101
    writer.write(ws_frame(0x2, control_frame(spdy.FrameType.PING, b"", length=100)))
    data = await read_to_eof(reader, timeout=3)
    frames = ws_server_frames(data)
    tunnelled = b"".join(payload for opcode, payload in frames if opcode == 0x2)
    assert goaway_status(tunnelled) == spdy.GoAwayStatus.PROTOCOL_ERROR
    assert ws_close_code(data) == 1000
    writer.close()
    await nothing_left(server, before)


# --------------------------------------------------------------------------- 3. disconnect mid-frame


def _spdy_partial(ids: dict[str, int]) -> dict[str, bytes]:
    return {
        "half-a-header": data_frame_header(ids["stdin"], 10)[:4],
        "data-cut-at-half": data_frame_header(ids["stdin"], 1000) + bytes(500),
        "control-cut-at-half": control_frame(spdy.FrameType.SYN_STREAM, bytes(100), length=200),
    }


@pytest.mark.usefixtures("quick_frames")
@pytest.mark.parametrize("ending", ["close", "silence"])
@pytest.mark.parametrize("case", ["half-a-header", "data-cut-at-half", "control-cut-at-half"])
async def test_spdy_client_gone_mid_frame(short_tmp: str, case: str, ending: str) -> None:
    """`sh -c yes` with stdin: once output flows the client sends part of a frame and
    hangs up (or goes silent): the session ends and the exec's shell with it."""
    async with whole_shim(short_tmp) as (r, streaming, cid):
        before = set(asyncio.all_tasks())
        req = pb.ExecRequest(container_id=cid, cmd=["sh", "-c", "yes"], stdin=True, stdout=True, stderr=True)
        client, _ = await SpdyClient.connect((await r.rt.Exec(req)).url)
        ids = open_exec_streams(client, stdin=True)
        await client.until(lambda: len(client.got(ids["stdout"])) > 0)
        client.writer.write(_spdy_partial(ids)[case])
        await client.writer.drain()
        if ending == "close":
            await client.close()
        else:
            # the server gives up on the frame after FRAME_TIMEOUT and says why
            await eventually(lambda: streaming.open_sessions == 0, timeout=3, what="session ended")
            await client.close()
        await nothing_left(streaming, before)


@pytest.mark.usefixtures("quick_frames")
@pytest.mark.parametrize("ending", ["close", "silence"])
@pytest.mark.parametrize("case", ["half-a-header", "payload-cut-at-half"])
async def test_websocket_client_gone_mid_frame(short_tmp: str, case: str, ending: str) -> None:
    async with whole_shim(short_tmp) as (r, streaming, cid):
        before = set(asyncio.all_tasks())
        req = pb.ExecRequest(container_id=cid, cmd=["sh", "-c", "yes"], stdin=True, stdout=True, stderr=True)
        url = (await r.rt.Exec(req)).url
        reader, writer, status, _, _ = await raw_upgrade(url, "GET", ws_upgrade_headers(V5))
        assert status == 101
        seen = b""
        while b"y\n" not in seen:  # the shell's output flows
            seen += await reader.read(65536)
        partial = {
            "half-a-header": b"\x82\xfe\x03",
            "payload-cut-at-half": ws_frame(0x2, bytes(500), length=1000),
        }
        writer.write(partial[case])
        await writer.drain()
        if ending == "close":
            writer.close()
        else:
            await eventually(lambda: streaming.open_sessions == 0, timeout=3, what="session ended")
            writer.close()
        await nothing_left(streaming, before)


# --------------------------------------------------------------------------- 4. bad dials


DIALS = [
    "expired",
    "reused",
    "unknown-token",
    "token-4000-chars",
    "token-percent-garbage",
    "token-dot-dot",
    "root",
    "kind-only",
    "kind-and-slash",
    "unknown-kind",
    "extra-segment",
    "wrong-kind",
    "wrong-method",
    "no-upgrade",
    "not-http",
    "head-over-64KiB",
    "head-never-finished",
]


@pytest.mark.parametrize("case", DIALS)
async def test_bad_dials_are_answered_at_once(
    runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    monkeypatch.setattr(server_module, "REQUEST_TIMEOUT", 0.3)
    server = StreamingServer(runtime, StreamingConfig(token_ttl=0.3 if case == "expired" else 60.0))
    await server.start()
    try:
        url = good_url = server.exec_url(exec_req(["echo", "once"]))
        base, token = url.rsplit("/exec/", 1)
        method, headers, raw = "POST", list(SPDY_UPGRADE_HEADERS), b""
        want = 404
        match case:
            case "expired":
                await asyncio.sleep(0.4)
            case "reused":
                client, _ = await SpdyClient.connect(url)
                first = open_exec_streams(client)
                await client.until(lambda: first["error"] in client.fins)
                await client.close()
            case "unknown-token":
                url = f"{base}/exec/{'A' * len(token)}"
            case "token-4000-chars":
                url = f"{base}/exec/{'A' * 4000}"
            case "token-percent-garbage":
                url = f"{base}/exec/%00%ff%2F{token}"
            case "token-dot-dot":
                url = f"{base}/exec/../exec/{token}"
            case "root":
                url = f"{base}/"
            case "kind-only":
                url = f"{base}/exec"
            case "kind-and-slash":
                url = f"{base}/exec/"
            case "unknown-kind":
                url = f"{base}/run/{token}"
            case "extra-segment":
                url = f"{base}/exec/{token}/more"
            case "wrong-kind":
                url = f"{base}/attach/{token}"
            case "wrong-method":
                method, want = "PUT", 405
            case "no-upgrade":
                headers, want = [], 400
            case "not-http":
                raw, want = b"\x16\x03\x01\x02\x00garbage\r\n\r\n", 400
            case "head-over-64KiB":
                headers, want = [("X-Filler", "f" * 70_000)], 400
            case "head-never-finished":
                raw, want = b"POST /exec/", 400
        started = time.monotonic()
        if raw:
            host, port = base.removeprefix("http://").rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(raw)
            answer = await read_to_eof(reader, timeout=2)
            status = int(answer.split(b" ", 2)[1])
            body = answer.split(b"\r\n\r\n", 1)[1]
        else:
            _, writer, status, _, body = await http_request(url, method, headers)
        elapsed = time.monotonic() - started
        writer.close()
        print(f"\n{case}: {status} {body!r} in {elapsed * 1000:.1f} ms")
        assert status == want
        assert body.strip()  # a reason, not an empty answer
        assert elapsed < (1.0 if case != "head-never-finished" else 1.3)
        await sessions_drained(server)
        if case not in ("expired", "reused"):
            # a dial that started no session left the token usable
            client, _ = await SpdyClient.connect(good_url)
            usable = open_exec_streams(client)
            await client.until(lambda: usable["error"] in client.fins)
            assert client.got(usable["stdout"]) == b"once"
            await client.close()
    finally:
        await server.stop()


async def test_dials_waiting_for_their_head_are_bounded(runtime: FakeRuntime) -> None:
    """Connections that never send a request head hold a slot each for REQUEST_TIMEOUT:
    past max_handshakes the next is answered 503 at once, and the slots come back."""
    server = StreamingServer(runtime, StreamingConfig(max_handshakes=4))
    await server.start()
    try:
        idle = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(4)]
        await eventually(lambda: server.open_connections == 4)
        started = time.monotonic()
        _, writer, status, headers, body = await http_request(
            server.exec_url(exec_req(["echo", "x"])), "POST"
        )
        writer.close()
        assert (status, header(headers, "Retry-After")) == (503, ["1"])
        assert b"too many connections waiting to start a streaming session (at most 4)" in body
        assert time.monotonic() - started < 1.0
        for _, writer in idle:
            writer.close()
        await eventually(lambda: server.open_connections == 0)
        client, _ = await SpdyClient.connect(server.exec_url(exec_req(["echo", "x"])))
        await client.close()
    finally:
        await server.stop()


# --------------------------------------------------------------------------- 5. the gRPC API meanwhile


async def _version_latencies(r: Running, n: int = 200) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        await r.rt.Version(pb.VersionRequest())
        out.append(time.perf_counter() - started)
    return out


async def test_version_stays_quick_during_abuse(short_tmp: str) -> None:
    """200 Version calls idle, then 200 while clients abuse the streaming server of the
    same process: stuck `yes` sessions, floods of pings, garbage, half frames, bad
    dials. The bound is generous, p99 under abuse < max(5 x idle p99, 50 ms), and a
    miss is measured again (at most four rounds, both phases): on a loaded 2-core
    machine the whole process is at times descheduled for tens of milliseconds, which
    must not fail the test by chance. The figures of every round are printed."""
    async with whole_shim(short_tmp, max_streams=8) as (r, streaming, cid):
        before = set(asyncio.all_tasks())
        await _version_latencies(r, 20)  # warm up
        rounds = []
        for _ in range(4):
            idle = await _version_latencies(r)
            during, dials = await _under_abuse(r, cid, _version_latencies(r))
            idle_p99, abuse_p99 = p99(idle), p99(during)
            bound = max(5 * idle_p99, 0.050)
            rounds.append(abuse_p99 < bound)
            print(
                f"\nVersion over gRPC, 200 calls each: idle p50 {sorted(idle)[100] * 1000:.2f} ms, "
                f"p99 {idle_p99 * 1000:.2f} ms; during abuse p50 {sorted(during)[100] * 1000:.2f} ms, "
                f"p99 {abuse_p99 * 1000:.2f} ms, max {max(during) * 1000:.2f} ms (bound {bound * 1000:.0f} ms); "
                f"abuse meanwhile: {dials}"
            )
            assert all(dials.values())
            if rounds[-1]:
                break
        assert rounds[-1], "Version p99 under abuse out of bound in every round"
        await nothing_left(streaming, before)


async def _under_abuse(
    r: Running, cid: str, work: Awaitable[Any], kinds: str = "all"
) -> tuple[Any, dict[str, int]]:
    """Run ``work`` while the streaming server is abused; its result, and what was done.

    ``kinds``: "all", or one of "stuck", "flood", "garbage" (bench/abuse_bench.py)."""
    stop = asyncio.Event()
    dials = {"garbage": 0, "bad-token": 0, "half-frame": 0, "flood-bytes": 0}
    yes = pb.ExecRequest(container_id=cid, cmd=["sh", "-c", "yes"], stdin=True, stdout=True, stderr=True)
    exec_sleep = pb.ExecRequest(container_id=cid, cmd=["sleep", "60"], stdout=True)

    async def stuck(transport: str) -> None:
        """`yes` into a client that never reads"""
        url = (await r.rt.Exec(yes)).url
        if transport == "spdy":
            reader, writer, _, _, _ = await raw_upgrade(url, "POST", SPDY_UPGRADE_HEADERS, SMALL_RCVBUF)
            open_exec_streams(SpdyClient(reader, writer), stdin=True)
        else:
            reader, writer, _, _, _ = await raw_upgrade(url, "GET", ws_upgrade_headers(V5), SMALL_RCVBUF)
        await stop.wait()
        writer.transport.abort()

    async def flood(transport: str) -> None:
        """pings as fast as the server takes them, answers never read"""
        url = (await r.rt.Exec(exec_sleep)).url
        if transport == "spdy":
            _, writer, _, _, _ = await raw_upgrade(url, "POST", SPDY_UPGRADE_HEADERS, SMALL_RCVBUF)
            chunk = control_frame(spdy.FrameType.PING, struct.pack(">I", 1)) * 5000
        else:
            _, writer, _, _, _ = await raw_upgrade(url, "GET", ws_upgrade_headers(V5), SMALL_RCVBUF)
            chunk = ws_frame(0x9, b"") * 10000
        while not stop.is_set():
            writer.write(chunk)
            dials["flood-bytes"] += len(chunk)
            with contextlib.suppress(TimeoutError, ConnectionError):
                async with asyncio.timeout(0.2):
                    await writer.drain()
        writer.transport.abort()

    async def garbage() -> None:
        """random bytes after an upgrade, a spent token, a frame cut in half"""
        while not stop.is_set():
            url = (await r.rt.Exec(exec_sleep)).url
            reader, writer, _, _, _ = await raw_upgrade(url, "POST", SPDY_UPGRADE_HEADERS)
            writer.write(random.Random(dials["garbage"]).randbytes(2048) + b"\x80\x02")
            with contextlib.suppress(TimeoutError, ConnectionError):
                await read_to_eof(reader, timeout=2)
            writer.close()
            dials["garbage"] += 1
            _, writer, _, _, _ = await http_request(url, "POST", SPDY_UPGRADE_HEADERS)
            writer.close()
            dials["bad-token"] += 1
            url = (await r.rt.Exec(exec_sleep)).url
            reader, writer, _, _, _ = await raw_upgrade(url, "GET", ws_upgrade_headers(V5))
            writer.write(ws_frame(0x2, bytes(100), length=1000))
            writer.close()
            dials["half-frame"] += 1

    chosen = {
        "stuck": lambda: (stuck("spdy"), stuck("ws")),
        "flood": lambda: (flood("spdy"), flood("ws")),
        "garbage": lambda: (garbage(),),
    }
    coros = [c for k, make in chosen.items() if kinds in ("all", k) for c in make()]
    abuse = [asyncio.ensure_future(coro) for coro in coros]
    try:
        await asyncio.sleep(0.3)  # under way
        result = await work
    finally:
        stop.set()
        await asyncio.gather(*abuse)
    return result, dials
