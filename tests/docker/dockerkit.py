"""Helpers for the docker backend tests: records, a recording EventSink, a clean-up harness."""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import docker

from backends.contract import ContainerRecord, SandboxRecord
from backends.docker import DockerBackend, create
from cri_api import api_pb2 as pb
from tests.follow import Follower

ENDPOINT = os.environ.get("CRI_SHIM_DOCKER_ENDPOINT", "unix:///var/run/docker.sock")
REGISTRY = "127.0.0.1:5000"
BUSYBOX = f"{REGISTRY}/busybox:1.36"
PAUSE = f"{REGISTRY}/pause:3.10"
# Recovery removes unclaimed containers of its instance only: keep this run's
# apart from a shim (or another test run) using the same engine.
INSTANCE = f"test-{os.getpid()}"


Events = Follower  # a recording EventSink that follows containers as the shim does


def new_id() -> str:
    return secrets.token_hex(32)


def sandbox_record(name: str = "pod", **config: Any) -> SandboxRecord:
    cfg = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, uid=new_id()[:16], namespace="test", attempt=0),
        hostname=name,
        labels={"app": name},
        annotations={"note": "docker-test"},
        **config,
    )
    return SandboxRecord(
        id=new_id(), handler="docker", backend="docker", config=cfg, created_at=time.time_ns()
    )


def container_record(
    sandbox: SandboxRecord, command: list[str], log_path: str = "", name: str = "c", **config: Any
) -> ContainerRecord:
    cfg = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name, attempt=0),
        image=pb.ImageSpec(image=BUSYBOX),
        command=command,
        labels={"role": name},
        **config,
    )
    return ContainerRecord(
        id=new_id(),
        sandbox_id=sandbox.id,
        backend="docker",
        config=cfg,
        created_at=time.time_ns(),
        log_path=log_path,
        image_name=BUSYBOX,
    )


class Harness:
    """A started backend plus clean-up of everything a test made through it."""

    def __init__(self, backend: DockerBackend, events: Events, engine: docker.APIClient) -> None:
        self.backend = backend
        self.events = events
        self.engine = engine
        self.sandboxes: list[SandboxRecord] = []
        self.containers: list[ContainerRecord] = []

    async def run_sandbox(self, sb: SandboxRecord | None = None) -> SandboxRecord:
        sb = sb or sandbox_record()
        self.sandboxes.append(sb)
        net = await self.backend.lifecycle.run_sandbox(sb)
        sb.committed = True
        sb.status = type(sb.status)(ready=True, ip=net.ip)
        return sb

    async def create(self, ct: ContainerRecord, sb: SandboxRecord) -> ContainerRecord:
        self.containers.append(ct)
        await self.backend.lifecycle.create_container(ct, sb)
        ct.committed = True
        return ct

    async def cleanup(self) -> None:
        for ct in self.containers:
            await self.backend.lifecycle.remove_container(ct)
        for sb in self.sandboxes:
            await self.backend.lifecycle.stop_sandbox(sb)
            await self.backend.lifecycle.remove_sandbox(sb)


@contextlib.asynccontextmanager
async def harnessed(backend: DockerBackend, engine: docker.APIClient) -> AsyncIterator[Harness]:
    """The backend started, and after the test what it made removed and the backend closed."""
    events = Events()
    await backend.lifecycle.start(events)
    h = Harness(backend, events, engine)
    try:
        yield h
    finally:
        await h.cleanup()
        await h.events.close()
        # A test may have replaced the backend (a restart); close the one in use too.
        for b in {id(backend): backend, id(h.backend): h.backend}.values():
            await b.lifecycle.close()


class HttpGet:
    """A port-forward client (PortStream) that asks for ``path`` and keeps the answer."""

    def __init__(self, path: str) -> None:
        self.sent = [f"GET {path} HTTP/1.0\r\n\r\n".encode()]
        self.got = bytearray()

    async def read(self) -> bytes:
        return self.sent.pop(0) if self.sent else b""

    async def write(self, data: bytes) -> None:
        self.got += data


def unstarted_backend() -> DockerBackend:
    return create(
        "docker",
        {"endpoint": ENDPOINT, "pause_image": PAUSE, "pull_no_progress_timeout": 60, "instance": INSTANCE},
    )


async def new_backend(events: Events) -> DockerBackend:
    backend = unstarted_backend()
    await backend.lifecycle.start(events)
    return backend
