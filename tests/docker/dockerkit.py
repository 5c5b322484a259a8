"""Helpers for the docker backend tests: records, a recording EventSink, a clean-up harness."""

from __future__ import annotations

import os
import secrets
import time
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
        net = await self.backend.run_sandbox(sb)
        sb.committed = True
        sb.status = type(sb.status)(ready=True, ip=net.ip)
        return sb

    async def create(self, ct: ContainerRecord, sb: SandboxRecord) -> ContainerRecord:
        self.containers.append(ct)
        await self.backend.create_container(ct, sb)
        ct.committed = True
        return ct

    async def cleanup(self) -> None:
        for ct in self.containers:
            await self.backend.remove_container(ct)
        for sb in self.sandboxes:
            await self.backend.stop_sandbox(sb)
            await self.backend.remove_sandbox(sb)


async def new_backend(events: Events) -> DockerBackend:
    backend = create(
        "docker",
        {"endpoint": ENDPOINT, "pause_image": PAUSE, "pull_no_progress_timeout": 60, "instance": INSTANCE},
    )
    await backend.start(events)
    return backend
