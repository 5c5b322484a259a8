"""Directory usage of a runtime's store: allocated bytes and inodes, hard links once, cached."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from backends.linux.usage import UsageCache, dir_usage


def test_dir_usage_counts_blocks_and_inodes_and_hard_links_once(tmp_path: Path) -> None:
    empty_size, empty_inodes = dir_usage(str(tmp_path))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "big").write_bytes(os.urandom(1 << 20))
    os.link(tmp_path / "sub" / "big", tmp_path / "link")
    size, inodes = dir_usage(str(tmp_path))
    assert inodes == empty_inodes + 2  # sub, big (its second name is the same inode)
    assert (1 << 20) <= size - empty_size < (1 << 20) + 64 * 1024
    assert dir_usage(str(tmp_path / "missing")) == (0, 0)


async def test_usage_cache_serves_the_last_figure_until_it_is_old(tmp_path: Path) -> None:
    cache = UsageCache(str(tmp_path), max_age=3600)
    first = await cache.get()
    (tmp_path / "f").write_bytes(b"x" * 8192)
    assert await cache.get() == first  # fresh enough: no new walk
    cache.max_age = 0
    assert await cache.get() == first  # stale: the last figure at once, a new walk in the background
    for _ in range(200):
        if (await cache.get())[1] == first[1] + 1:
            break
        await asyncio.sleep(0.01)
    assert (await cache.get())[1] == first[1] + 1
