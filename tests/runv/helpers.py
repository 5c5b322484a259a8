"""Helpers for the runv tests: support checks, an event recorder, records, a log sink."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from typing import Any

import pytest

from backends import contract
from backends.linux.cgroups import Cgroup
from cri_api import api_pb2 as pb
from tests.follow import Follower, MemoryLog

BUSYBOX = shutil.which("busybox")


def vm_support() -> str:
    """Why VM tests cannot run here, or "" when they can."""
    if os.geteuid() != 0:
        return "needs root (namespaces, cgroups, runc)"
    for tool in ("runc", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install {'runc' if tool == 'runc' else 'util-linux'})"
    if BUSYBOX is None:
        return "no static busybox for the test rootfs (apt-get install busybox-static)"
    roots = Cgroup("").dirs()  # where a VM's cgroup is made
    if not roots or not all(os.access(d, os.W_OK) for d in roots):
        return "cgroupfs is not writable"
    return ""


needs_vm = pytest.mark.skipif(bool(vm_support()), reason=vm_support() or "ok")


Events = Follower  # what the backend reports, and its containers followed as the shim does
MemorySink = MemoryLog


def sandbox_record(name: str = "pod", **linux: Any) -> contract.SandboxRecord:
    cfg = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, uid=name + "-uid", namespace="default"),
        hostname=name,
        dns_config=pb.DNSConfig(servers=["10.0.0.10"], searches=["svc.local"]),
    )
    if linux:
        cfg.linux.resources.CopyFrom(pb.LinuxContainerResources(**linux))
    return contract.SandboxRecord(
        id=uuid.uuid4().hex + uuid.uuid4().hex,
        handler="runv",
        backend="runv",
        config=cfg,
        created_at=time.time_ns(),
    )


def container_record(
    sandbox: contract.SandboxRecord, image: str, command: list[str], name: str = "c", **kw: Any
) -> contract.ContainerRecord:
    cfg = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name),
        image=pb.ImageSpec(image=image),
        command=command,
        **kw,
    )
    return contract.ContainerRecord(
        id=uuid.uuid4().hex + uuid.uuid4().hex,
        sandbox_id=sandbox.id,
        backend="runv",
        config=cfg,
        created_at=time.time_ns(),
        log_path="",
    )


class FakePort:
    """A port-forward client: sends one request, keeps what comes back."""

    def __init__(self, request: bytes) -> None:
        self._in = [request]
        self.got = bytearray()

    async def read(self) -> bytes:
        return self._in.pop(0) if self._in else b""

    async def write(self, data: bytes) -> None:
        self.got += data
