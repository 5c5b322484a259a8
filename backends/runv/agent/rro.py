"""Make mounts of a created container read-only with everything mounted below them (recursive read-only).

runc applies "ro" to a bind mount itself only, and the runc of this guest has no "rro"; the
kernel has done it since 5.12 with mount_setattr(AT_RECURSIVE, MOUNT_ATTR_RDONLY). The agent
runs this between `runc create` and `runc start`, while the container's init waits: it joins the
init's mount namespace (a single-threaded process is needed for that, hence a helper started as
``python -S -I rro.py``, standard library only), whose root is the container's root after
pivot_root, and sets the attribute on each destination.

    python -S -I rro.py PID DESTINATION [DESTINATION ...]
"""

from __future__ import annotations

import ctypes
import os
import sys

SYS_SETNS = 308
SYS_MOUNT_SETATTR = 442  # x86_64 and the generic table alike
CLONE_NEWNS = 0x20000
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
AT_SYMLINK_NOFOLLOW = 0x100
MOUNT_ATTR_RDONLY = 0x1


class MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _check(ret: int, what: str) -> None:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def supported() -> bool:
    """Whether this kernel has mount_setattr (ENOSYS otherwise)."""
    attr = MountAttr(0, 0, 0, 0)
    ret = _libc.syscall(SYS_MOUNT_SETATTR, -1, b"", 0, ctypes.byref(attr), ctypes.sizeof(attr))
    return not (ret < 0 and ctypes.get_errno() == 38)


def make_readonly(pid: int, destinations: list[str]) -> None:
    fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.syscall(SYS_SETNS, fd, CLONE_NEWNS), "setns")
    finally:
        os.close(fd)
    os.chdir("/")
    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    for dest in destinations:
        _check(
            _libc.syscall(
                SYS_MOUNT_SETATTR,
                AT_FDCWD,
                dest.encode(),
                AT_RECURSIVE | AT_SYMLINK_NOFOLLOW,
                ctypes.byref(attr),
                ctypes.sizeof(attr),
            ),
            f"mount_setattr {dest}",
        )


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    try:
        make_readonly(int(argv[0]), argv[1:])
    except OSError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
