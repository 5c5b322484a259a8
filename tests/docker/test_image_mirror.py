"""ListImages and ImageFsInfo from memory, over the recording fake engine: the image
mirror fed by engine events, its fallback while the stream is broken, read-your-writes.
No dockerd needed (tests/docker/test_image_mirror_engine.py has the real one)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backends.contract import ImageInfo
from backends.contract.errors import UnavailableError
from backends.docker import image_fs, image_mirror
from backends.docker.fake_engine import FakeEngine
from backends.docker.image_mirror import ImageMirror
from backends.linux.usage import dir_usage
from cri_api import api_pb2 as pb
from tests.criutil import until
from tests.docker.dockerkit import BUSYBOX, PAUSE
from tests.docker.test_docker_logic import Kit, new_kit


@pytest.fixture
async def kit() -> AsyncIterator[Kit]:
    k = await new_kit()
    await until(lambda: k.backend._shared.engine_images.mirror.synced)
    yield k
    await k.events.close()
    await k.backend.lifecycle.close()


def by_id(images: list[ImageInfo]) -> dict[str, ImageInfo]:
    return {i.id: i for i in images}


async def matches_engine(kit: Kit) -> bool:
    """The backend's answer is what the engine lists now (same images, order and fields)."""
    return (
        await kit.backend.images.list_images() == await kit.backend._shared.engine_images.mirror.from_engine()
    )


async def test_the_list_is_served_from_memory_once_read(kit: Kit) -> None:
    engine = kit.engine
    calls = len(engine.calls)
    for _ in range(5):
        listed = await kit.backend.images.list_images()
    assert len(engine.calls) == calls  # not one engine call
    assert {i.repo_tags for i in listed} == {(BUSYBOX,), (PAUSE,)}
    assert [i.pinned for i in listed if i.repo_tags == (PAUSE,)] == [True]
    assert await matches_engine(kit)


async def test_changes_on_the_host_show_in_the_list(kit: Kit) -> None:
    engine, backend = kit.engine, kit.backend
    new = engine.add_image("example.com/app:1", user="1234")  # docker pull on the host
    await until(lambda: _listed(kit, new))
    assert by_id(await backend.images.list_images())[new].uid == 1234
    assert await matches_engine(kit)

    old = next(i for i, info in engine.images.items() if BUSYBOX in info["RepoTags"])
    engine.tag_image(new, BUSYBOX)  # the tag leaves the old image with no event of its own
    await until(lambda: _tagged(kit, new, ("example.com/app:1", BUSYBOX)))
    assert by_id(await backend.images.list_images())[old].repo_tags == ()
    assert await matches_engine(kit)

    engine.rmi("example.com/app:1")  # one of two tags: untagged only
    await until(lambda: _tagged(kit, new, (BUSYBOX,)))
    engine.rmi(BUSYBOX)  # the last: deleted
    await until(lambda: _gone(kit, new))
    assert await matches_engine(kit)


async def test_images_of_the_same_second_are_listed_in_one_order(kit: Kit) -> None:
    """The engine lists images created in the same second in a new order each call; the
    mirror answers one order (newest first, then by ID), whether from memory or the engine."""
    engine, backend = kit.engine, kit.backend
    made = [engine.add_image(f"example.com/tie:{n}") for n in range(6)]
    same = next(iter(engine.images.values()))["Created"]
    for image_id in made:
        engine.images[image_id]["Created"] = same
    engine.add_image("example.com/tie:last")  # an event after the edit: the mirror reads again
    await until(lambda: _listed(kit, made[0]))
    await until(lambda: matches_engine(kit))
    first = await backend.images.list_images()
    for _ in range(10):
        assert await backend.images.list_images() == first
        assert await backend._shared.engine_images.mirror.from_engine() == first
    tied = [i.id for i in first if i.id in made]
    assert tied == sorted(made)


async def _listed(kit: Kit, image_id: str) -> bool:
    return image_id in by_id(await kit.backend.images.list_images())


async def _gone(kit: Kit, image_id: str) -> bool:
    return not await _listed(kit, image_id)


async def _tagged(kit: Kit, image_id: str, tags: tuple[str, ...]) -> bool:
    info = by_id(await kit.backend.images.list_images()).get(image_id)
    return info is not None and info.repo_tags == tags


async def test_a_burst_of_events_shares_reads(kit: Kit) -> None:
    reads = kit.engine.count("image_list")
    made = [kit.engine.add_image(f"example.com/burst:{n}") for n in range(20)]
    await until(lambda: _listed(kit, made[-1]))
    assert set(made) <= by_id(await kit.backend.images.list_images()).keys()
    assert kit.engine.count("image_list") - reads <= 2


async def test_a_caller_after_an_event_waits_for_the_read_it_started(kit: Kit) -> None:
    engine = kit.engine
    gate = engine.gates["image_list"] = asyncio.Event()
    reads = engine.count("image_list")
    new = engine.add_image("example.com/late:1")
    await until(lambda: engine.count("image_list") > reads)  # the event was heard; its read hangs
    listing = asyncio.ensure_future(kit.backend.images.list_images())
    await asyncio.sleep(0.05)
    assert not listing.done()  # the mirror is known to be behind: not served
    gate.set()
    assert new in by_id(await listing)


async def test_the_list_without_waiting_only_while_nothing_heard_is_pending(kit: Kit) -> None:
    """list_images_now answers what list_images would, or None when list_images would have
    to wait (a heard change not read yet) or ask the engine (stream down)."""
    engine, backend, mirror = kit.engine, kit.backend, kit.backend._shared.engine_images.mirror
    assert backend.images.list_images_now() == await backend.images.list_images()
    gate = engine.gates["image_list"] = asyncio.Event()
    reads = engine.count("image_list")
    new = engine.add_image("example.com/pending:1")
    await until(lambda: engine.count("image_list") > reads)  # heard, its read hangs
    assert backend.images.list_images_now() is None
    gate.set()
    await until(lambda: backend.images.list_images_now() is not None)
    now = backend.images.list_images_now()
    assert now is not None and new in by_id(now)
    engine.fail("events", UnavailableError("docker engine unreachable"))
    engine.break_events()
    await until(lambda: not mirror.synced)
    assert backend.images.list_images_now() is None
    await until(lambda: mirror.synced, seconds=10)


async def test_a_broken_stream_falls_back_to_the_engine_until_read_again(kit: Kit) -> None:
    engine, mirror = kit.engine, kit.backend._shared.engine_images.mirror
    engine.fail("events", UnavailableError("docker engine unreachable"))  # the first reconnect fails
    engine.break_events()
    await until(lambda: not mirror.synced)
    new = engine.add_image("example.com/unheard:1")  # no stream to tell of it
    reads = engine.count("image_list")
    assert new in by_id(await kit.backend.images.list_images())  # asked of the engine, not the mirror
    assert new in by_id(await kit.backend.images.list_images())
    assert engine.count("image_list") == reads + 2
    await until(lambda: mirror.synced, seconds=10)  # reconnected after the failed attempt, read again
    reads = engine.count("image_list")
    assert new in by_id(await kit.backend.images.list_images())
    assert engine.count("image_list") == reads
    assert await matches_engine(kit)


async def test_own_pulls_and_removals_are_read_at_once(kit: Kit) -> None:
    engine, backend = kit.engine, kit.backend
    engine.event_delay = 0.5  # the engine's events lag behind its answers
    reads = engine.count("image_list")
    image_id = await backend.images.pull_image(pb.ImageSpec(image="example.com/mine:1"), None, None)
    assert by_id(await backend.images.list_images())[image_id].repo_tags == ("example.com/mine:1",)
    await backend.images.remove_image(pb.ImageSpec(image="example.com/mine:1"))
    assert image_id not in by_id(await backend.images.list_images())
    assert engine.count("image_list") == reads  # from memory, before any event came
    await until(lambda: engine.count("image_list") > reads)  # the events, late
    await until(lambda: kit.backend._shared.engine_images.mirror.synced)
    assert await matches_engine(kit)


async def test_the_pause_image_is_pinned_again_when_pulled_again(kit: Kit) -> None:
    backend = kit.backend
    pause = pb.ImageSpec(image=PAUSE)
    await backend.images.remove_image(pause)
    assert not any(i.pinned for i in await backend.images.list_images())
    image_id = await backend.images.pull_image(pause, None, None)
    assert [i.id for i in await backend.images.list_images() if i.pinned] == [image_id]
    status = await backend.images.image_status(pause)
    assert status is not None and status.pinned


async def test_a_write_during_a_read_is_applied_again_on_top_of_it() -> None:
    engine = FakeEngine()
    engine.add_image(PAUSE)
    mirror = ImageMirror(engine, PAUSE)
    mirror.connected()
    try:
        await until(lambda: mirror.synced)
        gate = engine.gates["image_list"] = asyncio.Event()
        host = engine.add_image("example.com/host:1")  # no stream here: announced by hand
        mirror.changed()
        reads = engine.count("image_list")
        await until(lambda: engine.count("image_list") > reads)  # the read took its list...
        mine = engine.add_image("example.com/mine:1")
        mirror.pulled("example.com/mine:1", await engine.image_inspect(mine))  # ...before this pull
        gate.set()
        listed = await mirror.current()
        assert listed is not None and {host, mine} <= by_id(listed).keys()
    finally:
        mirror.disconnected()


async def test_changes_with_no_event_are_caught_by_the_resync(
    kit: Kit, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(image_mirror, "_RESYNC", 0.05)
    engine = kit.engine
    engine.add_image(BUSYBOX)  # a read, so that the next timer is set with the short period
    await until(lambda: engine.count("image_list") > 1)
    built = "sha256:" + "b" * 64  # what an untagged build makes: an image no event announces
    engine.images[built] = next(iter(engine.images.values())) | {"Id": built, "RepoTags": []}
    await until(lambda: _listed(kit, built))


async def test_image_fs_info_from_memory(kit: Kit) -> None:
    engine = kit.engine
    first = await kit.backend.images.image_fs_info()
    assert first.image_filesystems[0].used_bytes.value == sum(i["Size"] for i in engine.images.values())
    assert first.image_filesystems[0].fs_id.mountpoint == "/var/lib/docker"
    calls = len(engine.calls)
    for _ in range(5):
        again = await kit.backend.images.image_fs_info()
    now = kit.backend.images.image_fs_info_now()
    assert len(engine.calls) == calls
    assert now is not None and now.image_filesystems[0].used_bytes == first.image_filesystems[0].used_bytes
    # Stamped when measured (FilesystemUsage.timestamp: when the figures were collected, as
    # containerd stamps its snapshot usage), not when asked; the next figure has a later one.
    assert again.image_filesystems[0].timestamp == first.image_filesystems[0].timestamp
    await kit.backend._store_usage._measure()
    later = kit.backend.images.image_fs_info_now()
    assert later is not None and later.image_filesystems[0].timestamp > first.image_filesystems[0].timestamp


async def test_image_fs_info_splits_images_from_writable_layers_on_one_filesystem() -> None:
    """A remote engine's /system/df: the images' layers in image_filesystems, the containers'
    writable layers in container_filesystems, both at the one store (no split disk)."""
    k = await new_kit()
    try:
        sb = await k.pod()
        await k.running(sb)
        await k.backend._store_usage._measure()  # a new figure now, not at the next period
        fs = await k.backend.images.image_fs_info()
        (images,), (writable,) = fs.image_filesystems, fs.container_filesystems
        assert images.used_bytes.value == sum(i["Size"] for i in k.engine.images.values())
        assert writable.used_bytes.value == 100 * len(k.engine.containers)  # the pause and the app
        assert images.fs_id.mountpoint == writable.fs_id.mountpoint == "/var/lib/docker"
    finally:
        await k.events.close()
        await k.backend.lifecycle.close()


def test_a_local_store_is_split_by_the_layer_stores_mounts(tmp_path: Path) -> None:
    graph, mounts = tmp_path / "overlay2", tmp_path / "image/overlay2/layerdb/mounts"
    for layer, size in (("img1", 8192), ("img2", 4096), ("ctr1", 65536), ("ctr1-init", 4096)):
        (graph / layer / "diff").mkdir(parents=True)
        (graph / layer / "diff" / "f").write_bytes(b"x" * size)
    (mounts / "c1").mkdir(parents=True)
    (mounts / "c1" / "mount-id").write_text("ctr1")
    (mounts / "c1" / "init-id").write_text("ctr1-init")
    (images_bytes, images_inodes), (ctr_bytes, ctr_inodes) = image_fs.split_usage(str(graph), str(mounts))
    total_bytes, total_inodes = dir_usage(str(graph))
    assert (images_bytes + ctr_bytes, images_inodes + ctr_inodes) == (total_bytes, total_inodes)
    assert ctr_bytes >= 65536 + 4096 and images_bytes >= 8192 + 4096
    assert ctr_inodes == 6 and images_inodes == 7  # 3 each layer; the directory itself is the images'


async def test_image_fs_info_is_measured_again_while_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(image_fs, "_DF_EVERY", 0.05)
    k = await new_kit()
    try:
        used = (await k.backend.images.image_fs_info()).image_filesystems[0].used_bytes.value
        k.engine.add_image("example.com/big:1")
        await until(lambda: _used(k, used + 1000))
        measured = k.engine.count("df")
        await asyncio.sleep(0.3)  # nobody asks: at most the measurement already due
        assert k.engine.count("df") <= measured + 1
    finally:
        await k.events.close()
        await k.backend.lifecycle.close()


async def _used(kit: Kit, want: int) -> bool:
    return (await kit.backend.images.image_fs_info()).image_filesystems[0].used_bytes.value == want


async def test_image_fs_info_before_any_figure_asks_the_engine() -> None:
    engine = FakeEngine()
    engine.down = True
    k = await new_kit(engine)
    try:
        assert k.backend.images.image_fs_info_now() is None  # nothing measured: only the coroutine can say
        with pytest.raises(UnavailableError):
            await k.backend.images.image_fs_info()
        engine.down = False
        assert (await k.backend.images.image_fs_info()).image_filesystems[0].used_bytes.value == 2000
    finally:
        await k.events.close()
        await k.backend.lifecycle.close()
