"""RunPodSandbox, StopPodSandbox, RemovePodSandbox: a pod is a VM, sized from its resources,
booted cold or taken warm, set up by its agent (hostname, DNS, sysctls) and put on the pod
network."""

from __future__ import annotations

import math
import time
from typing import Any

import structlog

from backends import contract
from backends.contract import errors
from backends.runv.agent import messages as m
from backends.runv.hypervisor import MIB, VM, VMSpec
from backends.runv.network import host_ports
from cri_api import api_pb2 as pb

from . import plumbing
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


def _vm_id(sandbox_id: str) -> str:
    # Short: the agent socket path under the run dir must fit in sun_path.
    return sandbox_id[:16]


class Sandboxes:
    def __init__(self, shared: Shared, warm: WarmVMs) -> None:
        self._shared = shared
        self._warm = warm

    async def run(self, sandbox: contract.SandboxRecord) -> contract.SandboxNetwork:
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
            shared.overhead_memory + max(over.memory_limit_in_bytes, 0),
        )
        host_net = cfg.linux.security_context.namespace_options.network == pb.NODE
        if host_net:
            bad = sorted(k for k in cfg.linux.sysctls if k.startswith("net."))
            if bad:
                raise errors.InvalidArgumentError(f"sysctls {bad} are not allowed with host networking")
        ports = [] if host_net else host_ports(cfg.port_mappings)
        self._warm.starting += 1  # the pool's refill waits while any pod starts
        try:
            return await self._run(sandbox, vcpus, memory, host_net, ports)
        finally:
            self._warm.starting -= 1

    async def _run(
        self, sandbox: contract.SandboxRecord, vcpus: int, memory: int, host_net: bool, ports: list[Any]
    ) -> contract.SandboxNetwork:
        shared = self._shared
        cfg = sandbox.config
        pod = self._warm.take(vcpus, memory) if not host_net else None
        if pod is None:
            vm = await self._boot_cold(VMSpec(_vm_id(sandbox.id), vcpus, memory, cfg.hostname, host_net))
            pod = Pod(sandbox.id, vm)
        else:
            pod.sandbox_id = sandbox.id
            sandbox.backend_data["warm"] = True
            log.info("sandbox.warm_vm", sandbox_id=sandbox.id, vm=pod.vm.id)
        vm = pod.vm
        ip = ""
        try:
            if pod.agent is None:
                await shared.connect(pod)
            else:  # a warm VM, booted for no pod: sized up to this pod's needs, if it asks more
                if vcpus > vm.vcpus:
                    await self._warm.with_room(shared.hv.set_vcpus, vm, vcpus)
                if memory > vm.memory_bytes:
                    await self._warm.with_room(shared.hv.set_memory, vm, memory)
            assert pod.agent is not None
            if not host_net:
                ip = await plumbing.plumb(shared, sandbox, pod, ports)
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
            await shared.hv.destroy(vm)
            await plumbing.unplumb(shared, sandbox)
            await plumbing.unwire_warm(shared, pod)
            raise
        sandbox.backend_data["vm"] = vm.to_dict()
        shared.pods[sandbox.id] = pod
        shared.watch(pod)
        return contract.SandboxNetwork(ip=ip)

    async def _boot_cold(self, spec: VMSpec) -> VM:
        """Boot a VM for one pod."""
        try:
            return await self._warm.with_room(self._shared.hv.create, spec)
        except errors.CriError:
            raise
        except Exception as exc:  # BootError and friends: the VM is already gone
            raise errors.UnavailableError(f"VM boot failed: {exc or type(exc).__name__}") from exc

    async def stop(self, sandbox: contract.SandboxRecord) -> None:
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

    async def remove(self, sandbox: contract.SandboxRecord) -> None:
        await self.stop(sandbox)
        for cid, sid in list(self._shared.owner.items()):
            if sid == sandbox.id:
                self._shared.forget(cid)
