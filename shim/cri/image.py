"""The ImageService: PullImage, ListImages, ImageStatus, RemoveImage, ImageFsInfo.

Each runtime handler keeps its own image store (runv's, the engine's, the fake's). A request
whose ``image.runtime_handler`` names a handler (KEP-4216) goes to that handler's store only:
PullImage, ImageStatus, RemoveImage, and ListImages by ``filter.image.runtime_handler`` (its
entries then carry that handler in ``spec.runtime_handler``). Without a handler:

- PullImage and ImageStatus go to the default handler's store;
- ListImages merges every store, one entry per image ID (the tags and digests of all, pinned if
  any store pins it), with no ``spec.runtime_handler``, as containerd and CRI-O answer. A
  kubelet with the RuntimeClassInImageCriApi gate keys its image records by (ID, that handler)
  and the images in use by (ID, ``Container.image.runtime_handler``), which it never sets in
  CreateContainer: entries per handler would never count as in use. Off, it keys by ID alone;
  either way one entry per ID is what it can garbage-collect;
- RemoveImage removes the image from every store that holds it: the kubelet's image GC removes
  what ListImages listed, by ID and with no handler (v1.35 drops the handler on RemoveImage
  even with the gate on), so an image only a non-default store holds is freed too.

RemoveImage of an image a container (in any state: an exited one still has its layers) of the
same handler was created from, or mounts as an image volume, is refused (FAILED_PRECONDITION,
naming the container), as CRI-O refuses; the kubelet's GC never asks it (it removes only images
no container uses), ``crictl rmi`` may. A pinned image is removed when asked: the CRI makes
``pinned`` a recommendation the runtime must not enforce (CRI-O does not).

Concurrent pulls of the same image by the same backend with the same credentials share one
pull. ListImages and ImageFsInfo are polled: shim/cri/answers.py answers them from what the
stores hold in memory when it can, as these methods would.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import Iterable

import structlog

from backends.contract import Backend, ContainerRecord, ImageInfo, Images
from backends.reference import BadReference
from backends.reference import parse as parse_reference
from cri_api import api_pb2 as pb
from shim.cri.errors import FailedPreconditionError, InvalidArgumentError, UnimplementedError
from shim.cri.state import Shim

log = structlog.get_logger("image")


class ImageService:
    def __init__(self, shim: Shim) -> None:
        self.shim = shim
        self._pulls: dict[tuple[str, str, str], asyncio.Task[str]] = {}
        self._stores: list[tuple[str, Images]] | None = None  # the image stores, default first

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
        return [images for _name, images in self.handler_stores()]

    def handler_stores(self) -> list[tuple[str, Images]]:
        """(handler, its image store) of the handlers that keep images, the default first."""
        stores = self._stores
        if stores is None:
            registry = self.shim.registry
            names = [registry.default, *(n for n in registry.names() if n != registry.default)]
            stores = [(n, b.images) for n, b in ((n, registry.get(n)) for n in names) if b.images is not None]
            self._stores = stores
        return stores

    async def list_(self, req: pb.ListImagesRequest) -> pb.ListImagesResponse:
        """Every store's images, one entry per image ID (the tags and digests of all), filtered
        by ``filter.image`` if it is set; only its handler's, if it names one."""
        want = wanted_image(req)
        handler = wanted_handler(req)
        stores = [self._store_of(self._backend(req.filter.image))] if handler else self.stores()
        lists = await asyncio.gather(*(s.list_images() for s in stores))
        merged: dict[str, pb.Image] = {}
        for infos in lists:
            for info in infos:
                seen = merged.get(info.id)
                if seen is None:
                    merged[info.id] = image_pb(info, handler)
                    continue
                for tag in info.repo_tags:
                    if tag not in seen.repo_tags:
                        seen.repo_tags.append(tag)
                for dg in info.repo_digests:
                    if dg not in seen.repo_digests:
                        seen.repo_digests.append(dg)
                seen.pinned = seen.pinned or info.pinned
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
            img = image_pb(info, req.image.runtime_handler)
            resp.image.CopyFrom(img)
            if req.verbose:
                resp.info["info"] = json.dumps({"id": img.id, "repoTags": list(img.repo_tags)})
        return resp

    async def remove(self, req: pb.RemoveImageRequest) -> pb.RemoveImageResponse:
        """From the named handler's store, or from every store that holds the image; nothing is
        removed if a container uses it in any of them."""
        self._require_image(req.image, req.HasField("image"))
        if req.image.runtime_handler:
            store = self._store_of(self._backend(req.image))
            stores = [(self.shim.registry.resolve_name(req.image.runtime_handler), store)]
        else:
            stores = self.handler_stores()
        found: list[tuple[Images, str]] = []
        for handler, store in stores:
            info = await store.image_status(req.image)
            if info is None:
                continue
            user = self._user(handler, info.id)
            if user is not None:
                raise FailedPreconditionError(
                    f"image {req.image.image!r} ({info.id}) is in use by container {user.id} "
                    f"({self._describe(user)}); remove the container first"
                )
            found.append((store, info.id))
        for store, image_id in found:
            # By ID: the image checked above, with all its tags.
            await store.remove_image(pb.ImageSpec(image=image_id, runtime_handler=req.image.runtime_handler))
            log.info("image.removed", image=req.image.image, id=image_id)
        return pb.RemoveImageResponse()

    def _user(self, handler: str, image_id: str) -> ContainerRecord | None:
        """A container of ``handler`` created from the image, or mounting it as a volume."""
        for c in self.shim.store.containers:
            if c.backend == handler and (c.image_ref == image_id or image_id in c.image_volume_refs.values()):
                return c
        return None

    def _describe(self, c: ContainerRecord) -> str:
        sandbox = self.shim.store.sandboxes.get(c.sandbox_id)
        where = ""
        if sandbox is not None:
            meta = sandbox.config.metadata
            where = f" of pod {meta.namespace}/{meta.name}"
        state = pb.ContainerState.Name(c.state).removeprefix("CONTAINER_").lower()
        return f'"{c.config.metadata.name}"{where}, {state}'

    async def fs_info(self, req: pb.ImageFsInfoRequest) -> pb.ImageFsInfoResponse:
        """Every handler's stores, the default handler's first: the kubelet reads entry 0 of
        each list for its image GC and imagefs eviction signals. A filesystem named by two
        handlers (one engine behind both) is listed once."""
        return merged_fs_info(await asyncio.gather(*(s.image_fs_info() for s in self.stores())))


def wanted_image(req: pb.ListImagesRequest) -> str:
    """The image a ListImages filter names, "" for none."""
    return req.filter.image.image if req.HasField("filter") and req.filter.HasField("image") else ""


def wanted_handler(req: pb.ListImagesRequest) -> str:
    """The runtime handler a ListImages filter names, "" for none (every store)."""
    return req.filter.image.runtime_handler if req.HasField("filter") and req.filter.HasField("image") else ""


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


def image_pb(info: ImageInfo, handler: str = "") -> pb.Image:
    """The CRI's Image of what a backend's store reports (built here once for every backend);
    ``handler``: the runtime handler whose store was asked by name ("": none was)."""
    img = pb.Image(
        id=info.id,
        repo_tags=[t for t in info.repo_tags if t != "<none>:<none>"],
        repo_digests=[d for d in info.repo_digests if d != "<none>@<none>"],
        size=max(0, info.size),
        username=info.username,
        spec=pb.ImageSpec(image=info.id, runtime_handler=handler),
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
