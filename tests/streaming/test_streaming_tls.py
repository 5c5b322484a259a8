"""The streaming server over TLS (certificate made with the openssl CLI, if present)."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
from pathlib import Path

import pytest

from cri_api import api_pb2 as pb
from shim.streaming import StreamingConfig, StreamingServer, spdy
from tests.streaming.streaming_helpers import FakeRuntime

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


async def test_exec_over_tls(tmp_path: Path, runtime: FakeRuntime) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    server = StreamingServer(runtime, StreamingConfig(tls_cert=str(cert), tls_key=str(key)))
    await server.start()
    try:
        url = server.exec_url(pb.ExecRequest(container_id="c", cmd=["echo", "secret"], stdout=True))
        assert url.startswith("https://127.0.0.1:")
        context = ssl.create_default_context(cafile=str(cert))
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port, ssl=context)
        path = url.split(str(server.port), 1)[1]
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\n"
            "X-Stream-Protocol-Version: v4.channel.k8s.io\r\n\r\n".encode()
        )
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101 ")
        encoder, decoder = spdy.FrameEncoder(), spdy.FrameDecoder()
        writer.write(encoder.encode(spdy.SynStreamFrame(1, {"streamtype": "error"})))
        writer.write(encoder.encode(spdy.SynStreamFrame(3, {"streamtype": "stdout"})))
        data: dict[int, bytes] = {}
        fins: set[int] = set()
        async with asyncio.timeout(10):
            while 1 not in fins:
                frame_head = await reader.readexactly(8)
                body = await reader.readexactly(spdy.parse_frame_header(frame_head)[3])
                frame = decoder.decode(frame_head, body)
                if isinstance(frame, spdy.DataFrame):
                    data[frame.stream_id] = data.get(frame.stream_id, b"") + frame.data
                    if frame.fin:
                        fins.add(frame.stream_id)
        assert data[3] == b"secret"
        assert json.loads(data[1])["status"] == "Success"
        writer.close()
    finally:
        await server.stop()
