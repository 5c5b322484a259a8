"""Image volumes through the CRI, on every backend: the image read-only at the mount, or UNIMPLEMENTED."""

from __future__ import annotations

import grpc
import pytest

from backends.contract import Capability
from cri_api import api_pb2 as pb
from tests.contract.conftest import Cri
from tests.contract.test_contract import code_of, create, run_pod, wait_state


async def test_an_image_volume_is_the_image_read_only(cri: Cri) -> None:
    pod, sc = await run_pod(cri)
    image_ref = (await cri.im.PullImage(pb.PullImageRequest(image=pb.ImageSpec(image=cri.image)))).image_ref
    volume = pb.Mount(container_path="/mnt/iv", readonly=True, image=pb.ImageSpec(image=image_ref))
    sub = pb.Mount(
        container_path="/mnt/etc", readonly=True, image=pb.ImageSpec(image=image_ref), image_sub_path="etc"
    )
    if not cri.backend.capabilities & Capability.IMAGE_VOLUMES:
        call = cri.rt.CreateContainer(
            pb.CreateContainerRequest(
                pod_sandbox_id=pod,
                config=pb.ContainerConfig(
                    metadata=pb.ContainerMetadata(name="iv"),
                    image=pb.ImageSpec(image=cri.image),
                    mounts=[volume],
                ),
                sandbox_config=sc,
            )
        )
        assert await code_of(call) == grpc.StatusCode.UNIMPLEMENTED
        return
    cid = await create(cri, pod, sc, ["sh", "-c", "sleep 3600"], name="iv", mounts=[volume, sub])
    await cri.rt.StartContainer(pb.StartContainerRequest(container_id=cid))
    assert (await wait_state(cri, cid, pb.CONTAINER_RUNNING)).state == pb.CONTAINER_RUNNING

    async def code(script: str) -> int:
        req = pb.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", script], timeout=10)
        return (await cri.rt.ExecSync(req)).exit_code

    assert await code("test -e /mnt/iv/bin/sh") == 0
    assert await code("echo x > /mnt/iv/x") != 0  # read-only
    assert await code("/mnt/iv/bin/busybox true") == 0  # not noexec
    assert await code("test -e /mnt/etc/passwd && ! test -e /mnt/etc/etc") == 0  # the sub path only
    st = (await cri.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid))).status
    refs = {m.container_path: m.image.image_ref for m in st.mounts}
    assert refs == {"/mnt/iv": image_ref, "/mnt/etc": image_ref}
    await cri.rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=1))
    await cri.rt.RemoveContainer(pb.RemoveContainerRequest(container_id=cid))

    # A sub path the image does not have, or a writable image volume: refused, nothing left.
    for mount in (
        pb.Mount(
            container_path="/x", readonly=True, image=pb.ImageSpec(image=image_ref), image_sub_path="nope"
        ),
        pb.Mount(container_path="/x", readonly=False, image=pb.ImageSpec(image=image_ref)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await create(cri, pod, sc, ["true"], name="bad", mounts=[mount])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert not (await cri.rt.ListContainers(pb.ListContainersRequest())).containers
