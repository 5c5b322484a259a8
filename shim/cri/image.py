"""The ImageService: PullImage, ListImages, ImageStatus, RemoveImage, ImageFsInfo.

An image request goes to the backend of ``image.runtime_handler`` ("" is
the default handler). ListImages merges every backend that keeps images,
one entry per image ID. Concurrent pulls of the same image by the same
backend with the same credentials share one pull. ListImages and ImageFsInfo
are polled: shim/cri/answers.py answers them from what the stores hold in
memory when it can, as these methods would.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import Iterable

import structlog

from backends.contract import Backend, ImageInfo, Images
from backends.reference import BadReference
from backends.reference import parse as parse_reference
from cri_api import api_pb2 as pb
from shim.cri.errors import InvalidArgumentError, UnimplementedError
from shim.cri.state import Shim

log = structlog.get_logger("image")


class ImageService:
    def __init__(self, shim: Shim) -> None:
        self.shim = shim
        self._pulls: dict[tuple[str, str, str], asyncio.Task[str]] = {}
        self._stores: list[Images] | None = None  # the image stores, default first

    def _backend(self, spec: pb.ImageSpec) -> Backend:
        try:
            backend = self.shim.registry.get(spec.runtime_handler)
        except LookupError as exc:
            raise InvalidArgumentError(f"image.runtime_handler: {exc}") from None
        return backend

    @staticmethod
    def _store_of(backend: Backend) -> Images:
        if backend.images is None:
            raise UnimplementedError(f"runtime handler {backend.name!r} does not support images")
        return backend.images

    @staticmethod
    def _require_image(spec: pb.ImageSpec, present: bool) -> None:
        if not present or not spec.image:
            raise InvalidArgumentError("image.image must not be empty")
        if len(spec.image) > 4096 or any(ch.isspace() for ch in spec.image):
            raise InvalidArgumentError(f"image.image {spec.image[:80]!r} is not a valid image reference")

    async def pull(self, req: pb.PullImageRequest) -> pb.PullImageResponse:
        self._require_image(req.image, req.HasField("image"))
        backend = self._backend(req.image)
        auth = req.auth if req.HasField("auth") else None
        # Credentials are part of the key (hashed, never logged): a pull with
        # other credentials must not ride on one that may be refused.
        key = (
            backend.name,
            req.image.image,
            hashlib.sha256(auth.SerializeToString()).hexdigest() if auth is not None else "",
        )
        task = self._pulls.get(key)
        if task is None:
            sandbox = req.sandbox_config if req.HasField("sandbox_config") else None
            task = asyncio.ensure_future(self._store_of(backend).pull_image(req.image, auth, sandbox))
            self._pulls[key] = task
            task.add_done_callback(lambda _t: self._pulls.pop(key, None))
        # A client that gives up must not cancel the pull others wait for.
        ref = await asyncio.shield(task)
        return pb.PullImageResponse(image_ref=ref)

    def stores(self) -> list[Images]:
        """The handlers' image stores, the default handler's first (a registry is fixed)."""
        stores = self._stores
        if stores is None:
            registry = self.shim.registry
            names = [registry.default, *(n for n in registry.names() if n != registry.default)]
            stores = [b.images for b in (registry.get(n) for n in names) if b.images is not None]
            self._stores = stores
        return stores

    async def list_(self, req: pb.ListImagesRequest) -> pb.ListImagesResponse:
        """Every store's images, one entry per image ID (the tags and digests of all), filtered
        by ``filter.image`` if it is set."""
        want = wanted_image(req)
        stores = self.stores()
        lists = await asyncio.gather(*(s.list_images() for s in stores))
        merged: dict[str, pb.Image] = {}
        for infos in lists:
            for info in infos:
                seen = merged.get(info.id)
                if seen is None:
                    merged[info.id] = image_pb(info)
                    continue
                for tag in info.repo_tags:
                    if tag not in seen.repo_tags:
                        seen.repo_tags.append(tag)
                for dg in info.repo_digests:
                    if dg not in seen.repo_digests:
                        seen.repo_digests.append(dg)
        images = list(merged.values())
        if want:
            images = [i for i in images if _matches(i, want)]
        return pb.ListImagesResponse(images=images)

    async def status(self, req: pb.ImageStatusRequest) -> pb.ImageStatusResponse:
        self._require_image(req.image, req.HasField("image"))
        info = await self._store_of(self._backend(req.image)).image_status(req.image)
        resp = pb.ImageStatusResponse()
        # A missing image is not an error: the response simply has no image.
        if info is not None:
            img = image_pb(info)
            resp.image.CopyFrom(img)
            if req.verbose:
                resp.info["info"] = json.dumps({"id": img.id, "repoTags": list(img.repo_tags)})
        return resp

    async def remove(self, req: pb.RemoveImageRequest) -> pb.RemoveImageResponse:
        self._require_image(req.image, req.HasField("image"))
        await self._store_of(self._backend(req.image)).remove_image(req.image)
        return pb.RemoveImageResponse()

    async def fs_info(self, req: pb.ImageFsInfoRequest) -> pb.ImageFsInfoResponse:
        """Every handler's stores, the default handler's first: the kubelet reads entry 0 of
        each list for its image GC and imagefs eviction signals. A filesystem named by two
        handlers (one engine behind both) is listed once."""
        return merged_fs_info(await asyncio.gather(*(s.image_fs_info() for s in self.stores())))


def wanted_image(req: pb.ListImagesRequest) -> str:
    """The image a ListImages filter names, "" for none."""
    return req.filter.image.image if req.HasField("filter") and req.filter.HasField("image") else ""


def merged_fs_info(infos: list[pb.ImageFsInfoResponse]) -> pb.ImageFsInfoResponse:
    """One answer of the stores' ``infos``, each filesystem (by mountpoint) once, in order."""
    if len(infos) == 1 and _distinct_all(infos[0]):
        return infos[0]
    resp = pb.ImageFsInfoResponse()
    seen: tuple[set[str], set[str]] = (set(), set())
    for info in infos:
        for have, got, out in (
            (seen[0], info.image_filesystems, resp.image_filesystems),
            (seen[1], info.container_filesystems, resp.container_filesystems),
        ):
            for fs in got:
                if fs.fs_id.mountpoint not in have:
                    have.add(fs.fs_id.mountpoint)
                    out.append(fs)
    return resp


def _distinct_all(info: pb.ImageFsInfoResponse) -> bool:
    return all(_distinct(fs) for fs in (info.image_filesystems, info.container_filesystems))


def _distinct(filesystems: Iterable[pb.FilesystemUsage]) -> bool:
    mountpoints = [fs.fs_id.mountpoint for fs in filesystems]
    return len(set(mountpoints)) == len(mountpoints)


def image_pb(info: ImageInfo) -> pb.Image:
    """The CRI's Image of what a backend's store reports (built here once for every backend)."""
    img = pb.Image(
        id=info.id,
        repo_tags=[t for t in info.repo_tags if t != "<none>:<none>"],
        repo_digests=[d for d in info.repo_digests if d != "<none>@<none>"],
        size=max(0, info.size),
        username=info.username,
        spec=pb.ImageSpec(image=info.id),
        pinned=info.pinned,
    )
    if info.uid is not None:
        img.uid.value = info.uid
    return img


def _matches(img: pb.Image, want: str) -> bool:
    """Whether ``want`` (an ID or its prefix, a reference as written or in full, a repository
    for all its tags) names ``img``: the names ImageStatus and PullImage accept for it."""
    if img.id == want or img.id.removeprefix("sha256:").startswith(want.removeprefix("sha256:")):
        return True
    names = {want}
    with contextlib.suppress(BadReference):
        ref = parse_reference(want)
        tagged = bool(ref.digest) or ":" in want.rpartition("/")[2]
        names.add(ref.name if tagged else ref.repository)
    return any(
        name in img.repo_tags
        or name in img.repo_digests
        or any(t.startswith(name + ":") for t in img.repo_tags)
        for name in names
    )
