"""Make mounts of a created container read-only with everything mounted below them (recursive read-only).

runc applies "ro" to a bind mount itself only, and the runc of this guest has no "rro"; the
kernel has done it since 5.12 with mount_setattr(AT_RECURSIVE, MOUNT_ATTR_RDONLY). The agent
runs this between `runc create` and `runc start`, while the container's init waits: it joins the
init's mount namespace (a single-threaded process is needed for that, hence a helper started as
``python -S -I rro.py``, standard library and :mod:`backends.linux.mountns` only), whose root is
the container's root after pivot_root, and sets the attribute on each destination.

    python -S -I rro.py PID DESTINATION [DESTINATION ...]
"""

from __future__ import annotations

import ctypes
import os
import sys

if not __package__:  # run as a file: the package root (for backends.linux.mountns) is three folders up
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "../../..")))

from backends.linux import mountns

AT_SYMLINK_NOFOLLOW = 0x100


def supported() -> bool:
    """Whether this kernel has mount_setattr (ENOSYS otherwise)."""
    attr = mountns.MountAttr(0, 0, 0, 0)
    ret = mountns.libc.syscall(mountns.SYS_MOUNT_SETATTR, -1, b"", 0, ctypes.byref(attr), ctypes.sizeof(attr))
    return not (ret < 0 and ctypes.get_errno() == 38)


def make_readonly(pid: int, destinations: list[str]) -> None:
    mountns.enter(pid)
    for dest in destinations:
        mountns.make_readonly(dest, mountns.AT_RECURSIVE | AT_SYMLINK_NOFOLLOW, f"mount_setattr {dest}")


def run(argv: list[str]) -> bool:
    """Carry out the command line; False when it is not one."""
    if len(argv) < 2 or not argv[0].isdigit():
        return False
    make_readonly(int(argv[0]), argv[1:])
    return True


def main(argv: list[str]) -> int:
    return mountns.exit_status(run, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
