"""Which name a container's status gives its image (shim/cri/container.py display_image)."""

from __future__ import annotations

import types
from typing import Any

import pytest

from backends.contract import ImageInfo
from backends.contract.errors import UnavailableError
from cri_api import api_pb2 as pb
from shim.cri.container import display_image

ID = "sha256:" + "ab" * 32


class _Images:
    def __init__(self, info: ImageInfo | None = None, fail: bool = False) -> None:
        self.info, self.fail, self.asked = info, fail, 0

    async def image_status(self, spec: pb.ImageSpec) -> ImageInfo | None:
        self.asked += 1
        if self.fail:
            raise UnavailableError("engine gone")
        return self.info


@pytest.mark.parametrize(
    ("spec", "images", "want"),
    [
        # The kubelet from v1.30: created from the ID, the pod spec's name beside it.
        (
            pb.ImageSpec(image=ID, user_specified_image="registry.k8s.io/x/busybox:1.37"),
            _Images(),
            "registry.k8s.io/x/busybox:1.37",
        ),
        # No name given: the image's first tag, with or without the sha256: prefix.
        (
            pb.ImageSpec(image=ID),
            _Images(ImageInfo(ID, ("docker.io/library/busybox:1.36", "b:2"))),
            "docker.io/library/busybox:1.36",
        ),
        (pb.ImageSpec(image=ID.removeprefix("sha256:")), _Images(ImageInfo(ID, ("b:1",))), "b:1"),
        # An untagged image, an image gone, a backend that cannot say: the ID as given.
        (pb.ImageSpec(image=ID), _Images(ImageInfo(ID)), ID),
        (pb.ImageSpec(image=ID), _Images(None), ID),
        (pb.ImageSpec(image=ID), _Images(fail=True), ID),
        (pb.ImageSpec(image=ID), None, ID),  # a backend with no image store
        # A name is shown as the client wrote it, without asking the backend.
        (
            pb.ImageSpec(image="busybox:1.36", user_specified_image="other"),
            _Images(fail=True),
            "busybox:1.36",
        ),
    ],
)
async def test_display_image(spec: pb.ImageSpec, images: Any, want: str) -> None:
    assert await display_image(types.SimpleNamespace(images=images), spec) == want  # type: ignore[arg-type]
