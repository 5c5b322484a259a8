"""A fake container's files: its own in memory, and the volumes the kubelet gave it on the host.

The fake runs no processes, but the pods people write pass files around:
an init container leaves a marker in an emptyDir for the app container, a
container writes its termination message to ``/dev/termination-log`` (which
the kubelet reads from the host), a hostPath volume carries a file in. So a
container's CRI mounts are real here: a path under a mount's container path
is the file under its host path, shared with every other container that
mounts it and kept across restarts, as the kubelet expects. Everything else
is the container's own, in memory, gone with the container: the image's
files (none unless the config scripts them), ``/etc/hostname``,
``/etc/hosts`` and ``/etc/resolv.conf`` as the pod's config makes them.

A path never leaves its mount: ``..`` and symbolic links that point outside
the host path are refused (PermissionError), so a fake container cannot
reach the node's files through a volume.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import posixpath
import sys
from collections.abc import Callable, Mapping, Sequence

from backends.fake.shell import MemoryFs
from backends.fake.shell.fs import FileStat

_libc = ctypes.CDLL(None, use_errno=True)


def statfs_type(path: str) -> int:
    """statfs(2)'s f_type of the host file system holding ``path`` (a tmpfs emptyDir is TMPFS_MAGIC):
    Python has no statfs, and its f_type is what agnhost's mounttest prints. f_type is the struct's
    first field, a C long."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if _libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    size = ctypes.sizeof(ctypes.c_long)
    return int.from_bytes(buf.raw[:size], sys.byteorder, signed=True)


@dataclasses.dataclass(frozen=True, slots=True)
class Mount:
    container_path: str
    host_path: str
    readonly: bool = False
    noexec: bool = False  # Mount.mount_options has noexec: nothing under it runs


class ContainerFiles:
    """The ``Fs`` of one fake container (see :mod:`backends.fake.shell`)."""

    def __init__(self, own: Mapping[str, bytes], mounts: Sequence[Mount]) -> None:
        self.memory = MemoryFs()
        for path, data in own.items():
            self.memory.mkdir(posixpath.dirname(path), parents=True)
            self.memory.write(path, data)
        # Longest first: a mount inside another mount wins.
        self._mounts = sorted(
            (dataclasses.replace(m, container_path=posixpath.normpath(m.container_path)) for m in mounts),
            key=lambda m: len(m.container_path),
            reverse=True,
        )
        for m in self._mounts:
            # The mount point exists in the container's own tree, as a runtime would make it.
            parent = m.container_path if os.path.isdir(m.host_path) else posixpath.dirname(m.container_path)
            self.memory.mkdir(parent, parents=True)

    def _host(self, path: str, writing: bool = False) -> str | None:
        """The host path behind ``path`` if a mount holds it, else None (the container's own)."""
        path = posixpath.normpath(posixpath.join("/", path))
        for m in self._mounts:
            mp = m.container_path
            if path != mp and not path.startswith(mp.rstrip("/") + "/"):
                continue
            if writing and m.readonly:
                raise PermissionError(errno.EROFS, "Read-only file system", path)
            rel = posixpath.relpath(path, mp)
            real = m.host_path if rel == "." else os.path.join(m.host_path, rel)
            root = os.path.realpath(m.host_path)
            resolved = os.path.realpath(real)
            if resolved != root and not resolved.startswith(root.rstrip("/") + "/"):
                raise PermissionError(errno.EACCES, "Permission denied (outside its volume)", path)
            return real
        return None

    def noexec(self, path: str) -> bool:
        """Whether ``path`` is under a mount with the noexec option (its files do not run)."""
        path = posixpath.normpath(posixpath.join("/", path))
        for m in self._mounts:
            mp = m.container_path
            if path == mp or path.startswith(mp.rstrip("/") + "/"):
                return m.noexec
        return False

    def read(self, path: str) -> bytes:
        host = self._host(path)
        if host is None:
            return self.memory.read(path)
        with open(host, "rb") as f:
            return f.read()

    def write(self, path: str, data: bytes, append: bool = False) -> None:
        host = self._host(path, writing=True)
        if host is None:
            self.memory.write(path, data, append)
            return
        with open(host, "ab" if append else "wb") as f:
            f.write(data)

    def exists(self, path: str) -> bool:
        return self._test(path, self.memory.exists, os.path.exists)

    def is_dir(self, path: str) -> bool:
        return self._test(path, self.memory.is_dir, os.path.isdir)

    def _test(self, path: str, own: Callable[[str], bool], on_host: Callable[[str], bool]) -> bool:
        """A test of ``path`` where it is; a path outside its volume fails every test."""
        try:
            host = self._host(path)
        except PermissionError:
            return False
        return own(path) if host is None else on_host(host)

    def listdir(self, path: str) -> list[str]:
        host = self._host(path)
        return self.memory.listdir(path) if host is None else sorted(os.listdir(host))

    def mkdir(self, path: str, parents: bool = False) -> None:
        host = self._host(path, writing=True)
        if host is None:
            self.memory.mkdir(path, parents)
        elif parents:
            os.makedirs(host, exist_ok=True)
        else:
            os.mkdir(host)

    def stat(self, path: str) -> FileStat:
        host = self._host(path)
        if host is None:
            return self.memory.stat(path)
        st = os.stat(host)
        return FileStat(st.st_mode, st.st_uid, st.st_gid)

    def chmod(self, path: str, mode: int) -> None:
        host = self._host(path, writing=True)
        if host is None:
            self.memory.chmod(path, mode)
        else:
            os.chmod(host, mode & 0o7777)

    def fs_type(self, path: str) -> int:
        host = self._host(path)
        return self.memory.fs_type(path) if host is None else statfs_type(host)

    def remove(self, path: str) -> None:
        host = self._host(path, writing=True)
        if host is None:
            self.memory.remove(path)
        elif os.path.isdir(host):
            os.rmdir(host)
        else:
            os.unlink(host)
