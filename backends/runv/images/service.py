"""The image service of the runv backend over its own store (:mod:`.store`): PullImage,
ListImages, ImageStatus, RemoveImage, ImageFsInfo, and the image a container or an image
volume names."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Sequence

from backends import contract
from backends.contract import errors
from backends.contract.pinning import PinnedImages
from backends.linux.usage import UsageCache
from cri_api import api_pb2 as pb

from .store import Credentials, Image, ImageStore


class VmImages:
    def __init__(self, store: ImageStore, containers_dir: str, pinned: PinnedImages | None = None) -> None:
        self._store = store
        self._pinned = pinned or PinnedImages()
        self._containers_dir = containers_dir
        self._image_usage = UsageCache(store.root)
        self._layer_usage = UsageCache(containers_dir)

    async def pull_image(
        self, image: pb.ImageSpec, auth: pb.AuthConfig | None, sandbox_config: pb.PodSandboxConfig | None
    ) -> str:
        creds = None
        if auth is not None:
            creds = Credentials(
                auth.username,
                auth.password,
                auth.auth,
                auth.identity_token,
                auth.registry_token,
                server_address=auth.server_address,
            )
        return await self._store.pull(image.image, creds)

    def _info(self, img: Image) -> contract.ImageInfo:
        uid, username = contract.image_user(str(img.config.get("User") or ""))
        return contract.ImageInfo(
            id=img.id,
            repo_tags=tuple(img.repo_tags),
            repo_digests=tuple(img.repo_digests),
            size=max(img.size, 1),
            uid=uid,
            username=username,
            pinned=img.pinned or self._pinned.matches(img.repo_tags, img.repo_digests),
        )

    async def list_images(self) -> list[contract.ImageInfo]:
        return [self._info(i) for i in self._store.all()]

    def list_images_now(self) -> list[contract.ImageInfo] | None:
        return None  # the coroutine answers

    async def image_status(self, image: pb.ImageSpec) -> contract.ImageInfo | None:
        img = self._store.resolve(image.image)
        return None if img is None else self._info(img)

    async def remove_image(self, image: pb.ImageSpec) -> None:
        await asyncio.to_thread(self._store.remove, image.image)

    def image_fs_info_now(self) -> pb.ImageFsInfoResponse | None:
        return None  # measured on disk (cached a while) by the coroutine

    async def image_fs_info(self) -> pb.ImageFsInfoResponse:
        """runv's own image store, and the directory of its containers' writable layers."""
        (used, inodes), (ct_used, ct_inodes) = await asyncio.gather(
            self._image_usage.get(), self._layer_usage.get()
        )
        now = time.time_ns()
        return pb.ImageFsInfoResponse(
            image_filesystems=[
                pb.FilesystemUsage(
                    timestamp=now,
                    fs_id=pb.FilesystemIdentifier(mountpoint=self._store.root),
                    used_bytes=pb.UInt64Value(value=used),
                    inodes_used=pb.UInt64Value(value=inodes),
                )
            ],
            container_filesystems=[
                pb.FilesystemUsage(
                    timestamp=now,
                    fs_id=pb.FilesystemIdentifier(mountpoint=self._containers_dir),
                    used_bytes=pb.UInt64Value(value=ct_used),
                    inodes_used=pb.UInt64Value(value=ct_inodes),
                )
            ],
        )

    async def find(self, ref: str, names: Sequence[str]) -> Image:
        """The image ``ref`` (a container's or an image volume's), pulled into this store by one
        of ``names`` if only another handler's store has it."""
        img = self._store.resolve(ref)
        if img is not None:
            return img
        # Pulled through another handler's store (e.g. docker as the default handler):
        # fetch it into ours by name, so one `crictl pull` serves every handler. The
        # image ID (config digest) is the same in both stores.
        for name in (ref, *names):
            if not name or re.fullmatch(r"(sha256:)?[0-9a-f]{12,64}", name):
                continue
            with contextlib.suppress(errors.NotFoundError, errors.InvalidArgumentError):
                image_id = await self._store.pull(name)
                if ref in (name, image_id) or image_id.removeprefix("sha256:").startswith(
                    ref.removeprefix("sha256:")
                ):
                    return self._store.images[image_id]
        raise errors.NotFoundError(f"image {ref!r} not found")
