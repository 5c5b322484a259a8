# ruff: noqa: ASYNC240, ASYNC110
# Spawning the VM process and touching cgroupfs/procfs files is quick and bounded;
# polling is how a VM that is not our child is watched without pidfd.
"""What the stub and qemu drivers share: a VM is one host process in a cgroup of its own.

:class:`ProcessVMs` is the driver-neutral part of both (the VM process, the node's
capacity, shares attached by the share helper :class:`Injector`); a driver says how its VM
process boots, stops and hot-plugs, and where its guest sees a share.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from backends.contract.errors import (
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    ResourceExhaustedError,
)
from backends.linux import procfs
from backends.linux.cgroups import Cgroup, cgroupfs_path
from backends.runv.hypervisor import MIB, VM, BootError, Fault, VMSpec

CONSOLE_KEPT = 1 << 20  # the end of a console a driver reads back


def _mem_total() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def process_start(pid: int) -> int:
    """Start time of a live process in clock ticks since boot (0 if gone), to detect PID reuse."""
    st = procfs.stat(pid)
    if st is None:
        return 0
    if st.state in ("Z", "X"):
        # A zombie: dead. Reap it if it is ours (a VM booted by this process before a "restart").
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return 0
    return st.start_time


async def end_helper(proc: asyncio.subprocess.Process) -> None:
    """End a helper that serves requests on its stdin: its input closes, which ends it; killed
    if it has not gone 5 s later."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        async with asyncio.timeout(5):
            await proc.wait()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


class Injector:
    """The share helper (inject.py), one long-lived process answering requests in turn.

    inject.py needs only the standard library and backends.linux.mountns: it runs as a
    file, isolated and without site packages. Started on first use, and again if it has died; it
    ends when its input does, so with the shim.
    """

    TIMEOUT = 30.0

    def __init__(self, python: str) -> None:
        self.python = python
        self.helper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inject.py")
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def call(self, argv: list[str]) -> str:
        """Run one request; its error text, "" on success."""
        async with self._lock:
            request = json.dumps(argv).encode() + b"\n"
            for attempt in (1, 2):
                proc = await self._running()
                assert proc.stdin is not None and proc.stdout is not None
                try:
                    proc.stdin.write(request)
                    await proc.stdin.drain()
                except ConnectionError:
                    # It had died since the last request: nothing was sent, so
                    # one more try on a new helper is safe.
                    await self.close()
                    if attempt == 1:
                        continue
                    return "the share helper cannot be started"
                try:
                    async with asyncio.timeout(self.TIMEOUT):
                        line = await proc.stdout.readline()
                except TimeoutError:
                    line = b""
                if line:
                    try:
                        return str(json.loads(line).get("error", ""))
                    except (ValueError, AttributeError):
                        pass
                # Died or stuck under this request: whether it was done is unknown,
                # so it is not repeated; the next request gets a new helper.
                await self.close()
                return "the share helper did not answer"
            return "the share helper cannot be started"

    async def _running(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                self.python,
                "-S",
                "-I",
                self.helper,
                "serve",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
            )
        return self._proc

    async def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            await end_helper(proc)


class ProcessVMs(abc.ABC):
    """What the stub and qemu drivers share: a VM is one host process (the unshared agent, or
    QEMU) in a cgroup and a mount namespace of its own, reserved against the node's capacity.

    Shares are host trees attached into that mount namespace by the share helper (inject.py),
    so mounts made on the host after boot are seen at attach time, host mounts under a shared
    host directory keep propagating in, and nothing pins host directories in the host's
    namespace. A file (the kubelet's /etc/hosts, /dev/termination-log) is shared on a file: a
    mount takes the kind of what it covers. Subclasses say where the guest sees a share and
    how it is attached (``_guest_path``, ``_share_mode``).
    """

    name = ""

    @staticmethod
    def common_settings(
        config: dict[str, Any], run_dir: str, cgroup_parent: str, cpu_overcommit: int
    ) -> tuple[str, str, int, int, str]:
        """The keys every driver reads, with the driver's defaults: ``__init__``'s arguments."""
        cpus = os.cpu_count() or 1
        return (
            str(config.get("run_dir", run_dir)),
            str(config.get("cgroup_parent", cgroup_parent)),
            int(config.get("capacity_vcpus", cpus * int(config.get("cpu_overcommit", cpu_overcommit)))),
            int(config.get("capacity_memory", _mem_total())),
            str(config.get("python", sys.executable)),
        )

    def __init__(
        self, run_dir: str, cgroup_parent: str, total_vcpus: int, total_memory: int, python: str
    ) -> None:
        self.run_dir = run_dir
        self.cgroup_parent = cgroup_parent.strip("/")
        self.total_vcpus = total_vcpus
        self.total_memory = total_memory
        self.python = python
        self._reserved: dict[str, tuple[int, int]] = {}
        self._faults: set[Fault] = set()
        self._lock = asyncio.Lock()
        self._injector = Injector(python)

    # ---- cgroups: a VM's is below its pod's (VMSpec.cgroup_parent), else below the driver's parent
    @property
    def extra_memory(self) -> int:
        """What a VM holds of the host beyond its ``memory_bytes`` (none: the stub's VM is its cgroup)."""
        return 0

    def _cgroup(self, vm: VM) -> Cgroup:
        return Cgroup(vm.cgroup or f"{self.cgroup_parent}/{vm.id}")

    def _cgroup_below(self, vm: VM, cgroup_parent: str) -> Cgroup:
        """Where ``vm``'s cgroup goes below a pod's cgroup parent (cgroupfs or systemd form)."""
        return Cgroup(f"{cgroupfs_path(cgroup_parent) or self.cgroup_parent}/{vm.id}")

    def _host_memory(self, vm: VM) -> int:
        """The memory limit of ``vm``'s host cgroup: all that its processes may use."""
        return vm.memory_bytes + self.extra_memory

    def _memory_parts(self, vm: VM) -> str:
        """What ``_host_memory`` is made of, for an error."""
        return f"{vm.memory_bytes // MIB} MiB"

    def _fit(self, vm: VM, cg: Cgroup) -> None:
        """FailedPreconditionError if the cgroups above ``cg`` (the pod's, which the kubelet
        limits to its containers' limits plus the pod's overhead) allow ``vm`` less memory than
        it needs: it would be killed by the host as it fills its memory, not refused now."""
        _, limit = cg.parent_limits()
        need = self._host_memory(vm)
        if limit is not None and limit < need:
            parent = os.path.dirname(cg.rel) or "/"
            raise FailedPreconditionError(
                f"the pod's memory limit of {limit // MIB} MiB (cgroup {parent}) is below the "
                f"{need // MIB} MiB its VM needs ({self._memory_parts(vm)}): give the pod's "
                "RuntimeClass an overhead that covers the VM, or the pod more memory"
            )

    def _make_cgroup(self, vm: VM, cg: Cgroup) -> None:
        """Make ``vm``'s cgroup ``cg`` and size it: its vCPUs (within its parents' quota) and
        its host memory; the state directory says where it is (for leftovers after a restart)."""
        cg.create()
        cg.set_limits(vm.vcpus, self._host_memory(vm))
        self._record_cgroup(vm, cg.rel)

    @staticmethod
    def _record_cgroup(vm: VM, rel: str) -> None:
        vm.cgroup = rel
        os.makedirs(vm.state_dir, exist_ok=True)
        with open(os.path.join(vm.state_dir, "cgroup"), "w") as fh:
            fh.write(rel)

    def _leftover_cgroup(self, state_dir: str, vm_id: str) -> Cgroup:
        """The cgroup of a VM found in ``state_dir`` with no record (its state file, else the
        driver's parent/<id>)."""
        try:
            with open(os.path.join(state_dir, "cgroup")) as fh:
                rel = fh.read().strip()
        except OSError:
            rel = ""
        return Cgroup(rel or f"{self.cgroup_parent}/{vm_id}")

    async def place(self, vm: VM, cgroup_parent: str) -> None:
        old = self._cgroup(vm)
        new = self._cgroup_below(vm, cgroup_parent)
        if new.rel == old.rel:
            return
        self._fit(vm, new)
        try:
            self._make_cgroup(vm, new)
            new.adopt(old)
        except OSError as exc:
            old.adopt(new)
            new.remove()
            self._record_cgroup(vm, old.rel)
            raise InternalError(f"VM {vm.id}: cannot move into cgroup {new.rel}: {exc}") from exc
        old.remove()

    # ---- capacity

    def _tidy_cgroups(self) -> None:
        """The cgroup parent, if no VM is left in it (rmdir fails on a cgroup in use anyway)."""
        parent = Cgroup(self.cgroup_parent)
        if not parent.pids():
            parent.remove()

    def _footprint(self, vm: VM) -> tuple[int, int]:
        """What ``vm`` holds of the node: vCPUs and memory."""
        return vm.vcpus, vm.memory_bytes

    def capacity(self) -> tuple[int, int, int, int]:
        vcpus = sum(v for v, _ in self._reserved.values())
        mem = sum(m for _, m in self._reserved.values())
        return vcpus, self.total_vcpus, mem, self.total_memory

    def _reserve(self, vm_id: str, vcpus: int, memory: int) -> None:
        others = {k: v for k, v in self._reserved.items() if k != vm_id}
        used_c = sum(v for v, _ in others.values())
        used_m = sum(m for _, m in others.values())
        if used_c + vcpus > self.total_vcpus or used_m + memory > self.total_memory:
            raise ResourceExhaustedError(
                f"node capacity exceeded: VM needs {vcpus} vCPU/{memory // MIB} MiB, "
                f"free {self.total_vcpus - used_c} vCPU/{(self.total_memory - used_m) // MIB} MiB"
            )
        self._reserved[vm_id] = (vcpus, memory)

    # ---- the VM process
    def _own_netns(self, spec: VMSpec) -> bool:
        """Whether the VM process of ``spec`` gets a network namespace of its own."""
        return spec.own_netns

    async def _create(self, spec: VMSpec, boot: Callable[[VM], Awaitable[None]]) -> VM:
        """Reserve room for ``spec``, make its record and ``boot`` it; on any failure nothing is left."""
        check_size(spec)
        state_dir = os.path.join(self.run_dir, spec.id)
        vm = VM(
            id=spec.id,
            driver=self.name,
            pid=0,
            vcpus=spec.vcpus,
            memory_bytes=spec.memory_bytes,
            state_dir=state_dir,
            channel=os.path.join(state_dir, "agent.sock"),
            host_network=spec.host_network,
            own_netns=self._own_netns(spec),
        )
        cg = self._cgroup_below(vm, spec.cgroup_parent)
        self._fit(vm, cg)
        async with self._lock:
            self._reserve(spec.id, *self._footprint(vm))
        try:
            self._make_cgroup(vm, cg)
            await boot(vm)
        except BaseException:
            await self.destroy(vm)
            raise
        return vm

    def _spawn_in_cgroup(
        self, vm: VM, argv: list[str], cg: Cgroup, output: str, env: dict[str, str], fds: Sequence[int] = ()
    ) -> None:
        """Start the VM process: it joins ``cg`` before exec'ing ``argv`` (so all of the VM is in
        it), in a session of its own, its output appended to ``output``; ``fds`` are its
        descriptors 3, 4... (a QEMU started from a template: its guest's RAM).

        posix_spawn rather than Popen: the VM must outlive this process (recovery), so it is
        watched by PID like an adopted VM, and setsid keeps it out of the shim's process group.
        """
        script = 'for f in $RUNV_CGROUP_PROCS; do echo $$ > "$f" || exit 97; done; exec "$@"'
        env = dict(env, RUNV_CGROUP_PROCS=" ".join(cg.procs_files()))
        actions = [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_OPEN, 1, output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640),
            (os.POSIX_SPAWN_DUP2, 1, 2),
        ]
        # From copies above the targets: a dup2 onto itself would keep close-on-exec.
        copies = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3 + len(fds)) for fd in fds]
        actions += [(os.POSIX_SPAWN_DUP2, fd, 3 + i) for i, fd in enumerate(copies)]
        try:
            vm.pid = os.posix_spawnp(
                "sh", ["sh", "-c", script, "sh", *argv], env, file_actions=actions, setsid=True
            )
        finally:
            for fd in copies:
                os.close(fd)
        vm.started_at = process_start(vm.pid)

    async def _release(self, vm: VM) -> None:
        """After the VM process is gone: its cgroup, its state directory, its reservation."""
        cg = self._cgroup(vm)
        # The PID namespace dies with its init; give the kernel a moment to empty the cgroups.
        for _ in range(100):
            cg.remove()
            if not any(os.path.isdir(d) for d in cg.all_dirs()):
                break
            await asyncio.sleep(0.02)
        left = _mounts_under(vm.state_dir)
        if left:
            # Never delete through a mount: that would delete host data it shows.
            raise InternalError(f"VM {vm.id}: mounts left under {vm.state_dir}: {left}")
        shutil.rmtree(vm.state_dir, ignore_errors=True)
        async with self._lock:
            self._reserved.pop(vm.id, None)

    def alive(self, vm: VM) -> bool:
        return vm.pid > 0 and process_start(vm.pid) == vm.started_at and vm.started_at != 0

    async def wait(self, vm: VM) -> None:
        await wait_for_exit(vm, self.alive)

    async def adopt(self, vm: VM) -> bool:
        if not self.alive(vm):
            return False
        async with self._lock:
            self._reserved[vm.id] = self._footprint(vm)
        return True

    async def close(self) -> None:
        """Stop the driver's own helpers (VMs keep running)."""
        await self._injector.close()

    def usage(self, vm: VM) -> tuple[int, int]:
        return self._cgroup(vm).usage()

    def console(self, vm: VM) -> str:
        try:
            with open(os.path.join(vm.state_dir, "console.log"), "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - CONSOLE_KEPT))
                return fh.read().decode(errors="replace")
        except OSError:
            return ""

    async def connect(self, vm: VM) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_unix_connection(vm.channel, limit=1024 * 1024)

    # ---- shares
    def _guest_path(self, vm: VM, tag: str) -> str:
        """Where the guest sees share ``tag``."""
        return os.path.join(shares_dir(vm), tag)

    @abc.abstractmethod
    def _share_mode(self, readonly: bool, bidirectional: bool) -> list[str]:
        """The share helper's mode words for such a share (raises for one it cannot make)."""

    async def attach_share(
        self, vm: VM, tag: str, host_path: str, readonly: bool, bidirectional: bool = False
    ) -> str:
        if "/" in tag or tag in ("", ".", ".."):
            raise InvalidArgumentError(f"invalid share tag {tag!r}")
        mode = self._share_mode(readonly, bidirectional)
        guest = self._guest_path(vm, tag)
        if vm.shares.get(tag) == host_path:
            return guest  # image layers are shared by the pod's containers
        if tag in vm.shares:
            await self.detach_share(vm, tag)
        if not self.alive(vm):
            raise BootError(f"VM {vm.id} is not running")
        target = os.path.join(shares_dir(vm), tag)  # the mount point, as the VM process sees it
        try:
            is_dir = os.path.isdir(host_path)
            if not is_dir and not os.path.exists(host_path):
                raise InvalidArgumentError(f"share source {host_path} does not exist")
            _remove_target(target)  # a leftover of another kind
            if is_dir:
                os.makedirs(target, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
        except OSError as exc:
            raise InternalError(f"cannot make the mount point of share {tag} in VM {vm.id}: {exc}") from exc
        try:
            await self._inject("attach", host_path, str(vm.pid), target, *mode)
        except BaseException:
            _remove_target(target)
            raise
        vm.shares[tag] = host_path
        return guest

    async def detach_share(self, vm: VM, tag: str) -> None:
        target = os.path.join(shares_dir(vm), tag)
        if tag in vm.shares and self.alive(vm):
            await self._inject("detach", str(vm.pid), target)
        _remove_target(target)
        vm.shares.pop(tag, None)

    async def _inject(self, *args: str) -> None:
        error = await self._injector.call(list(args))
        if error:
            raise InternalError(f"share {args[0]} failed: {error}")

    @abc.abstractmethod
    async def destroy(self, vm: VM) -> None:
        """Kill the VM and release everything it held. Idempotent."""

    # ---- faults
    @abc.abstractmethod
    def _hang(self, vm: VM) -> None:
        """Make the VM's agent stop answering, the VM process alive."""

    def inject(self, fault: Fault, vm: VM | None = None) -> None:
        if fault is Fault.BOOT_FAILURE:
            self._faults.add(fault)
            return
        if vm is None:
            raise ValueError(f"fault {fault.value} needs a VM")
        if fault is Fault.CRASH:
            with contextlib.suppress(ProcessLookupError):
                os.kill(vm.pid, signal.SIGKILL)
        elif fault is Fault.AGENT_HANG:
            self._hang(vm)


def check_size(spec: VMSpec) -> None:
    if spec.vcpus < 1 or spec.memory_bytes < 32 * MIB:
        raise InvalidArgumentError(f"VM size {spec.vcpus} vCPU/{spec.memory_bytes // MIB} MiB is too small")


async def wait_for_exit(vm: VM, alive: Callable[[VM], bool]) -> None:
    """Return when the VM process has exited: its pidfd turns readable, else by polling."""
    try:
        fd = os.pidfd_open(vm.pid)
    except OSError:
        fd = -1
    if fd >= 0:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def ready() -> None:
            if not done.done():
                done.set_result(None)

        loop.add_reader(fd, ready)
        try:
            if alive(vm):
                await done
        finally:
            loop.remove_reader(fd)
            os.close(fd)
    while alive(vm):
        await asyncio.sleep(0.05)


def _remove_target(path: str) -> None:
    """Remove an unmounted share mount point, a directory or a file (gone already: fine)."""
    with contextlib.suppress(OSError):
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.unlink(path)


def shares_dir(vm: VM) -> str:
    return os.path.join(vm.state_dir, "shares")


def _mounts_under(path: str) -> list[str]:
    root = os.path.abspath(path)
    return [m.point for m in procfs.mounts() if m.point == root or m.point.startswith(root + "/")]


def package_root() -> str:
    """The directory holding the ``backends`` package (the agent's code, for the guest)."""
    here = os.path.abspath(__file__)  # backends/runv/drivers/base.py
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(here))))
