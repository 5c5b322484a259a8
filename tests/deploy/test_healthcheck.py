"""deploy/healthcheck.py, the image's HEALTHCHECK, against a real server."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.config import Config
from shim.server import Server

PROBE = Path(__file__).resolve().parents[2] / "deploy" / "healthcheck.py"


@pytest.fixture
def workdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="crih", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def probe(*args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(PROBE), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_probe_follows_the_server(workdir: str) -> None:
    target = f"unix://{workdir}/s.sock"
    base = Config()
    server = Server(
        dataclasses.replace(
            base, server=dataclasses.replace(base.server, listen=target, state_dir=f"{workdir}/state")
        )
    )
    await server.start()
    try:
        for service in ("", "runtime.v1.RuntimeService", "runtime.v1.ImageService"):
            done = await probe(target, service)
            assert done.returncode == 0, done.stdout + done.stderr
            assert "SERVING" in done.stdout
        unknown = await probe(target, "no.such.Service")
        assert unknown.returncode == 1
        assert "NOT_FOUND" in unknown.stdout
    finally:
        await server.stop(grace=1)
    gone = await probe(target)
    assert gone.returncode == 1
    assert "UNAVAILABLE" in gone.stdout
