"""Image volumes on an engine that has no image mounts (API 1.41): the image's layers, read-only.

The engine keeps every pulled image's layers in its storage driver; with overlay2,
``GraphDriver.Data`` of the image names their directories (``UpperDir`` the top
layer, ``LowerDir`` the ones below). For each image volume the backend stacks them
read-only (an overlay of them all, or a bind of a single layer) under
``<state_dir>/image-volumes/<container id>/<n>`` on this host and gives the engine
that directory, or ``image_sub_path`` of it, as a read-only bind mount. The stacks
go when the container is removed, and a restarted shim removes those of containers
it no longer has. Only on the engine's host (the directories must be the engine's),
and only with overlay2: anything else and the handler says it has no image volumes.

Mount options (Mount.mount_options: noexec, nodev, nosuid, ro) are made the same way: the
engine's binds take none of them (API 1.41: its Binds accept ro/rw, propagation and SELinux
labels; BindOptions has no per-mount flags), so the host path is bound under
``<state_dir>/image-volumes/<container id>/<n>`` and that bind remounted with the flags; the
engine's bind of it keeps them (a bind mount inherits the flags of the mount it copies). They go
with the container, as the stacks do. Only as root, on the engine's host.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterable
from typing import Any

import structlog

from backends.contract.errors import InternalError, InvalidArgumentError, NotFoundError
from backends.linux.files import unclaimed
from cri_api import api_pb2 as pb

log = structlog.get_logger("docker.image_volumes")

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MNT_DETACH = 2
MAX_OPTIONS = 4000  # mount options must fit in a page
# Mount.mount_options as mount(2) flags.
FLAGS = {"noexec": MS_NOEXEC, "nodev": MS_NODEV, "nosuid": MS_NOSUID, "ro": MS_RDONLY}


def _mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()) != 0:
        err = ctypes.get_errno()
        raise InternalError(f"cannot mount {source or 'again'} at {target}: {os.strerror(err)}")


def _umount(target: str) -> None:
    ctypes.CDLL(None, use_errno=True).umount2(target.encode(), MNT_DETACH)


def layers_of(info: dict[str, Any]) -> list[str]:
    """The image's layer directories, top first, from an image inspection ([] if not overlay2)."""
    driver = info.get("GraphDriver") or {}
    if driver.get("Name") != "overlay2":
        return []
    data = driver.get("Data") or {}
    top = str(data.get("UpperDir") or "")
    below = [d for d in str(data.get("LowerDir") or "").split(":") if d]
    return [d for d in (top, *below) if d]


class ImageVolumes:
    """The read-only stacks of one docker handler's image volumes, under ``root``."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.usable = False  # set at start: overlay2, a state directory, root

    def check(self, driver: str) -> None:
        self.usable = bool(self.root) and driver == "overlay2" and os.geteuid() == 0

    @property
    def flags_usable(self) -> bool:
        """Whether mount options can be applied (binds remounted here need root and a state directory)."""
        return bool(self.root) and os.geteuid() == 0

    def flagged(self, container_id: str, index: int, mnt: pb.Mount) -> str:
        """``mnt``'s host path bound under this container's folder and remounted with the flags
        of its mount_options (and read-only if it is); the directory to give the engine."""
        flags = MS_RDONLY if mnt.readonly else 0
        for option in mnt.mount_options:
            flag = FLAGS.get(option)
            if flag is None:
                raise InvalidArgumentError(
                    f"mount {mnt.container_path}: mount option {option!r} is not applied here"
                )
            flags |= flag
        if not os.path.exists(mnt.host_path):
            raise InvalidArgumentError(f"mount source {mnt.host_path!r} does not exist")
        target = os.path.join(self.root, container_id, str(index))
        if os.path.isdir(os.path.realpath(mnt.host_path)):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "a"):
                pass  # a file's bind needs a file to cover
        _mount(mnt.host_path, target, "", MS_BIND | MS_REC, "")
        _mount("", target, "", MS_REMOUNT | MS_BIND | flags, "")
        return target

    def stack(self, container_id: str, index: int, mnt: pb.Mount, info: dict[str, Any]) -> str:
        """Stack the image's layers for ``mnt``; the host directory to bind (its sub path)."""
        layers = layers_of(info)
        if not layers or not all(os.path.isdir(d) for d in layers):
            raise NotFoundError(
                f"the layers of image {mnt.image.image!r} (mount {mnt.container_path}) are not on this host"
            )
        target = os.path.join(self.root, container_id, str(index))
        os.makedirs(target, exist_ok=True)
        if len(layers) == 1:
            _mount(layers[0], target, "", MS_BIND | MS_REC, "")
            _mount("", target, "", MS_REMOUNT | MS_BIND | MS_RDONLY, "")
        else:
            options = "lowerdir=" + ":".join(layers)
            if len(options) > MAX_OPTIONS:
                raise InvalidArgumentError(
                    f"image {mnt.image.image!r} has too many layers for an image volume here ({len(layers)})"
                )
            _mount("overlay", target, "overlay", MS_RDONLY, options)
        source = os.path.join(target, mnt.image_sub_path) if mnt.image_sub_path else target
        real = os.path.realpath(source)
        if not (real == target or real.startswith(target + "/")) or not os.path.exists(real):
            raise InvalidArgumentError(
                f"image_sub_path {mnt.image_sub_path!r} does not exist in image {mnt.image.image!r}"
            )
        return real

    def release(self, container_id: str) -> None:
        """Unmount and remove a container's stacks. Idempotent."""
        folder = os.path.join(self.root, container_id)
        if not self.root or not os.path.isdir(folder):
            return
        for name in os.listdir(folder):
            _umount(os.path.join(folder, name))
        with contextlib.suppress(OSError):
            for name in os.listdir(folder):
                path = os.path.join(folder, name)
                # Empty once unmounted (a file's bind covered an empty file); never a recursive delete.
                if os.path.isdir(path):
                    os.rmdir(path)
                elif os.path.getsize(path) == 0:
                    os.unlink(path)
            os.rmdir(folder)
        if os.path.isdir(folder):
            log.warning("image_volume.not_removed", path=folder)

    def sweep(self, known: Iterable[str]) -> None:
        """Release the stacks of containers this handler no longer has (after a restart)."""
        for cid in unclaimed(self.root, known):
            self.release(cid)
