"""The native transport (shim/transport/native/): what grpcio's server does, checked through grpcio's client.

The CRI behaviour itself is covered by every test on the ``running`` fixture
and the fake's contract tests, which run on both transports. Here: flow
control both ways, size limits, deadlines, cancellation, the health check,
status details, a graceful stop, and peers that do not speak HTTP/2.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cri_api import api_pb2 as pb
from shim.transport.native import PREFACE, percent, timeout
from tests.criutil import until
from tests.transport.conftest import Native, pod_request, start_native


def test_grpc_timeout_and_message_encodings() -> None:
    assert timeout(b"100m") == pytest.approx(0.1)
    assert timeout(b"5S") == 5.0
    assert timeout(b"2H") == 7200.0
    assert timeout(b"m") is None  # no digits
    assert timeout(b"1x") is None  # no such unit
    assert timeout(b"1234567890S") is None  # more than 8 digits
    assert percent("plain text: ok") == b"plain text: ok"
    assert percent("50% ü\n") == b"50%25 %C3%BC%0A"


async def test_a_reply_larger_than_the_clients_window_arrives_whole(native: Native) -> None:
    # ~700 pods encode to well over the 64 KiB an HTTP/2 stream starts with.
    for i in range(700):
        await native.rt.RunPodSandbox(pod_request(f"pod-{i:04d}", note="x" * 40))
    resp = await native.rt.ListPodSandbox(pb.ListPodSandboxRequest())
    assert len(resp.items) == 700
    assert resp.ByteSize() > 100_000
    # and the stream form, cut into chunks by the servicer
    got = 0
    async for part in native.rt.StreamPodSandboxes(pb.StreamPodSandboxesRequest()):
        got += len(part.pod_sandboxes)
    assert got == 700


async def test_many_large_replies_at_once_each_arrive_whole(native: Native) -> None:
    # Replies that wait for window on one connection, released by WINDOW_UPDATEs that
    # arrive among new requests: each must keep its frames in order (headers, data, trailers).
    for i in range(300):
        await native.rt.RunPodSandbox(pod_request(f"pod-{i:04d}", note="x" * 100))
    replies = await asyncio.gather(
        *(native.rt.ListPodSandbox(pb.ListPodSandboxRequest()) for _ in range(200))
    )
    assert [len(r.items) for r in replies] == [300] * 200


async def test_a_request_in_many_frames_is_read_whole(native: Native) -> None:
    blobs = {f"blob{i}": str(i) * 200_000 for i in range(3)}  # ~37 DATA frames of 16 KiB
    pod = (await native.rt.RunPodSandbox(pod_request("big", **blobs))).pod_sandbox_id
    status = await native.rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=pod))
    assert dict(status.status.annotations) == blobs


async def test_messages_over_the_limit_are_resource_exhausted(short_tmp: str) -> None:
    n = await start_native(short_tmp, max_message_bytes=20_000)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await n.rt.RunPodSandbox(pod_request("big", blob="z" * 50_000))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than the maximum" in (err.value.details() or "")
        for i in range(200):
            await n.rt.RunPodSandbox(pod_request(f"p{i:03d}", note="n" * 100))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await n.rt.ListPodSandbox(pb.ListPodSandboxRequest())
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # the connection is still good
        assert (await n.rt.Version(pb.VersionRequest())).runtime_api_version == "v1"
    finally:
        await n.channel.close()
        await n.server.stop(0)


async def test_errors_keep_their_code_and_text(native: Native) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await native.rt.ContainerStatus(pb.ContainerStatusRequest(container_id="nö-such-100%"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "nö-such-100%" in (err.value.details() or "")
    nope = native.channel.unary_unary("/runtime.v1.RuntimeService/NoSuchCall")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await nope(b"")
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    bad = native.channel.unary_unary("/runtime.v1.RuntimeService/RunPodSandbox")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await bad(b"\x0a\xff\xff\xff")  # field 1, a length far past the end
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_health_check(native: Native) -> None:
    health = health_pb2_grpc.HealthStub(native.channel)
    for service in ("", "runtime.v1.RuntimeService", "runtime.v1.ImageService"):
        resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await health.Check(health_pb2.HealthCheckRequest(service="nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_deadline_and_cancel_end_the_call_not_the_server(native: Native) -> None:
    native.fake.set_latency("run_sandbox", 2.0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await native.rt.RunPodSandbox(pod_request("slow"), timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    call = native.rt.RunPodSandbox(pod_request("slow-2"))
    await asyncio.sleep(0.1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    native.fake.set_latency("run_sandbox", 0.0)
    await until(lambda: not native.server.native.calls.tasks)  # type: ignore[union-attr]
    pod = (await native.rt.RunPodSandbox(pod_request("after"))).pod_sandbox_id
    pods = (await native.rt.ListPodSandbox(pb.ListPodSandboxRequest())).items
    assert [p.id for p in pods] == [pod]  # the cut calls left nothing behind


async def test_container_events_stream(native: Native) -> None:
    events = native.rt.GetContainerEvents(pb.GetEventsRequest())
    await asyncio.sleep(0.1)
    req = pod_request("ev")
    pod = (await native.rt.RunPodSandbox(req)).pod_sandbox_id
    cc = pb.ContainerConfig(metadata=pb.ContainerMetadata(name="c"), image=pb.ImageSpec(image="busybox"))
    await native.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
    cid = (
        await native.rt.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=req.config)
        )
    ).container_id
    event = await asyncio.wait_for(events.read(), 5)
    assert event.container_id == cid
    assert event.container_event_type == pb.CONTAINER_CREATED_EVENT
    events.cancel()


async def test_stop_lets_a_call_under_way_finish(short_tmp: str) -> None:
    n = await start_native(short_tmp)
    try:
        n.fake.set_latency("run_sandbox", 0.5)
        call = asyncio.ensure_future(n.rt.RunPodSandbox(pod_request("late")))
        await asyncio.sleep(0.1)
        await n.server.stop(5)
        assert (await call).pod_sandbox_id
        assert not os.path.exists(n.sock)
    finally:
        await n.channel.close()


def _raw(path: str, payload: bytes) -> bytes:
    """Send ``payload`` on a new connection and read until the server closes it."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(payload)
        chunks: list[bytes] = []
        while True:
            data = s.recv(65536)
            if not data:
                return b"".join(chunks)
            chunks.append(data)


def _until_ping_ack(path: str, payload: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(payload)
        seen = b""
        while not any(k == 6 and f & 1 for k, f, _, _ in _frames(seen)):
            seen += s.recv(4096)
        return seen


def _frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, pos = [], 0
    while pos + 9 <= len(data):
        n = int.from_bytes(data[pos : pos + 3], "big")
        kind, flags, sid = data[pos + 3], data[pos + 4], int.from_bytes(data[pos + 5 : pos + 9], "big")
        out.append((kind, flags, sid, data[pos + 9 : pos + 9 + n]))
        pos += 9 + n
    return out


def _goaway_code(data: bytes) -> int:
    goaways = [p for kind, _, _, p in _frames(data) if kind == 7]
    assert goaways, data
    code: int = struct.unpack(">II", goaways[0][:8])[1]
    return code


async def test_peers_that_break_the_protocol_lose_their_connection_only(native: Native) -> None:
    loop = asyncio.get_running_loop()
    # not HTTP/2 at all
    assert _goaway_code(await loop.run_in_executor(None, _raw, native.sock, b"GET / HTTP/1.1\r\n\r\n")) == 1
    settings = bytes(9)[:3] + b"\x04\x00" + bytes(4)
    # HEADERS on an even (server-side) stream
    bad_headers = b"\x00\x00\x01\x01\x04\x00\x00\x00\x02\x82"
    got = await loop.run_in_executor(None, _raw, native.sock, PREFACE + settings + bad_headers)
    assert _goaway_code(got) == 1
    # a frame over the 16 KiB we allow
    huge = (20000).to_bytes(3, "big") + b"\x00\x00\x00\x00\x00\x01" + bytes(20000)
    assert _goaway_code(await loop.run_in_executor(None, _raw, native.sock, PREFACE + settings + huge)) == 6
    # a header block that is not HPACK
    junk = b"\x00\x00\x04\x01\x05\x00\x00\x00\x01\xff\xff\xff\xff"
    assert _goaway_code(await loop.run_in_executor(None, _raw, native.sock, PREFACE + settings + junk)) == 9
    # a ping is answered, then the peer closes: nothing else happens
    ping = b"\x00\x00\x08\x06\x00\x00\x00\x00\x00" + b"12345678"
    seen = await loop.run_in_executor(None, _until_ping_ack, native.sock, PREFACE + settings + ping)
    assert [p for k, f, _, p in _frames(seen) if k == 6] == [b"12345678"]
    assert (await native.rt.Version(pb.VersionRequest())).runtime_api_version == "v1"
