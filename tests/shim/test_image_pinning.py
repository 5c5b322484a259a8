"""Pinned images: the patterns of ``[images] pinned`` (backends/contract/pinning.py), and what
ListImages and ImageStatus say of them through the edge, whose encoded ListImages answer
(shim/cri/answers.py) must equal the image service's message."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backends.contract.errors import InvalidArgumentError
from backends.contract.pinning import PinnedImages
from cri_api import api_pb2 as pb
from tests.shim.services_kit import Kit, open_kit

BUSYBOX = "docker.io/library/busybox:1.36"
DIGEST = "docker.io/library/busybox@sha256:" + "a" * 64


@pytest.mark.parametrize(
    ("pattern", "tags", "digests", "pinned"),
    [
        ("busybox:1.36", [BUSYBOX], [], True),  # a reference, normalised as a pull normalises it
        ("busybox:1.35", [BUSYBOX], [], False),
        ("busybox", [BUSYBOX], [], False),  # busybox:latest
        ("docker.io/library/busybox:1.36", [BUSYBOX], [], True),
        (DIGEST, [], [DIGEST], True),  # a repo digest
        ("busybox:*", [BUSYBOX], [], True),  # a glob, against Docker's short form too
        ("library/busybox:*", [BUSYBOX], [], True),
        ("docker.io/*", [BUSYBOX], [], True),
        ("*BusyBox*", [BUSYBOX], [], True),  # CRI-O's keyword form, without regard to case
        ("*@sha256:aaa*", [], [DIGEST], True),
        ("registry.k8s.io/*", [BUSYBOX], [], False),
        ("busy*", [], [], False),  # an image without names matches nothing
        ("quay.io/x/y:1.*", ["quay.io/x/y:1a"], [], False),  # only * is special
        ("quay.io/x/y:1.*", ["quay.io/x/y:1.2"], [], True),
    ],
    ids=lambda v: str(v) if isinstance(v, str | bool) else None,
)
def test_patterns(pattern: str, tags: list[str], digests: list[str], pinned: bool) -> None:
    assert PinnedImages.of([pattern]).matches(tags, digests) is pinned


def test_the_sandbox_image_is_pinned_and_no_pattern_pins_nothing() -> None:
    pins = PinnedImages.of([], "registry.k8s.io/pause:3.10")
    assert pins.matches(["registry.k8s.io/pause:3.10"], [])
    assert not pins.matches(["registry.k8s.io/pause:3.9"], [])
    assert not PinnedImages.of([]) and not PinnedImages.of([]).matches([BUSYBOX], [DIGEST])


@pytest.mark.parametrize("pattern", ["", "Busy Box", "a b*", "x@sha256:123", "UPPER/case:1", "y:1?"])
def test_a_pattern_that_is_no_reference_nor_glob_is_an_error_naming_it(pattern: str) -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape(f"pinned: {pattern!r}")):
        PinnedImages.of([pattern])


@pytest.fixture
async def kit(tmp_path: Path) -> AsyncIterator[Kit]:
    async with open_kit(
        str(tmp_path),
        images=("busybox:1.36", "alpine:3", "registry.k8s.io/coredns/coredns:v1.11.1"),
        pause_image="registry.k8s.io/pause:3.10",
        pinned=["alpine:*", "registry.k8s.io/coredns/*"],
    ) as k:
        yield k


def pinned_tags(images: list[pb.Image]) -> set[str]:
    return {t for i in images if i.pinned for t in i.repo_tags}


async def test_list_and_status_say_pinned_for_the_patterns_and_the_sandbox_image(kit: Kit) -> None:
    resp = await kit.ok("ListImages", pb.ListImagesRequest())
    assert pinned_tags(list(resp.images)) == {
        "docker.io/library/alpine:3",
        "registry.k8s.io/coredns/coredns:v1.11.1",
        "registry.k8s.io/pause:3.10",
    }
    for name, pinned in (("alpine:3", True), ("busybox:1.36", False), ("registry.k8s.io/pause:3.10", True)):
        st = await kit.ok("ImageStatus", pb.ImageStatusRequest(image=pb.ImageSpec(image=name)))
        assert st.image.pinned is pinned, name


async def test_the_edges_list_images_is_the_services_message(kit: Kit) -> None:
    req = pb.ListImagesRequest()
    outcome = kit.servicer.image_answers.list_images(req)  # the encoded answer from memory
    assert isinstance(outcome, bytes)
    plain = await kit.servicer.images.list_(req)
    assert outcome == plain.SerializeToString()
    assert pinned_tags(list(pb.ListImagesResponse.FromString(outcome).images))  # pins are in it
