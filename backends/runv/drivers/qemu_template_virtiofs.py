"""VM templates for VMs on virtio-fs (``qemu_template.py`` with ``qemu_virtiofs.py``).

QEMU 7.2 cannot migrate a VM with a ``vhost-user-fs-pci`` device (the device is marked
unmigratable: its state is in virtiofsd), so a template on virtio-fs is saved without it and
each VM restored from it gets its own again:

- **Made**: the template's VM boots as any VM on virtio-fs (the guest's init mounts the
  shares); its agent unmounts them (``before_save``), then the device is unplugged
  (:func:`unplug`: QMP ``device_del``, the guest ejects it through ACPI PCI hot-plug, QEMU
  says ``DEVICE_DELETED``; ``chardev-remove`` of its socket, after which virtiofsd ends), and
  the VM is saved as on 9p.
- **Restored**: QEMU starts with ``-incoming`` and no virtio-fs device (``qemu_argv``), its
  virtiofsd started before it as for a cold boot (sandboxed, in QEMU's namespace, confined
  or not); once the state is loaded and the VM runs, the device is plugged in again in the
  same PCI slot (:func:`hotplug`: ``chardev-add`` of virtiofsd's socket, ``device_add``), and
  the agent mounts the ``shares`` tag when its kernel has found it (``restored`` with
  ``sharefs = "virtiofs"``).
- **RAM**: vhost-user maps the guest's RAM into virtiofsd, so it must be a shared mapping of
  a file, and a private copy-on-write mapping of the template's memfd (the 9p case) will not
  do. Each VM gets its own memfd, a copy of the template's RAM (:func:`fresh_ram`), mapped
  ``share=on``. The copy is made by :data:`RAM_COPY`, the first program QEMU's start runs,
  already in the VM's cgroup: the pages it fills are charged to the VM, not to the shim. It
  copies only the template's data extents (``SEEK_DATA``/``SEEK_HOLE``: pages the saved guest
  never touched stay holes) with ``copy_file_range``, then closes the template's memfd and
  execs the rest of the command. A VM on virtio-fs from a template therefore shares no RAM
  with the template (a 9p one shares the pages it has not written) and pays the copy: see
  bench/README.md (issue 42).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from backends.runv.drivers import qemu_snapshot, qemu_virtiofs
from backends.runv.hypervisor import VM

FRESH_FD = 3  # the VM's own RAM (a new memfd), as QEMU inherits it
TEMPLATE_FD = 4  # the template's RAM, read by RAM_COPY and closed before QEMU
# Seconds for a template's guest to eject its virtio-fs device (well under one under TCG): a
# guest without ACPI PCI hot-plug costs the first VM of its shape this much before it boots cold.
UNPLUG_TIMEOUT = 20.0

# Run as `python3 -I -S -c RAM_COPY CMD...` with the VM's memfd on descriptor 3 (sized, empty)
# and the template's on 4: the template's data extents copied into the VM's, 4 closed, CMD
# exec'd. pread/pwrite if copy_file_range cannot copy between the two.
RAM_COPY = r"""
import os, sys
src, dst = 4, 3
end = os.fstat(src).st_size
off = 0
while off < end:
    try:
        data = os.lseek(src, off, os.SEEK_DATA)
    except OSError:
        break
    hole = os.lseek(src, data, os.SEEK_HOLE)
    pos = data
    while pos < hole:
        try:
            n = os.copy_file_range(src, dst, hole - pos, pos, pos)
        except OSError:
            n = os.pwrite(dst, os.pread(src, min(hole - pos, 1 << 22), pos), pos)
        if n <= 0:
            sys.exit("runv: the template's RAM could not be copied")
        pos += n
    off = hole
os.close(src)
os.execvp(sys.argv[1], sys.argv[1:])
"""


def ram_copy_argv() -> list[str]:
    """The prefix of QEMU's command that copies the template's RAM first (see RAM_COPY)."""
    return [sys.executable, "-I", "-S", "-c", RAM_COPY]


def fresh_ram(template_fd: int, name: str) -> int:
    """A new memfd as large as the template's RAM (no pages yet): a VM's own RAM."""
    fd = os.memfd_create(f"runv-ram-{name[:16]}", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, os.fstat(template_fd).st_size)
    except BaseException:
        os.close(fd)
        raise
    return fd


async def unplug(vm: VM, timeout: float = UNPLUG_TIMEOUT) -> None:
    """Take the virtio-fs device out of ``vm`` (running, its shares unmounted): the guest
    ejects it, then its socket goes. Raises SnapshotError."""
    deadline = time.monotonic() + timeout
    async with qemu_snapshot.qmp_of(vm, timeout) as qmp:
        await qmp.execute("device_del", {"id": qemu_virtiofs.DEVICE})
        await qmp.event("DEVICE_DELETED", deadline, device=qemu_virtiofs.DEVICE)
        await qmp.execute("chardev-remove", {"id": qemu_virtiofs.CHARDEV})


def hotplug_device(vm: VM) -> dict[str, Any]:
    """``device_add``'s arguments: the device as ``qemu_virtiofs.device_argv`` has it."""
    return {
        "driver": "vhost-user-fs-pci",
        "id": qemu_virtiofs.DEVICE,
        "chardev": qemu_virtiofs.CHARDEV,
        "tag": "shares",
        "addr": qemu_virtiofs.SLOT,
    }


async def hotplug(vm: VM, timeout: float) -> None:
    """Plug ``vm``'s virtio-fs device in (QEMU connects to its virtiofsd's socket); the guest
    finds it on its own (ACPI). Raises SnapshotError."""
    sock = os.path.join(vm.state_dir, qemu_virtiofs.SOCKET)
    chardev = {"type": "unix", "data": {"path": sock}}
    async with qemu_snapshot.qmp_of(vm, timeout) as qmp:
        await qmp.execute(
            "chardev-add",
            {
                "id": qemu_virtiofs.CHARDEV,
                "backend": {"type": "socket", "data": {"addr": chardev, "server": False}},
            },
        )
        await qmp.execute("device_add", hotplug_device(vm))
