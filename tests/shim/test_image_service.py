"""ListImages and ImageFsInfo at the edge (shim/cri/answers.py EncodedImages) over the image
service: answered encoded from what stores hold in memory, else by the service's coroutine, and
always what the service itself answers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, cast

import pytest

from backends.contract import ImageInfo
from cri_api import api_pb2 as pb
from shim.cri.answers import EncodedImages
from shim.cri.image import ImageService, image_pb
from shim.cri.state import Shim


class Store:
    """A backend whose image store (its Images part: itself) answers as the test sets."""

    name = "store"

    def __init__(self) -> None:
        self.infos: list[ImageInfo] = []
        self.fs = pb.ImageFsInfoResponse()

    @property
    def images(self) -> Store:
        return self

    async def list_images(self) -> list[ImageInfo]:
        return list(self.infos)

    async def image_fs_info(self) -> pb.ImageFsInfoResponse:
        return self.fs

    def list_images_now(self) -> list[ImageInfo] | None:
        return None  # only the coroutines answer

    def image_fs_info_now(self) -> pb.ImageFsInfoResponse | None:
        return None


class NowStore(Store):
    """A store that can answer from memory, while ``ready`` says so."""

    def __init__(self) -> None:
        super().__init__()
        self.ready = True

    def list_images_now(self) -> list[ImageInfo] | None:
        return list(self.infos) if self.ready else None

    def image_fs_info_now(self) -> pb.ImageFsInfoResponse | None:
        return self.fs if self.ready else None


async def settled(answer: Any) -> Any:
    return await answer if asyncio.iscoroutine(answer) else answer


class Edge:
    """The polled image RPCs as the servicer serves them, and the service behind them."""

    def __init__(self, plain: ImageService) -> None:
        self.plain = plain
        self.fast = EncodedImages(plain)

    def list_(self, req: pb.ListImagesRequest) -> Any:
        return self.fast.list_images(req)

    def fs_info(self, req: pb.ImageFsInfoRequest) -> Any:
        return self.fast.image_fs_info(req)


async def fs_answer(svc: Edge) -> pb.ImageFsInfoResponse:
    resp = await settled(svc.fs_info(pb.ImageFsInfoRequest()))
    got = pb.ImageFsInfoResponse.FromString(resp) if isinstance(resp, bytes) else resp
    assert got == await svc.plain.fs_info(pb.ImageFsInfoRequest())
    return got


class RegistryStub:
    def __init__(self, *stores: Store) -> None:
        self.stores = {s.name: s for s in stores}
        self.default = stores[0].name

    def __iter__(self) -> Iterator[Store]:
        return iter(self.stores.values())

    def names(self) -> list[str]:
        return list(self.stores)

    def get(self, name: str) -> Store:
        return self.stores[name or self.default]


def service(*stores: Store) -> Edge:
    shim: Any = type("ShimStub", (), {"registry": RegistryStub(*stores)})()
    return Edge(ImageService(cast(Shim, shim)))


IMAGES = [
    ImageInfo(
        id="sha256:" + "a" * 64, repo_tags=("a:1", "a:2"), repo_digests=("a@sha256:1",), size=10, uid=0
    ),
    ImageInfo(id="sha256:" + "b" * 64, repo_tags=(), repo_digests=(), size=20, username="www", pinned=True),
    ImageInfo(id="sha256:" + "c" * 64, repo_tags=("<none>:<none>",), repo_digests=("<none>@<none>",)),
]


async def listed(svc: Edge, want: str = "") -> list[pb.Image]:
    req = pb.ListImagesRequest()
    if want:
        req.filter.image.image = want
    resp = await settled(svc.list_(req))
    got = pb.ListImagesResponse.FromString(resp) if isinstance(resp, bytes) else resp
    assert got == await svc.plain.list_(req)  # the edge answers what the service answers
    return list(got.images)


async def test_one_store_is_answered_encoded_as_the_messages_would_be() -> None:
    store = NowStore()
    store.infos = list(IMAGES)
    svc = service(store)
    assert isinstance(await settled(svc.list_(pb.ListImagesRequest())), bytes)
    assert await listed(svc) == [image_pb(i) for i in IMAGES]
    assert await listed(svc) == [image_pb(i) for i in IMAGES]  # entries reused


async def test_a_changed_image_is_encoded_again() -> None:
    store = NowStore()
    store.infos = list(IMAGES)
    svc = service(store)
    await listed(svc)
    changed = ImageInfo(id=IMAGES[0].id, repo_tags=("a:3",), size=11)
    store.infos = [changed, IMAGES[2]]
    assert await listed(svc) == [image_pb(changed), image_pb(IMAGES[2])]


async def test_a_twice_listed_id_and_a_filter_take_the_general_way() -> None:
    store = NowStore()
    other_tags = ImageInfo(id=IMAGES[0].id, repo_tags=("a:9",), repo_digests=("a@sha256:1",))
    store.infos = [IMAGES[0], other_tags]
    svc = service(store)
    [merged] = await listed(svc)
    assert list(merged.repo_tags) == ["a:1", "a:2", "a:9"] and list(merged.repo_digests) == ["a@sha256:1"]
    store.infos = list(IMAGES)
    assert [i.id for i in await listed(svc, "a:2")] == [IMAGES[0].id]


def usage(mountpoint: str, used: int) -> pb.FilesystemUsage:
    return pb.FilesystemUsage(
        fs_id=pb.FilesystemIdentifier(mountpoint=mountpoint), used_bytes=pb.UInt64Value(value=used)
    )


async def test_image_fs_info_of_one_store() -> None:
    store = Store()
    store.fs = pb.ImageFsInfoResponse(
        image_filesystems=[usage("/i", 1)], container_filesystems=[usage("/i", 1)]
    )
    svc = service(store)
    assert await fs_answer(svc) == store.fs
    # A mountpoint twice in one list is named once, as when several stores share it.
    store.fs = pb.ImageFsInfoResponse(image_filesystems=[usage("/i", 1), usage("/i", 2), usage("/j", 3)])
    got = await fs_answer(svc)
    assert [(f.fs_id.mountpoint, f.used_bytes.value) for f in got.image_filesystems] == [("/i", 1), ("/j", 3)]


@pytest.mark.parametrize("ready", [True, False])
async def test_a_store_answering_from_memory_is_answered_without_a_coroutine(ready: bool) -> None:
    """What the store has in memory settles the call at once (no task on the native
    transport); when it has not, the coroutine gives the same answer."""
    store = NowStore()
    store.infos = list(IMAGES)
    store.fs = pb.ImageFsInfoResponse(
        image_filesystems=[usage("/i", 1)], container_filesystems=[usage("/c", 2)]
    )
    store.ready = ready
    svc = service(store)
    images = svc.list_(pb.ListImagesRequest())
    fs = svc.fs_info(pb.ImageFsInfoRequest())
    assert asyncio.iscoroutine(images) is (not ready) and asyncio.iscoroutine(fs) is (not ready)
    assert await listed(svc) == [image_pb(i) for i in IMAGES]
    assert await settled(images) == await settled(svc.list_(pb.ListImagesRequest()))
    fs = await settled(fs)
    assert (pb.ImageFsInfoResponse.FromString(fs) if ready else fs) == store.fs
    # A filter takes the general way even from memory.
    store.ready = True
    filtered = svc.list_(pb.ListImagesRequest(filter=pb.ImageFilter(image=pb.ImageSpec(image="a:2"))))
    assert asyncio.iscoroutine(filtered)
    assert [i.id for i in (await filtered).images] == [IMAGES[0].id]
    # A mountpoint named twice is merged from memory too.
    store.fs = pb.ImageFsInfoResponse(image_filesystems=[usage("/i", 1), usage("/i", 2)])
    twice = svc.fs_info(pb.ImageFsInfoRequest())
    assert isinstance(twice, bytes)
    assert [f.used_bytes.value for f in pb.ImageFsInfoResponse.FromString(twice).image_filesystems] == [1]


async def test_image_fs_info_from_memory_is_encoded_once_per_figure() -> None:
    """The encoded answer is kept while the store hands out the same figures, and made
    again from the figures it hands out next (never a stale answer)."""
    store = NowStore()
    store.fs = pb.ImageFsInfoResponse(
        image_filesystems=[usage("/i", 1)], container_filesystems=[usage("/c", 2)]
    )
    svc = service(store)
    first = svc.fs_info(pb.ImageFsInfoRequest())
    assert svc.fs_info(pb.ImageFsInfoRequest()) is first
    store.fs = pb.ImageFsInfoResponse(
        image_filesystems=[usage("/i", 5)], container_filesystems=[usage("/c", 2)]
    )
    again = svc.fs_info(pb.ImageFsInfoRequest())
    assert again is not first
    assert pb.ImageFsInfoResponse.FromString(again) == store.fs


async def test_image_fs_info_of_several_stores_from_memory_default_first() -> None:
    """Stores that all answer from memory are merged at once, the default handler's first,
    a filesystem two stores share named once; one that cannot makes it the coroutine."""
    main, other = NowStore(), NowStore()
    main.name, other.name = "main", "other"
    main.fs = pb.ImageFsInfoResponse(
        image_filesystems=[usage("/m", 1)], container_filesystems=[usage("/c", 2)]
    )
    other.fs = pb.ImageFsInfoResponse(
        image_filesystems=[usage("/o", 3)], container_filesystems=[usage("/c", 4)]
    )
    svc = service(main, other)
    at_once = svc.fs_info(pb.ImageFsInfoRequest())
    assert isinstance(at_once, bytes)
    got = pb.ImageFsInfoResponse.FromString(at_once)
    assert [(f.fs_id.mountpoint, f.used_bytes.value) for f in got.image_filesystems] == [("/m", 1), ("/o", 3)]
    assert [(f.fs_id.mountpoint, f.used_bytes.value) for f in got.container_filesystems] == [("/c", 2)]
    other.ready = False
    later = svc.fs_info(pb.ImageFsInfoRequest())
    assert asyncio.iscoroutine(later)
    assert await later == got


async def test_a_store_that_cannot_answer_from_memory_is_asked() -> None:
    store = Store()
    store.infos = list(IMAGES)
    svc = service(store)
    assert asyncio.iscoroutine(pending := svc.list_(pb.ListImagesRequest()))
    assert list((await pending).images) == [image_pb(i) for i in IMAGES]
    assert await listed(svc) == [image_pb(i) for i in IMAGES]
