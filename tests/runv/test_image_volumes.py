"""Image volumes in runv: an image's filesystem mounted read-only in a container, whole or a sub path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from backends.contract import Capability
from backends.runv.agent import containers
from backends.runv.agent.messages import ContainerSpec, Mount
from backends.runv.agent.protocol import AgentError
from backends.runv.backend import RunvBackend
from cri_api import api_pb2 as pb
from shim.cri import errors
from shim.cri.messages import container_status_pb
from tests.runv.helpers import Events, MemorySink, container_record, needs_vm, sandbox_record

IMAGE = "test/busybox:1"


@needs_vm
async def test_an_image_volume_is_the_image_read_only(runv: tuple[RunvBackend, Events]) -> None:
    backend, events = runv
    assert backend.capabilities & Capability.IMAGE_VOLUMES
    sb = sandbox_record("imgvol")
    await backend.lifecycle.run_sandbox(sb)
    ct = container_record(sb, IMAGE, ["sleep", "60"])
    ct.config.mounts.add(container_path="/mnt/iv", readonly=True, image=pb.ImageSpec(image=IMAGE))
    ct.config.mounts.add(
        container_path="/mnt/etc", readonly=True, image=pb.ImageSpec(image=IMAGE), image_sub_path="etc"
    )
    await backend.lifecycle.create_container(ct, sb)
    await events.start(backend.lifecycle, ct, sb, MemorySink())

    async def run(*cmd: str) -> int:
        return (await backend.exec.exec_sync(ct, list(cmd))).exit_code

    assert await run("ls", "/mnt/iv/bin/sh") == 0
    assert await run("sh", "-c", "echo x > /mnt/iv/x") != 0  # read-only
    assert await run("/mnt/iv/bin/busybox", "true") == 0  # not noexec
    assert await run("ls", "/mnt/etc/passwd") == 0  # the sub path, not the root
    assert await run("ls", "/mnt/etc/etc") != 0
    status = container_status_pb(ct)
    refs = {mnt.container_path: mnt.image.image_ref for mnt in status.mounts}
    assert refs == {"/mnt/iv": ct.image_ref, "/mnt/etc": ct.image_ref}
    await backend.lifecycle.stop_container(ct, 1)
    await backend.lifecycle.remove_container(ct)

    missing = container_record(sb, IMAGE, ["sleep", "60"], name="missing")
    missing.config.mounts.add(
        container_path="/mnt/x", readonly=True, image=pb.ImageSpec(image=IMAGE), image_sub_path="not-there"
    )
    with pytest.raises(errors.InvalidArgumentError, match="not-there"):
        await backend.lifecycle.create_container(missing, sb)
    unknown = container_record(sb, IMAGE, ["sleep", "60"], name="unknown")
    unknown.config.mounts.add(
        container_path="/mnt/x", readonly=True, image=pb.ImageSpec(image="sha256:" + "0" * 64)
    )
    with pytest.raises(errors.NotFoundError):
        await backend.lifecycle.create_container(unknown, sb)
    await backend.lifecycle.stop_sandbox(sb)
    await backend.lifecycle.remove_sandbox(sb)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount")
def test_layers_are_stacked_read_only_and_unmounted_with_the_bundle(tmp_path: Path) -> None:
    top, bottom = tmp_path / "top", tmp_path / "bottom"
    (top / "etc").mkdir(parents=True)
    (bottom / "etc").mkdir(parents=True)
    (top / "etc/a").write_text("top")
    (bottom / "etc/a").write_text("bottom")
    (bottom / "etc/b").write_text("bottom")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    spec = ContainerSpec(
        args=["true"],
        mounts=[
            Mount(source="", destination="/v", image_lowers=[str(top), str(bottom)], image_sub_path="etc")
        ],
    )
    try:
        out = containers._mount_image_volumes(str(bundle), spec)
        src = Path(out.mounts[0].source)
        assert src == bundle / "imgvol-0" / "etc" and out.mounts[0].readonly
        assert (src / "a").read_text() == "top" and (src / "b").read_text() == "bottom"
        with pytest.raises(OSError):
            (src / "c").write_text("no")
    finally:
        containers._umount_image_volumes(str(bundle))
    assert not os.listdir(bundle / "imgvol-0")
    bad = ContainerSpec(
        args=["true"],
        mounts=[Mount(source="", destination="/v", image_lowers=[str(top)], image_sub_path="../..")],
    )
    with pytest.raises(AgentError):
        containers._mount_image_volumes(str(bundle), bad)
    containers._umount_image_volumes(str(bundle))
