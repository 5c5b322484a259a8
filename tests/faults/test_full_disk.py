"""A full state disk: what cannot be persisted is refused (RESOURCE_EXHAUSTED naming the path) and
changes nothing; reads keep working; what was acknowledged before survives a restart."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
from collections.abc import Iterator

import grpc
import pytest

from backends.fake import FakeBackend
from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc
from shim.server import Server
from tests.conftest import make_ids, own_channel, server_config
from tests.criutil import container_config, sandbox_config


@pytest.fixture
def small_disk(short_tmp: str) -> Iterator[str]:
    """A 256 KiB tmpfs for the state directory (root only)."""
    disk = os.path.join(short_tmp, "disk")
    os.makedirs(disk)
    if (
        os.geteuid() != 0
        or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", disk], check=False).returncode
    ):
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", disk], check=False)


def fill(disk: str) -> str:
    """Fill the disk to the last byte; the path of the ballast, to free it again."""
    ballast = os.path.join(disk, "ballast")
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"x" * 4096)
        except OSError:
            pass
    return ballast


def server_on(short_tmp: str, disk: str, seed: str) -> Server:
    """A shim whose state directory is on ``disk``; the fake's own files stay off it, the same each time."""
    cfg = server_config(short_tmp)
    cfg = dataclasses.replace(
        cfg, server=dataclasses.replace(cfg.server, state_dir=os.path.join(disk, "state"))
    )
    fake = FakeBackend("fake", {"state_dir": os.path.join(short_tmp, "fake")})
    return Server(cfg, backends={"fake": fake}, id_factory=make_ids(seed))


async def test_a_full_state_disk_refuses_changes_and_keeps_serving(short_tmp: str, small_disk: str) -> None:
    server = server_on(short_tmp, small_disk, "d")
    await server.start()
    try:
        async with own_channel(f"{short_tmp}/cri.sock") as ch:
            rt, im = api_pb2_grpc.RuntimeServiceStub(ch), api_pb2_grpc.ImageServiceStub(ch)
            await im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
            sc = sandbox_config(name="kept")
            kept = (await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
            req = pb.CreateContainerRequest(
                pod_sandbox_id=kept, config=container_config(name="c"), sandbox_config=sc
            )
            cid = (await rt.CreateContainer(req)).container_id
            ballast = fill(small_disk)

            for call in (
                rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox_config(name="new"))),
                rt.CreateContainer(
                    pb.CreateContainerRequest(
                        pod_sandbox_id=kept, config=container_config(name="d"), sandbox_config=sc
                    )
                ),
                rt.StartContainer(pb.StartContainerRequest(container_id=cid)),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
                assert small_disk in (info.value.details() or "")
            # Nothing changed that could not be recorded, and reads are served.
            pods = (await rt.ListPodSandbox(pb.ListPodSandboxRequest())).items
            assert [p.id for p in pods] == [kept]
            ctrs = (await rt.ListContainers(pb.ListContainersRequest())).containers
            assert [(c.id, c.state) for c in ctrs] == [(cid, pb.CONTAINER_CREATED)]
            assert not server.shim.backend("fake").runtime.lifecycle.running  # type: ignore[union-attr]
            assert len(server.shim.backend("fake").runtime.lifecycle.sandboxes) == 1  # type: ignore[union-attr]
            # Space returns: the same calls work.
            os.unlink(ballast)
            await rt.StartContainer(pb.StartContainerRequest(container_id=cid))
            await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sandbox_config(name="new")))
    finally:
        await server.stop(0)
    again = server_on(short_tmp, small_disk, "e")
    await again.start()
    try:
        async with own_channel(f"{short_tmp}/cri.sock") as ch:
            rt = api_pb2_grpc.RuntimeServiceStub(ch)
            names = {p.metadata.name for p in (await rt.ListPodSandbox(pb.ListPodSandboxRequest())).items}
            assert names == {"kept", "new"}
            st = (await rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
            assert st.state == pb.CONTAINER_RUNNING
    finally:
        await again.stop(0)


async def test_a_full_state_disk_refuses_updates_before_their_effect_and_never_blocks_a_stop(
    short_tmp: str, small_disk: str
) -> None:
    """UpdateContainerResources is refused before the container sees it; StopContainer,
    StopPodSandbox and RemovePodSandbox still work — a node under disk pressure evicts by
    stopping and removing pods — and a restarted shim reads the stops off the runtime."""
    server = server_on(short_tmp, small_disk, "u")
    await server.start()
    try:
        async with own_channel(f"{short_tmp}/cri.sock") as ch:
            rt, im = api_pb2_grpc.RuntimeServiceStub(ch), api_pb2_grpc.ImageServiceStub(ch)
            await im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image="busybox")))
            pods = []
            for name in ("evicted", "stopped"):
                sc = sandbox_config(name=name)
                pod = (await rt.RunPodSandbox(pb.RunPodSandboxRequest(config=sc))).pod_sandbox_id
                cc = container_config(name="c", command=["sh", "-c", "sleep 3600"])
                req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
                cid = (await rt.CreateContainer(req)).container_id
                await rt.StartContainer(pb.StartContainerRequest(container_id=cid))
                pods.append((pod, cid))
            server.shim.store.RETRY_SECONDS = 0.2  # (5 s in service)
            ballast = fill(small_disk)
            (evicted, evicted_c), (stopped, stopped_c) = pods

            update = pb.UpdateContainerResourcesRequest(
                container_id=stopped_c,
                linux=pb.LinuxContainerResources(cpu_shares=512, memory_limit_in_bytes=1 << 28),
            )
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await rt.UpdateContainerResources(update)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
            assert small_disk in (info.value.details() or "")
            calls = server.shim.backend("fake").calls  # type: ignore[union-attr]
            assert not [c for c in calls if c.method == "update_container_resources"]
            st = (await rt.ContainerStatus(pb.ContainerStatusRequest(container_id=stopped_c))).status
            assert st.resources.linux.cpu_shares != 512

            await rt.StopContainer(pb.StopContainerRequest(container_id=stopped_c, timeout=1))
            st = (await rt.ContainerStatus(pb.ContainerStatusRequest(container_id=stopped_c))).status
            assert st.state == pb.CONTAINER_EXITED
            await rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=stopped))
            st = (await rt.PodSandboxStatus(pb.PodSandboxStatusRequest(pod_sandbox_id=stopped))).status
            assert st.state == pb.SANDBOX_NOTREADY
            await rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=evicted))
            await rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=evicted))
            ids = [p.id for p in (await rt.ListPodSandbox(pb.ListPodSandboxRequest())).items]
            assert ids == [stopped]
            # Space returns: the stops the disk refused are written by the retry.
            assert sorted(server.shim.store.unsaved_ids()) == sorted([stopped, stopped_c])
            os.unlink(ballast)
            for _ in range(100):
                if not server.shim.store.unsaved_ids():
                    break
                await asyncio.sleep(0.1)
            assert server.shim.store.unsaved_ids() == []
    finally:
        await server.stop(0)
    again = server_on(short_tmp, small_disk, "v")
    await again.start()
    try:
        async with own_channel(f"{short_tmp}/cri.sock") as ch:
            rt = api_pb2_grpc.RuntimeServiceStub(ch)
            pods = (await rt.ListPodSandbox(pb.ListPodSandboxRequest())).items
            assert [(p.id, p.state) for p in pods] == [(stopped, pb.SANDBOX_NOTREADY)]
            st = (await rt.ContainerStatus(pb.ContainerStatusRequest(container_id=stopped_c))).status
            assert st.state == pb.CONTAINER_EXITED
            code = None
            try:
                await rt.ContainerStatus(pb.ContainerStatusRequest(container_id=evicted_c))
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
            assert code == grpc.StatusCode.NOT_FOUND
    finally:
        await again.stop(0)
