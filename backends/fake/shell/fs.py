"""The container's files as the shell sees them (:class:`Fs`), and :class:`MemoryFs`, one in memory."""

from __future__ import annotations

import dataclasses
import errno
import posixpath
import stat
import sys
from collections.abc import Iterable, Mapping, Set
from typing import Protocol

OVERLAYFS_MAGIC = 0x794C7630  # statfs(2)'s f_type of a container's own root, as runtimes mount it
TMPFS_MAGIC = 0x01021994


@dataclasses.dataclass(frozen=True, slots=True)
class FileStat:
    """What stat(2) tells of a file that tools print (agnhost's mounttest): st_mode, owner, group."""

    mode: int  # file type and permission bits, as st_mode
    uid: int = 0
    gid: int = 0


class Fs(Protocol):
    """The container's filesystem as the shell sees it: absolute, normalised paths."""

    def read(self, path: str) -> bytes: ...

    def write(self, path: str, data: bytes, append: bool = False) -> None: ...

    def exists(self, path: str) -> bool: ...

    def is_dir(self, path: str) -> bool: ...

    def listdir(self, path: str) -> list[str]: ...

    def mkdir(self, path: str, parents: bool = False) -> None: ...

    def remove(self, path: str) -> None: ...

    def stat(self, path: str) -> FileStat:
        """Its mode and owners, following symbolic links; raises OSError."""
        ...

    def chmod(self, path: str, mode: int) -> None:
        """Sets its permission bits (mode & 0o7777); raises OSError."""
        ...

    def fs_type(self, path: str) -> int:
        """The f_type statfs(2) gives for the file system holding it (TMPFS_MAGIC...); raises OSError."""
        ...


def norm(path: str) -> str:
    """An absolute, normalised path; POSIX keeps a leading '//', a container does not.

    Interned: every container of a fake node holds the same few paths (/etc/hosts,
    /proc/sys/..., their parents), once each for all of them rather than once each."""
    return sys.intern("/" + posixpath.normpath(path if path.startswith("/") else "/" + path).lstrip("/"))


_SHAPES: dict[frozenset[str], frozenset[str]] = {}
_SHAPES_MAX = 256


class MemoryFs:
    """An :class:`Fs` held in a dict of file contents by path and a set of directories.

    Why: tests and simple callers need a container filesystem that never touches the host. The
    parent directories of the ``files`` given are created; paths under ``read_only`` refuse changes
    with PermissionError, as a read-only mount (a ConfigMap volume) would.
    """

    def __init__(self, files: Mapping[str, bytes | str] | None = None, read_only: Iterable[str] = ()) -> None:
        self.files: dict[str, bytes] = {}
        # Between changes, the set of every other MemoryFs with the same directories
        # (share_dirs): containers of one image have the same tree, and a set of its
        # directories each cost a fake node ~0.5 KiB a container. Copied when changed.
        self.dirs: Set[str] = {"/"}
        self.modes: dict[str, int] = {}  # permission bits set by chmod; else 0644 files, 0755 dirs
        self._read_only: tuple[str, ...] = ()
        self._writable: tuple[str, ...] = ()  # mounts of their own under a read-only path
        for path, data in (files or {}).items():
            full = norm(path)
            self.mkdir(posixpath.dirname(full), parents=True)
            self.files[full] = data.encode() if isinstance(data, str) else bytes(data)
        self._read_only = tuple(norm(p) for p in read_only)

    def share_dirs(self) -> None:
        """Hold the set of directories that another MemoryFs with the same tree holds, until
        either changes its tree (one copy for the containers of an image, not one each)."""
        shape = frozenset(self.dirs)
        kept = _SHAPES.get(shape)
        if kept is None:
            if len(_SHAPES) >= _SHAPES_MAX:
                _SHAPES.clear()  # bounded: trees are few, and one not kept is merely not shared
            kept = _SHAPES[shape] = shape
        self.dirs = kept

    def _own_dirs(self) -> set[str]:
        """The directories, as a set of this MemoryFs's own that may be changed."""
        if not isinstance(self.dirs, set):
            self.dirs = set(self.dirs)
        return self.dirs

    def read_only_root(self, writable: Iterable[str] = ()) -> None:
        """From now on the whole tree refuses changes but under ``writable`` (a read-only root file
        system, as readOnlyRootFilesystem makes it; /dev and /proc are mounts of their own)."""
        self._read_only = ("/",)
        self._writable = tuple(norm(p) for p in writable)

    def _check_writable(self, path: str) -> None:
        if any(path == top or path.startswith(top + "/") for top in self._writable):
            return
        for top in self._read_only:
            if path == top or path.startswith(top.rstrip("/") + "/"):
                raise PermissionError(errno.EROFS, "Read-only file system", path)

    def _check_parent(self, path: str) -> None:
        """Raises unless the directory of path exists, as open(O_CREAT) and mkdir do."""
        parent = posixpath.dirname(path)
        if parent in self.dirs:
            return
        if parent in self.files:
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)

    def read(self, path: str) -> bytes:
        p = norm(path)
        if p in self.dirs:
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        try:
            return self.files[p]
        except KeyError:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path) from None

    def write(self, path: str, data: bytes, append: bool = False) -> None:
        p = norm(path)
        self._check_writable(p)
        if p in self.dirs:
            raise IsADirectoryError(errno.EISDIR, "Is a directory", path)
        self._check_parent(p)
        self.files[p] = self.files.get(p, b"") + data if append else bytes(data)

    def exists(self, path: str) -> bool:
        p = norm(path)
        return p in self.files or p in self.dirs

    def is_dir(self, path: str) -> bool:
        return norm(path) in self.dirs

    def listdir(self, path: str) -> list[str]:
        p = norm(path)
        if p in self.files:
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", path)
        if p not in self.dirs:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        prefix = p.rstrip("/") + "/"
        names = {q[len(prefix) :].split("/", 1)[0] for q in (*self.files, *self.dirs) if q.startswith(prefix)}
        names.discard("")
        return sorted(names)

    def mkdir(self, path: str, parents: bool = False) -> None:
        p = norm(path)
        if p in self.dirs and parents:
            return
        self._check_writable(p)
        if p in self.dirs or p in self.files:
            raise FileExistsError(errno.EEXIST, "File exists", path)
        parent = posixpath.dirname(p)
        if parents and parent not in self.dirs and parent not in self.files:
            self.mkdir(parent, parents=True)
        self._check_parent(p)
        self._own_dirs().add(p)

    def remove(self, path: str) -> None:
        p = norm(path)
        self._check_writable(p)
        if p in self.files:
            del self.files[p]
            self.modes.pop(p, None)
            return
        if p not in self.dirs:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        if p == "/":
            raise PermissionError(errno.EBUSY, "Device or resource busy", path)
        if self.listdir(p):
            raise OSError(errno.ENOTEMPTY, "Directory not empty", path)
        self._own_dirs().remove(p)
        self.modes.pop(p, None)

    def stat(self, path: str) -> FileStat:
        p = norm(path)
        if p in self.dirs:
            return FileStat(stat.S_IFDIR | self.modes.get(p, 0o755))
        if p in self.files:
            return FileStat(stat.S_IFREG | self.modes.get(p, 0o644))
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)

    def chmod(self, path: str, mode: int) -> None:
        p = norm(path)
        self._check_writable(p)
        if p not in self.dirs and p not in self.files:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        self.modes[p] = mode & 0o7777

    def fs_type(self, path: str) -> int:
        if not self.exists(path):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        return OVERLAYFS_MAGIC
