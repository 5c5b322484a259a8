"""The ImageService's CRI rules over the fake's store (issue 44): a pulled image is listed and has a
status; removing is idempotent; an unknown image has an empty status, not an error; a failed pull
leaves nothing. Driven through the edge, watched through the CRI (tests/shim/services_kit.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from cri_api import api_pb2 as pb
from shim.cri.codes import Code
from tests.shim.services_kit import Kit, open_kit


@pytest.fixture
async def kit(tmp_path: Path) -> AsyncIterator[Kit]:
    async with open_kit(str(tmp_path), images=(), missing_images=["example.com/gone*"]) as k:
        yield k


def spec(image: str) -> pb.ImageSpec:
    return pb.ImageSpec(image=image)


async def listed(kit: Kit) -> dict[str, list[str]]:
    """ListImages: each image's ID and its tags."""
    resp = await kit.ok("ListImages", pb.ListImagesRequest())
    return {i.id: sorted(i.repo_tags) for i in resp.images}


async def status_of(kit: Kit, image: str) -> pb.ImageStatusResponse:
    return await kit.ok("ImageStatus", pb.ImageStatusRequest(image=spec(image)))


async def test_a_pulled_image_is_listed_and_has_a_status(kit: Kit) -> None:
    assert await listed(kit) == {}
    ref = (await kit.ok("PullImage", pb.PullImageRequest(image=spec("busybox:1.36")))).image_ref
    assert ref.startswith("sha256:")
    assert await listed(kit) == {ref: ["docker.io/library/busybox:1.36"]}
    for name in ("busybox:1.36", "docker.io/library/busybox:1.36", ref):
        st = await status_of(kit, name)
        assert st.HasField("image"), name
        assert (st.image.id, list(st.image.repo_tags)) == (ref, ["docker.io/library/busybox:1.36"])
    # A filter by its full name, its repository or its ID finds it; by another name, nothing.
    for name in ("docker.io/library/busybox:1.36", "docker.io/library/busybox", ref):
        assert await filtered(kit, name) == [ref], name
    assert await filtered(kit, "docker.io/library/alpine:3") == []


async def filtered(kit: Kit, name: str) -> list[str]:
    resp = await kit.ok("ListImages", pb.ListImagesRequest(filter=pb.ImageFilter(image=spec(name))))
    return [i.id for i in resp.images]


async def test_list_images_filtered_by_a_short_name_finds_what_image_status_finds(kit: Kit) -> None:
    ref = (await kit.ok("PullImage", pb.PullImageRequest(image=spec("busybox:1.36")))).image_ref
    assert (await status_of(kit, "busybox:1.36")).image.id == ref
    assert await filtered(kit, "busybox:1.36") == [ref]


@pytest.mark.parametrize("name", ["busybox:1.36", "by-id"], ids=["by-tag", "by-id"])
async def test_remove_image_twice_is_ok_and_it_is_gone(kit: Kit, name: str) -> None:
    ref = (await kit.ok("PullImage", pb.PullImageRequest(image=spec("busybox:1.36")))).image_ref
    kept = (await kit.ok("PullImage", pb.PullImageRequest(image=spec("alpine:3")))).image_ref
    target = ref if name == "by-id" else name
    for _ in range(2):
        code, detail, _ = await kit.call("RemoveImage", pb.RemoveImageRequest(image=spec(target)))
        assert code == Code.OK, detail
        assert set(await listed(kit)) == {kept}
        assert not (await status_of(kit, "busybox:1.36")).HasField("image")
        assert not (await status_of(kit, ref)).HasField("image")
    assert (await status_of(kit, "alpine:3")).image.id == kept


async def test_remove_of_an_image_never_pulled_is_ok(kit: Kit) -> None:
    code, detail, _ = await kit.call("RemoveImage", pb.RemoveImageRequest(image=spec("nginx:1.27")))
    assert code == Code.OK, detail


@pytest.mark.parametrize("name", ["nginx:1.27", "sha256:" + "ab" * 32], ids=["by-tag", "by-id"])
async def test_the_status_of_an_unknown_image_is_ok_and_empty(kit: Kit, name: str) -> None:
    """The CRI's rule: ImageStatus of an image that is not present is no error; the response
    simply has no image (the kubelet pulls when it sees none)."""
    await kit.ok("PullImage", pb.PullImageRequest(image=spec("busybox:1.36")))
    code, detail, resp = await kit.call("ImageStatus", pb.ImageStatusRequest(image=spec(name), verbose=True))
    assert code == Code.OK, detail
    assert not resp.HasField("image")
    assert dict(resp.info) == {}


PULL_FAULTS = {
    "pull_image-injected": (("pull_image", "UNAVAILABLE: the registry is down"),),
    "pull_image-denied": (("pull_image", "FAILED_PRECONDITION: unauthorized"),),
    "not-in-registry": (),  # the fake's missing_images rule: NOT_FOUND from the store itself
}
PULL_CODES = {
    "pull_image-injected": Code.UNAVAILABLE,
    "pull_image-denied": Code.FAILED_PRECONDITION,
    "not-in-registry": Code.NOT_FOUND,
}


@pytest.mark.parametrize("case", list(PULL_FAULTS), ids=list(PULL_FAULTS))
async def test_a_failed_pull_leaves_no_image(kit: Kit, case: str) -> None:
    kept = (await kit.ok("PullImage", pb.PullImageRequest(image=spec("busybox:1.36")))).image_ref
    before = await listed(kit)  # asked first: a kept answer would show up stale after
    name = "example.com/gone/app:1" if case == "not-in-registry" else "example.com/app:1"
    kit.inject(PULL_FAULTS[case])
    mark = kit.calls_mark()
    code, _, resp = await kit.call("PullImage", pb.PullImageRequest(image=spec(name)))
    assert (code, resp) == (PULL_CODES[case], None)
    assert [m for m, _ in kit.calls_since(mark)] == ["pull_image"]
    assert await listed(kit) == before == {kept: ["docker.io/library/busybox:1.36"]}
    assert not (await status_of(kit, name)).HasField("image")
    # A failed pull is not kept as the answer to the next one (concurrent pulls share one).
    if case != "not-in-registry":
        ref = (await kit.ok("PullImage", pb.PullImageRequest(image=spec(name)))).image_ref
        assert set(await listed(kit)) == {kept, ref}


@pytest.mark.parametrize("method", ["PullImage", "ImageStatus", "RemoveImage"])
async def test_an_empty_image_is_invalid(kit: Kit, method: str) -> None:
    mark = kit.calls_mark()
    for request in (getattr(pb, f"{method}Request")(), getattr(pb, f"{method}Request")(image=spec(""))):
        code, _, resp = await kit.call(method, request)
        assert (code, resp) == (Code.INVALID_ARGUMENT, None)
    assert kit.calls_since(mark) == []
