# ruff: noqa: ASYNC240
# A stat of a state file just written is quick and bounded.
"""VM templates of the qemu driver (``[handlers.NAME.qemu] template = true``, the default).

A guest boots in ~15 s under TCG; a VM started from the saved state of one that has booted
runs in about a second. Per shape (vCPUs, memory) the driver keeps one such state:

- **Made** on the first VM of its shape: a VM booted for no pod, its guest's RAM a shared
  mapping of a memfd the driver holds (``share=on``); its agent unmounts the shares
  (``before_save``: QEMU will not migrate a VM with a 9p export mounted), then it is stopped
  and saved (:func:`qemu_snapshot.save` with ``ignore_shared``: the stream holds the devices'
  state only, a few MiB, in ``<run_dir>/templates/<key>.state``) and its QEMU ends. The memfd
  is then sealed against writes.
- **Used** by every later VM of the shape: QEMU starts with ``-incoming defer``, its RAM a
  private (copy-on-write) mapping of that memfd, inherited as its descriptor 3 and opened as
  ``/proc/self/fd/3`` (a confined QEMU has no other way at it, and none can write to it: the
  one copy in the page cache is every such VM's RAM until it writes a page); the state is
  loaded (:func:`qemu_snapshot.restore`), and the guest's agent makes the VM its own
  (``restored``: fresh entropy and reseeded generators, the clock, the VM's MAC, its shares
  mounted). The backend then connects to the agent as after a cold boot (hostname, IP).
- **On virtio-fs** (``qemu_template_virtiofs.py``): the template's VM is saved without its
  ``vhost-user-fs-pci`` device (unplugged after the unmount: QEMU 7.2 cannot migrate it), and
  each VM restored from it gets the device hot-plugged after the restore, its own virtiofsd
  started as for a cold boot, and RAM of its own: a copy of the template's memfd, mapped
  shared (vhost-user maps it into virtiofsd), made in the VM's cgroup before QEMU runs.
- **Keyed** by what the saved guest is made of: the kernel, the base initramfs, the agent's
  initramfs (named after its content), the QEMU binary, the VM's size and the command line's
  settings, and the shares' transport. A shape's template of another key (a rebuilt guest
  image, another agent) is dropped and made again; one of another accelerator too.
- **Failing** to make or restore one is never a failed VM: the VM boots cold, with a log
  line (``runv.qemu.template_fallback``), and its shape has no template for ``RETRY`` s.
- **Lifetime**: the memfds live in the shim. A clean stop (``close``) drops them and the state
  files; a SIGKILL takes the memfds with it and the next start removes the state files left
  (``forget_stale``, from the driver's ``leftovers``); a template VM caught half-made is a
  leftover VM like any other.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import structlog

from backends.runv.agent.client import AgentClient
from backends.runv.agent.messages import R, Request
from backends.runv.agent.snapshot import RestoredRequest, SaveRequest
from backends.runv.drivers import qemu_argv, qemu_snapshot, qemu_template_virtiofs, qemu_virtiofs
from backends.runv.drivers.qemu_snapshot import GuestMemory
from backends.runv.hypervisor import VM, BootError, Fault, VMSpec


class Driver(qemu_argv.Driver, Protocol):
    """What of the qemu driver (QemuHypervisor) templates use."""

    run_dir: str
    guest_dir: str
    guest_shares: str
    shares: str
    virtiofsd: str
    _faults: set[Fault]

    @property
    def accel(self) -> str: ...

    @property
    def boot_timeout(self) -> float: ...

    @property
    def agent_timeout(self) -> float: ...

    async def _create(self, spec: VMSpec, boot: Callable[[VM], Awaitable[None]]) -> VM: ...

    async def _boot(
        self, vm: VM, kernel: str, initrd: str, memory: GuestMemory | None = None, fds: Sequence[int] = ()
    ) -> None: ...

    async def start_incoming(
        self,
        vm: VM,
        kernel: str,
        initrd: str,
        accel: str,
        memory: GuestMemory,
        fds: Sequence[int],
        console: bytes,
        prefix: Sequence[str] = (),
    ) -> None: ...

    async def unstart(self, vm: VM) -> None: ...

    def alive(self, vm: VM) -> bool: ...

    def console(self, vm: VM) -> str: ...

    async def connect(self, vm: VM) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]: ...

    async def destroy(self, vm: VM) -> None: ...


log = structlog.get_logger("cri-shim.runv.qemu")

TEMPLATES = "templates"  # under the driver's run_dir: the templates' state files
RETRY = 300.0  # seconds a shape boots cold after its template failed
RAM_FD = 3  # the memfd, as QEMU inherits it
SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
CONSOLE_KEPT = 16384  # bytes of the saved VM's console each restored VM's begins with
RESTORED_TIMEOUT = 30.0  # for the agent of a restored VM to answer (it is running by then)

Shape = tuple[int, int]  # vCPUs, memory bytes


@dataclasses.dataclass(eq=False)
class Template:
    key: str
    accel: str
    sharefs: str  # the VMs' shares: "9p" or "virtiofs" (saved without its device)
    memory_fd: int  # the saved guest's RAM, sealed
    state: str  # the saved devices' state
    console: bytes = b""  # the saved VM's boot, the start of every restored VM's console
    users: int = 0  # VMs being started from it now: its memfd stays open until they have it
    dropped: bool = False

    def close_if_unused(self) -> None:
        if self.dropped and self.users == 0 and self.memory_fd >= 0:
            os.close(self.memory_fd)
            self.memory_fd = -1


class Templates:
    """The templates of one qemu driver, one per shape."""

    def __init__(self, hv: Driver) -> None:
        self._hv = hv
        self._ready: dict[Shape, Template] = {}
        self._locks: dict[Shape, asyncio.Lock] = {}
        self._failed: dict[Shape, float] = {}  # shape -> until when it boots cold
        # What happened so far (tests, the bench): templates made, VMs restored, cold fallbacks.
        self.made = 0
        self.restored = 0
        self.fallbacks = 0

    @property
    def dir(self) -> str:
        return os.path.join(self._hv.run_dir, TEMPLATES)

    def key(self, vm: VM, kernel: str, initrd: str, sharefs: str) -> str:
        """What a template of ``vm``'s shape on ``sharefs`` is made of, as a digest."""
        hv = self._hv
        base = os.path.join(hv.guest_dir, "initrd.img")
        binary = shutil.which(hv.qemu) or hv.qemu
        parts: list[Any] = [
            [(os.path.basename(p), _stat(p)) for p in (kernel, base, initrd, binary)],
            [vm.vcpus, vm.memory_bytes, hv.guest_memory, hv.machine, hv.confine, hv.extra_args],
            sharefs,
        ]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]

    def state_files(self) -> list[str]:
        return sorted(os.listdir(self.dir)) if os.path.isdir(self.dir) else []

    # ---- a VM from its shape's template
    async def start(self, vm: VM, kernel: str, initrd: str) -> bool:
        """Start ``vm`` from its shape's template, made first if there is none: True when it
        runs as its own; False when it is to boot cold (nothing of the attempt is left)."""
        hv = self._hv
        shape = (vm.vcpus, vm.memory_bytes)
        if Fault.BOOT_FAILURE in hv._faults:
            return False  # an injected boot failure is the cold boot's
        if time.monotonic() < self._failed.get(shape, 0.0):
            return False
        sharefs = qemu_virtiofs.choose(hv.shares, hv.virtiofsd, hv.guest_dir)
        tpl = await self._template(shape, self.key(vm, kernel, initrd, sharefs), kernel, initrd)
        if tpl is None:
            return False
        tpl.users += 1
        try:
            t0 = time.monotonic()
            phases = await self._restore(vm, kernel, initrd, tpl)
        except Exception as exc:
            log.warning(
                "runv.qemu.template_fallback",
                vm=vm.id,
                template=tpl.key,
                reason="the template could not be restored: booting cold",
                error=str(exc)[-500:],
            )
            self.fallbacks += 1
            self._failed[shape] = time.monotonic() + RETRY
            self._drop(shape, tpl)
            await hv.unstart(vm)
            return False
        finally:
            tpl.users -= 1
            tpl.close_if_unused()
        self.restored += 1
        log.info(
            "runv.qemu.restored",
            vm=vm.id,
            template=tpl.key,
            pid=vm.pid,
            seconds=round(time.monotonic() - t0, 3),
            **phases,
        )
        return True

    async def _restore(self, vm: VM, kernel: str, initrd: str, tpl: Template) -> dict[str, float]:
        """Start ``vm`` from ``tpl``: the seconds each step took (for the log)."""
        hv = self._hv
        phases: dict[str, float] = {}
        t = time.monotonic()

        def step(name: str) -> None:
            nonlocal t
            now = time.monotonic()
            phases[name] = round(now - t, 3)
            t = now

        console = tpl.console + f"runv: restored from template {tpl.key}\n".encode()
        if tpl.sharefs == "virtiofs":
            # RAM of its own, shared with its virtiofsd: a copy of the template's, made in its
            # cgroup before QEMU runs (qemu_template_virtiofs).
            own = qemu_template_virtiofs.fresh_ram(tpl.memory_fd, vm.id)
            try:
                memory = GuestMemory(f"/proc/self/fd/{qemu_template_virtiofs.FRESH_FD}", share=True)
                prefix = qemu_template_virtiofs.ram_copy_argv()
                await hv.start_incoming(
                    vm, kernel, initrd, tpl.accel, memory, [own, tpl.memory_fd], console, prefix
                )
            finally:
                os.close(own)  # QEMU has it
        else:
            memory = GuestMemory(f"/proc/self/fd/{RAM_FD}", share=False)
            await hv.start_incoming(vm, kernel, initrd, tpl.accel, memory, [tpl.memory_fd], console)
        step("start")
        await qemu_snapshot.restore(vm, tpl.state, ignore_shared=True, timeout=hv.boot_timeout)
        step("load")  # with a RAM copy (virtio-fs): QEMU's QMP socket appears once it is made
        if tpl.sharefs == "virtiofs":
            await qemu_template_virtiofs.hotplug(vm, hv.boot_timeout)
            step("hotplug")
        identity = RestoredRequest(
            entropy=base64.b64encode(os.urandom(64)).decode(),
            time_ns=time.time_ns(),
            mac=hv.mac(vm.id),
            shares=hv.guest_shares,
            sharefs=tpl.sharefs,
        )
        await self._call(vm, identity, min(hv.agent_timeout, RESTORED_TIMEOUT))
        step("agent")  # with the shares mounted (on virtio-fs: once the guest found the device)
        return phases

    async def _call(self, vm: VM, req: Request[R], timeout: float) -> R:
        """One request to ``vm``'s agent on a connection of its own."""
        if not self._hv.alive(vm):
            raise BootError(f"VM {vm.id} is not running: {self._hv.console(vm)[-300:]}")
        try:
            reader, writer = await self._hv.connect(vm)
        except OSError as exc:
            raise BootError(f"the agent of VM {vm.id} does not answer: {exc}") from exc
        client = AgentClient(reader, writer, lambda _name, _body: None, timeout)
        try:
            return await client.call(req)
        finally:
            await client.close()

    # ---- making one
    async def _template(self, shape: Shape, key: str, kernel: str, initrd: str) -> Template | None:
        """The shape's template of ``key``, made now if there is none (None if it cannot be)."""
        async with self._locks.setdefault(shape, asyncio.Lock()):
            tpl = self._ready.get(shape)
            if tpl is not None and (tpl.key != key or tpl.accel != self._hv.accel):
                log.info("runv.qemu.template_stale", template=tpl.key, new=key, vcpus=shape[0])
                self._drop(shape, tpl)
                tpl = None
            if tpl is not None:
                return tpl
            if time.monotonic() < self._failed.get(shape, 0.0):
                return None
            try:
                tpl = await self._make(shape, key, kernel, initrd)
            except Exception as exc:
                log.warning(
                    "runv.qemu.template_fallback",
                    template=key,
                    reason="the template could not be made: booting cold",
                    error=str(exc)[-500:],
                )
                self.fallbacks += 1
                self._failed[shape] = time.monotonic() + RETRY
                return None
            self._ready[shape] = tpl
            return tpl

    async def _make(self, shape: Shape, key: str, kernel: str, initrd: str) -> Template:
        hv = self._hv
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        state = os.path.join(self.dir, f"{key}.state")
        fd = os.memfd_create(f"runv-template-{key[:12]}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        t0 = time.monotonic()
        console = b""

        sharefs = ""

        async def boot(vm: VM) -> None:
            nonlocal console, sharefs
            memory = GuestMemory(f"/proc/self/fd/{RAM_FD}", share=True)
            await hv._boot(vm, kernel, initrd, memory, [fd])
            console = hv.console(vm)[-CONSOLE_KEPT:].encode()
            await self._call(vm, SaveRequest(shares=hv.guest_shares), hv.agent_timeout)
            sharefs = "virtiofs" if qemu_virtiofs.marked(vm) else "9p"
            if sharefs == "virtiofs":  # QEMU 7.2 cannot save a vhost-user-fs device
                await qemu_template_virtiofs.unplug(vm)
            await qemu_snapshot.save(vm, state, resume=False, ignore_shared=True, timeout=hv.boot_timeout)

        try:
            vm = await hv._create(VMSpec("t" + key[:15], *shape), boot)
            await hv.destroy(vm)  # its QEMU gone, nothing maps the memfd shared any more
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(state)
            if not self._ready:
                with contextlib.suppress(OSError):
                    os.rmdir(self.dir)
            raise
        self.made += 1
        log.info(
            "runv.qemu.template_made",
            template=key,
            vcpus=shape[0],
            memory=shape[1],
            seconds=round(time.monotonic() - t0, 3),
            sharefs=sharefs,
            state_bytes=os.path.getsize(state),
            ram_bytes=os.fstat(fd).st_size,
        )
        return Template(key, hv.accel, sharefs, fd, state, console)

    # ---- dropping them
    def _drop(self, shape: Shape, tpl: Template) -> None:
        if self._ready.get(shape) is tpl:
            del self._ready[shape]
        tpl.dropped = True
        with contextlib.suppress(OSError):
            os.unlink(tpl.state)
        tpl.close_if_unused()

    def close(self) -> None:
        """Drop every template (a clean stop)."""
        for shape, tpl in list(self._ready.items()):
            self._drop(shape, tpl)
        shutil.rmtree(self.dir, ignore_errors=True)

    def forget_stale(self) -> None:
        """Remove the state files of no template of this driver (a killed shim's)."""
        live = {os.path.basename(t.state) for t in self._ready.values()}
        for name in self.state_files():
            if name not in live:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.dir, name))
        if not live:
            with contextlib.suppress(OSError):
                os.rmdir(self.dir)


def _stat(path: str) -> list[int]:
    try:
        st = os.stat(path)
    except OSError:
        return [0, 0]
    return [st.st_size, st.st_mtime_ns]
