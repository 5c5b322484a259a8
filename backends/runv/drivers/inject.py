"""Put a host directory into a stub VM's mount namespace, and take it out (virtio-fs style shares).

Run as a short-lived helper process (``python -S -I inject.py``, standard library and
:mod:`backends.linux.mountns` only): joining a mount namespace needs a single-threaded process.
``attach`` clones the host directory's mount tree (open_tree, recursive) in the host namespace,
joins the VM's mount namespace and attaches the clone there (move_mount), as a recursive slave:
host mounts under a shared host directory keep reaching the guest, and nothing the guest does
propagates back. The mounts exist only in the VM, so they never pin host directories (a host
rmdir detaches them) and die with the VM.

    python -S -I inject.py attach HOST_PATH VM_PID TARGET [shared|ro]
    python -S -I inject.py detach VM_PID TARGET
    python -S -I inject.py overlay VM_PID TARGET UPPER WORK LOWER...   (inject_overlay.py)
    python -S -I inject.py serve

``serve`` takes requests as JSON lines on stdin (``["attach", HOST_PATH, VM_PID, TARGET]`` or
``["detach", VM_PID, TARGET]``) and answers each with one JSON line (``{"error": ""}`` on success):
one interpreter start for all of them instead of one each (about 20 ms of CPU). It stays single-
threaded and forks a child per request, which joins the VM's namespace and exits; it ends at the
end of its input, so it never outlives the shim that started it.
"""

from __future__ import annotations

import ctypes
import os
import sys

if not __package__:  # run as a file: the package root (for backends.linux.mountns) is three folders up
    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "../../..")))

from backends.linux.mountns import (
    AT_FDCWD,
    AT_RECURSIVE,
    MOUNT_ATTR_RDONLY,
    SYS_MOUNT_SETATTR,
    MountAttr,
    check,
    enter,
    exit_status,
    libc,
)
from backends.runv.drivers import inject_overlay

SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
OPEN_TREE_CLONE = 1
MOVE_MOUNT_F_EMPTY_PATH = 0x4
AT_EMPTY_PATH = 0x1000
MS_SLAVE = 1 << 19
MNT_DETACH = 2


def _set_attr(tree: int, flags: int, attr_set: int, propagation: int, what: str) -> None:
    """mount_setattr(2) on the detached tree ``tree`` (its top mount; AT_RECURSIVE: all of it)."""
    attr = MountAttr(attr_set, 0, propagation, 0)
    check(
        libc.syscall(
            SYS_MOUNT_SETATTR, tree, b"", AT_EMPTY_PATH | flags, ctypes.byref(attr), ctypes.sizeof(attr)
        ),
        what,
    )


def attach(host_path: str, pid: int, target: str, shared: bool = False, readonly: bool = False) -> None:
    """``shared``: left in the host mount's peer group (when the host's is shared), for a
    BIDIRECTIONAL mount: what the guest mounts under it then shows on the host. ``readonly``:
    the mount itself read-only, enforced here (a real VM's guest is not trusted with it); mounts
    under it keep their own mode, as a CRI readonly mount that is not recursive wants."""
    tree = check(
        libc.syscall(
            SYS_OPEN_TREE, AT_FDCWD, host_path.encode(), OPEN_TREE_CLONE | AT_RECURSIVE | os.O_CLOEXEC
        ),
        f"open_tree {host_path}",
    )
    # Both before the tree is attached, so that they hold for the copies a shared mount point
    # makes of it (the qemu driver's virtio-fs shares directory: virtiofsd's namespace).
    if not shared:
        _set_attr(tree, AT_RECURSIVE, 0, MS_SLAVE, f"make-rslave {host_path}")
    if readonly:  # this mount only, not recursive
        _set_attr(tree, 0, MOUNT_ATTR_RDONLY, 0, f"read-only {host_path}")
    enter(pid)
    check(
        libc.syscall(SYS_MOVE_MOUNT, tree, b"", AT_FDCWD, target.encode(), MOVE_MOUNT_F_EMPTY_PATH),
        f"move_mount {target}",
    )


def detach(pid: int, target: str) -> None:
    enter(pid)
    if libc.umount2(target.encode(), MNT_DETACH) != 0 and ctypes.get_errno() not in (22, 2):
        # EINVAL: not a mount point (already detached); ENOENT: gone.
        check(-1, f"umount {target}")


def run(argv: list[str]) -> bool:
    """Carry out one request; False when it is not one."""
    if argv[:1] == ["attach"] and (len(argv) == 4 or (len(argv) == 5 and argv[4] in ("shared", "ro"))):
        mode = argv[4] if len(argv) == 5 else ""
        attach(argv[1], int(argv[2]), argv[3], shared=mode == "shared", readonly=mode == "ro")
    elif argv[:1] == ["detach"] and len(argv) == 3:
        detach(int(argv[1]), argv[2])
    else:
        return inject_overlay.run(argv)  # ["overlay", VM_PID, TARGET, UPPER, WORK, LOWER...]
    return True


def _in_child(argv: list[str]) -> str:
    """Run one request in a forked child (the namespace it joins dies with it); its error, or ""."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            if not run(argv):
                os.write(w, f"not a request: {argv!r}".encode())
                code = 2
        except Exception as exc:  # everything goes back to the shim as text
            os.write(w, str(exc).encode(errors="replace")[:4096])
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        error = fh.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if not error and status != 0:
        error = f"helper child ended with status {status}"
    return error


def serve() -> int:
    import json

    for line in sys.stdin.buffer:
        try:
            argv = [str(a) for a in json.loads(line)]
        except (ValueError, TypeError) as exc:
            error = f"bad request line: {exc}"
        else:
            error = _in_child(argv)
        sys.stdout.write(json.dumps({"error": error}) + "\n")
        sys.stdout.flush()
    return 0


def main(argv: list[str]) -> int:
    if argv == ["serve"]:
        return serve()
    return exit_status(run, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
