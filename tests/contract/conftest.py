"""One suite, every backend: the same CRI behaviour whatever runs the pods.

Each backend joins by adding a factory to BACKENDS. A backend whose runtime
is missing on this machine is skipped, except in CI (CI=true), where a
skipped backend is a failure: CI installs and starts every runtime.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from backends.contract import Backend
from cri_api import api_pb2_grpc
from shim.server import Server
from tests.conftest import make_ids, own_channel, server_config

IN_CI = os.environ.get("CI") == "true"


@dataclasses.dataclass
class Cri:
    kind: str
    backend: Backend
    rt: api_pb2_grpc.RuntimeServiceStub
    im: api_pb2_grpc.ImageServiceStub
    image: str  # an image with a POSIX shell, pullable by this backend
    root: str
    channel: grpc.aio.Channel
    server: Server
    ids: str  # seed of the shim's ID factory
    transport: str = "native"  # [server] transport

    async def restart(self) -> None:
        """Stop the shim and start a new one, with a new backend of the same kind on the same
        directories: what a shim restart is (the runtime's objects outlive the process)."""
        await self.channel.close()
        await self.server.stop(0)
        self.backend, _ = BACKENDS[self.kind](self.root)
        self.server = _server(self.kind, self.backend, self.root, self.ids + "-again", self.transport)
        await self.server.start()
        self.channel = own_channel(f"{self.root}/cri.sock")
        self.rt = api_pb2_grpc.RuntimeServiceStub(self.channel)
        self.im = api_pb2_grpc.ImageServiceStub(self.channel)


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"backend unavailable in CI: {reason}")
    pytest.skip(reason)


def make_fake(root: str) -> tuple[Backend, str]:
    from backends.fake import FakeBackend

    return FakeBackend("fake", {"state_dir": os.path.join(root, "fake")}), "busybox"


def make_docker(root: str) -> tuple[Backend, str]:
    if importlib.util.find_spec("backends.docker") is None:
        _unavailable("the docker backend is not built")
    import docker

    try:
        docker.APIClient(base_url="unix:///var/run/docker.sock", timeout=5).ping()
    except Exception as exc:
        _unavailable(f"no Docker engine on /var/run/docker.sock ({exc}); run scripts/testenv/up")
    from backends.docker import create

    reg = os.environ.get("CRI_SHIM_TEST_REGISTRY", "127.0.0.1:5000")
    backend = create(
        "docker",
        {"pause_image": f"{reg}/pause:3.10", "state_dir": os.path.join(root, "docker")},
    )
    return backend, f"{reg}/busybox:1.36"


def make_runv(root: str) -> tuple[Backend, str]:
    from tests.runv.helpers import vm_support

    why = vm_support()
    if why:
        _unavailable(f"runv VMs cannot run here: {why}")
    reg = os.environ.get("CRI_SHIM_TEST_REGISTRY", "127.0.0.1:5000")
    from backends.runv import create

    tag = os.path.basename(root)[-8:]
    backend = create(
        "runv",
        {
            "root": os.path.join(root, "runv"),
            "run_dir": f"/tmp/rvc-{tag}",
            "agent_timeout": 10.0,
            "stub": {
                "cgroup_parent": f"cri-shim-contract-{tag}",
                "capacity_vcpus": 16,
                "capacity_memory": 4 << 30,
            },
        },
    )
    return backend, f"{reg}/busybox:1.36"


BACKENDS: dict[str, Callable[[str], tuple[Backend, str]]] = {
    "fake": make_fake,
    "docker": make_docker,
    "runv": make_runv,
}


def _server(kind: str, backend: Backend, root: str, ids: str, transport: str = "native") -> Server:
    cfg = dataclasses.replace(server_config(root, default_handler=kind, transport=transport), handlers={})
    return Server(cfg, backends={kind: backend}, id_factory=make_ids(ids))


# Every backend behind the native transport (the default), and the fake behind grpcio too.
@pytest.fixture(params=[*sorted(BACKENDS), "fake-grpcio"])
async def cri(request: Any, short_tmp: str) -> AsyncIterator[Cri]:
    kind, _, transport = request.param.partition("-")
    transport = transport or "native"
    backend, image = BACKENDS[kind](short_tmp)
    ids = f"contract-{os.getpid()}-{id(request)}"
    server = _server(kind, backend, short_tmp, ids, transport)
    await server.start()
    channel = own_channel(f"{short_tmp}/cri.sock")
    rt = api_pb2_grpc.RuntimeServiceStub(channel)
    cri = Cri(
        kind,
        backend,
        rt,
        api_pb2_grpc.ImageServiceStub(channel),
        image,
        short_tmp,
        channel,
        server,
        ids,
        transport,
    )
    try:
        yield cri
    finally:
        # Leave the runtime as we found it, whatever the test did.
        from cri_api import api_pb2 as pb

        try:
            pods = await cri.rt.ListPodSandbox(pb.ListPodSandboxRequest())
            for p in pods.items:
                await cri.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=p.id))
        finally:
            await cri.channel.close()
            await cri.server.stop(0)
