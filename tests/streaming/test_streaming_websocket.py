"""Exec, attach and port-forward over WebSocket against the real server."""

from __future__ import annotations

import asyncio
import base64
import json
import struct

import pytest

from cri_api import api_pb2 as pb
from shim.streaming import StreamingServer, spdy
from shim.streaming import websocket as websocket_module
from tests.streaming.streaming_helpers import (
    FakeRuntime,
    SpdyClient,
    WsClient,
    header,
    sessions_drained,
    task_origin,
)

SUCCESS = {"metadata": {}, "status": "Success"}


def exec_req(cmd: list[str], stdin: bool = False, tty: bool = False) -> pb.ExecRequest:
    return pb.ExecRequest(container_id="c1", cmd=cmd, stdin=stdin, stdout=True, stderr=not tty, tty=tty)


def channels(messages: list[bytes | str]) -> dict[int, bytes]:
    """Binary channel messages joined per channel (the initial empty message included)."""
    out: dict[int, bytes] = {}
    for message in messages:
        assert isinstance(message, bytes) and message
        out[message[0]] = out.get(message[0], b"") + message[1:]
    return out


@pytest.mark.parametrize("protocol", ["v5.channel.k8s.io", "v4.channel.k8s.io"])
async def test_exec_binary(server: StreamingServer, protocol: str) -> None:
    ws, status, resp, _ = await WsClient.connect(server.exec_url(exec_req(["both"])), [protocol])
    assert ws is not None and status == 101
    assert header(resp, "Sec-WebSocket-Protocol") == [protocol]
    messages = await ws.messages()
    assert messages[0] == b"\x01"  # empty stdout message: the streams are ready
    got = channels(messages)
    assert got[1] == b"to stdout" and got[2] == b"to stderr"
    assert json.loads(got[3]) == SUCCESS
    await ws.close()


@pytest.mark.parametrize("protocol", ["v4.base64.channel.k8s.io", "base64.channel.k8s.io"])
async def test_exec_base64(server: StreamingServer, protocol: str) -> None:
    ws, _, _, _ = await WsClient.connect(server.exec_url(exec_req(["exit", "4"])), [protocol])
    assert ws is not None and ws.subprotocol == protocol
    await ws.send("0" + base64.b64encode(b"ignored: no stdin").decode())
    messages = await ws.messages()
    assert all(isinstance(m, str) for m in messages)
    errors = [base64.b64decode(m[1:]) for m in messages if isinstance(m, str) and m[0] == "3"]
    assert len(errors) == 1
    if protocol.startswith("v4."):
        status = json.loads(errors[0])
        assert status["reason"] == "NonZeroExitCode"
        assert status["details"]["causes"][0]["message"] == "4"
    else:
        assert errors[0].startswith(b"command terminated with non-zero exit code")
    await ws.close()


async def test_exec_without_subprotocol_is_channel_v1(server: StreamingServer) -> None:
    ws, _, _, _ = await WsClient.connect(server.exec_url(exec_req(["echo", "legacy"])), [])
    assert ws is not None and ws.subprotocol == ""
    got = channels(await ws.messages())
    assert got[1] == b"legacy"
    assert got.get(3, b"") == b""  # v1: success is silence
    await ws.close()


async def test_unsupported_subprotocol_is_400(server: StreamingServer) -> None:
    ws, status, _, body = await WsClient.connect(server.exec_url(exec_req(["echo"])), ["v9.channel.k8s.io"])
    assert ws is None and status == 400
    assert b"not supported" in body


async def test_v5_stdin_close_signal(server: StreamingServer) -> None:
    ws, _, _, _ = await WsClient.connect(
        server.exec_url(exec_req(["cat"], stdin=True)), ["v5.channel.k8s.io"]
    )
    assert ws is not None
    await ws.send(b"\x00first ")
    await ws.send(b"\x00second")
    await ws.send(b"\xff\x00")  # close stdin: cat ends
    got = channels(await ws.messages())
    assert got[1] == b"first second"
    assert json.loads(got[3]) == SUCCESS
    await ws.close()


async def test_tty_resize_channel(server: StreamingServer) -> None:
    ws, _, _, _ = await WsClient.connect(
        server.exec_url(exec_req(["resize", "2"], stdin=True, tty=True)), ["v5.channel.k8s.io"]
    )
    assert ws is not None
    await ws.send(b'\x04{"Width":100,"Height":50}')
    await ws.send(b'\x04{"Width":101,"Height":51}')
    got = channels(await ws.messages())
    assert got[1] == b"[(100, 50), (101, 51)]"
    await ws.close()


async def test_attach(server: StreamingServer) -> None:
    req = pb.AttachRequest(container_id="c2", stdin=True, stdout=True)
    ws, _, _, _ = await WsClient.connect(server.attach_url(req), ["v5.channel.k8s.io"])
    assert ws is not None
    await ws.send(b"\x00typed")
    await ws.send(b"\xff\x00")
    got = channels(await ws.messages())
    assert got[1] == b"attached;typed"
    await ws.close()


async def test_disconnect_cancels_the_runtime(server: StreamingServer, runtime: FakeRuntime) -> None:
    ws, _, _, _ = await WsClient.connect(
        server.exec_url(exec_req(["sleep"], stdin=True)), ["v4.channel.k8s.io"]
    )
    assert ws is not None
    await asyncio.wait_for(runtime.started.wait(), 5)
    ws.writer.transport.abort()
    await asyncio.wait_for(runtime.cancelled.wait(), 5)
    await sessions_drained(server)


# --------------------------------------------------------------------------- port-forward


@pytest.mark.parametrize("protocol", ["v4.channel.k8s.io", "portforward.k8s.io"])
async def test_portforward_channels(server: StreamingServer, echo_port: int, protocol: str) -> None:
    req = pb.PortForwardRequest(pod_sandbox_id="s1", port=[echo_port, 1])
    ws, _, _, _ = await WsClient.connect(server.portforward_url(req), [protocol])
    assert ws is not None and ws.subprotocol == protocol
    port_bytes = struct.pack("<H", echo_port)
    # Every channel first carries its port, little-endian.
    first = [await ws.recv() for _ in range(4)]
    assert first == [b"\x00" + port_bytes, b"\x01" + port_bytes, b"\x02\x01\x00", b"\x03\x01\x00"]
    # Port 1 has no listener: its error channel says so.
    message = await ws.recv()
    assert isinstance(message, bytes) and message[0] == 3 and b"error forwarding port 1" in message
    await ws.send(b"\x00hello")
    assert await ws.recv() == b"\x00hello"
    await ws.close()


async def test_portforward_ports_from_query(server: StreamingServer, echo_port: int) -> None:
    url = server.portforward_url(pb.PortForwardRequest(pod_sandbox_id="s1")) + f"?port={echo_port}"
    ws, _, _, _ = await WsClient.connect(url, ["v4.base64.channel.k8s.io"])
    assert ws is not None
    assert await ws.recv() == "0" + base64.b64encode(struct.pack("<H", echo_port)).decode()
    assert await ws.recv() == "1" + base64.b64encode(struct.pack("<H", echo_port)).decode()
    await ws.send("0" + base64.b64encode(b"b64").decode())
    assert await ws.recv() == "0" + base64.b64encode(b"b64").decode()
    await ws.close()


async def test_portforward_without_ports_is_400(server: StreamingServer) -> None:
    url = server.portforward_url(pb.PortForwardRequest(pod_sandbox_id="s1"))
    ws, status, _, _ = await WsClient.connect(url, ["v4.channel.k8s.io"])
    assert ws is None and status == 400


async def test_portforward_spdy_tunnel(server: StreamingServer, runtime: FakeRuntime, echo_port: int) -> None:
    """SPDY frames inside binary WebSocket messages, as client-go's SPDYOverWebsocket dialer sends them."""
    url = server.portforward_url(pb.PortForwardRequest(pod_sandbox_id="s1"))
    ws, _, _, _ = await WsClient.connect(url, ["SPDY/3.1+portforward.k8s.io"])
    assert ws is not None and ws.subprotocol == "SPDY/3.1+portforward.k8s.io"
    encoder, decoder = spdy.FrameEncoder(), spdy.FrameDecoder()
    err = encoder.encode(
        spdy.SynStreamFrame(1, {"streamtype": "error", "port": str(echo_port), "requestid": "0"})
    )
    data = encoder.encode(
        spdy.SynStreamFrame(3, {"streamtype": "data", "port": str(echo_port), "requestid": "0"})
    )
    payload = encoder.encode(spdy.DataFrame(3, b"tunnelled", fin=True))
    # Message boundaries need not match frame boundaries.
    stream = err + data + payload
    await ws.send(stream[:5])
    await ws.send(stream[5:40])
    await ws.send(stream[40:])
    buf = b""
    frames: list[spdy.Frame] = []
    async with asyncio.timeout(10):
        while not any(isinstance(f, spdy.DataFrame) and f.stream_id == 3 and f.fin for f in frames):
            message = await ws.recv()
            assert isinstance(message, bytes)
            buf += message
            while len(buf) >= 8 and len(buf) >= 8 + spdy.parse_frame_header(buf[:8])[3]:
                length = spdy.parse_frame_header(buf[:8])[3]
                frame = decoder.decode(buf[:8], buf[8 : 8 + length])
                assert frame is not None
                frames.append(frame)
                buf = buf[8 + length :]
    assert {f.stream_id for f in frames if isinstance(f, spdy.SynReplyFrame)} == {1, 3}
    assert (
        b"".join(f.data for f in frames if isinstance(f, spdy.DataFrame) and f.stream_id == 3) == b"tunnelled"
    )
    assert runtime.calls == [("port_forward", "s1", (str(echo_port),))]
    await ws.close()


async def test_spdy_and_websocket_share_the_listener(server: StreamingServer) -> None:
    ws, _, _, _ = await WsClient.connect(server.exec_url(exec_req(["echo", "ws"])), ["v5.channel.k8s.io"])
    client, _ = await SpdyClient.connect(server.exec_url(exec_req(["echo", "spdy"])))
    assert ws is not None
    error = client.open({"streamtype": "error"})
    stdout = client.open({"streamtype": "stdout"})
    client.open({"streamtype": "stderr"})
    await client.until(lambda: error in client.fins)
    assert client.got(stdout) == b"spdy"
    assert channels(await ws.messages())[1] == b"ws"
    await ws.close()
    await client.close()


async def test_disconnect_is_seen_while_input_is_stalled(
    server: StreamingServer, runtime: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(websocket_module, "PROBE_INTERVAL", 0.1)
    ws, _, _, _ = await WsClient.connect(
        server.exec_url(exec_req(["sleep"], stdin=True)), ["v5.channel.k8s.io"]
    )
    assert ws is not None
    for _ in range(100):  # the runtime never reads stdin
        ws.protocol.send_binary(b"\x00" + b"z" * 32 * 1024)
        ws._flush()
    await asyncio.sleep(0.5)
    assert not runtime.cancelled.is_set()
    ws.writer.transport.abort()
    await asyncio.wait_for(runtime.cancelled.wait(), 5)
    await sessions_drained(server)


async def test_finished_sessions_leave_no_tasks(server: StreamingServer, echo_port: int) -> None:
    client, _ = await SpdyClient.connect(server.exec_url(exec_req(["echo", "a"])))
    ids = {t: client.open({"streamtype": t}) for t in ("error", "stdout", "stderr")}
    await client.until(lambda: ids["error"] in client.fins)
    await client.close()
    ws, _, _, _ = await WsClient.connect(server.exec_url(exec_req(["echo", "b"])), ["v5.channel.k8s.io"])
    assert ws is not None
    await ws.messages()
    await ws.close()
    req = pb.PortForwardRequest(pod_sandbox_id="s1", port=[echo_port])
    pf, _, _, _ = await WsClient.connect(server.portforward_url(req), ["v4.channel.k8s.io"])
    assert pf is not None
    await pf.recv()
    await pf.close()
    await sessions_drained(server)
    async with asyncio.timeout(5):
        while [t for t in asyncio.all_tasks() if "shim/streaming" in task_origin(t)]:  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def test_malformed_frame_closes_only_that_connection(
    server: StreamingServer, runtime: FakeRuntime
) -> None:
    healthy, _, _, _ = await WsClient.connect(
        server.exec_url(exec_req(["cat"], stdin=True)), ["v5.channel.k8s.io"]
    )
    assert healthy is not None
    broken, _, _, _ = await WsClient.connect(server.exec_url(exec_req(["sleep"])), ["v5.channel.k8s.io"])
    assert broken is not None
    async with asyncio.timeout(5):
        while len(runtime.calls) < 2:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    broken.writer.write(b"\x82\x05hello")  # a client frame without a mask
    await broken.messages()  # the server closes this connection...
    await asyncio.wait_for(runtime.cancelled.wait(), 5)
    await broken.close()
    await healthy.send(b"\x00fine")  # ...and only this one
    await healthy.send(b"\xff\x00")
    assert channels(await healthy.messages())[1] == b"fine"
    await healthy.close()
