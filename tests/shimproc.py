"""`cri-shim serve` as a child process of a test, driven through gRPC on its socket and stopped,
or SIGKILLed, by its PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


class ShimProcess:
    """A mixin: the class gives ``root`` (the config is ``root/cri-shim.toml``, the log goes to
    ``root/server.log``) and ``sock``, the socket the config listens on."""

    root: Path
    sock: str
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Start it and wait until it answers Version (60 s)."""
        with open(self.root / "server.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "shim.cli", "serve", "--config", f"{self.root}/cri-shim.toml"],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the shim did not start: {(self.root / 'server.log').read_text()}")
            if os.path.exists(self.sock):
                with grpc.insecure_channel(f"unix://{self.sock}") as ch:
                    try:
                        api_pb2_grpc.RuntimeServiceStub(ch).Version(pb.VersionRequest(), timeout=1)
                        return
                    except grpc.RpcError:
                        pass
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)
        self.proc = None

    def channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(f"unix://{self.sock}")
