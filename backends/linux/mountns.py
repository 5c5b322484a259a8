"""Mount-namespace system calls through ctypes: join a process's namespace, make a mount read-only.

Shared by the two helpers that run as files (``python -S -I FILE``, standard library only):
``backends/runv/agent/rro.py`` in the guest and ``backends/runv/drivers/inject.py`` on the host.
Both put the package root on ``sys.path`` for this module alone; it imports nothing but ctypes
and os, and is in the guest with the rest of ``backends/linux``.
"""

from __future__ import annotations

import ctypes
import os
import sys

TYPE_CHECKING = False  # typing's, without importing typing: a helper's start stays cheap
if TYPE_CHECKING:
    from collections.abc import Callable

SYS_SETNS = 308
SYS_MOUNT_SETATTR = 442  # x86_64 and the generic table alike
CLONE_NEWNS = 0x20000
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1


class MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def check(ret: int, what: str) -> int:
    """``ret`` of a libc call, or the OSError of its errno when it is negative."""
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def enter(pid: int) -> None:
    """Join the mount namespace of process ``pid`` (this process must be single-threaded), at its /."""
    fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        check(libc.syscall(SYS_SETNS, fd, CLONE_NEWNS), "setns")
    finally:
        os.close(fd)
    os.chdir("/")


def make_readonly(path: str, flags: int, what: str) -> None:
    """mount_setattr(2): the mount at ``path`` (from the working directory) read-only; with
    AT_RECURSIVE in ``flags``, everything mounted below it too."""
    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    check(
        libc.syscall(
            SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, ctypes.byref(attr), ctypes.sizeof(attr)
        ),
        what,
    )


def exit_status(run: Callable[[list[str]], bool], argv: list[str], usage: str | None) -> int:
    """A helper's exit status for its command line: 2 (and ``usage`` on stderr) when ``run``
    finds no command in it, 1 (and the error) when the command raises OSError, else 0."""
    try:
        if not run(argv):
            print(usage, file=sys.stderr)
            return 2
    except OSError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0
