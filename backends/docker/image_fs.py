"""ImageFsInfo on the engine: the usage of its store, measured in the background.

The store is the graph driver's directory, where the engine keeps the image layers
and the containers' writable layers (one store, as with every graph driver). The
kubelet takes the capacity from the filesystem holding the mountpoint and the usage
from here: what the store holds (a walk of that one filesystem in a thread), not the
whole disk. A remote engine (its root not visible here) is asked for /system/df.
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


class StoreUsage:
    """Measured when the backend starts, then each period again if someone asked meanwhile
    (an idle shim walks nothing); calls are answered from the last figure, and only those
    before the first figure wait for one."""

    def __init__(self, engine: EngineAPI, spawn: Callable[[Coroutine[Any, Any, Figure]], asyncio.Task[Any]]):
        self._engine = engine
        self._spawn = spawn
        self._path: str | None = None  # None: not asked yet; "": not visible here
        self._figure: Figure | None = None
        self._asked = True
        self._measuring: asyncio.Task[Figure] | None = None

    async def watch(self) -> None:
        """The background measurements, for as long as the backend runs."""
        while True:
            if self._asked:
                self._asked = False
                with contextlib.suppress(CriError):
                    await self._measure()
            await asyncio.sleep(_DF_EVERY if self._path == "" else _WALK_EVERY)

    async def fs_info(self) -> pb.ImageFsInfoResponse:
        self._asked = True
        used, inodes = self._figure or await self._measure()
        usage = pb.FilesystemUsage(
            timestamp=time.time_ns(),
            fs_id=pb.FilesystemIdentifier(mountpoint=self._path or "/var/lib/docker"),
            used_bytes=pb.UInt64Value(value=used),
        )
        if inodes is not None:
            usage.inodes_used.value = inodes
        return pb.ImageFsInfoResponse(image_filesystems=[usage], container_filesystems=[usage])

    async def _measure(self) -> Figure:
        """One measurement at a time, shared by whoever waits for it."""
        task = self._measuring
        if task is None:
            task = self._measuring = self._spawn(self._take())
            task.add_done_callback(self._measured)
        return await asyncio.shield(task)

    def _measured(self, task: asyncio.Task[Figure]) -> None:
        if self._measuring is task:
            self._measuring = None

    async def _take(self) -> Figure:
        if self._path is None:
            info = await self._engine.info()
            root = str(info.get("DockerRootDir") or "/var/lib/docker")
            driver = str(info.get("Driver") or "")
            mount = f"{root}/{driver}" if driver else root
            self._path = mount if await self._engine.run(lambda: os.path.isdir(mount)) else ""
        if self._path:
            figure: Figure = await asyncio.to_thread(dir_usage, self._path)
        else:
            try:
                df = await self._engine.df()
            except CriError:
                self._figure = None  # while the engine cannot say, neither can we
                raise
            writable = sum(int(c.get("SizeRw") or 0) for c in df.get("Containers") or [])
            figure = (int(df.get("LayersSize") or 0) + writable, None)
        self._figure = figure
        return figure
