"""The runv backend: one VM per pod, containers inside it through the guest agent."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import structlog

from backends import contract
from backends.contract import errors
from backends.contract.pool import PoolFigures
from backends.contract.usage import Layer, Sample
from backends.linux import cgroups
from backends.linux.usage import UsageCache
from backends.runv import config as runv_config
from backends.runv.agent import messages as m
from backends.runv.agent import rro
from backends.runv.agent.client import AgentClient
from backends.runv.agent.protocol import AgentError, Ch, ConnectionLost, Stream
from backends.runv.drivers.qemu import QemuHypervisor
from backends.runv.drivers.stub import StubHypervisor
from backends.runv.hypervisor import MIB, VM, Fault, Hypervisor, VMSpec
from backends.runv.images.store import Credentials, Image, ImageStore
from backends.runv.network import PodNetwork, host_ports
from backends.runv.pool import CpuMeter, Pool, PoolConfig
from cri_api import api_pb2 as pb

log = structlog.get_logger(__name__)

VM_CRASH_EXIT = 255
VM_CRASH_REASON = "VMCrashed"


@dataclasses.dataclass(eq=False)
class _Pod:
    sandbox_id: str
    vm: VM
    agent: AgentClient | None = None
    containers: set[str] = dataclasses.field(default_factory=set)
    stopping: bool = False
    dead: bool = False
    monitor: asyncio.Task[None] | None = None
    procs: dict[str, VmProcess] = dataclasses.field(default_factory=dict)  # started containers
    # A warm VM's network, wired before any pod asked for it: its IP (held in the IPAM
    # under ``holder`` until a pod takes it) and the VM's interface, up.
    warm_net: dict[str, str] | None = None


class VmProcess:
    """A container in the VM as the shim follows it: the agent's output stream, the exit.

    The stream is subscribed before the container starts (the agent keeps a
    backlog until then) and ends when the agent closes it (all output sent) or
    the channel goes (VM stopped or dead).
    """

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self.exit = contract.ExitLatch()

    async def output(self) -> AsyncIterator[contract.Output]:
        stream = self._stream
        try:
            async for ch, data in stream.received():
                yield contract.Output("stderr" if ch == Ch.STDERR else "stdout", data)
        finally:
            stream.forget()


T = TypeVar("T")


def _vm_id(sandbox_id: str) -> str:
    # Short: the agent socket path under the run dir must fit in sun_path.
    return sandbox_id[:16]


class RunvBackend:
    capabilities = (
        contract.Capability.EXEC_SYNC
        | contract.Capability.EXEC
        | contract.Capability.ATTACH
        | contract.Capability.PORT_FORWARD
        | contract.Capability.STATS
        | contract.Capability.METRICS
        | contract.Capability.UPDATE_RESOURCES
        | contract.Capability.IMAGES
        | contract.Capability.HOST_NETWORK
        | contract.Capability.SUPPLEMENTAL_GROUPS_POLICY
        | contract.Capability.IMAGE_VOLUMES
        | contract.Capability.USER_NAMESPACES
    )

    def __init__(self, name: str, config: dict[str, Any], hypervisor: Hypervisor | None = None) -> None:
        runv_config.check(name, config)
        self.name = name
        self.config = config
        # Per handler by default, so that two runv handlers (a stub one and a qemu one) never
        # take each other's VMs for leftovers; the handler "runv" keeps the historic paths.
        own = name if re.fullmatch(r"[A-Za-z0-9_.-]+", name) and name not in (".", "..") else "runv"
        self.root = str(config.get("root", f"/var/lib/cri-shim/{own}"))
        run_dir = str(config.get("run_dir", f"/run/cri-shim/{own}"))
        self.driver = str(config.get("driver", "stub"))
        if hypervisor is not None:
            self.hv: Hypervisor = hypervisor
        elif self.driver == "qemu":
            qemu_config = dict(config.get("qemu") or {})
            qemu_config.setdefault("run_dir", run_dir)
            self.hv = QemuHypervisor(qemu_config)
        elif self.driver == "stub":
            stub_config = dict(config.get("stub") or {})
            stub_config.setdefault("run_dir", run_dir)
            self.hv = StubHypervisor(stub_config)
        else:
            raise errors.InvalidArgumentError(
                f"runv handler {name!r}: driver must be 'stub' or 'qemu', not {self.driver!r}"
            )
        caps = type(self).capabilities
        if self.hv.name == "qemu":
            # A VM has its own kernel (Debian's 6.1: recursive read-only mounts) and network.
            caps = (caps | contract.Capability.RECURSIVE_READ_ONLY_MOUNTS) & ~contract.Capability.HOST_NETWORK
        elif rro.supported():  # the stub's guests run on this kernel
            caps |= contract.Capability.RECURSIVE_READ_ONLY_MOUNTS
        self.capabilities = caps
        # Unset: the driver's (seconds of work for an agent on an emulated CPU), else 10 s.
        self._agent_timeout: float | None = (
            float(config["agent_timeout"]) if config.get("agent_timeout") is not None else None
        )
        self.overhead_vcpus = float(config.get("overhead_vcpus", 0.0))
        self.overhead_memory = int(config.get("overhead_memory_mib", 32)) * MIB
        self.images = ImageStore(os.path.join(self.root, "images"), config.get("insecure_registries"))
        self._containers_dir = os.path.join(self.root, "containers")
        self._image_usage = UsageCache(self.images.root)
        self._layer_usage = UsageCache(self._containers_dir)
        self._layer_usage_of: dict[str, UsageCache] = {}  # container ID -> its writable layer
        self._selinux_said = False
        net_config = dict(config.get("network") or {})
        net_config.setdefault("owner", hashlib.sha256(os.path.abspath(self.root).encode()).hexdigest()[:12])
        self.net = PodNetwork(net_config)
        self._pods: dict[str, _Pod] = {}
        self._owner: dict[str, str] = {}  # container ID -> sandbox ID
        self._events: contract.EventSink | None = None
        # Warm VMs: the shape of a pod without limits unless the pool table says otherwise.
        self.pool_config = PoolConfig.from_table(config.get("pool"))
        plain_vcpus, plain_memory = vm_size(0, 100_000, 0, self.overhead_vcpus, self.overhead_memory)
        self.pool_shape = (
            self.pool_config.vcpus or plain_vcpus,
            self.pool_config.memory_mib * MIB or plain_memory,
        )
        self._sandboxes_starting = 0
        self._cpu = CpuMeter()
        self.pool: Pool[_Pod] = Pool(
            self.pool_config.size,
            self._boot_warm,
            self._discard_warm,
            self._warm_usable,
            self._refill_should_wait,
            self.pool_config.refill_interval,
            name="runv",
        )

    # ------------------------------------------------------------------ lifecycle
    async def start(self, events: contract.EventSink) -> None:
        self._events = events
        os.makedirs(self._containers_dir, exist_ok=True)

    async def close(self) -> None:
        # Warm VMs belong to no pod: they go. Pods' VMs keep running (recovered on the
        # next start); only our side goes away.
        await self.pool.close()
        tasks: list[asyncio.Task[None]] = []
        for pod in self._pods.values():
            if pod.monitor is not None:
                tasks.append(pod.monitor)
            if pod.agent is not None:
                await pod.agent.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.hv.close()
        if not self._pods:
            self.hv.tidy()  # no VM left: drop the empty run dir and cgroup parent
        self._pods.clear()

    @property
    def agent_timeout(self) -> float:
        if self._agent_timeout is not None:
            return self._agent_timeout
        return float(getattr(self.hv, "agent_timeout", 10.0))

    @agent_timeout.setter
    def agent_timeout(self, value: float) -> None:
        self._agent_timeout = value

    async def health(self) -> contract.Health:
        if shutil.which(str(self.config.get("stub", {}).get("runc", "runc"))) is None:
            return contract.Health(False, True, "RuncMissing", "runc is not installed")
        return contract.Health(True, True)

    def warm_figures(self) -> PoolFigures | None:
        return self.pool.figures() if self.pool.size > 0 else None

    def runtime_config(self) -> pb.RuntimeConfigResponse:
        return pb.RuntimeConfigResponse(linux=pb.LinuxRuntimeConfiguration(cgroup_driver=pb.CGROUPFS))

    # ------------------------------------------------------------------ agent plumbing
    def _pod(self, sandbox_id: str) -> _Pod:
        pod = self._pods.get(sandbox_id)
        if pod is None:
            raise errors.NotFoundError(f"VM of sandbox {sandbox_id} is not running")
        if pod.dead:
            raise errors.FailedPreconditionError(f"VM of sandbox {sandbox_id} crashed")
        return pod

    def _agent(self, pod: _Pod) -> AgentClient:
        if pod.agent is None or pod.agent.closed:
            raise errors.UnavailableError(f"agent of sandbox {pod.sandbox_id} is not connected")
        return pod.agent

    def _pod_of(self, container: contract.ContainerRecord) -> _Pod:
        return self._pod(container.sandbox_id)

    async def _connect(self, pod: _Pod) -> None:
        try:
            reader, writer = await self.hv.connect(pod.vm)
        except OSError as exc:
            # A VM whose agent refuses or has no socket left: that pod is down, not the backend.
            raise errors.UnavailableError(f"agent of VM {pod.vm.id} does not answer: {exc}") from exc
        pod.agent = AgentClient(reader, writer, lambda n, b: self._on_event(pod, n, b), self.agent_timeout)
        await pod.agent.call(m.HelloRequest())

    def _on_event(self, pod: _Pod, name: str, body: dict[str, Any]) -> None:
        if name == m.EXIT_EVENT:
            try:
                state = m.ContainerState.from_dict(body)
            except AgentError as exc:
                log.warning("agent sent a bad exit event", sandbox_id=pod.sandbox_id, error=exc.message)
                return
            info = contract.ExitInfo(
                exit_code=state.exit_code,
                finished_at=state.finished_at or time.time_ns(),
                reason=state.reason,
            )
            self._report_exit(pod, state.id, info)

    @staticmethod
    def _report_exit(pod: _Pod, cid: str, info: contract.ExitInfo) -> None:
        """The container's exit, to the shim following it (the first report wins)."""
        proc = pod.procs.get(cid)
        if proc is not None:
            proc.exit.set(info)

    def _watch(self, pod: _Pod) -> None:
        async def monitor() -> None:
            await self.hv.wait(pod.vm)
            if pod.stopping:
                return
            pod.dead = True
            now = time.time_ns()
            msg = f"the VM of the pod exited unexpectedly: {self.hv.console(pod.vm)[-200:].strip()}"
            for cid in sorted(pod.containers):
                self._report_exit(pod, cid, contract.ExitInfo(VM_CRASH_EXIT, now, VM_CRASH_REASON, msg))
            if self._events is not None:
                self._events.sandbox_not_ready(pod.sandbox_id, VM_CRASH_REASON)

        pod.monitor = asyncio.get_running_loop().create_task(monitor())

    # ------------------------------------------------------------------ recovery
    async def recover(
        self, sandboxes: Sequence[contract.SandboxRecord], containers: Sequence[contract.ContainerRecord]
    ) -> tuple[dict[str, contract.Observed], dict[str, contract.Observed]]:
        sb_obs: dict[str, contract.Observed] = {}
        ct_obs: dict[str, contract.Observed] = {}
        agent_states: dict[str, m.ContainerState] = {}
        known: set[str] = set()
        for sb in sandboxes:
            data = sb.backend_data.get("vm")
            if not data:
                sb_obs[sb.id] = contract.Observed(exists=False)
                continue
            vm = VM.from_dict(data)
            known.add(vm.id)
            if not sb.committed or not await self.hv.adopt(vm):
                await self.hv.destroy(vm)
                await self._unplumb(sb)
                await self.net.delete_veth(self.net.veth_names(vm.id)[0])
                sb_obs[sb.id] = contract.Observed(exists=False)
                continue
            net = sb.backend_data.get("net")
            if net:
                self.net.reserve(sb.id, str(net["ip"]))
            pod = _Pod(sb.id, vm)
            self._pods[sb.id] = pod
            try:
                await self._connect(pod)
                assert pod.agent is not None
                listing = await pod.agent.call(m.ListRequest())
            except errors.CriError:
                sb_obs[sb.id] = contract.Observed(
                    exists=True, running=False, status=contract.SandboxStatus(ready=False)
                )
                self._watch(pod)
                continue
            for c in listing.containers:
                agent_states[c.id] = c
            self._watch(pod)
            sb_obs[sb.id] = contract.Observed(exists=True, running=True, status=sb.status)
        for ct in containers:
            state = agent_states.get(ct.id)
            owner = self._pods.get(ct.sandbox_id)
            if state is None or owner is None:
                ct_obs[ct.id] = contract.Observed(exists=False)
                continue
            self._owner[ct.id] = ct.sandbox_id
            owner.containers.add(ct.id)
            if state.status == "exited":
                info = contract.ExitInfo(state.exit_code, state.finished_at, state.reason)
                ct_obs[ct.id] = contract.Observed(True, False, info, state.started_at)
            else:
                running = state.status == "running"
                ct_obs[ct.id] = contract.Observed(True, running, None, state.started_at)
        for vm in self.hv.leftovers(known):
            await self.hv.destroy(vm)
            # A RunPodSandbox killed between making the VM's veth and recording it.
            await self.net.delete_veth(self.net.veth_names(vm.id)[0])
        with_net = {sb.id for sb in sandboxes if sb.backend_data.get("net")}
        for sb in sandboxes:
            if sb.id in with_net and not sb_obs.get(sb.id, contract.Observed(exists=False)).exists:
                with_net.discard(sb.id)
        self.net.release_unknown(with_net)
        with contextlib.suppress(errors.CriError):
            await self.net.remove_unknown_host_ports(with_net)
        # Only now: a warm VM booted before recovery would have been taken for a leftover.
        self.pool.start()
        return sb_obs, ct_obs

    # ------------------------------------------------------------------ sandboxes
    async def run_sandbox(self, sandbox: contract.SandboxRecord) -> contract.SandboxNetwork:
        cfg = sandbox.config
        res = cfg.linux.resources
        over = cfg.linux.overhead
        vcpus, memory = vm_size(
            res.cpu_quota,
            res.cpu_period or 100_000,
            res.memory_limit_in_bytes,
            self.overhead_vcpus
            + (over.cpu_quota / (over.cpu_period or 100_000) if over.cpu_quota > 0 else 0),
            self.overhead_memory + max(over.memory_limit_in_bytes, 0),
        )
        host_net = cfg.linux.security_context.namespace_options.network == pb.NODE
        if host_net:
            bad = sorted(k for k in cfg.linux.sysctls if k.startswith("net."))
            if bad:
                raise errors.InvalidArgumentError(f"sysctls {bad} are not allowed with host networking")
        ports = [] if host_net else host_ports(cfg.port_mappings)
        self._sandboxes_starting += 1  # the pool's refill waits while any pod starts
        try:
            return await self._run_sandbox(sandbox, vcpus, memory, host_net, ports)
        finally:
            self._sandboxes_starting -= 1

    async def _run_sandbox(
        self, sandbox: contract.SandboxRecord, vcpus: int, memory: int, host_net: bool, ports: list[Any]
    ) -> contract.SandboxNetwork:
        cfg = sandbox.config
        pod = self._take_warm(vcpus, memory) if not host_net else None
        if pod is None:
            vm = await self._boot_cold(VMSpec(_vm_id(sandbox.id), vcpus, memory, cfg.hostname, host_net))
            pod = _Pod(sandbox.id, vm)
        else:
            pod.sandbox_id = sandbox.id
            sandbox.backend_data["warm"] = True
            log.info("sandbox.warm_vm", sandbox_id=sandbox.id, vm=pod.vm.id)
        vm = pod.vm
        ip = ""
        try:
            if pod.agent is None:
                await self._connect(pod)
            else:  # a warm VM, booted for no pod: sized up to this pod's needs, if it asks more
                if vcpus > vm.vcpus:
                    await self._with_room(self.hv.set_vcpus, vm, vcpus)
                if memory > vm.memory_bytes:
                    await self._with_room(self.hv.set_memory, vm, memory)
            assert pod.agent is not None
            if not host_net:
                ip = await self._plumb(sandbox, pod, ports)
            dns = cfg.dns_config
            await pod.agent.call(
                m.SetupRequest(
                    hostname=cfg.hostname or sandbox.id[:12],
                    dns=m.Dns(list(dns.servers), list(dns.searches), list(dns.options)),
                    sysctls=dict(cfg.linux.sysctls),
                )
            )
        except BaseException:
            if pod.agent is not None:
                await pod.agent.close()
            await self.hv.destroy(vm)
            await self._unplumb(sandbox)
            await self._unwire_warm(pod)
            raise
        sandbox.backend_data["vm"] = vm.to_dict()
        self._pods[sandbox.id] = pod
        self._watch(pod)
        return contract.SandboxNetwork(ip=ip)

    async def _boot_cold(self, spec: VMSpec) -> VM:
        """Boot a VM for one pod."""
        try:
            return await self._with_room(self.hv.create, spec)
        except errors.CriError:
            raise
        except Exception as exc:  # BootError and friends: the VM is already gone
            raise errors.UnavailableError(f"VM boot failed: {exc or type(exc).__name__}") from exc

    async def _with_room(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``fn(*args)``; on a node full because of warm VMs, they give their room back first."""
        while True:
            try:
                return await fn(*args)
            except errors.ResourceExhaustedError:
                if not await self.pool.give_back_one():
                    raise

    # ------------------------------------------------------------------ warm VMs
    def _take_warm(self, vcpus: int, memory: int) -> _Pod | None:
        """A warm VM for a pod of this size, or None: a pod smaller than the pool's shape boots cold."""
        if vcpus < self.pool_shape[0] or memory < self.pool_shape[1]:
            return None
        return self.pool.take()

    async def _boot_warm(self) -> _Pod:
        """A VM for no pod yet: booted, its agent answering, its network wired."""
        vcpus, memory = self.pool_shape
        vm = await self.hv.create(VMSpec("w" + secrets.token_hex(8)[:15], vcpus, memory))
        pod = _Pod("", vm)
        try:
            await self._connect(pod)
            holder = "warm-" + vm.id  # in no record: released by recovery after a SIGKILL
            pod.warm_net = {"ip": self.net.allocate(holder), "holder": holder}
            await self._wire(pod, pod.warm_net["ip"])
        except BaseException:
            await self._discard_warm(pod)
            raise
        return pod

    async def _discard_warm(self, pod: _Pod) -> None:
        if pod.agent is not None:
            await pod.agent.close()
        await self.hv.destroy(pod.vm)
        await self._unwire_warm(pod)

    async def _unwire_warm(self, pod: _Pod) -> None:
        """Release what a warm VM's network held, if no sandbox took it."""
        warm, pod.warm_net = pod.warm_net, None
        if warm is not None:
            await self.net.delete_veth(self.net.veth_names(pod.vm.id)[0])
            self.net.release(warm["ip"], warm["holder"])

    def _warm_usable(self, pod: _Pod) -> bool:
        return pod.agent is not None and not pod.agent.closed and self.hv.alive(pod.vm)

    def _refill_should_wait(self) -> bool:
        return self._sandboxes_starting > 0 or self._cpu.over(self.pool_config.max_cpu)

    async def _plumb(self, sandbox: contract.SandboxRecord, pod: _Pod, ports: list[Any]) -> str:
        """Give the VM its pod IP on the bridge and publish its host ports; return the IP.

        A warm VM is wired already: its IP passes to the sandbox, and only the host
        ports are left to publish.
        """
        warm, pod.warm_net = pod.warm_net, None
        if warm is not None:
            ip = warm["ip"]
            self.net.transfer(ip, warm["holder"], sandbox.id)
        else:
            ip = self.net.allocate(sandbox.id)
        host_if, _peer = self.net.veth_names(pod.vm.id)
        # Recorded first: whatever exists of it is undone by _unplumb, now or after a restart.
        sandbox.backend_data["net"] = {
            "ip": ip,
            "host_if": host_if,
            "bridge": self.net.bridge,
            "ports": [p.to_dict() for p in ports],
        }
        if warm is None:
            await self._wire(pod, ip)
        await self.net.add_host_ports(sandbox.id, ip, ports)
        return ip

    async def _wire(self, pod: _Pod, ip: str) -> None:
        """A veth from the bridge into the VM, configured by the agent with ``ip``."""
        agent = self._agent(pod)
        _host_if, peer = self.net.veth_names(pod.vm.id)
        await self.net.create_veth(pod.vm.id)
        guest_if = await self.hv.attach_interface(pod.vm, peer)
        await agent.call(
            m.NetworkRequest(
                interface=guest_if,
                name="eth0",
                address=f"{ip}/{self.net.prefix}",
                gateway=self.net.gateway,
                mtu=self.net.mtu,
            )
        )

    async def _unplumb(self, sandbox: contract.SandboxRecord) -> None:
        """Release the pod's network: host-port rules, veth, IP. Idempotent."""
        data = sandbox.backend_data.get("net")
        if not data:
            return
        await self.net.remove_host_ports(sandbox.id)
        await self.net.delete_veth(str(data.get("host_if", "")))
        self.net.release(str(data.get("ip", "")), sandbox.id)
        sandbox.backend_data.pop("net", None)

    async def stop_sandbox(self, sandbox: contract.SandboxRecord) -> None:
        pod = self._pods.get(sandbox.id)
        if pod is None:
            data = sandbox.backend_data.get("vm")
            if data:  # adopted but never connected, or a leftover
                await self.hv.destroy(VM.from_dict(data))
            await self._unplumb(sandbox)
            return
        pod.stopping = True
        if pod.agent is not None and not pod.agent.closed and not pod.dead:
            try:
                await pod.agent.call(m.ShutdownRequest(), timeout=min(self.agent_timeout, 5.0))
                graceful = True
            except errors.CriError:
                graceful = False  # a hung or lost agent: no point waiting for a power-off
            await pod.agent.close()
            if graceful:
                await self.hv.stop(pod.vm, timeout=5.0)
            else:
                await self.hv.destroy(pod.vm)
        else:
            if pod.agent is not None:
                await pod.agent.close()
            await self.hv.destroy(pod.vm)
        if pod.monitor is not None:
            pod.monitor.cancel()
        now = time.time_ns()
        for cid in sorted(pod.containers):
            self._report_exit(pod, cid, contract.ExitInfo(137, now, "Error", "the pod's VM was stopped"))
        del self._pods[sandbox.id]
        await self._unplumb(sandbox)

    async def remove_sandbox(self, sandbox: contract.SandboxRecord) -> None:
        await self.stop_sandbox(sandbox)
        for cid, sid in list(self._owner.items()):
            if sid == sandbox.id:
                self._forget(cid)

    def _forget(self, cid: str) -> None:
        self._owner.pop(cid, None)
        self._layer_usage_of.pop(cid, None)
        shutil.rmtree(os.path.join(self._containers_dir, cid), ignore_errors=True)

    # ------------------------------------------------------------------ containers
    async def _image(self, ref: str, names: Sequence[str]) -> Image:
        img = self.images.resolve(ref)
        if img is not None:
            return img
        # Pulled through another handler's store (e.g. docker as the default handler):
        # fetch it into ours by name, so one `crictl pull` serves every handler. The
        # image ID (config digest) is the same in both stores.
        for name in (ref, *names):
            if not name or re.fullmatch(r"(sha256:)?[0-9a-f]{12,64}", name):
                continue
            with contextlib.suppress(errors.NotFoundError, errors.InvalidArgumentError):
                image_id = await self.images.pull(name)
                if ref in (name, image_id) or image_id.removeprefix("sha256:").startswith(
                    ref.removeprefix("sha256:")
                ):
                    return self.images.images[image_id]
        raise errors.NotFoundError(f"image {ref!r} not found")

    async def _image_volume(self, pod: _Pod, container: contract.ContainerRecord, mnt: pb.Mount) -> m.Mount:
        """An image's layers shared into the VM, for the agent to stack read-only at the mount."""
        img = await self._image(mnt.image.image, [mnt.image.user_specified_image])
        lowers = []
        for layer in self.images.lowers(img):
            tag = "layer-" + os.path.basename(os.path.dirname(layer))[:12]
            lowers.append(await self.hv.attach_share(pod.vm, tag, layer, readonly=True))
        if not lowers:
            raise errors.InvalidArgumentError(
                f"image {mnt.image.image!r} of {mnt.container_path} has no layers"
            )
        # ContainerStatus reports which image each image volume is (Mount.image.image_ref).
        container.backend_data.setdefault("image_volumes", {})[mnt.container_path] = img.id
        return m.Mount(
            source="",
            destination=mnt.container_path,
            readonly=True,
            image_lowers=lowers,
            image_sub_path=mnt.image_sub_path,
        )

    async def create_container(
        self, container: contract.ContainerRecord, sandbox: contract.SandboxRecord
    ) -> None:
        pod = self._pod(sandbox.id)
        agent = self._agent(pod)
        cfg = container.config
        img = await self._image(cfg.image.image, [container.image_name, cfg.image.user_specified_image])
        container.image_ref = img.id
        host_dir = os.path.join(self._containers_dir, container.id)
        upper, work = os.path.join(host_dir, "upper"), os.path.join(host_dir, "work")
        os.makedirs(upper, exist_ok=True)
        os.makedirs(work, exist_ok=True)
        try:
            rw = await self.hv.attach_share(pod.vm, f"ct-{container.id[:12]}", host_dir, readonly=False)
            lowers = []
            for layer in self.images.lowers(img):
                tag = "layer-" + os.path.basename(os.path.dirname(layer))[:12]
                lowers.append(await self.hv.attach_share(pod.vm, tag, layer, readonly=True))
            mounts: list[m.Mount] = []
            host_ro = bool(getattr(self.hv, "readonly_on_host", False))
            for mnt in cfg.mounts:
                if mnt.HasField("image") and mnt.image.image:
                    mounts.append(await self._image_volume(pod, container, mnt))
                    continue
                if mnt.selinux_relabel and not self._selinux_said:
                    # No SELinux in the VM (nor, mostly, on the host): nothing to relabel.
                    self._selinux_said = True
                    log.info("selinux_relabel ignored: runv VMs have no SELinux", container_id=container.id)
                if not os.path.exists(mnt.host_path):  # noqa: ASYNC240 - one stat
                    raise errors.InvalidArgumentError(f"mount source {mnt.host_path} does not exist")
                bidirectional = mnt.propagation == pb.PROPAGATION_BIDIRECTIONAL
                guest = await self.hv.attach_share(
                    pod.vm,
                    f"mnt-{container.id[:12]}-{len(mounts)}",
                    mnt.host_path,
                    mnt.readonly,
                    bidirectional=bidirectional,
                )
                mounts.append(
                    m.Mount(
                        source=guest,
                        destination=mnt.container_path,
                        # Where the driver makes the share read-only on the host (qemu, over 9p),
                        # the guest's bind stays writable: host mounts under it (a tmpfs in the
                        # directory) then keep their own mode, as a non-recursive read-only mount
                        # wants, which one read-only bind over the 9p tree could not give.
                        readonly=mnt.readonly and (not host_ro or mnt.recursive_read_only),
                        recursive_readonly=mnt.recursive_read_only,
                        # Host mounts reach the VM (a slave of the host), and from there a
                        # HOST_TO_CONTAINER mount; a BIDIRECTIONAL one is shared all the way
                        # (the stub's VM is a mount namespace; a real VM's driver refuses it).
                        propagation=(
                            "rprivate"
                            if mnt.propagation == pb.PROPAGATION_PRIVATE
                            else "rshared"
                            if bidirectional
                            else "rslave"
                        ),
                    )
                )
            rootfs = m.Rootfs(lowers=lowers, upper=os.path.join(rw, "upper"), work=os.path.join(rw, "work"))
            spec = _process_spec(cfg, img, rootfs, mounts)
            ns = sandbox.config.linux.security_context.namespace_options
            userns = ns.userns_options
            if ns.HasField("userns_options") and userns.mode == pb.POD and userns.uids:
                # The pod's user namespace, the same for all its containers.
                spec = dataclasses.replace(
                    spec,
                    uid_mappings=[m.IdMap(u.container_id, u.host_id, u.length) for u in userns.uids],
                    gid_mappings=[m.IdMap(g.container_id, g.host_id, g.length) for g in userns.gids],
                )
            created = await agent.call(m.CreateRequest(id=container.id, spec=spec))
            user = {"uid": created.uid, "gid": created.gid, "groups": created.groups}
            container.backend_data["user"] = user  # ContainerStatus.user: the effective identity
        except BaseException:
            shutil.rmtree(host_dir, ignore_errors=True)
            raise
        self._owner[container.id] = sandbox.id
        pod.containers.add(container.id)
        container.backend_data["vm"] = pod.vm.id

    async def _subscribe(self, pod: _Pod, cid: str) -> VmProcess:
        """The container's output stream, subscribed before anything of it can be missed."""
        agent = self._agent(pod)
        stream = agent.stream()
        try:
            await agent.call(m.OutputRequest(id=cid, stream=stream.id))
        except BaseException:
            stream.forget()
            raise
        proc = pod.procs[cid] = VmProcess(stream)
        return proc

    async def start_container(
        self, container: contract.ContainerRecord, sandbox: contract.SandboxRecord
    ) -> contract.Started:
        pod = self._pod(sandbox.id)
        agent = self._agent(pod)
        proc = await self._subscribe(pod, container.id)
        state = await agent.call(m.StartRequest(id=container.id))
        return contract.Started(state.started_at or time.time_ns(), proc)

    async def reattach(
        self, container: contract.ContainerRecord, after: contract.LogMarks | None
    ) -> VmProcess | None:
        # The agent sends what it holds of the output (its backlog since the
        # last reader), so nothing written while the shim was away is lost.
        pod = self._pods.get(container.sandbox_id)
        if pod is None or pod.dead or container.id not in pod.containers:
            return None
        proc = await self._subscribe(pod, container.id)
        # An exit event that came before the subscription found no process to report to.
        state = await self._agent(pod).call(m.StateRequest(id=container.id))
        if state.status == "exited":
            proc.exit.set(contract.ExitInfo(state.exit_code, state.finished_at, state.reason))
        return proc

    async def stop_container(self, container: contract.ContainerRecord, timeout: int) -> contract.ExitInfo:
        pod = self._pods.get(container.sandbox_id)
        if pod is None or pod.dead:
            return contract.ExitInfo(VM_CRASH_EXIT, time.time_ns(), VM_CRASH_REASON, "the pod's VM is gone")
        agent = self._agent(pod)
        state = await agent.call(m.StateRequest(id=container.id))
        if state.status == "running":
            sig = int(contract.host_signal(container.config.stop_signal) or signal.SIGTERM)
            await agent.call(m.SignalRequest(id=container.id, signal=sig))
            try:
                state = await agent.call(m.WaitRequest(id=container.id), timeout=max(timeout, 0) or 0.01)
            except errors.UnavailableError:
                await agent.call(m.SignalRequest(id=container.id, signal=int(signal.SIGKILL)))
                state = await agent.call(m.WaitRequest(id=container.id))
        elif state.status == "created":
            return contract.ExitInfo(0, time.time_ns(), "Completed")
        info = contract.ExitInfo(state.exit_code, state.finished_at, state.reason)
        self._report_exit(pod, container.id, info)
        return info

    async def remove_container(self, container: contract.ContainerRecord) -> None:
        pod = self._pods.get(container.sandbox_id)
        if pod is not None and not pod.dead and pod.agent is not None and not pod.agent.closed:
            await pod.agent.call(m.RemoveRequest(id=container.id))
        if pod is not None:
            for tag in [t for t in pod.vm.shares if t.startswith(f"mnt-{container.id[:12]}-")]:
                await self.hv.detach_share(pod.vm, tag)
            await self.hv.detach_share(pod.vm, f"ct-{container.id[:12]}")
        if pod is not None:
            pod.containers.discard(container.id)
            pod.procs.pop(container.id, None)
        self._forget(container.id)

    async def update_container_resources(
        self, container: contract.ContainerRecord, resources: pb.LinuxContainerResources
    ) -> None:
        pod = self._pod_of(container)
        agent = self._agent(pod)
        # Hot-plug: the VM grows to fit the container's new limits (it never shrinks under them).
        if resources.cpu_quota > 0 and resources.cpu_period > 0:
            need = -(-resources.cpu_quota // resources.cpu_period)
            if need > pod.vm.vcpus:
                await self.hv.set_vcpus(pod.vm, need)
        if resources.memory_limit_in_bytes > pod.vm.memory_bytes:
            await self.hv.set_memory(pod.vm, resources.memory_limit_in_bytes + self.overhead_memory)
        await agent.call(m.UpdateRequest(id=container.id, resources=_resources(resources)))

    # ------------------------------------------------------------------ exec
    async def _exec(
        self,
        container: contract.ContainerRecord,
        cmd: Sequence[str],
        stdin: bool,
        tty: bool,
        on_output: Any,
        stdin_source: Any = None,
        resizes: Any = None,
    ) -> int:
        pod = self._pod_of(container)
        agent = self._agent(pod)
        stream = agent.stream()
        call = asyncio.ensure_future(
            agent.call(
                m.ExecRequest(id=container.id, stream=stream.id, args=list(cmd), stdin=stdin, tty=tty),
                timeout=None,
            )
        )
        helpers: list[asyncio.Task[None]] = []

        async def read_output() -> None:
            async for ch, data in stream.received():
                await on_output(ch, data)

        if stdin_source is not None:

            async def feed() -> None:
                while data := await stdin_source():
                    await stream.write(Ch.STDIN, data)
                await stream.close(Ch.STDIN)

            helpers.append(asyncio.ensure_future(feed()))
        if resizes is not None:

            async def resize() -> None:
                async for size in resizes:
                    with contextlib.suppress(errors.CriError):
                        await agent.call(
                            m.ResizeRequest(stream=stream.id, width=size.width, height=size.height)
                        )

            helpers.append(asyncio.ensure_future(resize()))
        reader = asyncio.ensure_future(read_output())
        try:
            result = await call
            await reader
            return result.exit_code
        except asyncio.CancelledError:
            # The shim's timeout, or the client gave up (its own deadline, a closed session):
            # the process goes too.
            with contextlib.suppress(errors.CriError):
                await asyncio.shield(agent.call(m.ExecKillRequest(id=container.id, stream=stream.id)))
            raise
        finally:
            for task in (*helpers, reader, call):
                task.cancel()
            await asyncio.gather(*helpers, reader, call, return_exceptions=True)
            stream.forget()

    async def exec_sync(self, container: contract.ContainerRecord, cmd: Sequence[str]) -> contract.ExecResult:
        out = bytearray()
        err = bytearray()

        async def collect(ch: int, data: bytes) -> None:
            (err if ch == Ch.STDERR else out).extend(data)

        code = await self._exec(container, cmd, False, False, collect)
        return contract.ExecResult(code, bytes(out), bytes(err))

    async def exec(
        self, container: contract.ContainerRecord, cmd: Sequence[str], io: contract.StreamIO
    ) -> int:
        async def forward(ch: int, data: bytes) -> None:
            if ch == Ch.STDERR and not io.tty:
                await io.write_stderr(data)
            else:
                await io.write_stdout(data)

        return await self._exec(
            container,
            cmd,
            io.stdin,
            io.tty,
            forward,
            io.read_stdin if io.stdin else None,
            io.resizes() if io.tty else None,
        )

    async def attach(self, container: contract.ContainerRecord, io: contract.StreamIO) -> None:
        pod = self._pod_of(container)
        agent = self._agent(pod)
        stream = agent.stream()
        await agent.call(m.AttachRequest(id=container.id, stream=stream.id, stdin=io.stdin))
        tasks: list[asyncio.Task[None]] = []
        if io.stdin:

            async def feed() -> None:
                while data := await io.read_stdin():
                    await stream.write(Ch.STDIN, data)
                await stream.close(Ch.STDIN)

            tasks.append(asyncio.ensure_future(feed()))
        if io.tty:

            async def resize() -> None:
                async for size in io.resizes():
                    await agent.call(m.ResizeRequest(id=container.id, width=size.width, height=size.height))

            tasks.append(asyncio.ensure_future(resize()))
        try:
            async for ch, data in stream.received():
                if ch == Ch.STDERR and io.stderr:
                    await io.write_stderr(data)
                elif io.stdout:
                    await io.write_stdout(data)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            stream.forget()

    async def port_forward(
        self, sandbox: contract.SandboxRecord, port: int, stream: contract.PortStream
    ) -> None:
        pod = self._pod(sandbox.id)
        agent = self._agent(pod)
        st: Stream = agent.stream()
        await agent.call(m.PortForwardRequest(port=port, stream=st.id))

        async def upstream() -> None:
            try:
                while data := await stream.read():
                    await st.write(Ch.STDIN, data)
                await st.close(Ch.STDIN)
            except ConnectionLost:
                pass

        up = asyncio.ensure_future(upstream())
        try:
            async for _ch, data in st.received():
                await stream.write(data)
        finally:
            up.cancel()
            await asyncio.gather(up, return_exceptions=True)
            st.forget()

    # ------------------------------------------------------------------ stats
    def _writable_usage(self, cid: str) -> UsageCache:
        layer = self._layer_usage_of.get(cid)
        if layer is None:
            layer = UsageCache(os.path.join(self._containers_dir, cid, "upper"), max_age=10.0)
            self._layer_usage_of[cid] = layer
        return layer

    async def container_stats(
        self, containers: Sequence[contract.ContainerRecord]
    ) -> dict[str, contract.ContainerUsage]:
        async def one(ct: contract.ContainerRecord) -> contract.ContainerUsage | None:
            pod = self._pods.get(ct.sandbox_id)
            if pod is None or pod.dead or pod.agent is None or pod.agent.closed:
                return None
            try:
                s = await pod.agent.call(m.StatsRequest(id=ct.id))
            except errors.CriError:
                return None
            used, inodes = await self._writable_usage(ct.id).get()
            sample = Sample(
                timestamp=time.time_ns(),
                cpu_ns=s.cpu_ns,
                memory_usage=s.memory_bytes,
                working_set=s.working_set_bytes,
            )
            return contract.ContainerUsage(sample, Layer(self._containers_dir, used, inodes))

        # Each VM's agent answers for its own containers: ask them all at once.
        got = await asyncio.gather(*(one(ct) for ct in containers))
        return {ct.id: u for ct, u in zip(containers, got, strict=True) if u is not None}

    async def sandbox_stats(
        self, sandboxes: Sequence[contract.SandboxRecord], containers: Sequence[contract.ContainerRecord]
    ) -> dict[str, contract.SandboxUsage]:
        per_ct = await self.container_stats(containers)
        out: dict[str, contract.SandboxUsage] = {}
        for sb in sandboxes:
            pod = self._pods.get(sb.id)
            if pod is None or pod.dead:
                continue
            cpu, mem = self.hv.usage(pod.vm)
            # The VM is the pod: its cgroup's figures, its memory as the limit.
            sample = Sample(
                timestamp=time.time_ns(),
                cpu_ns=cpu,
                memory_usage=mem,
                working_set=mem,
                memory_limit=pod.vm.memory_bytes,
            )
            mine = {cid: u for cid, u in per_ct.items() if self._owner.get(cid) == sb.id}
            out[sb.id] = contract.SandboxUsage(sample, containers=mine)
        return out

    async def sandbox_metrics(
        self, sandboxes: Sequence[contract.SandboxRecord], containers: Sequence[contract.ContainerRecord]
    ) -> dict[str, contract.PodMetrics]:
        """cAdvisor's container_* figures, from each VM's agent (its containers' cgroups and
        its network)."""
        running: dict[str, list[contract.ContainerRecord]] = {}
        for ct in containers:
            if ct.status.state == pb.CONTAINER_RUNNING:
                running.setdefault(ct.sandbox_id, []).append(ct)
        layer_fs = await asyncio.to_thread(_fs_of, self._containers_dir)

        async def one(sb: contract.SandboxRecord) -> contract.PodMetrics | None:
            pod = self._pods.get(sb.id)
            if pod is None or pod.dead or pod.agent is None or pod.agent.closed:
                return None
            cts = running.get(sb.id, [])
            try:
                got = await pod.agent.call(m.MetricsRequest(ids=[c.id for c in cts]))
            except errors.CriError:
                return None
            found: dict[str, contract.ContainerUsage] = {}
            for ct in cts:
                part = got.containers.get(ct.id)
                if part is None:
                    continue
                used, inodes = await self._writable_usage(ct.id).get()
                layer = (
                    dataclasses.replace(layer_fs, used_bytes=used, inodes_used=inodes) if layer_fs else None
                )
                found[ct.id] = contract.ContainerUsage(part.sample, layer, part.detail)
            return contract.PodMetrics(
                name=pod.vm.id,
                interfaces=None if pod.vm.host_network else tuple(got.interfaces),
                containers=found,
            )

        got = await asyncio.gather(*(one(sb) for sb in sandboxes))
        return {sb.id: pm for sb, pm in zip(sandboxes, got, strict=True) if pm is not None}

    # ------------------------------------------------------------------ images
    async def pull_image(
        self, image: pb.ImageSpec, auth: pb.AuthConfig | None, sandbox_config: pb.PodSandboxConfig | None
    ) -> str:
        creds = None
        if auth is not None:
            creds = Credentials(
                auth.username, auth.password, auth.auth, auth.identity_token, auth.registry_token
            )
        return await self.images.pull(image.image, creds)

    def _info(self, img: Image) -> contract.ImageInfo:
        uid, username = contract.image_user(str(img.config.get("User") or ""))
        return contract.ImageInfo(
            id=img.id,
            repo_tags=tuple(img.repo_tags),
            repo_digests=tuple(img.repo_digests),
            size=max(img.size, 1),
            uid=uid,
            username=username,
            pinned=img.pinned,
        )

    async def list_images(self) -> list[contract.ImageInfo]:
        return [self._info(i) for i in self.images.all()]

    async def image_status(self, image: pb.ImageSpec) -> contract.ImageInfo | None:
        img = self.images.resolve(image.image)
        return None if img is None else self._info(img)

    async def remove_image(self, image: pb.ImageSpec) -> None:
        await asyncio.to_thread(self.images.remove, image.image)

    async def image_fs_info(self) -> pb.ImageFsInfoResponse:
        """runv's own image store, and the directory of its containers' writable layers."""
        (used, inodes), (ct_used, ct_inodes) = await asyncio.gather(
            self._image_usage.get(), self._layer_usage.get()
        )
        now = time.time_ns()
        return pb.ImageFsInfoResponse(
            image_filesystems=[
                pb.FilesystemUsage(
                    timestamp=now,
                    fs_id=pb.FilesystemIdentifier(mountpoint=self.images.root),
                    used_bytes=pb.UInt64Value(value=used),
                    inodes_used=pb.UInt64Value(value=inodes),
                )
            ],
            container_filesystems=[
                pb.FilesystemUsage(
                    timestamp=now,
                    fs_id=pb.FilesystemIdentifier(mountpoint=self._containers_dir),
                    used_bytes=pb.UInt64Value(value=ct_used),
                    inodes_used=pb.UInt64Value(value=ct_inodes),
                )
            ],
        )

    # ------------------------------------------------------------------ test hooks
    def inject(self, fault: Fault, sandbox_id: str | None = None) -> None:
        """Inject a hypervisor fault, into the VM of ``sandbox_id`` when given."""
        self.hv.inject(fault, self._pods[sandbox_id].vm if sandbox_id else None)


# ---------------------------------------------------------------------- translation


def _resources(res: pb.LinuxContainerResources) -> m.Resources:
    return m.Resources(
        cpu_quota=res.cpu_quota,
        cpu_period=res.cpu_period,
        cpu_shares=res.cpu_shares,
        memory=res.memory_limit_in_bytes,
    )


def _process_spec(
    cfg: pb.ContainerConfig, img: Image, rootfs: m.Rootfs, mounts: list[m.Mount]
) -> m.ContainerSpec:
    """The neutral container description the agent turns into an OCI config."""
    icfg = img.config
    entry = list(cfg.command) or list(icfg.get("Entrypoint") or [])
    if cfg.args:
        cmd = list(cfg.args)
    elif cfg.command:
        cmd = []  # an explicit command drops the image's Cmd, as the kubelet expects
    else:
        cmd = list(icfg.get("Cmd") or [])
    args = entry + cmd
    if not args:
        raise errors.InvalidArgumentError("no command given and the image has none")
    env = [str(e) for e in icfg.get("Env") or []]
    keys = {kv.key for kv in cfg.envs}
    env = [e for e in env if e.split("=", 1)[0] not in keys] + [
        f"{kv.key}={kv.value.decode(errors='replace')}" for kv in cfg.envs
    ]
    sc = cfg.linux.security_context
    uid: int | None = None
    gid: int | None = None
    user_name = group_name = ""
    if sc.HasField("run_as_user"):
        uid = sc.run_as_user.value
    elif sc.run_as_username:
        user_name = sc.run_as_username
    else:
        image_user = str(icfg.get("User") or "")
        name, _, group = image_user.partition(":")
        if name.isdigit():
            uid = int(name)
        else:
            user_name = name
        if group.isdigit():
            gid = int(group)
        else:
            group_name = group
    if sc.HasField("run_as_group"):
        gid = sc.run_as_group.value
    return m.ContainerSpec(
        args=args,
        rootfs=rootfs,
        env=env,
        cwd=cfg.working_dir or str(icfg.get("WorkingDir") or "/"),
        user=m.User(uid=uid, name=user_name, gid=gid, group=group_name),
        supplemental_groups=list(sc.supplemental_groups),
        groups_policy="strict" if sc.supplemental_groups_policy == pb.Strict else "merge",
        tty=cfg.tty,
        stdin=cfg.stdin,
        stdin_once=cfg.stdin_once,
        privileged=sc.privileged,
        readonly_rootfs=sc.readonly_rootfs,
        no_new_privs=sc.no_new_privs,
        seccomp=_seccomp(sc),
        pid_mode={pb.POD: "pod", pb.NODE: "node"}.get(sc.namespace_options.pid, "container"),
        masked_paths=list(sc.masked_paths),
        readonly_paths=list(sc.readonly_paths),
        add_caps=["CAP_" + c.upper().removeprefix("CAP_") for c in sc.capabilities.add_capabilities],
        drop_caps=["CAP_" + c.upper().removeprefix("CAP_") for c in sc.capabilities.drop_capabilities],
        resources=_resources(cfg.linux.resources),
        mounts=mounts,
    )


def _seccomp(sc: pb.LinuxContainerSecurityContext) -> m.Seccomp | None:
    """The container's seccomp for the agent: None (unconfined), the runtime default, or a profile."""
    choice = contract.seccomp_of(
        sc.seccomp if sc.HasField("seccomp") else None, sc.seccomp_profile_path, sc.privileged
    )
    if choice.kind == "unconfined":
        return None
    if choice.kind == "default":
        return m.Seccomp(default=True)
    return m.Seccomp(profile=json.loads(choice.profile))


def _fs_of(path: str) -> Layer | None:
    """The filesystem holding ``path``: its device and size (usage filled in per container)."""
    try:
        st, vfs = os.stat(path), os.statvfs(path)
    except OSError:
        return None
    return Layer(
        mountpoint=path,
        used_bytes=0,
        inodes_used=0,
        device=cgroups.device_name(os.major(st.st_dev), os.minor(st.st_dev)),
        capacity_bytes=vfs.f_blocks * vfs.f_frsize,
        inodes_total=vfs.f_files,
        inodes_free=vfs.f_ffree,
    )


def vm_size(
    cpu_quota: int, cpu_period: int, memory_limit: int, overhead_vcpus: float, overhead_memory: int
) -> tuple[int, int]:
    """vCPUs and memory of a pod's VM: its limits plus overhead, 1 vCPU/128 MiB without limits."""
    vcpus = 1
    if cpu_quota > 0 and cpu_period > 0:
        vcpus = max(1, math.ceil(cpu_quota / cpu_period + overhead_vcpus))
    memory = 128 * MIB
    if memory_limit > 0:
        memory = memory_limit + overhead_memory
    return vcpus, memory
