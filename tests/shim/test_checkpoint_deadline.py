"""The deadline rule of CheckpointContainer and CheckpointPod, over both transports on a real
socket: a checkpoint that outlasts the call's gRPC deadline is DEADLINE_EXCEEDED, the containers
run as before and nothing, whole or partial, is left where the checkpoint was to be written."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import grpc
import pytest

from backends.fake import PROGRAM_ANNOTATION, FakeBackend
from cri_api import api_pb2 as pb
from shim.server import Server
from tests import counter
from tests.conftest import Running, make_ids, server_config
from tests.criutil import container_config, sandbox_config

SLOW = 3600.0  # seconds the fake takes to write a checkpoint: past any deadline here


@pytest.fixture(params=["grpcio", "native"])
async def slow(request: pytest.FixtureRequest, short_tmp: str) -> AsyncIterator[Running]:
    fake = FakeBackend("fake", {"state_dir": os.path.join(short_tmp, "fake"), "checkpoint_seconds": SLOW})
    server = Server(
        server_config(short_tmp, transport=request.param), backends={"fake": fake}, id_factory=make_ids()
    )
    await server.start()
    channel = grpc.aio.insecure_channel(f"unix://{short_tmp}/cri.sock")
    try:
        yield Running(server, channel, fake)
    finally:
        await channel.close()
        await server.stop(0)


async def counting(r: Running, root: str) -> tuple[str, str]:
    await r.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
    sc = sandbox_config(log_directory=os.path.join(root, "logs"))
    pod = (await r.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
    cc = container_config(log_path="c.log", annotations={PROGRAM_ANNOTATION: counter.program()})
    cid = (
        await r.rt.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
        )
    ).container_id
    await r.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    return pod, cid


async def code_of(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value.code()


async def test_a_checkpoint_past_the_call_deadline_leaves_nothing(slow: Running, short_tmp: str) -> None:
    r = slow
    pod, cid = await counting(r, short_tmp)
    out = os.path.join(short_tmp, "out")
    os.mkdir(out)
    location = os.path.join(out, "c.tar")
    req = pb.CheckpointContainerRequest(container_id=cid, location=location)
    assert await code_of(r.rt.CheckpointContainer(req, timeout=0.5)) == grpc.StatusCode.DEADLINE_EXCEEDED
    st = (await r.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
    assert st.state == pb.CONTAINER_RUNNING
    # A second checkpoint waits for the first call to have ended (the container's lock), then
    # ends on its own timeout: after it, neither left anything.
    req.timeout = 1
    assert await code_of(r.rt.CheckpointContainer(req, timeout=30)) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert os.listdir(out) == []
    # The same for a pod: all its containers run on, its directory stays empty.
    pod_out = os.path.join(short_tmp, "pod")
    os.mkdir(pod_out)
    pod_req = pb.CheckpointPodRequest(pod_sandbox_id=pod, output_path=pod_out, container_ids=[cid])
    assert await code_of(r.rt.CheckpointPod(pod_req, timeout=0.5)) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await code_of(r.rt.CheckpointContainer(req, timeout=30)) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert os.listdir(pod_out) == [] and os.listdir(out) == []
    st = (await r.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
    assert st.state == pb.CONTAINER_RUNNING
