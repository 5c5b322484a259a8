"""Exec, attach and port-forward over SPDY/3.1 against the real server."""

from __future__ import annotations

import asyncio
import json
import struct

import pytest

from cri_api import api_pb2 as pb
from shim.cri.errors import InvalidArgumentError
from shim.streaming import StreamingConfig, StreamingServer, spdy
from shim.streaming import session as session_module
from tests.streaming.streaming_helpers import FakeRuntime, SpdyClient, header, http_request, sessions_drained

V4, V3, V2, V1 = "v4.channel.k8s.io", "v3.channel.k8s.io", "v2.channel.k8s.io", "channel.k8s.io"


def exec_req(cmd: list[str], stdin: bool = False, tty: bool = False) -> pb.ExecRequest:
    return pb.ExecRequest(container_id="c1", cmd=cmd, stdin=stdin, stdout=True, stderr=not tty, tty=tty)


async def open_exec(
    client: SpdyClient, stdin: bool = False, tty: bool = False, resize: bool = False
) -> dict[str, int]:
    """Open the streams the way client-go does: error first, then the rest."""
    ids = {"error": client.open({"streamtype": "error"})}
    if stdin:
        ids["stdin"] = client.open({"streamtype": "stdin"})
    ids["stdout"] = client.open({"streamtype": "stdout"})
    if not tty:
        ids["stderr"] = client.open({"streamtype": "stderr"})
    if resize:
        ids["resize"] = client.open({"streamtype": "resize"})
    return ids


async def test_exec_v4_success(server: StreamingServer, runtime: FakeRuntime) -> None:
    url = server.exec_url(exec_req(["both"]))
    assert url.startswith(f"{server.base_url}/exec/")
    client, resp = await SpdyClient.connect(url, [V4, V3, V2, V1])
    assert header(resp, "X-Stream-Protocol-Version") == [V4]
    assert header(resp, "Upgrade") == ["SPDY/3.1"]
    ids = await open_exec(client)
    await client.until(lambda: {ids["stdout"], ids["stderr"], ids["error"]} <= client.fins)
    assert client.replies >= set(ids.values())
    assert client.got(ids["stdout"]) == b"to stdout"
    assert client.got(ids["stderr"]) == b"to stderr"
    assert json.loads(client.got(ids["error"])) == {"metadata": {}, "status": "Success"}
    await client.until_eof()  # the server says GOAWAY and hangs up
    assert any(isinstance(f, spdy.GoAwayFrame) for f in client.other)
    assert runtime.calls == [("exec", "c1", ("both",))]
    await client.close()


async def test_exec_v4_exit_code_status(server: StreamingServer) -> None:
    client, _ = await SpdyClient.connect(server.exec_url(exec_req(["exit", "3"])), [V4])
    ids = await open_exec(client)
    await client.until(lambda: ids["error"] in client.fins)
    status = json.loads(client.got(ids["error"]))
    assert status["status"] == "Failure"
    assert status["reason"] == "NonZeroExitCode"
    assert status["details"]["causes"] == [{"reason": "ExitCode", "message": "3"}]
    await client.close()


@pytest.mark.parametrize("protocol", [V3, V2, V1])
@pytest.mark.parametrize(
    ("cmd", "error_text"),
    [(["echo", "hi"], b""), (["exit", "2"], b"command terminated with non-zero exit code")],
    ids=["success", "failure"],
)
async def test_exec_older_versions_report_errors_as_text(
    server: StreamingServer, protocol: str, cmd: list[str], error_text: bytes
) -> None:
    client, resp = await SpdyClient.connect(server.exec_url(exec_req(cmd)), [protocol])
    assert header(resp, "X-Stream-Protocol-Version") == [protocol]
    ids = await open_exec(client)
    await client.until(lambda: {ids["error"], ids["stdout"]} <= client.fins)
    if error_text:
        assert client.got(ids["error"]).startswith(error_text)
    else:
        assert client.got(ids["error"]) == b""
        assert client.got(ids["stdout"]) == b"hi"
    await client.close()


async def test_exec_without_version_header_is_v1(server: StreamingServer) -> None:
    client, resp = await SpdyClient.connect(server.exec_url(exec_req(["echo", "old"])), [])
    assert header(resp, "X-Stream-Protocol-Version") == []
    ids = await open_exec(client)
    await client.until(lambda: ids["stdout"] in client.fins)
    assert client.got(ids["stdout"]) == b"old"
    await client.close()


async def test_runtime_error_is_reported(server: StreamingServer) -> None:
    client, _ = await SpdyClient.connect(server.exec_url(exec_req(["missing"])), [V4])
    ids = await open_exec(client)
    await client.until(lambda: ids["error"] in client.fins)
    status = json.loads(client.got(ids["error"]))
    assert status["status"] == "Failure" and "container gone" in status["message"]
    await client.close()


async def test_stdin_with_half_close(server: StreamingServer) -> None:
    client, _ = await SpdyClient.connect(server.exec_url(exec_req(["cat"], stdin=True)), [V4])
    ids = await open_exec(client, stdin=True)
    await client.until(lambda: ids["stdin"] in client.replies)
    client.write(ids["stdin"], b"hello ")
    client.write(ids["stdin"], b"world")
    client.write(ids["stdin"], b"", fin=True)
    await client.until(lambda: ids["error"] in client.fins)
    assert client.got(ids["stdout"]) == b"hello world"
    assert json.loads(client.got(ids["error"]))["status"] == "Success"
    await client.close()


@pytest.mark.parametrize("protocol", [V4, V3])
async def test_tty_resize(server: StreamingServer, protocol: str) -> None:
    client, _ = await SpdyClient.connect(
        server.exec_url(exec_req(["resize", "2"], stdin=True, tty=True)), [protocol]
    )
    ids = await open_exec(client, stdin=True, tty=True, resize=True)
    await client.until(lambda: ids["resize"] in client.replies)
    # Two JSON objects, the second split across frames.
    client.write(ids["resize"], b'{"Width":80,"Height":24}{"Width":')
    client.write(ids["resize"], b'120,"Height":40}')
    await client.until(lambda: ids["stdout"] in client.fins)
    assert client.got(ids["stdout"]) == b"[(80, 24), (120, 40)]"
    await client.close()


async def test_attach(server: StreamingServer, runtime: FakeRuntime) -> None:
    req = pb.AttachRequest(container_id="c2", stdin=True, stdout=True, stderr=True)
    client, _ = await SpdyClient.connect(server.attach_url(req), [V4])
    ids = await open_exec(client, stdin=True)
    await client.until(lambda: ids["stdin"] in client.replies)
    client.write(ids["stdin"], b"typed", fin=True)
    await client.until(lambda: ids["error"] in client.fins)
    assert client.got(ids["stdout"]) == b"attached;typed"
    assert runtime.calls == [("attach", "c2", ())]
    await client.close()


async def test_large_output_is_complete(server: StreamingServer) -> None:
    client, _ = await SpdyClient.connect(server.exec_url(exec_req(["big", str(3 * 1024 * 1024)])), [V4])
    ids = await open_exec(client)
    await client.until(lambda: ids["error"] in client.fins, timeout=30)
    assert client.got(ids["stdout"]) == b"x" * (3 * 1024 * 1024)
    await client.close()


async def test_flow_control_is_honoured_once_the_client_uses_it(server: StreamingServer) -> None:
    client, _ = await SpdyClient.connect(server.exec_url(exec_req(["big", str(200 * 1024)])), [V4])
    client.send(spdy.SettingsFrame(((0, spdy.Setting.INITIAL_WINDOW_SIZE, 16 * 1024),)))
    ids = await open_exec(client)
    await client.until(lambda: len(client.got(ids["stdout"])) >= 16 * 1024)
    # The stream window is spent: nothing more arrives until we open it.
    with pytest.raises(TimeoutError):
        await client.until(lambda: len(client.got(ids["stdout"])) > 16 * 1024, timeout=0.3)
    assert len(client.got(ids["stdout"])) == 16 * 1024
    client.send(spdy.WindowUpdateFrame(ids["stdout"], 10_000))
    await client.until(lambda: len(client.got(ids["stdout"])) >= 16 * 1024 + 10_000)
    with pytest.raises(TimeoutError):
        await client.until(lambda: len(client.got(ids["stdout"])) > 16 * 1024 + 10_000, timeout=0.3)
    # The session window (64 KiB) binds too.
    client.send(spdy.WindowUpdateFrame(ids["stdout"], 1_000_000))
    await client.until(lambda: len(client.got(ids["stdout"])) >= 64 * 1024)
    with pytest.raises(TimeoutError):
        await client.until(lambda: len(client.got(ids["stdout"])) > 64 * 1024, timeout=0.3)
    client.send(spdy.WindowUpdateFrame(0, 1_000_000))
    await client.until(lambda: ids["error"] in client.fins)
    assert len(client.got(ids["stdout"])) == 200 * 1024
    await client.close()


async def test_server_opens_the_window_as_it_reads(server: StreamingServer) -> None:
    client, _ = await SpdyClient.connect(server.exec_url(exec_req(["cat"], stdin=True)), [V4])
    ids = await open_exec(client, stdin=True)
    await client.until(lambda: ids["stdin"] in client.replies)
    # The server announced a 1 MiB window for streams and for the session.
    settings = [f for f in client.other if isinstance(f, spdy.SettingsFrame)]
    assert (0, spdy.Setting.INITIAL_WINDOW_SIZE, session_module.RECV_WINDOW) in settings[0].entries
    for _ in range(48):
        client.write(ids["stdin"], b"y" * 16 * 1024)
    await client.until(lambda: len(client.got(ids["stdout"])) == 768 * 1024)
    updates = [f for f in client.other if isinstance(f, spdy.WindowUpdateFrame)]
    assert {f.stream_id for f in updates} == {0, ids["stdin"]}
    assert sum(f.delta for f in updates if f.stream_id == ids["stdin"]) >= session_module.RECV_WINDOW // 2
    await client.close()


async def test_ping_is_echoed(server: StreamingServer) -> None:
    client, _ = await SpdyClient.connect(server.exec_url(exec_req(["sleep"])), [V4])
    client.send(spdy.PingFrame(11))
    await client.until(lambda: spdy.PingFrame(11) in client.other)
    await client.close()


async def test_portforward_pairs(server: StreamingServer, runtime: FakeRuntime, echo_port: int) -> None:
    client, resp = await SpdyClient.connect(
        server.portforward_url(pb.PortForwardRequest(pod_sandbox_id="s1")), ["portforward.k8s.io"]
    )
    assert header(resp, "X-Stream-Protocol-Version") == ["portforward.k8s.io"]
    pairs = []
    for rid in ("0", "1"):
        err = client.open({"streamtype": "error", "port": str(echo_port), "requestid": rid})
        data = client.open({"streamtype": "data", "port": str(echo_port), "requestid": rid})
        pairs.append((err, data))
    (err0, data0), (err1, data1) = pairs
    await client.until(lambda: {data0, data1} <= client.replies)
    client.write(data0, b"ping-0")
    client.write(data1, b"ping-1", fin=True)
    await client.until(lambda: client.got(data0) == b"ping-0" and data1 in client.fins)
    assert client.got(data1) == b"ping-1"
    await client.until(lambda: err1 in client.fins)
    assert client.got(err1) == b""  # no error
    client.write(data0, b"", fin=True)
    await client.until(lambda: {data0, err0} <= client.fins)
    assert sorted(runtime.calls) == [("port_forward", "s1", (str(echo_port),))] * 2
    await client.close()


async def test_portforward_error_stream(server: StreamingServer, echo_port: int) -> None:
    # Pairing by stream id, for clients that send no requestID.
    client, _ = await SpdyClient.connect(
        server.portforward_url(pb.PortForwardRequest(pod_sandbox_id="s1")), []
    )
    dead = 1  # nothing listens on port 1
    err = client.open({"streamtype": "error", "port": str(dead)})
    data = client.open({"streamtype": "data", "port": str(dead)})
    await client.until(lambda: {err, data} <= client.fins)
    assert client.got(err).startswith(b"error forwarding port 1 to pod s1")
    await client.close()


async def test_portforward_bad_stream_headers_are_reset(server: StreamingServer) -> None:
    client, _ = await SpdyClient.connect(
        server.portforward_url(pb.PortForwardRequest(pod_sandbox_id="s1")), []
    )
    bad_port = client.open({"streamtype": "data", "port": "99999", "requestid": "1"})
    bad_type = client.open({"streamtype": "stdout", "port": "80", "requestid": "2"})
    await client.until(lambda: {bad_port, bad_type} <= client.resets.keys())
    await client.close()


# --------------------------------------------------------------------------- HTTP level


async def test_negotiation_failure_is_403(server: StreamingServer) -> None:
    url = server.exec_url(exec_req(["echo"]))
    headers = [
        ("Connection", "Upgrade"),
        ("Upgrade", "SPDY/3.1"),
        ("X-Stream-Protocol-Version", "v9.channel.k8s.io"),
    ]
    _, writer, status, resp, body = await http_request(url, "POST", headers)
    writer.close()
    assert status == 403
    assert V4 in header(resp, "X-Accepted-Stream-Protocol-Versions")
    assert b"unable to negotiate protocol" in body


async def test_plain_request_without_upgrade_is_400(server: StreamingServer) -> None:
    _, writer, status, _, _ = await http_request(server.exec_url(exec_req(["echo"])), "POST")
    writer.close()
    assert status == 400


@pytest.mark.parametrize("case", ["unknown", "reused", "expired", "wrong-kind", "bad-path"])
async def test_bad_tokens_are_404(runtime: FakeRuntime, case: str) -> None:
    server = StreamingServer(runtime, StreamingConfig(token_ttl=0.2))
    await server.start()
    try:
        url = server.exec_url(exec_req(["echo", "once"]))
        if case == "unknown":
            url = url.rsplit("/", 1)[0] + "/AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
        elif case == "reused":
            client, _ = await SpdyClient.connect(url, [V4])
            ids = await open_exec(client)
            await client.until(lambda: ids["error"] in client.fins)
            await client.close()
        elif case == "expired":
            await asyncio.sleep(0.3)
        elif case == "wrong-kind":
            url = url.replace("/exec/", "/attach/")
        elif case == "bad-path":
            url = url.replace("/exec/", "/exec/x/")
        headers = [("Connection", "Upgrade"), ("Upgrade", "SPDY/3.1"), ("X-Stream-Protocol-Version", V4)]
        _, writer, status, _, _ = await http_request(url, "POST", headers)
        writer.close()
        assert status == 404
    finally:
        await server.stop()


async def test_session_limit(runtime: FakeRuntime) -> None:
    server = StreamingServer(runtime, StreamingConfig(max_streams=1))
    await server.start()
    try:
        first, _ = await SpdyClient.connect(server.exec_url(exec_req(["sleep"])), [V4])
        await open_exec(first)
        await asyncio.wait_for(runtime.started.wait(), 5)
        assert server.open_sessions == 1
        url = server.exec_url(exec_req(["echo"]))
        headers = [("Connection", "Upgrade"), ("Upgrade", "SPDY/3.1")]
        _, writer, status, _, _ = await http_request(url, "POST", headers)
        writer.close()
        assert status == 503
        await first.close()
        await asyncio.wait_for(runtime.cancelled.wait(), 5)
        await sessions_drained(server)
        # The refused request did not burn its token.
        client, _ = await SpdyClient.connect(url, [V4])
        await client.close()
    finally:
        await server.stop()


def test_url_validation(server: StreamingServer) -> None:
    with pytest.raises(InvalidArgumentError):
        server.exec_url(pb.ExecRequest(container_id="c", cmd=[], stdout=True))
    with pytest.raises(InvalidArgumentError):
        server.exec_url(pb.ExecRequest(container_id="c", cmd=["sh"]))
    with pytest.raises(InvalidArgumentError):
        server.attach_url(pb.AttachRequest(container_id="c", stdout=True, stderr=True, tty=True))
    with pytest.raises(InvalidArgumentError):
        server.portforward_url(pb.PortForwardRequest(pod_sandbox_id="s", port=[70000]))


# --------------------------------------------------------------------------- failures


async def test_client_disconnect_cancels_the_runtime(server: StreamingServer, runtime: FakeRuntime) -> None:
    client, _ = await SpdyClient.connect(server.exec_url(exec_req(["sleep"], stdin=True)), [V4])
    await open_exec(client, stdin=True)
    await asyncio.wait_for(runtime.started.wait(), 5)
    assert server.open_sessions == 1
    client.writer.transport.abort()  # vanish without a word
    await asyncio.wait_for(runtime.cancelled.wait(), 5)
    await sessions_drained(server)


async def test_portforward_disconnect_cancels_the_runtime(
    server: StreamingServer, runtime: FakeRuntime, echo_port: int
) -> None:
    client, _ = await SpdyClient.connect(
        server.portforward_url(pb.PortForwardRequest(pod_sandbox_id="s1")), []
    )
    client.open({"streamtype": "error", "port": str(echo_port), "requestid": "0"})
    data = client.open({"streamtype": "data", "port": str(echo_port), "requestid": "0"})
    client.write(data, b"x")
    await client.until(lambda: client.got(data) == b"x")
    await client.close()
    await asyncio.wait_for(runtime.cancelled.wait(), 5)


async def test_malformed_frame_closes_only_that_connection(
    server: StreamingServer, runtime: FakeRuntime
) -> None:
    healthy, _ = await SpdyClient.connect(server.exec_url(exec_req(["cat"], stdin=True)), [V4])
    healthy_ids = await open_exec(healthy, stdin=True)
    await healthy.until(lambda: healthy_ids["stdin"] in healthy.replies)

    broken, _ = await SpdyClient.connect(server.exec_url(exec_req(["echo"])), [V4])
    broken.writer.write(struct.pack(">HHI", 0x8002, 1, 10) + b"\x00" * 10)  # SPDY/2 frame
    await broken.until_eof()
    goaway = [f for f in broken.other if isinstance(f, spdy.GoAwayFrame)]
    assert goaway and goaway[0].status == spdy.GoAwayStatus.PROTOCOL_ERROR
    await broken.close()

    healthy.write(healthy_ids["stdin"], b"still here", fin=True)
    await healthy.until(lambda: healthy_ids["error"] in healthy.fins)
    assert healthy.got(healthy_ids["stdout"]) == b"still here"
    await healthy.close()


async def test_slow_client_does_not_block_others(server: StreamingServer) -> None:
    # This client never reads: its exec blocks once the socket buffers are full.
    slow, _ = await SpdyClient.connect(server.exec_url(exec_req(["big", str(64 * 1024 * 1024)])), [V4])
    await open_exec(slow)
    await asyncio.sleep(0.3)
    fast, _ = await SpdyClient.connect(server.exec_url(exec_req(["echo", "quick"])), [V4])
    ids = await open_exec(fast)
    await fast.until(lambda: ids["error"] in fast.fins, timeout=5)
    assert fast.got(ids["stdout"]) == b"quick"
    await fast.close()
    await slow.close()


async def test_stream_creation_timeout(runtime: FakeRuntime) -> None:
    server = StreamingServer(runtime, StreamingConfig(stream_creation_timeout=0.3))
    await server.start()
    try:
        client, _ = await SpdyClient.connect(server.exec_url(exec_req(["echo"])), [V4])
        err = client.open({"streamtype": "error"})  # and never stdout/stderr
        await client.until_eof()
        assert b"timed out" in client.got(err)
        assert runtime.calls == []
        await client.close()
    finally:
        await server.stop()


async def test_idle_timeout(runtime: FakeRuntime) -> None:
    server = StreamingServer(runtime, StreamingConfig(idle_timeout=0.3))
    await server.start()
    try:
        client, _ = await SpdyClient.connect(server.exec_url(exec_req(["sleep"])), [V4])
        await open_exec(client)
        await asyncio.wait_for(runtime.cancelled.wait(), 5)
        await client.until_eof()
        await client.close()
    finally:
        await server.stop()


async def test_stop_ends_sessions(runtime: FakeRuntime) -> None:
    server = StreamingServer(runtime, StreamingConfig())
    await server.start()
    client, _ = await SpdyClient.connect(server.exec_url(exec_req(["sleep"])), [V4])
    await open_exec(client)
    await asyncio.wait_for(runtime.started.wait(), 5)
    await server.stop()
    assert runtime.cancelled.is_set()
    await client.until_eof()
    await client.close()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", server.port)


async def test_disconnect_is_seen_while_input_is_stalled(
    server: StreamingServer, runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime never reads stdin, so the session's reader stops; a client that
    then vanishes must still cancel the runtime (found by probing with PING)."""
    monkeypatch.setattr(session_module, "PROBE_INTERVAL", 0.1)
    client, _ = await SpdyClient.connect(server.exec_url(exec_req(["sleep"], stdin=True)), [V4])
    ids = await open_exec(client, stdin=True)
    await client.until(lambda: ids["stdin"] in client.replies)
    for _ in range(40):  # far more than the server buffers, ignoring its window
        client.write(ids["stdin"], b"z" * 32 * 1024)
    await asyncio.sleep(0.5)
    assert not runtime.cancelled.is_set()
    client.writer.transport.abort()
    await asyncio.wait_for(runtime.cancelled.wait(), 5)
    await sessions_drained(server)
