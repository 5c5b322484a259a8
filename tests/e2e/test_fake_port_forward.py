"""Port-forward through the shim's streaming server, SPDY and WebSocket, to a fake pod whose command
serves files with busybox's httpd: the client gets that server's page, not an echo."""

from __future__ import annotations

import asyncio
import struct

from cri_api import api_pb2 as pb
from tests.conftest import Running
from tests.e2e.test_rpcs import pod_with_container
from tests.streaming.streaming_helpers import SpdyClient, WsClient

PORT = 8080
SERVE = f"mkdir -p /www && echo hello > /www/index.html && httpd -f -p {PORT} -h /www"
GET = b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"


async def serving_pod(r: Running, tmp: str) -> str:
    """A pod whose container runs SERVE, once its server has bound its port."""
    pod, cid = await pod_with_container(r, tmp, ["sh", "-c", SERVE])
    await r.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    for _ in range(1000):
        if PORT in r.fake.runtime.lifecycle.ports.bound(pod):
            return pod
        await asyncio.sleep(0.01)
    raise AssertionError(f"the container's httpd never bound port {PORT}")


def body_of(answer: bytes) -> bytes:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n"), answer
    assert b"\r\nContent-Length: 6" in head and b"\r\nContent-Type: text/html" in head
    return body


async def test_spdy_port_forward_reaches_the_pods_httpd(running: Running, short_tmp: str) -> None:
    r = running
    pod = await serving_pod(r, short_tmp)
    url = (await r.rt.PortForward(pb.PortForwardRequest(pod_sandbox_id=pod, port=[PORT]))).url
    client, _ = await SpdyClient.connect(url, ["portforward.k8s.io"])
    try:
        err = client.open({"streamtype": "error", "port": str(PORT), "requestid": "0"})
        data = client.open({"streamtype": "data", "port": str(PORT), "requestid": "0"})
        await client.until(lambda: data in client.replies)
        client.write(data, GET)
        # The server answers and closes (Connection: close); an echo would send GET back and wait.
        await client.until(lambda: data in client.fins)
        assert body_of(client.got(data)) == b"hello\n"
        await client.until(lambda: err in client.fins)
        assert client.got(err) == b""
    finally:
        await client.close()


async def test_websocket_port_forward_reaches_the_pods_httpd(running: Running, short_tmp: str) -> None:
    r = running
    pod = await serving_pod(r, short_tmp)
    url = (await r.rt.PortForward(pb.PortForwardRequest(pod_sandbox_id=pod, port=[PORT]))).url
    ws, status, _, body = await WsClient.connect(url, ["v4.channel.k8s.io"])
    assert ws is not None, (status, body)
    try:
        port = struct.pack("<H", PORT)
        assert [await ws.recv() for _ in range(2)] == [b"\x00" + port, b"\x01" + port]
        await ws.send(b"\x00" + GET)
        got = b""
        while b"hello\n" not in got:
            message = await ws.recv()
            assert isinstance(message, bytes) and message[:1] == b"\x00", (message, got)
            got += message[1:]
        assert body_of(got) == b"hello\n"
    finally:
        await ws.close()
