"""UpdatePodSandboxResources through a real socket (fake backend): validation, the record kept
across a restart, nothing changed when the backend or the disk refuses."""

from __future__ import annotations

import os

import grpc
import pytest

from backends.contract import errors
from backends.fake import FakeBackend
from cri_api import api_pb2 as pb
from shim.server import Server
from tests.conftest import Running, make_ids, server_config
from tests.criutil import sandbox_config


async def error_of(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value


def resized(
    pod: str, memory: int = 256 << 20, overhead_memory: int = 0
) -> pb.UpdatePodSandboxResourcesRequest:
    return pb.UpdatePodSandboxResourcesRequest(
        pod_sandbox_id=pod,
        resources=pb.LinuxContainerResources(
            cpu_period=100_000, cpu_quota=150_000, cpu_shares=1536, memory_limit_in_bytes=memory
        ),
        overhead=pb.LinuxContainerResources(memory_limit_in_bytes=overhead_memory),
    )


def recorded(server: Server, pod: str) -> pb.LinuxContainerConfig:
    assert server.shim is not None
    sb = server.shim.store.sandboxes.get(pod)
    assert sb is not None
    return sb.config.linux


BAD = [
    (
        "empty id",
        pb.UpdatePodSandboxResourcesRequest(),
        grpc.StatusCode.INVALID_ARGUMENT,
        "must not be empty",
    ),
    ("unknown", resized("f" * 64), grpc.StatusCode.NOT_FOUND, "not found"),
    (
        "nothing to update",
        pb.UpdatePodSandboxResourcesRequest(pod_sandbox_id="POD"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "nothing to update",
    ),
    (
        "bad shares",
        pb.UpdatePodSandboxResourcesRequest(
            pod_sandbox_id="POD", resources=pb.LinuxContainerResources(cpu_shares=1)
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "resources.cpu_shares 1",
    ),
    (
        "bad overhead",
        pb.UpdatePodSandboxResourcesRequest(
            pod_sandbox_id="POD", overhead=pb.LinuxContainerResources(memory_limit_in_bytes=-1)
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "overhead.memory_limit_in_bytes",
    ),
]


@pytest.mark.parametrize(("req", "code", "needle"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
async def test_bad_requests_are_refused_and_change_nothing(
    running: Running, req: pb.UpdatePodSandboxResourcesRequest, code: grpc.StatusCode, needle: str
) -> None:
    r = running
    pod = (await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox_config()))).pod_sandbox_id
    if req.pod_sandbox_id == "POD":
        req.pod_sandbox_id = pod
    err = await error_of(r.rt.UpdatePodSandboxResources(req))
    assert (err.code(), needle in (err.details() or "")) == (code, True), err.details()
    assert not recorded(r.server, pod).HasField("resources")
    assert not r.fake.calls_to("update_sandbox_resources")


async def test_a_stopped_pod_cannot_be_resized(running: Running) -> None:
    r = running
    pod = (await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox_config()))).pod_sandbox_id
    await r.rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod))
    err = await error_of(r.rt.UpdatePodSandboxResources(resized(pod)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "not ready" in (err.details() or "")


async def test_the_record_keeps_the_new_resources_across_a_restart(short_tmp: str) -> None:
    def start() -> tuple[Server, FakeBackend]:
        fake = FakeBackend("fake", {"state_dir": os.path.join(short_tmp, "fake")})
        return Server(server_config(short_tmp), backends={"fake": fake}, id_factory=make_ids()), fake

    server, fake = start()
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock")
    try:
        r = Running(server, channel, fake)
        pod = (await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox_config()))).pod_sandbox_id
        await r.rt.UpdatePodSandboxResources(resized(pod, 256 << 20, 64 << 20))
        assert [c.args for c in fake.calls_to("update_sandbox_resources")] == [(pod,)]
        # The backend refuses the next one: the record stays as it was, on disk too.
        fake.inject_error("update_sandbox_resources", errors.FailedPreconditionError("no room"))
        err = await error_of(r.rt.UpdatePodSandboxResources(resized(pod, 512 << 20)))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "no room" in (err.details() or "")
        assert recorded(server, pod).resources.memory_limit_in_bytes == 256 << 20
    finally:
        await channel.close()
        await server.stop(0)

    server, fake = start()
    await server.start()
    try:
        linux = recorded(server, pod)
        assert linux.resources == resized(pod).resources
        assert linux.overhead.memory_limit_in_bytes == 64 << 20
    finally:
        await server.stop(0)
