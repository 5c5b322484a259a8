"""Network namespaces pinned to a file, as ``ip netns`` and containerd keep theirs.

A process's namespace (``/proc/PID/ns/net``) is bind-mounted onto a file of our own. The pin keeps
the namespace alive after the process is gone, and its path names that namespace and no other: a
``/proc/PID`` path would name whatever process gets the PID next, and the CNI plugins run by a
late DEL would then delete interfaces in a stranger's namespace. Needs CAP_SYS_ADMIN.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

_MS_BIND = 0x1000
_MNT_DETACH = 0x2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_mount = _libc.mount
_mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_mount.restype = ctypes.c_int
_umount2 = _libc.umount2
_umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_umount2.restype = ctypes.c_int


def pin(pid: int, path: str) -> None:
    """Pin the network namespace of process ``pid`` at ``path`` (made, with its directory).

    A pin already at ``path`` is replaced. OSError when the process is gone or the mount is
    refused; nothing is left at ``path`` then.
    """
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    unpin(path)
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o400))
    if _mount(f"/proc/{pid}/ns/net".encode(), path.encode(), None, _MS_BIND, None) != 0:
        err = ctypes.get_errno()
        os.unlink(path)
        raise OSError(err, f"pinning the network namespace of process {pid}: {os.strerror(err)}", path)


def unpin(path: str) -> None:
    """Release the pin at ``path`` and remove the file; nothing to do when there is none."""
    # Detached: a plugin or a port-forward still holding the namespace open does not stop it.
    if _umount2(path.encode(), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):  # not a mount point (a reboot took it), or no file
            raise OSError(err, f"unpinning a network namespace: {os.strerror(err)}", path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def pins(directory: str) -> list[str]:
    """The names of the pins (and of files left where a pin was) in ``directory``."""
    try:
        return sorted(n for n in os.listdir(directory) if not n.startswith("."))
    except FileNotFoundError:
        return []
