"""`cri-shim serve --listen fd://` under systemd-socket-activate, as systemd starts it.

systemd-socket-activate (Debian package `systemd`) binds the socket, sets
LISTEN_FDS/LISTEN_PID and execs the command, exactly as a .socket unit hands
the descriptor to its service. The test also plays systemd's notify socket to
see READY=1 (after recovery) and STOPPING=1, scrapes --metrics-listen, and
checks SIGUSR1's stack dump.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
ACTIVATE = shutil.which("systemd-socket-activate")

pytestmark = pytest.mark.skipif(
    ACTIVATE is None,
    reason="systemd-socket-activate not found: apt-get install systemd (Debian's package ships it)",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Activated:
    def __init__(self, workdir: str) -> None:
        self.dir = workdir
        self.sock = os.path.join(workdir, "cri.sock")
        self.log_path = os.path.join(workdir, "shim.log")
        self.metrics_port = free_port()
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(os.path.join(workdir, "notify"))
        self.notify.settimeout(60)
        self.proc: subprocess.Popen[bytes] | None = None

    def launch(self, transport: str = "grpcio") -> None:
        assert ACTIVATE is not None
        cmd = [
            ACTIVATE,
            "--listen",
            self.sock,
            # systemd-socket-activate passes only PATH, HOME, USER, TERM and these on.
            "-E",
            f"NOTIFY_SOCKET={self.notify.getsockname()}",
            "-E",
            "PYTHONUNBUFFERED=1",
            sys.executable,
            "-m",
            "shim.cli",
            "serve",
            "--listen",
            "fd://",
            "--state-dir",
            os.path.join(self.dir, "state"),
            "--metrics-listen",
            f"127.0.0.1:{self.metrics_port}",
            "--log-format",
            "json",
            "--transport",
            transport,
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def notifications(self, until: str) -> list[str]:
        seen = []
        while until not in seen:
            data = self.notify.recv(4096).decode()
            seen.extend(data.split("\n"))
        return seen

    def wait_for_socket(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not os.path.exists(self.sock):
            if time.monotonic() > deadline or (self.proc is not None and self.proc.poll() is not None):
                return False
            time.sleep(0.02)
        return True

    def wait_for_log(self, text: str, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while text not in self.log():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")

    def kill(self) -> None:
        # Only the process this test started, by its PID.
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.notify.close()


@pytest.fixture
def activated() -> Iterator[Activated]:
    workdir = tempfile.mkdtemp(prefix="crisa", dir="/tmp")
    a = Activated(workdir)
    try:
        yield a
    finally:
        a.kill()
        shutil.rmtree(workdir, ignore_errors=True)


async def scrape(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    return data.decode()


async def test_version_over_the_activated_socket(activated: Activated) -> None:
    activated.launch()
    assert activated.proc is not None
    # systemd-socket-activate binds, then execs the shim: a client that
    # connects as soon as the socket exists waits in the listen backlog until
    # the shim has recovered and accepts.
    assert await asyncio.to_thread(activated.wait_for_socket, 20), activated.log()
    async with grpc.aio.insecure_channel(f"unix://{activated.sock}") as channel:
        stub = api_pb2_grpc.RuntimeServiceStub(channel)
        resp = await stub.Version(pb.VersionRequest(version="v1"), timeout=60, wait_for_ready=True)
        assert resp.runtime_api_version == "v1"
        assert resp.runtime_name
        # A second call on the same relayed connection.
        status = await stub.Status(pb.StatusRequest(), timeout=30)
        assert any(c.type == "RuntimeReady" for c in status.status.conditions)

    seen = await asyncio.to_thread(activated.notifications, "READY=1")
    assert "READY=1" in seen
    # The private gRPC socket the fd:// relay forwards to is not the activated one.
    assert os.path.exists(os.path.join(activated.dir, "state", "grpc.sock"))

    text = await scrape(activated.metrics_port)
    assert 'cri_shim_grpc_requests_total{code="OK",method="Version"} 1.0' in text

    # SIGUSR1: stacks to the log, and the shim keeps serving.
    os.kill(activated.proc.pid, signal.SIGUSR1)
    assert await asyncio.to_thread(activated.wait_for_log, "diagnostics.stacks", 20)
    assert activated.proc.poll() is None

    os.kill(activated.proc.pid, signal.SIGTERM)
    stopping = await asyncio.to_thread(activated.notifications, "STOPPING=1")
    assert "STOPPING=1" in stopping
    rc = await asyncio.to_thread(activated.proc.wait, 30)
    assert rc == 0, activated.log()[-2000:]


async def test_native_transport_serves_the_activated_socket_itself(activated: Activated) -> None:
    activated.launch("native")
    assert await asyncio.to_thread(activated.wait_for_socket, 20), activated.log()
    async with grpc.aio.insecure_channel(f"unix://{activated.sock}") as channel:
        stub = api_pb2_grpc.RuntimeServiceStub(channel)
        resp = await stub.Version(pb.VersionRequest(version="v1"), timeout=60, wait_for_ready=True)
        assert resp.runtime_api_version == "v1"
        status = await stub.Status(pb.StatusRequest(), timeout=30)
        assert any(c.type == "RuntimeReady" for c in status.status.conditions)
    assert "READY=1" in await asyncio.to_thread(activated.notifications, "READY=1")
    # No relay: the native server accepts on systemd's socket.
    assert not os.path.exists(os.path.join(activated.dir, "state", "grpc.sock"))
    assert activated.proc is not None
    os.kill(activated.proc.pid, signal.SIGTERM)
    rc = await asyncio.to_thread(activated.proc.wait, 30)
    assert rc == 0, activated.log()[-2000:]


async def test_fd_listen_without_a_socket_fails_clearly(activated: Activated) -> None:
    # `--listen fd://` started by hand (no LISTEN_FDS) must say what is wrong.
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "shim.cli",
        "serve",
        "--listen",
        "fd://",
        "--state-dir",
        os.path.join(activated.dir, "state"),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")},
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            if proc.returncode is None:
                os.kill(proc.pid, signal.SIGKILL)
                await proc.wait()
    assert proc.returncode == 1
    assert b"LISTEN_FDS" in out
