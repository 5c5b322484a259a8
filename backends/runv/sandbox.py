"""RunPodSandbox, StopPodSandbox, RemovePodSandbox: a pod is a VM, sized from its resources,
booted cold or taken warm, set up by its agent (hostname, DNS, sysctls) and put on the pod
network: the backend's own bridge (plumbing.py), or the node's CNI network (cninet.py)."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import structlog

from backends import contract
from backends.cni.pinned import NETNS, CniPods
from backends.contract import errors
from backends.runv.agent import messages as m
from backends.runv.hypervisor import MIB, VM, PodLimits, VMSpec
from backends.runv.network import host_ports
from cri_api import api_pb2 as pb

from . import cninet, plumbing
from .context import Shared
from .state import Pod
from .warm import WarmVMs

log = structlog.get_logger(__name__)


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


def overhead_memory(pod_overhead: int, handler_overhead: int, extra: int) -> int:
    """The memory a pod's VM gets beyond its containers' limits: the pod's overhead (its
    RuntimeClass's, which the kubelet adds to the pod cgroup's limit) less what the VM holds of
    the host beyond its memory (``extra``: a QEMU's guest kernel and agent, and QEMU itself), and
    at least the handler's ``overhead_memory_mib``. The VM then fits in the pod's cgroup when
    the pod's overhead covers it; one that does not is refused at RunPodSandbox."""
    return max(pod_overhead - extra, handler_overhead)


def _vm_id(sandbox_id: str) -> str:
    # Short: the agent socket path under the run dir must fit in sun_path.
    return sandbox_id[:16]


def pod_limits(
    vm: VM,
    resources: pb.LinuxContainerResources,
    overhead: pb.LinuxContainerResources,
    overhead_vcpus: float,
    overhead_memory: int,
) -> PodLimits:
    """The VM's size for a pod's new resources (UpdatePodSandboxResources), as ``vm_size`` sizes
    it at boot: the pod's CPU limit plus the pod's and the handler's CPU overhead, its memory
    limit plus ``overhead_memory`` (the pod's and the handler's: :func:`overhead_memory`).
    A resource without a limit leaves the VM's size of it as it is (a VM has one either way)."""
    vcpus, memory = vm_size(
        resources.cpu_quota,
        resources.cpu_period or 100_000,
        resources.memory_limit_in_bytes,
        overhead_vcpus
        + (overhead.cpu_quota / (overhead.cpu_period or 100_000) if overhead.cpu_quota > 0 else 0),
        overhead_memory,
    )
    shares = resources.cpu_shares + overhead.cpu_shares
    return PodLimits(
        vcpus=vcpus if resources.cpu_quota > 0 else vm.vcpus,
        memory_bytes=memory if resources.memory_limit_in_bytes > 0 else vm.memory_bytes,
        cpu_shares=min(shares, 262144) if resources.cpu_shares else 0,
        cpuset_cpus=resources.cpuset_cpus,
        cpuset_mems=resources.cpuset_mems,
    )


class Sandboxes:
    def __init__(self, shared: Shared, warm: WarmVMs) -> None:
        self._shared = shared
        self._warm = warm

    async def run_sandbox(self, sandbox: contract.SandboxRecord) -> contract.SandboxNetwork:
        shared = self._shared
        cfg = sandbox.config
        res = cfg.linux.resources
        over = cfg.linux.overhead
        vcpus, memory = vm_size(
            res.cpu_quota,
            res.cpu_period or 100_000,
            res.memory_limit_in_bytes,
            shared.overhead_vcpus
            + (over.cpu_quota / (over.cpu_period or 100_000) if over.cpu_quota > 0 else 0),
            overhead_memory(
                max(over.memory_limit_in_bytes, 0), shared.overhead_memory, shared.hv.extra_memory
            ),
        )
        host_net = cfg.linux.security_context.namespace_options.network == pb.NODE
        if host_net:
            bad = sorted(k for k in cfg.linux.sysctls if k.startswith("net."))
            if bad:
                raise errors.InvalidArgumentError(f"sysctls {bad} are not allowed with host networking")
        # On CNI the portmap plugin publishes the host ports; host-network pods skip CNI.
        cni = shared.cni if shared.cni is not None and shared.cni.adds and not host_net else None
        ports = [] if host_net or cni is not None else host_ports(cfg.port_mappings)
        self._warm.starting += 1  # the pool's refill waits while any pod starts
        try:
            return await self._run(sandbox, vcpus, memory, host_net, ports, cni)
        finally:
            self._warm.starting -= 1

    async def _run(
        self,
        sandbox: contract.SandboxRecord,
        vcpus: int,
        memory: int,
        host_net: bool,
        ports: list[Any],
        cni: CniPods | None,
    ) -> contract.SandboxNetwork:
        shared = self._shared
        cfg = sandbox.config
        pod = self._warm.take(vcpus, memory) if not host_net else None
        if pod is None:
            own_netns = cni is not None
            spec = VMSpec(
                _vm_id(sandbox.id),
                vcpus,
                memory,
                cfg.hostname,
                host_net,
                own_netns,
                cgroup_parent=cfg.linux.cgroup_parent,
            )
            pod = Pod(sandbox.id, await self._boot_cold(spec))
        else:
            pod.sandbox_id = sandbox.id
            sandbox.backend_data["warm"] = True
            log.info("sandbox.warm_vm", sandbox_id=sandbox.id, vm=pod.vm.id)
        vm = pod.vm
        net = contract.SandboxNetwork()
        try:
            if pod.agent is None:
                await shared.connect(pod)
            else:  # a warm VM, booted for no pod: sized up to this pod's needs, if it asks more
                if vcpus > vm.vcpus:
                    await self._warm.with_room(shared.hv.set_vcpus, vm, vcpus)
                if memory > vm.memory_bytes:
                    await self._warm.with_room(shared.hv.set_memory, vm, memory)
                await shared.hv.place(vm, cfg.linux.cgroup_parent)  # into the pod's cgroup
            assert pod.agent is not None
            if cni is not None:
                net = await cninet.attach(shared, sandbox, pod)
            elif not host_net:
                net = contract.SandboxNetwork(ip=await plumbing.plumb(shared, sandbox, pod, ports))
            dns = cfg.dns_config
            await pod.agent.call(
                m.SetupRequest(
                    hostname=cfg.hostname or sandbox.id[:12],
                    dns=m.Dns(list(dns.servers), list(dns.searches), list(dns.options)),
                    sysctls=dict(cfg.linux.sysctls),
                )
            )
        except BaseException:
            # Shielded: a RunPodSandbox given up (cancelled) again still leaves nothing.
            await asyncio.shield(self._undo(sandbox, pod, cni))
            raise
        sandbox.backend_data["vm"] = vm.to_dict()
        shared.pods[sandbox.id] = pod
        shared.watch(pod)
        return net

    async def _undo(self, sandbox: contract.SandboxRecord, pod: Pod, cni: CniPods | None) -> None:
        shared = self._shared
        if pod.agent is not None:
            await pod.agent.close()
        if cni is not None:
            await cni.release(sandbox)  # before the VM goes, as a stop does
        await shared.hv.destroy(pod.vm)
        await plumbing.unplumb(shared, sandbox)
        await plumbing.unwire_warm(shared, pod)

    async def _boot_cold(self, spec: VMSpec) -> VM:
        """Boot a VM for one pod."""
        try:
            return await self._warm.with_room(self._shared.hv.create, spec)
        except errors.CriError:
            raise
        except Exception as exc:  # BootError and friends: the VM is already gone
            raise errors.UnavailableError(f"VM boot failed: {exc or type(exc).__name__}") from exc

    async def update_sandbox_resources(
        self, sandbox: contract.SandboxRecord, request: pb.UpdatePodSandboxResourcesRequest
    ) -> None:
        """The pod's new resources on its VM (the driver says what its VMs can take); the VM's
        size in the record follows, for a restarted shim. Fields the VM's cgroup has no pod-level
        use for (swap, OOM score, hugepages, unified keys) are passed over, with a log line."""
        shared = self._shared
        pod = shared.pod(sandbox.id)
        linux = sandbox.config.linux
        resources = request.resources if request.HasField("resources") else linux.resources
        overhead = request.overhead if request.HasField("overhead") else linux.overhead
        extra = overhead_memory(
            max(overhead.memory_limit_in_bytes, 0), shared.overhead_memory, shared.hv.extra_memory
        )
        limits = pod_limits(pod.vm, resources, overhead, shared.overhead_vcpus, extra)
        await shared.hv.set_pod_limits(pod.vm, limits)
        sandbox.backend_data["vm"] = pod.vm.to_dict()
        unused = [
            name
            for name, set_ in (
                ("memory_swap_limit_in_bytes", resources.memory_swap_limit_in_bytes),
                ("oom_score_adj", resources.oom_score_adj),
                ("hugepage_limits", len(resources.hugepage_limits)),
                ("unified", len(resources.unified)),
            )
            if set_
        ]
        if unused:
            log.info("sandbox.resources_not_applied", sandbox_id=sandbox.id, fields=unused)
        log.info(
            "sandbox.resized",
            sandbox_id=sandbox.id,
            vm=pod.vm.id,
            vcpus=limits.vcpus,
            memory=limits.memory_bytes,
        )

    async def stop_sandbox(self, sandbox: contract.SandboxRecord) -> None:
        shared = self._shared
        unreleased: errors.CriError | None = None
        if NETNS in sandbox.backend_data and shared.cni is not None:
            try:
                await shared.cni.detach(sandbox)  # DEL from the cache, while the VM still runs
            except errors.CriError as exc:
                unreleased = exc
        await self._stop_vm(sandbox)
        if unreleased is not None:
            # The pod is stopped and its network not released: the caller hears why (and stops
            # again, which DELs again), and the record says NOTREADY, so that a remove needs
            # no stop first; the remove releases what it can whatever the plugins say.
            if shared.events is not None:
                shared.events.sandbox_not_ready(sandbox.id, "CNI DEL failed")
            raise unreleased

    async def _stop_vm(self, sandbox: contract.SandboxRecord) -> None:
        shared = self._shared
        pod = shared.pods.get(sandbox.id)
        if pod is None:
            data = sandbox.backend_data.get("vm")
            if data:  # adopted but never connected, or a leftover
                await shared.hv.destroy(VM.from_dict(data))
            await plumbing.unplumb(shared, sandbox)
            return
        pod.stopping = True
        if pod.agent is not None and not pod.agent.closed and not pod.dead:
            try:
                await pod.agent.call(m.ShutdownRequest(), timeout=min(shared.agent_timeout, 5.0))
                graceful = True
            except errors.CriError:
                graceful = False  # a hung or lost agent: no point waiting for a power-off
            await pod.agent.close()
            if graceful:
                await shared.hv.stop(pod.vm, timeout=5.0)
            else:
                await shared.hv.destroy(pod.vm)
        else:
            if pod.agent is not None:
                await pod.agent.close()
            await shared.hv.destroy(pod.vm)
        if pod.monitor is not None:
            pod.monitor.cancel()
        now = time.time_ns()
        for cid in sorted(pod.containers):
            shared.report_exit(pod, cid, contract.ExitInfo(137, now, "Error", "the pod's VM was stopped"))
        del shared.pods[sandbox.id]
        await plumbing.unplumb(shared, sandbox)

    async def remove_sandbox(self, sandbox: contract.SandboxRecord) -> None:
        if NETNS in sandbox.backend_data and self._shared.cni is not None:
            await self._shared.cni.release(sandbox)  # a plugin's failure is logged, never raised
        await self._stop_vm(sandbox)
        for cid, sid in list(self._shared.owner.items()):
            if sid == sandbox.id:
                self._shared.forget(cid)
