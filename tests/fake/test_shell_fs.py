"""The container's files as the shell sees them: MemoryFs (backends/fake/shell/fs.py)."""

from __future__ import annotations

import pytest

from backends.fake.shell import MemoryFs
from tests.fake.harness import Harness


async def test_files_persist_between_runs_sharing_a_memory_fs() -> None:
    fs = MemoryFs({"/etc/hostname": "pod\n"})
    fs.mkdir("/data")
    first = await Harness(fs=fs).run(
        ["sh", "-c", "echo written > /data/f; echo more >> /data/f; mkdir -p /data/d/e"]
    )
    assert first.code == 0
    second = await Harness(fs=fs).run(["sh", "-c", "cat /data/f; ls /data; test -d /data/d/e && echo dir"])
    assert second.stdout == b"written\nmore\nd\nf\ndir\n"
    assert fs.read("/data/f") == b"written\nmore\n"


def test_memory_fs_behaves_like_a_filesystem() -> None:
    fs = MemoryFs({"/a/b.txt": b"x", "/ro/c": "z"}, read_only=["/ro"])
    assert fs.is_dir("/a") and fs.exists("/a/b.txt") and fs.listdir("/") == ["a", "ro"]
    assert fs.read("/a/../a/b.txt") == b"x"
    with pytest.raises(FileNotFoundError):
        fs.read("/nope")
    with pytest.raises(IsADirectoryError):
        fs.read("/a")
    with pytest.raises(FileNotFoundError):
        fs.write("/missing/f", b"")
    with pytest.raises(NotADirectoryError):
        fs.listdir("/a/b.txt")
    with pytest.raises(FileExistsError):
        fs.mkdir("/a")
    with pytest.raises(OSError, match="not empty"):
        fs.remove("/a")
    with pytest.raises(PermissionError):
        fs.write("/ro/f", b"")
    with pytest.raises(PermissionError):
        fs.remove("/ro/c")
    fs.write("/a/b.txt", b"y", append=True)
    assert fs.read("/a/b.txt") == b"xy"
    fs.remove("/a/b.txt")
    fs.remove("/a")
    assert fs.listdir("/") == ["ro"]


def test_filesystems_of_one_tree_share_its_directories_until_one_changes() -> None:
    a, b = MemoryFs({"/etc/hosts": "a"}), MemoryFs({"/etc/hosts": "b"})
    for fs in (a, b):
        fs.mkdir("/tmp")
        fs.share_dirs()
    assert a.dirs is b.dirs  # one set for both

    a.mkdir("/tmp/only-a")
    b.remove("/tmp")
    assert a.is_dir("/tmp/only-a") and a.is_dir("/tmp")
    assert not b.exists("/tmp/only-a") and not b.exists("/tmp") and b.is_dir("/etc")
    assert b.listdir("/") == ["etc"] and a.listdir("/") == ["etc", "tmp"]

    c = MemoryFs({"/etc/hosts": "c"})
    c.mkdir("/tmp")
    c.share_dirs()
    assert c.dirs is not a.dirs and c.dirs is not b.dirs  # both changed: neither holds the shared set
    assert c.listdir("/") == ["etc", "tmp"] and not c.exists("/tmp/only-a")
