"""ImageService over one store: ListImages answered pre-encoded, ImageFsInfo passed through,
with the same answers as the general merge of several stores."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

from backends.contract import Capability, ImageInfo
from cri_api import api_pb2 as pb
from shim.cri.image import ImageService, image_pb
from shim.cri.state import Shim


class Store:
    """A backend with an image store whose answers the test sets."""

    name = "store"
    capabilities = Capability.IMAGES

    def __init__(self) -> None:
        self.images: list[ImageInfo] = []
        self.fs = pb.ImageFsInfoResponse()

    async def list_images(self) -> list[ImageInfo]:
        return list(self.images)

    async def image_fs_info(self) -> pb.ImageFsInfoResponse:
        return self.fs


class Registry:
    default = "store"

    def __init__(self, store: Store) -> None:
        self.store = store

    def __iter__(self) -> Iterator[Store]:
        return iter([self.store])

    def names(self) -> list[str]:
        return ["store"]

    def get(self, name: str) -> Store:
        return self.store


def service(store: Store) -> ImageService:
    shim: Any = type("ShimStub", (), {"registry": Registry(store)})()
    return ImageService(cast(Shim, shim))


IMAGES = [
    ImageInfo(
        id="sha256:" + "a" * 64, repo_tags=("a:1", "a:2"), repo_digests=("a@sha256:1",), size=10, uid=0
    ),
    ImageInfo(id="sha256:" + "b" * 64, repo_tags=(), repo_digests=(), size=20, username="www", pinned=True),
    ImageInfo(id="sha256:" + "c" * 64, repo_tags=("<none>:<none>",), repo_digests=("<none>@<none>",)),
]


async def listed(svc: ImageService, want: str = "") -> list[pb.Image]:
    req = pb.ListImagesRequest()
    if want:
        req.filter.image.image = want
    resp = await svc.list_(req)
    return list((pb.ListImagesResponse.FromString(resp) if isinstance(resp, bytes) else resp).images)


async def test_one_store_is_answered_encoded_as_the_messages_would_be() -> None:
    store = Store()
    store.images = list(IMAGES)
    svc = service(store)
    assert isinstance(await svc.list_(pb.ListImagesRequest()), bytes)
    assert await listed(svc) == [image_pb(i) for i in IMAGES]
    assert await listed(svc) == [image_pb(i) for i in IMAGES]  # entries reused


async def test_a_changed_image_is_encoded_again() -> None:
    store = Store()
    store.images = list(IMAGES)
    svc = service(store)
    await listed(svc)
    changed = ImageInfo(id=IMAGES[0].id, repo_tags=("a:3",), size=11)
    store.images = [changed, IMAGES[2]]
    assert await listed(svc) == [image_pb(changed), image_pb(IMAGES[2])]


async def test_a_twice_listed_id_and_a_filter_take_the_general_way() -> None:
    store = Store()
    other_tags = ImageInfo(id=IMAGES[0].id, repo_tags=("a:9",), repo_digests=("a@sha256:1",))
    store.images = [IMAGES[0], other_tags]
    svc = service(store)
    [merged] = await listed(svc)
    assert list(merged.repo_tags) == ["a:1", "a:2", "a:9"] and list(merged.repo_digests) == ["a@sha256:1"]
    store.images = list(IMAGES)
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
    assert await svc.fs_info(pb.ImageFsInfoRequest()) == store.fs
    # A mountpoint twice in one list is named once, as when several stores share it.
    store.fs = pb.ImageFsInfoResponse(image_filesystems=[usage("/i", 1), usage("/i", 2), usage("/j", 3)])
    got = await svc.fs_info(pb.ImageFsInfoRequest())
    assert [(f.fs_id.mountpoint, f.used_bytes.value) for f in got.image_filesystems] == [("/i", 1), ("/j", 3)]
