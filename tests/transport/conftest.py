"""The native transport (shim/transport/native/) on a real unix socket, over the fake backend."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import grpc
import pytest

from backends.fake import FakeBackend
from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc
from shim.server import Server
from tests.conftest import make_ids, server_config


class Native:
    def __init__(self, root: str, server: Server, fake: FakeBackend) -> None:
        self.root = root
        self.server = server
        self.fake = fake
        self.sock = f"{root}/cri.sock"
        self.channel = grpc.aio.insecure_channel(
            f"unix://{self.sock}", options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        self.rt = api_pb2_grpc.RuntimeServiceStub(self.channel)
        self.im = api_pb2_grpc.ImageServiceStub(self.channel)

    @property
    def tasks(self) -> int:
        """The calls the server is still running."""
        assert self.server.native is not None
        return len(self.server.native.calls.tasks)

    @property
    def connections(self) -> int:
        assert self.server.native is not None
        return len(self.server.native.connections)


async def start_native(root: str, **server: object) -> Native:
    """A server on the fake backend, by the native transport unless ``transport`` says otherwise."""
    fake = FakeBackend("fake", {"state_dir": os.path.join(root, "fake")})
    srv = Server(
        server_config(root, **{"transport": "native", **server}),
        backends={"fake": fake},
        id_factory=make_ids(),
    )
    await srv.start()
    return Native(root, srv, fake)


@pytest.fixture
async def native(short_tmp: str) -> AsyncIterator[Native]:
    n = await start_native(short_tmp)
    try:
        yield n
    finally:
        await n.channel.close()
        await n.server.stop(0)


def pod_request(name: str, **annotations: str) -> pb.RunPodSandboxRequest:
    return pb.RunPodSandboxRequest(
        config=pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=name, namespace="ns", uid=f"uid-{name}"),
            annotations=annotations,
        )
    )
