"""Fixtures: the CRI layer over a fake backend, in process or behind a real socket."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from backends.fake import FakeBackend
from cri_api import api_pb2_grpc
from shim.config import Config
from shim.server import Server


def make_ids(seed: str = "test"):  # type: ignore[no-untyped-def]
    counter = itertools.count(1)
    return lambda: hashlib.sha256(f"{seed}-{next(counter)}".encode()).hexdigest()


@pytest.fixture
def short_tmp() -> Iterator[str]:
    # unix socket paths are limited to 107 bytes: pytest's tmp_path is too long.
    d = tempfile.mkdtemp(prefix="cs-", dir="/tmp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def own_channel(sock: str) -> grpc.aio.Channel:
    """A channel to the unix socket ``sock`` with connections of its own. Tests that restart
    a server on the same socket need it: from grpc's pool, shared by the channels of a process
    with one target, the channel made after the restart could be handed the connection of the
    one before, which the stopped server closed (seen once in a full run: UNAVAILABLE,
    "sendmsg: Broken pipe", on the first call to the new server)."""
    return grpc.aio.insecure_channel(f"unix://{sock}", options=[("grpc.use_local_subchannel_pool", 1)])


def server_config(root: str, **server: object) -> Config:
    base = Config()
    return dataclasses.replace(
        base,
        server=dataclasses.replace(
            base.server, listen=f"unix://{root}/cri.sock", state_dir=os.path.join(root, "state"), **server
        ),
        nri=dataclasses.replace(base.nri, socket_path=os.path.join(root, "nri.sock")),
    )


class Running:
    def __init__(self, server: Server, channel: grpc.aio.Channel, fake: FakeBackend) -> None:
        self.server = server
        self.channel = channel
        self.fake = fake
        self.rt = api_pb2_grpc.RuntimeServiceStub(channel)
        self.im = api_pb2_grpc.ImageServiceStub(channel)


@pytest.fixture(params=["grpcio", "native"])
async def running(request: pytest.FixtureRequest, short_tmp: str) -> AsyncIterator[Running]:
    """A real server on a real unix socket, fake backend, clients through the generated stubs.

    Once per transport: grpcio's server and the native one (shim/transport/native/).
    """
    fake = FakeBackend("fake", {"state_dir": os.path.join(short_tmp, "fake")})
    cfg = server_config(short_tmp, transport=request.param)
    server = Server(cfg, backends={"fake": fake}, id_factory=make_ids())
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock")
    try:
        yield Running(server, channel, fake)
    finally:
        await channel.close()
        await server.stop(0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """In CI (CI=true) a skipped Docker or QEMU test is a failure: CI starts an engine and
    installs QEMU and the guest image."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI") == "true":
        for marker in ("docker", "qemu"):
            if item.get_closest_marker(marker) is not None:
                report.outcome = "failed"
                report.longrepr = f"{marker} test skipped in CI: {report.longrepr}"
