"""virtio-fs shares for the qemu driver (``[handlers.NAME.qemu] shares = "virtiofs"``).

A VM's shares directory reaches its guest over one of two transports, chosen when the VM boots
and recorded in its state directory (:data:`MARK`), so that a shim restarted with another
setting still treats a running VM as it booted:

- ``virtiofs`` (the default when it works, :func:`choose`): QEMU 7.2's C ``virtiofsd`` serves
  the shares directory on a vhost-user socket (:data:`SOCKET`), QEMU exposes it as a
  ``vhost-user-fs-pci`` device (:func:`device_argv`), and the guest's init mounts it with
  ``-t virtiofs`` (kernel argument ``runv.sharefs=virtiofs``). vhost-user maps the guest's RAM
  into virtiofsd, so the RAM is a shared memory backend (:func:`memory_argv`, the one place
  that picks the memory backend's arguments).
- ``9p``: QEMU's virtio-9p, through ``virtfs-proxy-helper`` when QEMU is confined.

virtiofsd is started as root in QEMU's mount namespace by :data:`VIRTIOFSD` (run by the
confinement script, or by :data:`PRELUDE` for an unconfined QEMU), after that namespace's
shares directory was made a shared mount: its own ``sandbox=namespace`` then gives it mount,
PID and network namespaces of its own whose root is the shares directory (``pivot_root``), a
slave of QEMU's, so every share the share helper attaches there later (``inject.py``) reaches
it too. Once QEMU connects, the process that serves the guest holds only the capabilities of
file operations (CHOWN, DAC_OVERRIDE, FOWNER, FSETID, SETUID, SETGID, MKNOD, SETFCAP), no
bounding set, ``no_new_privs`` and virtiofsd's seccomp filter; its parent, which only waits
for it, has dropped every capability. Both are in the VM's cgroup and die with QEMU (virtiofsd
ends when its vhost-user connection does).

A container's root filesystem is an overlay assembled on the host (:func:`attach_rootfs`, the
share helper's ``overlay`` request, ``inject_overlay.py``): the guest's overlayfs refuses an
upper directory on virtio-fs (FUSE), so the merged directory is what is shared, and the guest
binds it (``Rootfs(path=...)``). The overlay is never in the host's mount table: made detached
(fsopen/fsmount) and moved into QEMU's namespace.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from backends.contract.errors import InvalidArgumentError

if TYPE_CHECKING:
    from backends.runv.drivers.base import ProcessVMs
    from backends.runv.hypervisor import VM

SOCKET = "virtiofs.sock"  # virtiofsd's vhost-user socket in the VM's state directory
MARK = "shares-virtiofs"  # in the VM's state directory: its shares are virtio-fs
KINDS = ("virtiofs", "9p")
DEFAULT_VIRTIOFSD = "/usr/lib/qemu/virtiofsd"
CHARDEV = "vfs"  # QEMU's IDs of the vhost-user socket and of the device
DEVICE = "vfs0"
SLOT = "0x10"  # the device's PCI slot on pci.0 (hot-pluggable on the pc machine)

# Root, in QEMU's mount namespace (after its pivot_root when confined), with $st the state
# directory and $u QEMU's uid ("" when unconfined). The shares directory a shared mount of its
# own, so that what the share helper attaches under it later propagates into virtiofsd's
# namespace (a slave copy of this one); virtiofsd's cache=auto keeps attributes and names one
# second (a file the host changes shows within that), xattrs pass through (file
# capabilities of images), submounts are announced (each share of another file system is a
# mount of its own in the guest, with its own device and inode numbers).
VIRTIOFSD = r"""
mount --bind "$st/shares" "$st/shares"
mount --make-shared "$st/shares"
sock=$st/virtiofs.sock
rm -f "$sock"
"$RUNV_VIRTIOFSD" --socket-path="$sock" -o source="$st/shares" -o sandbox=namespace \
    -o cache=auto -o xattr -o announce_submounts -o log_level=warn &
i=0
while [ ! -S "$sock" ]; do
    i=$((i + 1))
    if [ "$i" -gt 1000 ]; then echo "runv: virtiofsd did not start" >&2; exit 98; fi
    sleep 0.01
done
if [ -n "$u" ]; then chown "$u:$u" "$sock"; chmod 0600 "$sock"; fi
"""

# An unconfined QEMU (confine = false) with virtio-fs: virtiofsd first, then QEMU ("$@").
PRELUDE = "set -eu\nst=$RUNV_STATE u=\n" + VIRTIOFSD + 'exec "$@"\n'


def setting(config: dict[str, Any]) -> str:
    """The ``shares`` key: ``virtiofs``, ``9p`` or "" (not set: virtio-fs when it works)."""
    value = str(config.get("shares", ""))
    if value not in ("", *KINDS):
        raise InvalidArgumentError(f"qemu shares must be virtiofs or 9p, not {value!r}")
    return value


def unusable(virtiofsd: str, guest_dir: str) -> str:
    """Why virtio-fs cannot be used with this virtiofsd and guest image, or ""."""
    if not os.access(virtiofsd, os.X_OK):
        return f"no virtiofsd at {virtiofsd}"
    try:
        with open(os.path.join(guest_dir, "manifest.json")) as fh:
            modules = json.load(fh).get("modules", [])
    except (OSError, ValueError, AttributeError):
        return f"no guest image manifest in {guest_dir}"
    if not any(str(m).endswith("/virtiofs.ko") for m in modules):
        return f"the guest image in {guest_dir} has no virtiofs module (rebuild it: scripts/runv-guest)"
    return ""


def choose(wanted: str, virtiofsd: str, guest_dir: str) -> str:
    """The transport of a VM booting now: ``wanted`` when set, else virtio-fs if usable."""
    if wanted == "virtiofs":
        why = unusable(virtiofsd, guest_dir)
        if why:
            raise InvalidArgumentError(f"qemu shares = virtiofs: {why}")
        return wanted
    if wanted:
        return wanted
    return "9p" if unusable(virtiofsd, guest_dir) else "virtiofs"


def mark(vm: VM, kind: str) -> None:
    """Record ``vm``'s transport in its state directory (before its boot)."""
    path = os.path.join(vm.state_dir, MARK)
    if kind == "virtiofs":
        os.makedirs(vm.state_dir, exist_ok=True)
        with open(path, "w") as fh:
            fh.write("1\n")
    elif os.path.exists(path):
        os.unlink(path)


def marked(vm: VM) -> bool:
    """Whether ``vm`` booted with virtio-fs shares."""
    return os.path.exists(os.path.join(vm.state_dir, MARK))


def memory_argv(machine: str, ram_mib: int, shared: bool) -> tuple[str, list[str]]:
    """The ``-machine`` value and the memory arguments of a guest of ``ram_mib`` MiB.

    ``shared``: its RAM a memfd mapped shared, named by the machine (vhost-user devices map the
    guest's memory into their backend: virtiofsd). Else QEMU's private anonymous RAM.
    """
    if not shared:
        return machine, ["-m", f"{ram_mib}M"]
    return f"{machine},memory-backend=ram", [
        "-m",
        f"{ram_mib}M",
        "-object",
        f"memory-backend-memfd,id=ram,size={ram_mib}M,share=on",
    ]


def device_argv(state_dir: str) -> list[str]:
    """QEMU's virtio-fs device, on virtiofsd's socket; the guest mounts tag ``shares``. Its
    ID and PCI slot fixed: a template's VM unplugs it before its state is saved and each VM
    restored from it gets it again in the same slot (``qemu_template_virtiofs.py``), the other
    devices keeping theirs."""
    return [
        "-chardev",
        f"socket,id={CHARDEV},path={os.path.join(state_dir, SOCKET)}",
        "-device",
        f"vhost-user-fs-pci,id={DEVICE},chardev={CHARDEV},tag=shares,addr={SLOT}",
    ]


async def attach_rootfs(
    hv: ProcessVMs, vm: VM, tag: str, lowers: list[str], upper: str, work: str, guest: str
) -> str:
    """A container's root filesystem as an overlay made on the host (``lowers`` top first,
    ``upper``, ``work``), attached as share ``tag`` of ``vm`` (guest path ``guest``). ``upper``
    "": an image volume, the lowers alone, read-only."""
    from backends.runv.drivers.base import _remove_target, shares_dir
    from backends.runv.hypervisor import BootError

    if not hv.alive(vm):
        raise BootError(f"VM {vm.id} is not running")
    if tag in vm.shares:
        await hv.detach_share(vm, tag)
    target = os.path.join(shares_dir(vm), tag)
    _remove_target(target)
    os.makedirs(target, exist_ok=True)
    try:
        await hv._inject("overlay", str(vm.pid), target, upper, work, *lowers)
    except BaseException:
        _remove_target(target)
        raise
    vm.shares[tag] = upper or lowers[0]
    return guest
