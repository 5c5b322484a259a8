"""The QEMU command line of a VM of the qemu driver (``QemuHypervisor.argv``).

A pure function of the VM, the driver's settings and the boot's choices (accelerator, tap,
the RAM of a template, waiting for a saved state), kept apart so that a reader of the devices
a guest gets finds them in one place and tests can compare command lines without a QEMU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

from backends.runv.drivers import qemu_virtiofs
from backends.runv.drivers.base import shares_dir
from backends.runv.drivers.qemu_confine import PROXY_SOCKET, SANDBOX
from backends.runv.drivers.qemu_snapshot import GuestMemory, incoming_args, qmp_args
from backends.runv.hypervisor import MIB, VM


class Driver(Protocol):
    """What of the qemu driver (QemuHypervisor) the command line is made from."""

    qemu: str
    machine: str
    guest_memory: int
    confine: bool

    @property
    def extra_args(self) -> Sequence[str]: ...

    def mac(self, vm_id: str) -> str: ...

    def ram_bytes(self, vm: VM) -> int: ...


GUEST_SHARES = "/run/runv/shares"  # where the guest mounts the VM's export
TCG_TB_MIB = 64  # QEMU's translation cache under TCG

# Kernel arguments: a quiet boot on the serial console, no probing for hardware a VM
# without defaults does not have, and a panic (init died) ends QEMU (-no-reboot).
KERNEL_ARGS = [
    "console=ttyS0",
    "quiet",
    "panic=-1",
    "reboot=t",
    "i8042.noaux",
    "i8042.nomux",
    "i8042.nopnp",
    "i8042.dumbkbd",
    "8250.nr_uarts=1",
    "cryptomgr.notests",
    "random.trust_cpu=on",
    "mitigations=off",
    "tsc=reliable",
    "no_timer_check",
    "rcupdate.rcu_expedited=1",
]


def size_mib(memory: int) -> int:
    return max(1, memory // MIB)


def command_line(
    hv: Driver,
    vm: VM,
    kernel: str,
    initrd: str,
    accel: str,
    tap: str,
    fail_boot: bool = False,
    memory: GuestMemory | None = None,
    incoming: bool = False,
) -> list[str]:
    """The QEMU command line of ``vm``: its guest's RAM in ``memory`` (else QEMU's own, or a
    shared memfd for virtio-fs), waiting for a saved state if ``incoming``."""
    sd = vm.state_dir
    size = size_mib(hv.ram_bytes(vm))
    virtiofs = qemu_virtiofs.marked(vm)  # as the driver's _prepare chose
    append = [*KERNEL_ARGS, f"runv.shares={GUEST_SHARES}", *hv.extra_args]
    append += ["runv.sharefs=virtiofs"] if virtiofs else []
    if memory:  # a template's RAM file (qemu_template.py)
        machine, ram = f"{hv.machine},memory-backend={memory.id}", ["-m", f"{size}M"]
    else:
        machine, ram = qemu_virtiofs.memory_argv(hv.machine, size, shared=virtiofs)
    if fail_boot:
        append.append("runv.fail_boot=1")
    argv = [
        hv.qemu,
        "-name",
        f"runv-{vm.id},debug-threads=on",
        "-machine",
        machine,
        "-accel",
        # TCG's translation cache bounded (QEMU's default is up to 1 GiB, charged to the VM).
        f"accel={accel}" + (f",tb-size={TCG_TB_MIB}" if accel == "tcg" else ""),
        "-cpu",
        "host" if accel == "kvm" else "max",
        "-smp",
        str(vm.vcpus),
        *ram,
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
        "-kernel",
        kernel,
        "-initrd",
        initrd,
        "-append",
        " ".join(append),
        "-chardev",
        # A restored VM's console follows the saved VM's boot (start_incoming writes it).
        f"file,id=console,path={os.path.join(sd, 'console.log')}" + (",append=on" if incoming else ""),
        "-serial",
        "chardev:console",
        "-chardev",
        f"socket,id=agent,path={vm.channel},server=on,wait=off",
        "-device",
        "virtio-serial-pci,id=vser",
        "-device",
        "virtserialport,bus=vser.0,chardev=agent,name=runv.agent",
        # A VM restored from a template gets its virtio-fs device later (qemu_template_virtiofs).
        *(([] if incoming else qemu_virtiofs.device_argv(sd)) if virtiofs else _9p_argv(vm, hv.confine)),
        "-device",
        "virtio-rng-pci",
        "-pidfile",
        os.path.join(sd, "qemu.pid"),
        *qmp_args(vm),
    ]
    if memory:
        argv += memory.args(size)
    if incoming:
        argv += incoming_args()
    if hv.confine:
        argv += ["-sandbox", SANDBOX]
    if tap:
        argv += [
            "-netdev",
            f"tap,id=net0,ifname={tap},script=no,downscript=no",
            "-device",
            f"virtio-net-pci,netdev=net0,mac={hv.mac(vm.id)},romfile=",
        ]
    return argv


def _9p_argv(vm: VM, confined: bool) -> list[str]:
    """The 9p export of the VM's shares: through the proxy helper when QEMU is confined."""
    fsdev = (
        f"proxy,id=shares,socket={os.path.join(vm.state_dir, PROXY_SOCKET)}"
        if confined
        else f"local,id=shares,path={shares_dir(vm)},security_model=passthrough,multidevs=remap"
    )
    return ["-fsdev", fsdev, "-device", "virtio-9p-pci,fsdev=shares,mount_tag=shares"]
