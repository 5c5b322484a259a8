"""The share helper's ``overlay`` request: a container's root overlay made on the host, attached
into a VM's mount namespace only (the qemu driver's virtio-fs shares, ``qemu_virtiofs.py``).

    ["overlay", VM_PID, TARGET, UPPER, WORK, LOWER...]     (lowers top first)

UPPER and WORK "" (an image volume): a read-only overlay of the lowers alone.

Run in the share helper's forked child (``inject.py``), as root in the host's namespaces: the
overlay is made detached (fsopen("overlay"), fsconfig, fsmount: a mount in no namespace), so it
never shows in the host's mount table, then the child joins the VM's mount namespace and
attaches it at TARGET (move_mount). Its layers are resolved here, in the host's namespace; its
copy-ups and whiteouts are made with the creator's credentials (root), whoever writes through
it later (virtiofsd, with fewer capabilities). nosuid and nodev on the host side.

A kernel without overlayfs's ``lowerdir+`` key (before 6.8: there, fsconfig takes at most 256
bytes a value, too few for a lower list) gets the overlay by mount(2) in a mount namespace of
the child's own, private, whose mount is cloned detached (open_tree) the same way.
"""

from __future__ import annotations

import ctypes
import errno
import os

from backends.linux.mountns import AT_FDCWD, check, enter, libc

SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_FSOPEN = 430
SYS_FSCONFIG = 431
SYS_FSMOUNT = 432
FSOPEN_CLOEXEC = 0x1
FSMOUNT_CLOEXEC = 0x1
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_CREATE = 6
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
OPEN_TREE_CLONE = 1
MOVE_MOUNT_F_EMPTY_PATH = 0x4
CLONE_NEWNS = 0x20000
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REC = 0x4000
MS_PRIVATE = 1 << 18


class _NoLowerdirPlus(Exception):
    """This kernel's overlayfs has no ``lowerdir+`` (or no fsopen at all)."""


def _fs_messages(fs: int) -> str:
    """What the kernel logged on the fs context (``e overlayfs: ...`` lines), for an error."""
    out = []
    while True:
        try:
            data = os.read(fs, 1024)
        except OSError:
            break
        if not data:
            break
        out.append(data.decode(errors="replace").strip())
    return "; ".join(out)


def _fsconfig(fs: int, key: str, value: str) -> None:
    ret = libc.syscall(SYS_FSCONFIG, fs, FSCONFIG_SET_STRING, key.encode(), value.encode(), 0)
    if ret < 0:
        err = ctypes.get_errno()
        if key == "lowerdir+" and err == errno.EINVAL:
            raise _NoLowerdirPlus
        raise OSError(err, f"overlay {key}={value}: {os.strerror(err)} {_fs_messages(fs)}".rstrip())


def _by_fsmount(upper: str, work: str, lowers: list[str]) -> int:
    fs = libc.syscall(SYS_FSOPEN, b"overlay", FSOPEN_CLOEXEC)
    if fs < 0:
        if ctypes.get_errno() == errno.ENOSYS:
            raise _NoLowerdirPlus
        check(fs, "fsopen overlay")
    try:
        for lower in lowers:
            _fsconfig(fs, "lowerdir+", lower)
        if upper:
            _fsconfig(fs, "upperdir", upper)
            _fsconfig(fs, "workdir", work)
        if libc.syscall(SYS_FSCONFIG, fs, FSCONFIG_CMD_CREATE, None, None, 0) < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"overlay: {os.strerror(err)} {_fs_messages(fs)}".rstrip())
        attrs = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | (0 if upper else MOUNT_ATTR_RDONLY)
        return check(libc.syscall(SYS_FSMOUNT, fs, FSMOUNT_CLOEXEC, attrs), "fsmount overlay")
    finally:
        os.close(fs)


def _by_private_mount(upper: str, work: str, lowers: list[str], at: str) -> int:
    """mount(2) at ``at`` in a private mount namespace of this process, cloned detached."""
    check(libc.unshare(CLONE_NEWNS), "unshare")
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "make-rprivate /")
    # Lowers relative to their common directory: mount(2) takes one page of options.
    base = os.path.commonpath(lowers) if len(lowers) > 1 else os.path.dirname(lowers[0])
    os.chdir(base)
    rel = ":".join(os.path.relpath(lower, base) for lower in lowers)
    data = f"lowerdir={rel}" + (f",upperdir={upper},workdir={work}" if upper else "")
    flags = MS_NOSUID | MS_NODEV | (0 if upper else MS_RDONLY)
    check(libc.mount(b"overlay", at.encode(), b"overlay", flags, data.encode()), "mount overlay")
    os.chdir("/")
    return check(
        libc.syscall(SYS_OPEN_TREE, AT_FDCWD, at.encode(), OPEN_TREE_CLONE | os.O_CLOEXEC), f"open_tree {at}"
    )


def attach(pid: int, target: str, upper: str, work: str, lowers: list[str]) -> None:
    """The overlay of ``lowers`` (top first), ``upper`` and ``work``, attached at ``target`` in
    the mount namespace of process ``pid``. A process of its own (it may unshare)."""
    paths = (target, *lowers, *((upper, work) if upper or work else ()))
    if not lowers or any(not os.path.isabs(p) for p in paths):
        raise OSError(errno.EINVAL, "overlay: absolute paths and at least one lower layer")
    try:
        tree = _by_fsmount(upper, work, lowers)
    except _NoLowerdirPlus:
        tree = _by_private_mount(upper, work, lowers, target)
    enter(pid)
    check(
        libc.syscall(SYS_MOVE_MOUNT, tree, b"", AT_FDCWD, target.encode(), MOVE_MOUNT_F_EMPTY_PATH),
        f"move_mount {target}",
    )


def run(argv: list[str]) -> bool:
    """``["overlay", PID, TARGET, UPPER, WORK, LOWER...]``; False when it is not that."""
    if argv[:1] != ["overlay"] or len(argv) < 6:
        return False
    attach(int(argv[1]), argv[2], argv[3], argv[4], argv[5:])
    return True
