# ruff: noqa: ASYNC240
# Spawning the VM process and touching cgroupfs/procfs files is quick and bounded.
"""The stub hypervisor: a "VM" is a host process in its own namespaces running the real agent.

Each VM is ``unshare --pid --fork --mount --uts --ipc --net --mount-proc
--kill-child python -m backends.runv.agent``: the agent is PID 1 of its PID
namespace, so killing the VM process takes every process of the VM with
it, and the VM's mounts (container rootfs overlays) vanish with its mount
namespace. Its size is enforced with a cgroup on the VM process, which the
containers' cgroups nest under. The agent channel is a unix socket in the
VM's state directory (the stub's virtio-serial port).

By default a VM is not booted by ``unshare`` but cloned from the VM template
(``template.py``, ``template_server.py``): a process that has imported the agent
once forks a VM process with the same namespaces, cgroup and process tree, and
the agent's main runs in it without a new interpreter. ``template = false``, or a
template that cannot start on this node, boots with ``unshare`` as above.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import Any

import structlog

from backends.contract.errors import DeadlineExceededError, FailedPreconditionError, InvalidArgumentError
from backends.linux import procfs
from backends.linux.cgroups import Cgroup, HugetlbError
from backends.runv import host
from backends.runv.drivers.base import ProcessVMs, package_root, process_start, shares_dir
from backends.runv.drivers.template import Template, TemplateError, template_env
from backends.runv.hypervisor import MIB, VM, BootError, Fault, PodLimits, VMSpec

log = structlog.get_logger(__name__)


class StubHypervisor(ProcessVMs):
    name = "stub"

    def __init__(self, config: dict[str, Any]) -> None:
        # A stub VM's vCPU is a CFS quota, not a reserved core. 64 per host CPU lets a 2-core
        # node hold the kubelet's default 110 pods at 1 vCPU each (16 refused the 33rd pod
        # the kubelet had admitted).
        super().__init__(*self.common_settings(config, "/run/cri-shim/runv", "cri-shim-runv", 64))
        self.boot_latency = float(config.get("boot_latency", 0.0))
        self.shutdown_latency = float(config.get("shutdown_latency", 0.0))
        self.boot_timeout = float(config.get("boot_timeout", 20.0))
        self.runc = str(config.get("runc", "runc"))
        self.unshare = str(config.get("unshare", "unshare"))
        self.ip = str(config.get("ip", "ip"))
        # VMs cloned from a template process that has imported the agent already (template.py);
        # None once it cannot be used (then every VM is booted by unshare, as with false).
        self.template: Template | None = (
            Template(self.python, template_env(package_root())) if config.get("template", True) else None
        )
        self._preparing: asyncio.Task[None] | None = None

    # ---- helpers
    def _agent_pid(self, vm: VM) -> int:
        kids = procfs.children(vm.pid)
        return kids[0] if kids else 0

    # ---- lifecycle
    def prepare(self) -> None:
        """Start the VM template in the background, so that the first boot finds it up."""
        if self.template is not None and self._preparing is None:
            self._preparing = asyncio.get_running_loop().create_task(self._start_template(self.template))

    @staticmethod
    async def _start_template(template: Template) -> None:
        with contextlib.suppress(TemplateError):  # the first boot tries again, and falls back
            await template.start()

    def _own_netns(self, spec: VMSpec) -> bool:
        return not spec.host_network  # unshare --net: the guest's namespace is the VM process's

    async def create(self, spec: VMSpec) -> VM:
        return await self._create(spec, self._boot)

    async def _boot(self, vm: VM) -> None:
        if len(vm.channel.encode()) > 107:
            raise InvalidArgumentError(f"agent socket path too long: {vm.channel}")
        os.makedirs(vm.state_dir, exist_ok=True)
        os.makedirs(shares_dir(vm), exist_ok=True)
        cg = self._cgroup(vm)
        if self.boot_latency:
            await asyncio.sleep(self.boot_latency)  # firmware + kernel boot
        fail = Fault.BOOT_FAILURE in self._faults
        self._faults.discard(Fault.BOOT_FAILURE)
        # The containers' cgroups go below the agent's own: the VM's, wherever it is (a warm VM
        # moves into its pod's cgroup when a pod takes it).
        args = ["--socket", vm.channel, "--state", vm.state_dir, "--cgroup-parent", "self"]
        args += ["--runc", self.runc, *(["--fail-boot"] if fail else [])]
        console = os.path.join(vm.state_dir, "console.log")
        if not await self._clone(vm, cg, console, args):
            self._unshare(vm, cg, console, args)
        deadline = time.monotonic() + self.boot_timeout
        while True:
            if not self.alive(vm):
                raise BootError(f"VM {vm.id} exited during boot: {self.console(vm)[-500:].strip()}")
            if os.path.exists(vm.channel):
                try:
                    _r, w = await asyncio.open_unix_connection(vm.channel)
                except OSError:
                    pass
                else:
                    w.close()
                    with contextlib.suppress(OSError):
                        await w.wait_closed()
                    return
            if time.monotonic() > deadline:
                raise DeadlineExceededError(
                    f"VM {vm.id} did not boot within {self.boot_timeout}s: {self.console(vm)[-500:].strip()}"
                )
            # A cloned agent is up some 20-40 ms after the request: a coarser poll would be
            # a good part of the boot. A poll is a stat and, once the socket is there, a connect.
            await asyncio.sleep(0.005)

    def _unshare(self, vm: VM, cg: Cgroup, console: str, args: list[str]) -> None:
        """Boot with a new interpreter: ``unshare ... python -m backends.runv.agent``."""
        argv = [self.unshare, "--pid", "--fork", "--mount", "--uts", "--ipc"]
        if not vm.host_network:
            argv.append("--net")
        # A slave of the host's mounts: what the host mounts under a shared directory later
        # shows in the VM (as virtio-fs would), and nothing the VM mounts leaks out.
        argv += ["--propagation", "slave", "--mount-proc", "--kill-child"]
        argv += [self.python, "-m", "backends.runv.agent", *args]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root(), env.get("PYTHONPATH", "")) if p)
        self._spawn_in_cgroup(vm, argv, cg, console, env)

    async def _clone(self, vm: VM, cg: Cgroup, console: str, args: list[str]) -> bool:
        """Boot from the template: False if there is none to use (then the caller boots with unshare)."""
        if self.template is None:
            return False
        try:
            vm.pid = await self.template.clone(cg.procs_files(), console, not vm.host_network, args)
        except TemplateError as exc:
            if not exc.started:
                # It will not come up on this node (no unshare for it, say): stop trying.
                log.warning("runv.stub.template_unavailable", error=str(exc), fallback="unshare")
                self.template = None
                return False
            # It died under this request: a VM process it may have forked is in the VM's
            # cgroup, and goes; this VM boots the old way, the next ones from a new template.
            log.warning("runv.stub.template_failed", vm=vm.id, error=str(exc), fallback="unshare")
            for pid in set(cg.pids()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return False
        vm.started_at = process_start(vm.pid)
        return True

    async def stop(self, vm: VM, timeout: float) -> None:
        if self.shutdown_latency:
            await asyncio.sleep(self.shutdown_latency)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wait(vm), timeout)
        await self.destroy(vm)

    async def destroy(self, vm: VM) -> None:
        if self.alive(vm):
            agent = self._agent_pid(vm)
            if agent:
                # A stopped (hung) agent must be able to die.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(agent, signal.SIGCONT)
            # unshare ignores TERM while it waits; KILL makes --kill-child take the VM down.
            with contextlib.suppress(ProcessLookupError):
                os.kill(vm.pid, signal.SIGKILL)
            await self.wait(vm)
        await self._release(vm)

    def leftovers(self, known: set[str]) -> list[VM]:
        out: list[VM] = []
        if not os.path.isdir(self.run_dir):
            return out
        for entry in os.listdir(self.run_dir):
            if entry in known or not os.path.isdir(os.path.join(self.run_dir, entry)):
                continue
            pid = 0
            cg = self._leftover_cgroup(os.path.join(self.run_dir, entry), entry)
            for cand in cg.pids():
                pid = cand
                break
            vm = VM(entry, self.name, 0, 0, 0, os.path.join(self.run_dir, entry), "", cgroup=cg.rel)
            if pid:
                # Find the VM process: the topmost process of the cgroup.
                while True:
                    st = procfs.stat(pid)
                    if st is None or st.ppid not in cg.pids():
                        break
                    pid = st.ppid
                vm.pid = pid
                vm.started_at = process_start(pid)
            out.append(vm)
        return out

    async def close(self) -> None:
        await super().close()
        if self._preparing is not None:
            self._preparing.cancel()
            await asyncio.gather(self._preparing, return_exceptions=True)
            self._preparing = None
        if self.template is not None:
            await self.template.close()

    def tidy(self) -> None:
        self._tidy_cgroups()
        with contextlib.suppress(OSError):
            os.rmdir(self.run_dir)

    # ---- hot-plug
    async def set_vcpus(self, vm: VM, vcpus: int) -> None:
        async with self._lock:
            self._reserve(vm.id, vcpus, vm.memory_bytes)
        self._cgroup(vm).set_limits(vcpus, vm.memory_bytes)
        vm.vcpus = vcpus

    async def set_memory(self, vm: VM, memory_bytes: int) -> None:
        async with self._lock:
            self._reserve(vm.id, vm.vcpus, memory_bytes)
        self._cgroup(vm).set_limits(vm.vcpus, memory_bytes)
        vm.memory_bytes = memory_bytes

    async def set_pod_limits(self, vm: VM, limits: PodLimits) -> None:
        """The stub's VM is its cgroup: the pod's size is its quota and memory limit (reserved
        against the node's capacity, as at boot), with its CPU shares and cpuset."""
        cg = self._cgroup(vm)
        if limits.memory_bytes < vm.memory_bytes:
            used = cg.memory_usage()
            if used > limits.memory_bytes:
                raise FailedPreconditionError(
                    f"VM {vm.id}: memory limit {limits.memory_bytes // MIB} MiB is below the "
                    f"{used // MIB} MiB the pod uses now, which the kernel cannot take back"
                )
        async with self._lock:
            self._reserve(vm.id, limits.vcpus, limits.memory_bytes)
        try:
            cg.resize(
                limits.vcpus, limits.memory_bytes, limits.cpu_shares, limits.cpuset_cpus, limits.cpuset_mems
            )
        except (OSError, HugetlbError) as exc:
            async with self._lock:
                self._reserved[vm.id] = (vm.vcpus, vm.memory_bytes)
            raise FailedPreconditionError(
                f"VM {vm.id}: the pod's cgroup refused its new limits: {exc}"
            ) from exc
        vm.vcpus, vm.memory_bytes = limits.vcpus, limits.memory_bytes

    # ---- shares: the guest sees them where the VM process mounts them (it is the guest).
    # Read-only is enforced by the agent's bind mounts.
    def _share_mode(self, readonly: bool, bidirectional: bool) -> list[str]:
        # The stub's VM is a mount namespace: a bidirectional share stays a peer of the host's
        # mount (when that is shared), so what the guest mounts there shows on the host.
        return ["shared"] if bidirectional else []

    async def attach_device(self, vm: VM, host_path: str) -> str:
        vm.devices[host_path] = host_path
        return host_path

    async def detach_device(self, vm: VM, host_path: str) -> None:
        vm.devices.pop(host_path, None)

    async def attach_interface(self, vm: VM, host_ifname: str) -> str:
        if vm.host_network:
            raise InvalidArgumentError(f"VM {vm.id} shares the host network: no interface to attach")
        if not self.alive(vm):
            raise BootError(f"VM {vm.id} is not running")
        # The unshare process (vm.pid) made the VM's network namespace and lives in it.
        await host.must(
            f"cannot move {host_ifname} into VM {vm.id}",
            *(self.ip, "link", "set", "dev", host_ifname, "netns", str(vm.pid)),
        )
        return host_ifname

    async def join_interface(self, vm: VM, netns: str, ifname: str) -> str:
        if not vm.own_netns:
            raise InvalidArgumentError(f"VM {vm.id} shares the host network: no interface to join")
        return ""  # the plugins made it in the guest's own namespace, and configured it there

    def _hang(self, vm: VM) -> None:
        agent = self._agent_pid(vm)
        if agent:
            os.kill(agent, signal.SIGSTOP)
