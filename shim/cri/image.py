"""The ImageService: PullImage, ListImages, ImageStatus, RemoveImage, ImageFsInfo.

An image request goes to the backend of ``image.runtime_handler`` ("" is
the default handler). ListImages merges every backend that keeps images,
one entry per image ID. Concurrent pulls of the same image by the same
backend with the same credentials share one pull.
"""

from __future__ import annotations

import asyncio
import hashlib
import json

import structlog

from backends.contract import Backend, Capability, ImageInfo
from cri_api import api_pb2 as pb
from shim.cri.errors import InvalidArgumentError
from shim.cri.state import Shim

log = structlog.get_logger("image")


class ImageService:
    def __init__(self, shim: Shim) -> None:
        self.shim = shim
        self._pulls: dict[tuple[str, str, str], asyncio.Task[str]] = {}

    def _backend(self, spec: pb.ImageSpec) -> Backend:
        try:
            backend = self.shim.registry.get(spec.runtime_handler)
        except LookupError as exc:
            raise InvalidArgumentError(f"image.runtime_handler: {exc}") from None
        return backend

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
            task = asyncio.ensure_future(backend.pull_image(req.image, auth, sandbox))
            self._pulls[key] = task
            task.add_done_callback(lambda _t: self._pulls.pop(key, None))
        # A client that gives up must not cancel the pull others wait for.
        ref = await asyncio.shield(task)
        return pb.PullImageResponse(image_ref=ref)

    async def list_(self, req: pb.ListImagesRequest) -> pb.ListImagesResponse:
        want = req.filter.image.image if req.HasField("filter") and req.filter.HasField("image") else ""
        merged: dict[str, pb.Image] = {}
        backends = [b for b in self.shim.registry if b.capabilities & Capability.IMAGES]
        for infos in await asyncio.gather(*(b.list_images() for b in backends)):
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
        info = await self._backend(req.image).image_status(req.image)
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
        await self._backend(req.image).remove_image(req.image)
        return pb.RemoveImageResponse()

    async def fs_info(self, req: pb.ImageFsInfoRequest) -> pb.ImageFsInfoResponse:
        """Every handler's stores, the default handler's first: the kubelet reads entry 0 of
        each list for its image GC and imagefs eviction signals. A filesystem named by two
        handlers (one engine behind both) is listed once."""
        registry = self.shim.registry
        names = [registry.default, *(n for n in registry.names() if n != registry.default)]
        backends = [registry.get(n) for n in names]
        infos = await asyncio.gather(
            *(b.image_fs_info() for b in backends if b.capabilities & Capability.IMAGES)
        )
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
    if img.id == want or img.id.removeprefix("sha256:").startswith(want.removeprefix("sha256:")):
        return True
    return (
        want in img.repo_tags
        or want in img.repo_digests
        or any(t.startswith(want + ":") for t in img.repo_tags)
    )
