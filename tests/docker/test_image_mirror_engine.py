"""ListImages from memory against the real engine: what `docker pull/tag/rmi` do behind the
shim's back shows within a bounded wait, the shim's own pulls and removals at once, and a
broken event stream sends ListImages to the engine until the stream is back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import docker
import pytest

from backends.contract import ImageInfo
from backends.docker import DockerBackend
from cri_api import api_pb2 as pb
from tests.criutil import until
from tests.docker.dockerkit import BUSYBOX, INSTANCE, PAUSE, Harness
from tests.docker.test_docker_backend import behind_proxy, push_own_image

pytestmark = pytest.mark.docker

MOVING = f"127.0.0.1:5000/crishim-mirror:{INSTANCE}"


async def tags_of(backend: DockerBackend) -> dict[str, tuple[str, ...]]:
    return {i.id: i.repo_tags for i in await backend.images.list_images()}


async def holder(backend: DockerBackend, tag: str) -> str:
    """The listed image holding ``tag`` ("" when none does)."""
    return next((i for i, tags in (await tags_of(backend)).items() if tag in tags), "")


async def answers_as_the_engine(backend: DockerBackend) -> bool:
    listed: list[ImageInfo] = await backend.images.list_images()
    return listed == await backend._shared.engine_images.mirror.from_engine()


async def test_host_changes_show_in_list_images(harness: Harness) -> None:
    backend, engine = harness.backend, harness.engine
    await until(lambda: backend._shared.engine_images.mirror.synced)
    busybox_id = engine.inspect_image(BUSYBOX)["Id"]
    pause_id = engine.inspect_image(PAUSE)["Id"]
    try:
        engine.tag(BUSYBOX, MOVING)
        await until(lambda: _held_by(backend, MOVING, busybox_id))
        engine.tag(PAUSE, MOVING)  # the tag moves: the engine says so of the new holder only
        await until(lambda: _held_by(backend, MOVING, pause_id))
        assert MOVING not in (await tags_of(backend))[busybox_id]
    finally:
        engine.remove_image(MOVING)
    await until(lambda: _held_by(backend, MOVING, ""))

    ref = await asyncio.to_thread(push_own_image, engine)
    await asyncio.to_thread(engine.pull, ref)
    own_id = engine.inspect_image(ref)["Id"]
    await until(lambda: _held_by(backend, ref, own_id))
    info = {i.id: i for i in await backend.images.list_images()}[own_id]
    assert info.size > 0 and any(d.startswith("127.0.0.1:5000/crishim-test@") for d in info.repo_digests)
    engine.remove_image(ref)
    await until(lambda: _held_by(backend, ref, ""))
    # Others share this engine and may be changing its images: the same answer, eventually.
    await until(lambda: answers_as_the_engine(backend))
    assert backend._shared.engine_images.mirror.synced


async def _held_by(backend: DockerBackend, tag: str, image_id: str) -> bool:
    return await holder(backend, tag) == image_id


async def test_own_pull_and_removal_are_listed_at_once(harness: Harness) -> None:
    backend = harness.backend
    await until(lambda: backend._shared.engine_images.mirror.synced)
    ref = await asyncio.to_thread(push_own_image, harness.engine)
    image_id = await backend.images.pull_image(pb.ImageSpec(image=ref), None, None)
    assert ref in (await tags_of(backend))[image_id]
    await backend.images.remove_image(pb.ImageSpec(image=ref))
    assert image_id not in await tags_of(backend)


async def test_a_broken_event_stream_sends_list_images_to_the_engine(
    engine: docker.APIClient, tmp_path: Path
) -> None:
    async with behind_proxy(engine, tmp_path) as (proxy, h):
        mirror = h.backend._shared.engine_images.mirror
        await until(lambda: mirror.synced)
        proxy.cut_events()
        await until(lambda: not mirror.synced)
        busybox_id = engine.inspect_image(BUSYBOX)["Id"]
        engine.tag(BUSYBOX, MOVING)  # heard by nobody
        try:
            assert await holder(h.backend, MOVING) == busybox_id  # at once: the engine's answer
            proxy.refusing_events = False
            await until(lambda: mirror.synced, seconds=15)
            assert await holder(h.backend, MOVING) == busybox_id
        finally:
            engine.remove_image(MOVING)
        await until(lambda: _held_by(h.backend, MOVING, ""))
