"""How much of a filesystem a directory tree holds: bytes allocated and inodes.

What ImageFsInfo and the writable-layer stats report is the usage of a
runtime's own store (``du -sx``), not of the whole disk. Walking a big store
takes a while, so it is done in a worker thread and the last figure is served
while a newer one is computed: the event loop never waits on a walk.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time


def dir_usage(path: str, limit: int = 0) -> tuple[int, int]:
    """Bytes allocated and inodes under ``path``, on its filesystem only; hard links once.

    ``limit`` (0: none) stops the walk after that many inodes: a bound on the
    cost of a per-container figure asked for on every stats call."""
    try:
        top = os.lstat(path)
    except OSError:
        return 0, 0
    seen: set[tuple[int, int]] = set()
    size = top.st_blocks * 512
    inodes = 1
    stack = [path]
    while stack and not (limit and inodes >= limit):
        d = stack.pop()
        with contextlib.suppress(OSError), os.scandir(d) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_dev != top.st_dev:
                    continue  # a mount (a running container's rootfs): another filesystem
                if st.st_nlink > 1:
                    key = (st.st_dev, st.st_ino)
                    if key in seen:
                        continue
                    seen.add(key)
                size += st.st_blocks * 512
                inodes += 1
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
    return size, inodes


class UsageCache:
    """``dir_usage`` of one directory, at most ``max_age`` seconds old once known."""

    def __init__(self, path: str, max_age: float = 30.0) -> None:
        self.path = path
        self.max_age = max_age
        self._figure: tuple[int, int] | None = None
        self._at = 0.0
        self._task: asyncio.Task[tuple[int, int]] | None = None

    async def get(self) -> tuple[int, int]:
        stale = self._figure is None or time.monotonic() - self._at > self.max_age
        if stale and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._refresh())
        if self._figure is None:
            assert self._task is not None
            return await asyncio.shield(self._task)
        return self._figure

    async def _refresh(self) -> tuple[int, int]:
        try:
            figure = await asyncio.to_thread(dir_usage, self.path)
            self._figure, self._at = figure, time.monotonic()
            return figure
        finally:
            self._task = None
