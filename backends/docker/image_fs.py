"""ImageFsInfo on the engine: the usage of its store, measured in the background.

The store is the graph driver's directory, where the engine keeps the image layers
and the containers' writable layers (one store, as with every graph driver): both
lists name it, so the kubelet sees one filesystem (no split image / container disk),
with what images use in the first and what containers' writable layers use in the
second (a layer directory is a container's when the engine's layer store lists it as
one's mount or init layer). The kubelet takes the capacity from the filesystem
holding the mountpoint and the usage from here: what the store holds (a walk of that
one filesystem in a thread), not the whole disk. A remote engine (its root not
visible here) is asked for /system/df.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

from backends.contract.errors import CriError
from backends.linux.usage import dir_usage
from cri_api import api_pb2 as pb

from .engine_api import EngineAPI

_WALK_EVERY = 30.0  # s between walks of the local store
_DF_EVERY = 10.0  # s between /system/df calls (the engine walks its store for each)

Figure = tuple[int, int | None]  # bytes, inodes (None: unknown)
Figures = tuple[Figure, Figure]  # the images', the containers' writable layers'


def split_usage(graph: str, mounts: str) -> Figures:
    """The usage of the graph driver's directory ``graph``, split into images' layers and the
    containers' writable (and init) layers, which the layer store's ``mounts`` directory names
    (``CONTAINER/mount-id``, ``CONTAINER/init-id``). One walk of each entry of ``graph``."""
    containers: set[str] = set()
    with contextlib.suppress(OSError):
        for entry in os.listdir(mounts):
            for name in ("mount-id", "init-id"):
                with contextlib.suppress(OSError), open(os.path.join(mounts, entry, name)) as fh:
                    containers.add(fh.read().strip())
    images = [0, 0]
    writable = [0, 0]
    used, inodes = dir_usage(graph, limit=1)  # the directory itself
    images[0] += used
    images[1] += inodes
    with contextlib.suppress(OSError):
        for entry in os.listdir(graph):
            used, inodes = dir_usage(os.path.join(graph, entry))
            bucket = writable if entry in containers else images
            bucket[0] += used
            bucket[1] += inodes
    return (images[0], images[1]), (writable[0], writable[1])


class StoreUsage:
    """Measured when the backend starts, then each period again if someone asked meanwhile
    (an idle shim walks nothing); calls are answered from the last figure, and only those
    before the first figure wait for one."""

    def __init__(self, engine: EngineAPI, spawn: Callable[[Coroutine[Any, Any, Figures]], asyncio.Task[Any]]):
        self._engine = engine
        self._spawn = spawn
        self._path: str | None = None  # None: not asked yet; "": not visible here
        self._mounts = ""  # the layer store's container mounts, beside the graph directory
        self._answer: pb.ImageFsInfoResponse | None = None  # the last figure's, built once for every call
        self._asked = True
        self._measuring: asyncio.Task[Figures] | None = None

    async def watch(self) -> None:
        """The background measurements, for as long as the backend runs."""
        while True:
            if self._asked:
                self._asked = False
                with contextlib.suppress(CriError):
                    await self._measure()
            await asyncio.sleep(_DF_EVERY if self._path == "" else _WALK_EVERY)

    def fs_info_now(self) -> pb.ImageFsInfoResponse | None:
        """The last figure's answer; None before the first figure (``fs_info`` waits for it)."""
        self._asked = True
        return self._answer

    async def fs_info(self) -> pb.ImageFsInfoResponse:
        self._asked = True
        if self._answer is None:
            figure = await self._measure()
            return self._answer or self._response(figure)
        return self._answer

    def _response(self, figure: Figures) -> pb.ImageFsInfoResponse:
        """The answer for ``figure``, stamped with the time it was measured (as the CRI's
        FilesystemUsage.timestamp says: when the information was collected): one object,
        shared by every call until the next figure; nobody changes it."""
        images, writable = figure
        now = time.time_ns()
        mountpoint = pb.FilesystemIdentifier(mountpoint=self._path or "/var/lib/docker")
        out = []
        for used, inodes in (images, writable):
            usage = pb.FilesystemUsage(timestamp=now, fs_id=mountpoint, used_bytes=pb.UInt64Value(value=used))
            if inodes is not None:
                usage.inodes_used.value = inodes
            out.append(usage)
        return pb.ImageFsInfoResponse(image_filesystems=[out[0]], container_filesystems=[out[1]])

    async def _measure(self) -> Figures:
        """One measurement at a time, shared by whoever waits for it."""
        task = self._measuring
        if task is None:
            task = self._measuring = self._spawn(self._take())
            task.add_done_callback(self._measured)
        return await asyncio.shield(task)

    def _measured(self, task: asyncio.Task[Figures]) -> None:
        if self._measuring is task:
            self._measuring = None

    async def _take(self) -> Figures:
        if self._path is None:
            info = await self._engine.info()
            root = str(info.get("DockerRootDir") or "/var/lib/docker")
            driver = str(info.get("Driver") or "")
            mount = f"{root}/{driver}" if driver else root
            self._path = mount if await self._engine.run(lambda: os.path.isdir(mount)) else ""
            self._mounts = f"{root}/image/{driver}/layerdb/mounts"
        if self._path:
            figure: Figures = await asyncio.to_thread(split_usage, self._path, self._mounts)
        else:
            try:
                df = await self._engine.df()
            except CriError:
                self._answer = None  # while the engine cannot say, neither can we
                raise
            writable = sum(int(c.get("SizeRw") or 0) for c in df.get("Containers") or [])
            figure = ((int(df.get("LayersSize") or 0), None), (writable, None))
        self._answer = self._response(figure)
        return figure
