"""The docker backend's pinned images, over the recording fake engine: the pause image (by its ID)
and the ``pinned`` patterns (by tags and digests), in the list from memory, the list from the
engine and the status; and the options it reads from the shim's [images] section."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from backends.contract import ImageInfo
from backends.contract.pinning import PinnedImages
from backends.docker import DockerBackend, create
from backends.docker.fake_engine import FakeEngine
from cri_api import api_pb2 as pb
from tests.criutil import until
from tests.docker.dockerkit import BUSYBOX, PAUSE, Events

APP = "example.com/team/app:1"


@pytest.fixture
async def backend() -> AsyncIterator[DockerBackend]:
    engine = FakeEngine()
    for ref in (PAUSE, BUSYBOX, APP):
        engine.add_image(ref)
    b = DockerBackend(
        "docker", engine=engine, pause_image=PAUSE, instance="pins", pinned=PinnedImages.of(["example.com/*"])
    )
    events = Events()
    await b.lifecycle.start(events)
    yield b
    await events.close()
    await b.lifecycle.close()


def pinned(images: list[ImageInfo]) -> set[str]:
    return {t for i in images if i.pinned for t in i.repo_tags}


async def test_the_pause_image_and_the_patterns_are_pinned_everywhere(backend: DockerBackend) -> None:
    images = backend.images
    assert images is not None
    want = {PAUSE, APP}
    assert pinned(await backend._shared.engine_images.list()) == want  # from the engine or memory
    await until(lambda: images.list_images_now() is not None)
    assert pinned(images.list_images_now() or []) == want  # from memory (the edge's answer)
    assert pinned(await images.list_images()) == want
    for ref, is_pinned in ((APP, True), (PAUSE, True), (BUSYBOX, False)):
        status = await images.image_status(pb.ImageSpec(image=ref))
        assert status is not None and status.pinned is is_pinned, ref


@pytest.mark.parametrize(
    ("options", "timeout"),
    [({}, 120.0), ({"image_pull_progress_timeout": 7}, 7.0), ({"pull_no_progress_timeout": 9}, 9.0)],
    ids=["default", "new-name", "old-name"],
)
def test_create_reads_the_images_options(options: dict[str, object], timeout: float) -> None:
    backend = create("docker", {"instance": "opts", "pinned": ["busybox:*"], **options})
    engine_images = backend._shared.engine_images
    assert engine_images._no_progress_timeout == timeout
    assert engine_images._pinned.matches(["docker.io/library/busybox:1.36"], [])
