"""Images per runtime handler (KEP-4216), pinned images and RemoveImage of an image in use, through
the gRPC edge of a node with several handlers: the fake (default), a second fake ("vm") and docker
over the recording fake engine (tests/runv/test_image_handlers.py has fake + runv)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backends.docker import DockerBackend
from backends.docker.fake_engine import FakeEngine
from backends.fake import FakeBackend
from cri_api import api_pb2 as pb
from shim.cri.codes import Code
from tests.shim.services_kit import Kit, create, open_kit, run_pod, start

PAUSE = "registry.k8s.io/pause:3.10"
APP = "127.0.0.1:5000/app:1"  # in no store at first
TOOL = "127.0.0.1:5000/tool:2"


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Kit]:
    engine = FakeEngine()
    engine.add_image(PAUSE)
    docker = DockerBackend("docker", engine=engine, pause_image=PAUSE, instance="handlers")
    vm = FakeBackend(
        "vm",
        {"state_dir": str(tmp_path / "vm"), "pull_seconds": 0, "pause_image": PAUSE, "pinned": [TOOL]},
    )
    await vm.lifecycle.start(None)  # type: ignore[arg-type]  # the store only: no events
    async with open_kit(
        str(tmp_path), images=(), handlers={"docker": docker, "vm": vm}, pause_image=PAUSE
    ) as kit:
        yield kit
    await vm.lifecycle.close()


def spec(image: str, handler: str = "") -> pb.ImageSpec:
    return pb.ImageSpec(image=image, runtime_handler=handler)


async def pull(kit: Kit, image: str, handler: str = "") -> str:
    return str((await kit.ok("PullImage", pb.PullImageRequest(image=spec(image, handler)))).image_ref)


async def status(kit: Kit, image: str, handler: str = "") -> pb.Image | None:
    resp = await kit.ok("ImageStatus", pb.ImageStatusRequest(image=spec(image, handler)))
    return resp.image if resp.HasField("image") else None


async def listed(kit: Kit, handler: str = "", image: str = "") -> list[pb.Image]:
    req = pb.ListImagesRequest()
    if handler or image:
        req.filter.image.CopyFrom(spec(image, handler))
    return list((await kit.ok("ListImages", req)).images)


def tags(images: list[pb.Image]) -> set[str]:
    return {t for i in images for t in i.repo_tags}


@pytest.mark.parametrize("handler", ["docker", "vm"])
async def test_pull_status_list_and_remove_naming_a_handler_use_its_store_only(
    node: Kit, handler: str
) -> None:
    image_id = await pull(node, APP, handler)
    # Its status: by that handler, and not by the default handler (the fake), whose store lacks it.
    got = await status(node, APP, handler)
    assert got is not None and got.id == image_id and got.spec.runtime_handler == handler
    assert await status(node, APP) is None
    assert await status(node, image_id, "fake") is None
    # The list of that handler holds it, marked with the handler; the default's does not.
    of_handler = await listed(node, handler)
    assert [i.spec.runtime_handler for i in of_handler if i.id == image_id] == [handler]
    assert image_id not in {i.id for i in await listed(node, "fake")}
    # The node's list (no handler) merges every store: one entry per ID, with no handler.
    merged = await listed(node)
    assert [i.spec.runtime_handler for i in merged if i.id == image_id] == [""]
    assert len({i.id for i in merged}) == len(merged)
    # Removed from that handler's store, by name.
    await node.ok("RemoveImage", pb.RemoveImageRequest(image=spec(APP, handler)))
    assert await status(node, APP, handler) is None
    assert image_id not in {i.id for i in await listed(node)}


async def test_an_unknown_handler_is_an_invalid_argument(node: Kit) -> None:
    for method, req in (
        ("PullImage", pb.PullImageRequest(image=spec(APP, "gvisor"))),
        ("ImageStatus", pb.ImageStatusRequest(image=spec(APP, "gvisor"))),
        ("RemoveImage", pb.RemoveImageRequest(image=spec(APP, "gvisor"))),
        ("ListImages", pb.ListImagesRequest(filter=pb.ImageFilter(image=spec("", "gvisor")))),
    ):
        code, detail, _ = await node.call(method, req)
        assert code == Code.INVALID_ARGUMENT and "gvisor" in detail, method


async def test_one_image_in_two_stores_is_one_entry_and_removing_it_by_handler_keeps_the_other(
    node: Kit,
) -> None:
    in_fake = await pull(node, TOOL)  # the default handler: the fake
    in_vm = await pull(node, TOOL, "vm")
    assert in_fake == in_vm  # the fakes give a repository one ID, as one registry does
    # One entry, pinned: the vm's store pins it (its own pinned option), the default's does not.
    assert [(i.id, i.pinned) for i in await listed(node) if TOOL in i.repo_tags] == [(in_fake, True)]
    assert not (await status(node, TOOL)).pinned  # type: ignore[union-attr]
    await node.ok("RemoveImage", pb.RemoveImageRequest(image=spec(TOOL, "vm")))
    assert await status(node, TOOL, "vm") is None
    assert (await status(node, TOOL)) is not None  # the default handler's copy stays


async def test_remove_without_a_handler_removes_the_image_from_every_store(node: Kit) -> None:
    """What the kubelet's image GC sends (an ID, no handler, even with RuntimeClassInImageCriApi
    on) frees the image wherever ListImages found it."""
    image_id = await pull(node, TOOL, "vm")
    await pull(node, TOOL, "docker")
    docker_id = (await status(node, TOOL, "docker")).id  # type: ignore[union-attr]
    await node.ok("RemoveImage", pb.RemoveImageRequest(image=spec(image_id)))
    assert await status(node, TOOL, "vm") is None
    assert await status(node, TOOL, "docker") is not None  # another ID in the engine: not named
    await node.ok("RemoveImage", pb.RemoveImageRequest(image=spec(TOOL)))  # by name: every store
    assert await status(node, docker_id, "docker") is None
    assert TOOL not in tags(await listed(node))


async def test_the_sandbox_image_is_pinned_in_every_store(node: Kit) -> None:
    await pull(node, PAUSE, "vm")
    await pull(node, PAUSE)
    for handler in ("fake", "vm", "docker"):
        got = await status(node, PAUSE, handler)
        assert got is not None and got.pinned, handler
        assert [i.pinned for i in await listed(node, handler) if PAUSE in i.repo_tags] == [True], handler
    # The node's list: the fakes' pause image is one entry (one ID); the engine's has its own ID.
    assert [i.pinned for i in await listed(node) if PAUSE in i.repo_tags] == [True, True]


async def pod_with_container(kit: Kit, name: str = "web") -> tuple[str, str]:
    pod = await run_pod(kit, name=f"pod-{name}")
    return pod.id, await create(kit, pod, name)


async def test_remove_image_of_a_container_in_any_state_is_refused_naming_it(node: Kit) -> None:
    image_id = await pull(node, "busybox")
    _pod, ctr = await pod_with_container(node)
    for step in ("created", "running", "exited"):
        if step == "running":
            await start(node, ctr)
        elif step == "exited":
            await node.ok("StopContainer", pb.StopContainerRequest(container_id=ctr, timeout=0))
        for name in ("busybox", image_id):
            code, detail, _ = await node.call("RemoveImage", pb.RemoveImageRequest(image=spec(name)))
            assert code == Code.FAILED_PRECONDITION, (step, name)
            assert ctr in detail and '"web"' in detail and step in detail, detail
        assert await status(node, "busybox") is not None
    await node.ok("RemoveContainer", pb.RemoveContainerRequest(container_id=ctr))
    await node.ok("RemoveImage", pb.RemoveImageRequest(image=spec("busybox")))
    assert await status(node, "busybox") is None


async def test_a_container_of_another_handler_does_not_hold_this_handlers_copy(node: Kit) -> None:
    await pull(node, "busybox")
    await pull(node, "busybox", "vm")
    _pod, ctr = await pod_with_container(node)  # on the default handler, the fake
    await node.ok("RemoveImage", pb.RemoveImageRequest(image=spec("busybox", "vm")))
    assert await status(node, "busybox", "vm") is None
    # Without a handler, every store: refused as a whole, the vm's copy (pulled again) kept too.
    await pull(node, "busybox", "vm")
    code, detail, _ = await node.call("RemoveImage", pb.RemoveImageRequest(image=spec("busybox")))
    assert code == Code.FAILED_PRECONDITION and ctr in detail
    assert await status(node, "busybox", "vm") is not None


async def test_a_pinned_image_is_removed_when_asked(node: Kit) -> None:
    await pull(node, PAUSE)
    assert (await status(node, PAUSE)).pinned  # type: ignore[union-attr]
    await node.ok("RemoveImage", pb.RemoveImageRequest(image=spec(PAUSE, "fake")))
    assert await status(node, PAUSE, "fake") is None
