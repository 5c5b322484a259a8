# ruff: noqa: ASYNC230, ASYNC240
# Spawning QEMU, reading its console file and writing small state files is quick and bounded;
# polling is how a VM that is not our child (one adopted after a restart) is watched.
"""The qemu driver: each pod sandbox is a QEMU virtual machine booting the guest image.

The guest is a kernel and an initramfs built from Debian packages by
``backends.runv.guest_image`` (``scripts/runv-guest``), plus a second cpio with the agent's
code appended at boot (``qemu_initrd.py``). Its ``/init`` loads the device modules, mounts
the VM's shares and becomes the agent, which serves the host on a virtio-serial port
(``runv.agent``) that QEMU exposes as a unix socket in the VM's state directory.

Devices (a ``pc`` machine with no defaults and virtio-pci devices; QEMU's ``microvm`` finds
its virtio-mmio devices only through ACPI with Debian's kernel, under which that kernel gets
no timer interrupt under TCG):

- virtio-serial: the agent channel; the console on the first serial port, kept in
  ``console.log``;
- virtio-fs (``qemu_virtiofs.py``: virtiofsd, shared guest RAM, each container's root overlay
  made on the host) or virtio-9p (``shares = "9p"``): one export per VM, its ``shares``
  directory. QEMU runs in a mount namespace of its own (a slave of the host's); a share is the
  host directory's mount tree attached under that directory there (``inject.py``, as the stub
  does), made read-only on the host side when asked, so the guest sees it at
  ``/run/runv/shares/<tag>``. The host's mount table never shows the shares, they die with
  QEMU, and nothing the guest mounts reaches the host;
- virtio-net on a tap device, joined to the veth the backend puts on the pod bridge by two
  tc redirects (``attach_interface``); on CNI (``VMSpec.own_netns``) QEMU runs in a network
  namespace of its own, makes the tap there, and the tap is joined the same way to the
  ``eth0`` the CNI plugins made in it (``join_interface``);
- virtio-rng, so that the guest's entropy is ready at once.

Acceleration: KVM when ``/dev/kvm`` opens and a VM runs on it, else TCG (full emulation:
slow, for testing). With ``accel = "auto"`` (the default) a boot that fails under KVM (QEMU
names KVM in its error, or the guest prints nothing at all before the boot timeout) is
retried under TCG, and later boots use TCG; the choice is logged (``runv.qemu.accel``).

The QEMU process runs in a cgroup of its own (usage and leftovers), in its own session, and
outlives the shim: after a restart it is found again by PID and start time and its agent by
its socket. Confined (the default), it runs as a uid of its own in a root of its own, with no
capabilities, the shares served by a sandboxed virtiofsd or the 9p proxy (``qemu_confine.py``).

Templates (``template = true``, the default): a VM starts from the saved state of a booted VM
of its shape instead of booting (``qemu_template.py``, on ``qemu_snapshot.py``; on virtio-fs
its device is plugged in after, ``qemu_template_virtiofs.py``); a VM that cannot boots cold.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import os
import shutil
import signal
import time
from collections.abc import Sequence
from typing import Any

import structlog

from backends.contract.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    UnimplementedError,
)
from backends.linux.cgroups import Cgroup, HugetlbError
from backends.runv import guest_image, host
from backends.runv.drivers import qemu_virtiofs
from backends.runv.drivers.base import ProcessVMs, check_size, process_start, shares_dir
from backends.runv.drivers.qemu_argv import GUEST_SHARES, command_line
from backends.runv.drivers.qemu_confine import CONFINE, PROXY_SOCKET, allocate_uid, confine_env
from backends.runv.drivers.qemu_initrd import agent_initrd
from backends.runv.drivers.qemu_snapshot import GuestMemory
from backends.runv.drivers.qemu_template import TEMPLATES, Templates
from backends.runv.hypervisor import MIB, VM, BootError, Fault, PodLimits, VMSpec

AGENT_INITRD_MAX = 2 * MIB  # the agent's cpio appended to the image's initramfs (about 0.5 MiB)

log = structlog.get_logger("cri-shim.runv.qemu")

READY = b"runv-agent: ready"
CONSOLE_TAIL = 800  # bytes of console quoted in a boot error


def kvm_openable() -> bool:
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


class QemuHypervisor(ProcessVMs):
    name = "qemu"
    readonly_on_host = True  # a read-only share is read-only at its source (see _share_mode)
    guest_shares = GUEST_SHARES

    def __init__(self, config: dict[str, Any]) -> None:
        # A vCPU is a host thread: overcommitted like the stub's, 8 per host CPU by default.
        super().__init__(*self.common_settings(config, "/run/cri-shim/runv-qemu", "cri-shim-runv-qemu", 8))
        # With ``criu``, the image built by ``scripts/runv-guest --criu`` (checkpoints need it).
        self.criu = bool(config.get("criu", False))
        default_guest = guest_image.DEFAULT_CRIU_OUT if self.criu else guest_image.DEFAULT_OUT
        self.guest_dir = str(config.get("guest_dir", default_guest))
        self.qemu = str(config.get("qemu", "qemu-system-x86_64"))
        self.accel_setting = str(config.get("accel", "auto"))
        if self.accel_setting not in ("auto", "kvm", "tcg"):
            raise InvalidArgumentError(f"qemu accel must be auto, kvm or tcg, not {self.accel_setting!r}")
        self.machine = str(config.get("machine", "pc"))
        self.ip = str(config.get("ip", "ip"))
        self.tc = str(config.get("tc", "tc"))
        self.unshare = str(config.get("unshare", "unshare"))
        self.extra_args = [str(a) for a in config.get("kernel_args", [])]
        # What the guest itself occupies (kernel, initramfs, agent) on top of the pod's memory.
        self.guest_memory = int(config.get("guest_memory_mib", 96)) * MIB
        # QEMU's own memory beyond the guest's RAM (its code, the emulator's translation cache
        # under TCG, device buffers): its cgroup allows the guest's RAM plus this.
        self._host_overhead = config.get("host_overhead_mib")
        # Confinement (qemu_confine.CONFINE): each QEMU as a user of its own, no capabilities, QEMU's
        # seccomp sandbox, a root of its own with only its files; shares through the 9p proxy.
        self.confine = bool(config.get("confine", True))
        self.uid_base = int(config.get("uid_base", 3_900_000_000))
        self.uid_count = int(config.get("uid_count", 65536))
        self.setpriv = str(config.get("setpriv", "setpriv"))
        self.proxy_helper = str(config.get("virtfs_proxy_helper", "/usr/lib/qemu/virtfs-proxy-helper"))
        # The shares' transport: "virtiofs", "9p", or "" (virtio-fs when virtiofsd and the guest have it).
        self.shares = qemu_virtiofs.setting(config)
        self.virtiofsd = str(config.get("virtiofsd", qemu_virtiofs.DEFAULT_VIRTIOFSD))
        self._uids: dict[str, int] = {}  # VM id -> the uid its QEMU runs as
        self._boot_timeout = config.get("boot_timeout")
        self._accel = "" if self.accel_setting == "auto" else self.accel_setting
        self._accel_known = self.accel_setting != "auto"  # "auto": after the first boot
        self._probe = asyncio.Lock()
        self._initrd = ""
        self._initrd_lock = asyncio.Lock()
        # VMs started from a saved booted VM of their shape (qemu_template.py).
        self.templates = Templates(self) if bool(config.get("template", True)) else None

    # ---- sizing
    @property
    def accel(self) -> str:
        """The acceleration boots use now (``kvm`` or ``tcg``)."""
        if not self._accel:
            self._accel = "kvm" if kvm_openable() else "tcg"
        return self._accel

    @property
    def boot_timeout(self) -> float:
        if self._boot_timeout is not None:
            return float(self._boot_timeout)
        return 20.0 if self.accel == "kvm" else 120.0

    @property
    def agent_timeout(self) -> float:
        """How long the backend waits for an agent's answer unless its config says: a create or
        an exec under TCG takes seconds, and several VMs booting at once share the CPUs."""
        return 10.0 if self.accel == "kvm" else 120.0

    def _footprint(self, vm: VM) -> tuple[int, int]:
        return vm.vcpus, self.ram_bytes(vm)

    def ram_bytes(self, vm: VM) -> int:
        """The guest's RAM: the pod's memory and the guest's own, and at least what its kernel
        needs to boot (:attr:`boot_memory`)."""
        return max(vm.memory_bytes + self.guest_memory, self.boot_memory)

    @functools.cached_property
    def boot_memory(self) -> int:
        """The least RAM the guest boots in: the kernel unpacks the initramfs (the image's and
        the agent's) while its archive is in memory too, beside the kernel's own. Measured under
        TCG with the 36.5 MiB default image: 160 MiB fails to unpack it, 176 boots; so 112 MiB
        and twice the archive, in steps of 16 MiB (192 MiB for that image, 224 with CRIU's)."""
        try:
            archive = os.path.getsize(os.path.join(self.guest_dir, "initrd.img")) + AGENT_INITRD_MAX
        except OSError:
            return 0  # no image: the boot says so (guest_files)
        step = 16 * MIB
        return -(-(112 * MIB + 2 * archive) // step) * step

    @property
    def host_overhead(self) -> int:
        """QEMU's own memory beyond the guest's RAM: 64 MiB under KVM, 192 MiB under TCG (its
        translation cache of TCG_TB_MIB, its code and buffers: a 224 MiB TCG guest running a
        container was OOM-killed at 352 MiB with the default translation cache)."""
        if self._host_overhead is not None:
            return int(self._host_overhead) * MIB
        # Until the first boot has found whether KVM works, what TCG needs: a VM sized then
        # still fits if it ends up emulated.
        return (64 if self._accel_known and self.accel == "kvm" else 192) * MIB

    @property
    def extra_memory(self) -> int:
        """The guest's own memory (kernel, initramfs, agent) and QEMU's, beyond the pod's."""
        return self.guest_memory + self.host_overhead

    def _memory_parts(self, vm: VM) -> str:
        return (
            f"{vm.memory_bytes // MIB} MiB for the pod, {self.guest_memory // MIB} MiB for the "
            f"guest's kernel and agent, {self.host_overhead // MIB} MiB for QEMU itself"
        )

    # ---- the guest image
    def guest_files(self) -> tuple[str, str]:
        kernel = os.path.join(self.guest_dir, "vmlinuz")
        initrd = os.path.join(self.guest_dir, "initrd.img")
        missing = [p for p in (kernel, initrd) if not os.path.exists(p)]
        if missing:
            raise FailedPreconditionError(
                f"the qemu driver's guest image is missing ({', '.join(missing)}): "
                f"build it with `scripts/runv-guest {'--criu ' if self.criu else ''}--out {self.guest_dir}`"
            )
        return kernel, initrd

    def _agent_initrd(self, base: str) -> str:
        """The base initramfs with the agent appended, made once per content (and looked for
        once per driver: the agent's code does not change under a running shim)."""
        if self._initrd and os.path.exists(self._initrd):
            return self._initrd
        self._initrd = agent_initrd(base, self.run_dir)
        return self._initrd

    # ---- the command line
    @staticmethod
    def tap_name(vm_id: str) -> str:
        return "rv" + hashlib.sha256(vm_id.encode()).hexdigest()[:12]

    @staticmethod
    def mac(vm_id: str) -> str:
        h = hashlib.sha256(b"mac" + vm_id.encode()).digest()
        return "52:54:" + ":".join(f"{b:02x}" for b in h[:4])

    # The QEMU command line of a VM (qemu_argv.py), a pure function of it and the settings.
    argv = command_line

    # ---- lifecycle
    async def create(self, spec: VMSpec) -> VM:
        check_size(spec)
        if spec.host_network:
            raise InvalidArgumentError(
                "a pod on the host's network cannot be a virtual machine: the qemu driver has no "
                "host-network pods (use a runv handler with the stub driver, or docker)"
            )
        kernel, base = self.guest_files()

        async def boot(vm: VM) -> None:
            initrd = await self.agent_initrd(base)
            if self.templates is not None and await self.templates.start(vm, kernel, initrd):
                return
            await self._boot(vm, kernel, initrd)

        return await self._create(spec, boot)

    async def agent_initrd(self, base: str) -> str:
        async with self._initrd_lock:  # a thread: copying tens of MiB and compiling the agent
            return await asyncio.to_thread(self._agent_initrd, base)

    async def _prepare(self, vm: VM) -> str:
        """What QEMU needs before it starts: its shares directory, its uid, its tap (the name)."""
        if len(vm.channel.encode()) > 107:
            raise InvalidArgumentError(f"VM socket path too long under {vm.state_dir}")
        os.makedirs(shares_dir(vm), exist_ok=True)
        qemu_virtiofs.mark(vm, qemu_virtiofs.choose(self.shares, self.virtiofsd, self.guest_dir))
        if self.confine:
            vm.uid = allocate_uid(self._uids, vm.id, self.uid_base, self.uid_count)
            # QEMU's own: its console, pid file and agent socket; nobody else's QEMU gets in.
            os.chown(vm.state_dir, vm.uid, vm.uid)
            os.chmod(vm.state_dir, 0o700)
        tap = self.tap_name(vm.id)
        if not vm.own_netns:  # else QEMU makes it, in its own namespace (join_interface)
            owner = ["user", str(vm.uid), "group", str(vm.uid)] if vm.uid else []
            await host.must(
                f"cannot create tap {tap}", self.ip, "tuntap", "add", "dev", tap, "mode", "tap", *owner
            )
            await host.must(f"cannot bring up tap {tap}", self.ip, "link", "set", "dev", tap, "up")
        return tap

    async def _boot(
        self, vm: VM, kernel: str, initrd: str, memory: GuestMemory | None = None, fds: Sequence[int] = ()
    ) -> None:
        """Boot ``vm`` from its kernel: its guest's RAM in ``memory`` (QEMU's descriptors ``fds``)."""
        tap = await self._prepare(vm)
        cg = self._cgroup(vm)
        fail = Fault.BOOT_FAILURE in self._faults
        self._faults.discard(Fault.BOOT_FAILURE)
        if self._accel_known:
            await self._spawn(vm, self.argv(vm, kernel, initrd, self.accel, tap, fail, memory), cg, fds)
        else:
            # The first boot finds out whether KVM works; the others wait for the answer.
            async with self._probe:
                await self._boot_probing(vm, kernel, initrd, tap, fail, cg, memory, fds)
        log.info("runv.qemu.booted", vm=vm.id, accel=self._accel, pid=vm.pid)

    async def start_incoming(
        self,
        vm: VM,
        kernel: str,
        initrd: str,
        accel: str,
        memory: GuestMemory | None,
        fds: Sequence[int],
        console: bytes = b"",
        prefix: Sequence[str] = (),
    ) -> None:
        """Start ``vm``'s QEMU waiting for a saved state (``qemu_snapshot.restore`` gives it one);
        its console begins with ``console`` (the saved VM's); ``prefix`` runs first, in its cgroup."""
        tap = await self._prepare(vm)
        path = os.path.join(vm.state_dir, "console.log")
        with open(path, "wb") as fh:
            fh.write(console)
        if vm.uid:
            os.chown(path, vm.uid, vm.uid)
        argv = self.argv(vm, kernel, initrd, accel, tap, memory=memory, incoming=True)
        self._start(vm, argv, self._cgroup(vm), fds, prefix)

    async def unstart(self, vm: VM) -> None:
        """Undo ``start_incoming`` (or a boot), the VM's record, cgroup and state kept: QEMU,
        its tap, its files; the VM can then boot again."""
        await self._kill(vm)
        vm.pid = vm.started_at = 0
        self._uids.pop(vm.id, None)
        if os.path.exists(f"/sys/class/net/{self.tap_name(vm.id)}"):
            await host.run(self.ip, "link", "del", "dev", self.tap_name(vm.id))
        for name in ("console.log", "qemu.log", "qemu.pid", "agent.sock", "qmp.sock", PROXY_SOCKET):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(vm.state_dir, name))

    async def _boot_probing(
        self,
        vm: VM,
        kernel: str,
        initrd: str,
        tap: str,
        fail: bool,
        cg: Cgroup,
        memory: GuestMemory | None,
        fds: Sequence[int],
    ) -> None:
        accel = self.accel
        try:
            await self._spawn(vm, self.argv(vm, kernel, initrd, accel, tap, fail, memory), cg, fds)
        except (BootError, DeadlineExceededError) as exc:
            if accel != "kvm":
                raise
            if isinstance(exc, BootError):
                qemu_said = _read_tail(os.path.join(vm.state_dir, "qemu.log"), 4000).lower()
                if b"kvm" not in qemu_said:
                    raise  # the guest failed, not the accelerator
                # A /dev/kvm that opens but cannot run a guest ("KVM internal error"): emulate.
                reason = f"KVM failed: {str(exc)[-300:]}"
            elif self.console(vm).strip():
                raise  # the guest ran (it printed) and did not come up: not the accelerator
            else:
                # A /dev/kvm that runs a VM which never prints a byte (seen under nested
                # virtualization): a guest that boots in 1-3 s under KVM said nothing at all.
                reason = f"nothing on the console under KVM in {self.boot_timeout:g}s"
            log.warning("runv.qemu.accel", accel="tcg", reason=reason)
            self._accel = "tcg"
            await self._kill(vm)
            # QEMU needs more of its own under TCG (host_overhead): its cgroup grows to that,
            # if the pod's allows it.
            self._fit(vm, cg)
            cg.set_limits(vm.vcpus, self._host_memory(vm))
            for name in ("console.log", "qemu.log"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(vm.state_dir, name))
            await self._spawn(vm, self.argv(vm, kernel, initrd, "tcg", tap, fail, memory), cg, fds)
        self._accel_known = True

    async def _spawn(self, vm: VM, argv: list[str], cg: Cgroup, fds: Sequence[int] = ()) -> None:
        self._start(vm, argv, cg, fds)
        await self._booted(vm)

    def _start(
        self, vm: VM, argv: list[str], cg: Cgroup, fds: Sequence[int] = (), prefix: Sequence[str] = ()
    ) -> None:
        log_path = os.path.join(vm.state_dir, "qemu.log")
        # QEMU gets a mount namespace of its own (a slave of the host's) where the shares are
        # mounted, so they never show in the host's mount table and die with it.
        # With own_netns, a network namespace too: its tap is then made there (-netdev tap).
        net = ["--net"] if vm.own_netns else []
        env = dict(os.environ)
        virtiofs = qemu_virtiofs.marked(vm)
        env.update(RUNV_STATE=vm.state_dir, RUNV_VIRTIOFSD=self.virtiofsd if virtiofs else "")
        if self.confine:
            tap = self.tap_name(vm.id) if vm.own_netns else ""
            env.update(confine_env(vm, argv, tap, self.proxy_helper, self.setpriv, self.ip))
            argv = ["sh", "-c", CONFINE, "runv-confine", *argv]
        elif virtiofs:  # virtiofsd first, in QEMU's namespaces
            argv = ["sh", "-c", qemu_virtiofs.PRELUDE, "runv-virtiofs", *argv]
        argv = [*prefix, self.unshare, "--mount", *net, "--propagation", "slave", *argv]
        self._spawn_in_cgroup(vm, argv, cg, log_path, env, fds)

    async def _booted(self, vm: VM) -> None:
        """Return when the guest's agent says it is ready on the console (raises if it dies or
        does not in time)."""
        console = os.path.join(vm.state_dir, "console.log")
        log_path = os.path.join(vm.state_dir, "qemu.log")
        deadline = time.monotonic() + self.boot_timeout
        seen = 0
        while True:
            text = _read_tail(console, 1 << 16)
            if READY in text:
                return
            if not self.alive(vm):
                why = _read_tail(log_path, 2000).decode(errors="replace").strip()
                raise BootError(
                    f"VM {vm.id} exited during boot: {why} {console_summary(self.console(vm))}".strip()
                )
            if time.monotonic() > deadline:
                raise DeadlineExceededError(
                    f"VM {vm.id}: the agent did not come up within {self.boot_timeout:g}s "
                    f"({self._accel}); console: {console_summary(self.console(vm))}"
                )
            seen += 1
            await asyncio.sleep(0.02 if seen < 50 else 0.1)

    async def adopt(self, vm: VM) -> bool:
        if not await super().adopt(vm):
            return False
        if vm.uid:
            self._uids[vm.id] = vm.uid
        return True

    async def stop(self, vm: VM, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wait(vm), timeout)
        await self.destroy(vm)

    async def _kill(self, vm: VM) -> None:
        if self.alive(vm):
            with contextlib.suppress(ProcessLookupError):
                os.kill(vm.pid, signal.SIGKILL)
            await self.wait(vm)
        for pid in set(self._cgroup(vm).pids()):  # its virtiofsd or 9p proxy, if still there
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    async def destroy(self, vm: VM) -> None:
        await self._kill(vm)  # its mount namespace, and the shares in it, go with it
        self._uids.pop(vm.id, None)
        if os.path.exists(f"/sys/class/net/{self.tap_name(vm.id)}"):
            await host.run(self.ip, "link", "del", "dev", self.tap_name(vm.id))
        await self._release(vm)

    def leftovers(self, known: set[str]) -> list[VM]:
        out: list[VM] = []
        if not os.path.isdir(self.run_dir):
            return out
        if self.templates is not None:
            self.templates.forget_stale()  # a killed shim's: their RAM went with it
        for entry in sorted(os.listdir(self.run_dir)):
            sd = os.path.join(self.run_dir, entry)
            if entry in known or entry == TEMPLATES or not os.path.isdir(sd):
                continue
            cgroup = self._leftover_cgroup(sd, entry).rel
            vm = VM(entry, self.name, 0, 0, 0, sd, os.path.join(sd, "agent.sock"), cgroup=cgroup)
            try:
                with open(os.path.join(sd, "qemu.pid")) as fh:
                    pid = int(fh.read().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and _is_qemu_of(pid, sd):
                vm.pid, vm.started_at = pid, process_start(pid)
            out.append(vm)
        return out

    async def close(self) -> None:
        if self.templates is not None:
            self.templates.close()
        await super().close()

    def tidy(self) -> None:
        self._tidy_cgroups()
        if os.path.isdir(self.run_dir) and not any(
            os.path.isdir(os.path.join(self.run_dir, e)) for e in os.listdir(self.run_dir)
        ):
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # ---- resources: a running VM keeps the vCPUs and memory it booted with
    async def set_vcpus(self, vm: VM, vcpus: int) -> None:
        if vcpus > vm.vcpus:
            raise FailedPreconditionError(
                f"VM {vm.id} booted with {vm.vcpus} vCPUs; the qemu driver cannot add vCPUs to a running VM"
            )

    async def set_memory(self, vm: VM, memory_bytes: int) -> None:
        if memory_bytes > vm.memory_bytes:
            raise FailedPreconditionError(
                f"VM {vm.id} booted with {vm.memory_bytes // MIB} MiB; the qemu driver cannot add "
                "memory to a running VM"
            )

    async def set_pod_limits(self, vm: VM, limits: PodLimits) -> None:
        """The guest keeps the vCPUs and memory it booted with (no hot-plug, no balloon): a pod
        that needs more vCPUs, or another memory size, is refused. Fewer vCPUs, CPU shares and a
        cpuset go to QEMU's cgroup, where they bound the whole VM. QEMU's memory limit stays what
        it booted with: the guest's RAM, the guest's own and QEMU's (``_host_memory``)."""
        if limits.vcpus > vm.vcpus:
            raise FailedPreconditionError(
                f"VM {vm.id} booted with {vm.vcpus} vCPUs; the qemu driver cannot give a running VM "
                f"the {limits.vcpus} the pod now needs"
            )
        if limits.memory_bytes != vm.memory_bytes:
            raise FailedPreconditionError(
                f"VM {vm.id} booted with {vm.memory_bytes // MIB} MiB; the qemu driver cannot "
                f"{'add memory to' if limits.memory_bytes > vm.memory_bytes else 'take memory back from'} "
                f"a running VM ({limits.memory_bytes // MIB} MiB asked)"
            )
        try:
            self._cgroup(vm).resize(
                limits.vcpus, None, limits.cpu_shares, limits.cpuset_cpus, limits.cpuset_mems
            )
        except (OSError, HugetlbError) as exc:
            raise FailedPreconditionError(
                f"VM {vm.id}: QEMU's cgroup refused the pod's limits: {exc}"
            ) from exc

    # ---- shares: under the VM's export, attached in QEMU's mount namespace
    def _guest_path(self, vm: VM, tag: str) -> str:
        return f"{GUEST_SHARES}/{tag}"

    async def attach_rootfs(self, vm: VM, tag: str, lowers: list[str], upper: str, work: str) -> str | None:
        """A container's root overlay (or with ``upper`` "" an image volume's, read-only) made on
        the host and shared merged (virtio-fs; its guest path), or None: the guest stacks the
        layers itself (9p)."""
        if not qemu_virtiofs.marked(vm):
            return None
        guest = self._guest_path(vm, tag)
        return await qemu_virtiofs.attach_rootfs(self, vm, tag, lowers, upper, work, guest)

    def _share_mode(self, readonly: bool, bidirectional: bool) -> list[str]:
        if bidirectional:
            # Over 9p or virtio-fs alike: a guest's mount is the guest kernel's, which no host
            # file server can pass back.
            raise UnimplementedError(
                "a BIDIRECTIONAL mount cannot reach the host from inside a virtual machine (qemu driver)"
            )
        # Read-only on the host side: the guest's kernel is not trusted to keep it.
        return ["ro"] if readonly else []

    async def attach_device(self, vm: VM, host_path: str) -> str:
        raise UnimplementedError(f"the qemu driver passes no host device through ({host_path})")

    async def detach_device(self, vm: VM, host_path: str) -> None:
        vm.devices.pop(host_path, None)

    # ---- network: an interface and the VM's tap, joined by two redirects (Kata's "tcfilter")
    async def attach_interface(self, vm: VM, host_ifname: str) -> str:
        if not self.alive(vm):
            raise BootError(f"VM {vm.id} is not running")
        mtu = _read_text(f"/sys/class/net/{host_ifname}/mtu")
        await self._redirect([], host_ifname, self.tap_name(vm.id), mtu)
        return "eth0"

    async def join_interface(self, vm: VM, netns: str, ifname: str) -> str:
        if not vm.own_netns:
            raise InvalidArgumentError(f"VM {vm.id} runs in the host's network namespace: nothing to join")
        if not self.alive(vm):
            raise BootError(f"VM {vm.id} is not running")
        inside = ["nsenter", f"--net={netns}"]
        argv = (*inside, self.ip, "-j", "link", "show", ifname)
        out = await host.must(f"cannot read {ifname} in {netns}", *argv)
        try:
            mtu = str(json.loads(out)[0]["mtu"])
        except (ValueError, LookupError, TypeError):
            raise InternalError(f"unreadable `ip -j link show {ifname}` in {netns}: {out[:200]}") from None
        await self._redirect(inside, ifname, self.tap_name(vm.id), mtu)
        return "eth0"

    async def _redirect(self, inside: list[str], ifname: str, tap: str, mtu: str) -> None:
        """Every frame from ``ifname`` to ``tap`` and back, both up and ``tap`` of ``ifname``'s
        MTU; ``inside`` prefixes each command (the namespace they are in)."""
        ip, tc = [*inside, self.ip], [*inside, self.tc]
        if mtu:
            await host.must(f"cannot set the MTU of {tap}", *ip, "link", "set", "dev", tap, "mtu", mtu)
        for dev in (tap, ifname):
            await host.must(f"cannot bring up {dev}", *ip, "link", "set", "dev", dev, "up")
        for src, dst in ((ifname, tap), (tap, ifname)):
            await host.run(*tc, "qdisc", "del", "dev", src, "ingress")
            await host.must(f"cannot redirect {src}", *tc, "qdisc", "add", "dev", src, "ingress")
            await host.must(
                f"cannot redirect {src} to {dst}",
                *(*tc, "filter", "add", "dev", src, "parent", "ffff:", "protocol", "all"),
                *("u32", "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", dst),
            )

    def _hang(self, vm: VM) -> None:
        # The whole VM paused (vCPUs stopped): its agent answers nothing, QEMU lives.
        with contextlib.suppress(ProcessLookupError):
            os.kill(vm.pid, signal.SIGSTOP)


def console_summary(text: str) -> str:
    """The lines of a console that say why a guest died: the init's own and a panic's first, else the end."""
    lines = [line.rstrip("\r") for line in text.splitlines()]
    picked = [line for line in lines if line.startswith("runv-")]
    for i, line in enumerate(lines):
        if "Kernel panic" in line or "Out of memory" in line:
            picked += lines[max(0, i - 3) : i + 1]
            break
    out = " | ".join(picked) if picked else " | ".join(lines[-8:])
    return out[-CONSOLE_TAIL:]


def _read_tail(path: str, size: int) -> bytes:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            end = fh.tell()
            fh.seek(max(0, end - size))
            return fh.read()
    except OSError:
        return b""


def _read_text(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _is_qemu_of(pid: int, state_dir: str) -> bool:
    """Whether ``pid`` is the QEMU of ``state_dir`` (not a reused PID)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            args = fh.read().split(b"\0")
    except OSError:
        return False
    return any(state_dir.encode() in a for a in args)
