"""RunvBackend: one VM per pod, containers inside it through the guest agent.

A sandbox is a VM booted by a hypervisor driver (:mod:`.drivers`); its record keeps the VM
in ``backend_data["vm"]`` (and its network in ``["net"]``, or its pinned namespace in
``["netns"]`` on CNI), so that a restarted shim adopts it. This class only composes the
parts, one per RPC family: :mod:`.sandbox` (its network: :mod:`.plumbing` on the own bridge,
:mod:`.cninet` on CNI), :mod:`.container`, :mod:`.exec`, :mod:`.stats`,
:mod:`.images.service`, :mod:`.recovery`, :mod:`.warm`; they share the driver, the pod
networks, the image store and the live pods (:mod:`.context`, :mod:`.state`).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
from collections.abc import Sequence
from typing import Any

from backends import contract
from backends.cni.pinned import CniPods
from backends.contract import errors
from backends.contract.pool import PoolFigures
from backends.runv import config as runv_config
from backends.runv.agent import rro
from backends.runv.drivers.qemu import QemuHypervisor
from backends.runv.drivers.stub import StubHypervisor
from backends.runv.hypervisor import MIB, Fault, Hypervisor
from backends.runv.images.service import Images
from backends.runv.images.store import ImageStore
from backends.runv.network import PodNetwork
from backends.runv.pool import PoolConfig
from cri_api import api_pb2 as pb

from . import recovery
from .container import Containers
from .context import VM_CRASH_EXIT, VM_CRASH_REASON, Shared
from .exec import Execs
from .sandbox import Sandboxes, vm_size
from .state import VmProcess
from .stats import Stats
from .warm import WarmVMs

__all__ = ["VM_CRASH_EXIT", "VM_CRASH_REASON", "RunvBackend", "VmProcess"]


def _driver(handler: str, config: dict[str, Any], run_dir: str) -> Hypervisor:
    """The hypervisor driver the handler's config names, with its table."""
    driver = str(config.get("driver", "stub"))
    if driver not in ("stub", "qemu"):
        raise errors.InvalidArgumentError(
            f"runv handler {handler!r}: driver must be 'stub' or 'qemu', not {driver!r}"
        )
    table = dict(config.get(driver) or {})
    table.setdefault("run_dir", run_dir)
    return QemuHypervisor(table) if driver == "qemu" else StubHypervisor(table)


class RunvBackend:
    """The ``runv`` runtime handler."""

    capabilities = (
        contract.Capability.EXEC_SYNC
        | contract.Capability.EXEC
        | contract.Capability.ATTACH
        | contract.Capability.PORT_FORWARD
        | contract.Capability.STATS
        | contract.Capability.METRICS
        | contract.Capability.UPDATE_RESOURCES
        | contract.Capability.UPDATE_SANDBOX_RESOURCES
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
        # Pins of pod namespaces under root, not run_dir: every directory there is a VM's.
        self.cni = CniPods.of_handler(name, config, self.root)
        self.driver = str(config.get("driver", "stub"))
        self.hv: Hypervisor = hypervisor if hypervisor is not None else _driver(name, config, run_dir)
        caps = type(self).capabilities
        if self.hv.name == "qemu":
            # A VM has its own kernel (Debian's 6.1: recursive read-only mounts) and network.
            caps = (caps | contract.Capability.RECURSIVE_READ_ONLY_MOUNTS) & ~contract.Capability.HOST_NETWORK
        elif rro.supported():  # the stub's guests run on this kernel
            caps |= contract.Capability.RECURSIVE_READ_ONLY_MOUNTS
        self.capabilities = caps
        # What RuntimeConfig reports: the kubelet's pod cgroups are its own business here (a VM's
        # cgroup is runv's, under its cgroup_parent, whichever driver the kubelet uses).
        self._cgroup_driver = pb.SYSTEMD if config.get("cgroup_driver") == "systemd" else pb.CGROUPFS
        self.overhead_vcpus = float(config.get("overhead_vcpus", 0.0))
        self.overhead_memory = int(config.get("overhead_memory_mib", 32)) * MIB
        self.images = ImageStore(os.path.join(self.root, "images"), config.get("insecure_registries"))
        net_config = dict(config.get("network") or {})
        net_config.setdefault("owner", hashlib.sha256(os.path.abspath(self.root).encode()).hexdigest()[:12])
        self.net = PodNetwork(net_config)
        containers_dir = os.path.join(self.root, "containers")
        self._shared = Shared(
            self.hv,
            self.net,
            self.images,
            containers_dir=containers_dir,
            agent_timeout=float(config["agent_timeout"]) if config.get("agent_timeout") is not None else None,
            overhead_vcpus=self.overhead_vcpus,
            overhead_memory=self.overhead_memory,
            cni=self.cni,
        )
        # Warm VMs: the shape of a pod without limits unless the pool table says otherwise.
        self.pool_config = PoolConfig.from_table(config.get("pool"), name)
        plain_vcpus, plain_memory = vm_size(0, 100_000, 0, self.overhead_vcpus, self.overhead_memory)
        self.pool_shape = (
            self.pool_config.vcpus or plain_vcpus,
            self.pool_config.memory_mib * MIB or plain_memory,
        )
        self.warm = WarmVMs(self._shared, self.pool_config, self.pool_shape)
        self.pool = self.warm.pool
        self._images = Images(self.images, containers_dir)
        self._sandboxes = Sandboxes(self._shared, self.warm)
        self._containers = Containers(self._shared, self._images)
        self._execs = Execs(self._shared)
        self._stats = Stats(self._shared)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, events: contract.EventSink) -> None:
        self._shared.events = events
        os.makedirs(self._shared.containers_dir, exist_ok=True)
        if isinstance(self.hv, StubHypervisor):
            self.hv.prepare()  # its VM template comes up while the shim does

    async def close(self) -> None:
        # Warm VMs belong to no pod: they go. Pods' VMs keep running (recovered on the
        # next start); only our side goes away.
        await self.pool.close()
        pods = self._shared.pods
        tasks: list[asyncio.Task[None]] = []
        for pod in pods.values():
            if pod.monitor is not None:
                tasks.append(pod.monitor)
            if pod.agent is not None:
                await pod.agent.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.hv.close()
        if not pods:
            self.hv.tidy()  # no VM left: drop the empty run dir and cgroup parent
        pods.clear()

    @property
    def agent_timeout(self) -> float:
        return self._shared.agent_timeout

    @agent_timeout.setter
    def agent_timeout(self, value: float) -> None:
        self._shared.agent_timeout_setting = value

    async def health(self) -> contract.Health:
        if shutil.which(str(self.config.get("stub", {}).get("runc", "runc"))) is None:
            return contract.Health(False, True, "RuncMissing", "runc is not installed")
        if self.cni is not None and self.cni.adds:
            # Read again each time: ready within a Status poll of the network add-on's config.
            ready = await self.cni.readiness()
            if not ready.ready:
                return contract.Health(True, False, reason=ready.reason, message=ready.message)
        return contract.Health(True, True)

    def set_pod_cidr(self, cidr: str) -> None:
        """On CNI, the node's pod CIDR goes to the plugins (``ipRanges``, the config template);
        the backend's own bridge keeps its own subnet."""
        if self.cni is not None and self.cni.adds:
            self.cni.set_pod_cidr(cidr)

    def warm_figures(self) -> PoolFigures | None:
        return self.pool.figures() if self.pool.size > 0 else None

    def runtime_config(self) -> pb.RuntimeConfigResponse:
        return pb.RuntimeConfigResponse(linux=pb.LinuxRuntimeConfiguration(cgroup_driver=self._cgroup_driver))

    async def recover(
        self, sandboxes: Sequence[contract.SandboxRecord], containers: Sequence[contract.ContainerRecord]
    ) -> tuple[dict[str, contract.Observed], dict[str, contract.Observed]]:
        observed = await recovery.recover(self._shared, sandboxes, containers)
        # Only now: a warm VM booted before recovery would have been taken for a leftover.
        self.pool.start()
        return observed

    # ------------------------------------------------------------------ sandboxes
    async def run_sandbox(self, sandbox: contract.SandboxRecord) -> contract.SandboxNetwork:
        return await self._sandboxes.run(sandbox)

    async def stop_sandbox(self, sandbox: contract.SandboxRecord) -> None:
        await self._sandboxes.stop(sandbox)

    async def remove_sandbox(self, sandbox: contract.SandboxRecord) -> None:
        await self._sandboxes.remove(sandbox)

    # ------------------------------------------------------------------ containers
    async def create_container(
        self, container: contract.ContainerRecord, sandbox: contract.SandboxRecord
    ) -> None:
        await self._containers.create(container, sandbox)

    async def start_container(
        self, container: contract.ContainerRecord, sandbox: contract.SandboxRecord
    ) -> contract.Started:
        return await self._containers.start(container, sandbox)

    async def reattach(
        self, container: contract.ContainerRecord, after: contract.LogMarks | None
    ) -> VmProcess | None:
        return await self._containers.reattach(container, after)

    async def stop_container(self, container: contract.ContainerRecord, timeout: int) -> contract.ExitInfo:
        return await self._containers.stop(container, timeout)

    async def remove_container(self, container: contract.ContainerRecord) -> None:
        await self._containers.remove(container)

    async def update_container_resources(
        self, container: contract.ContainerRecord, resources: pb.LinuxContainerResources
    ) -> None:
        await self._containers.update_resources(container, resources)

    async def update_sandbox_resources(
        self, sandbox: contract.SandboxRecord, request: pb.UpdatePodSandboxResourcesRequest
    ) -> None:
        await self._sandboxes.update_resources(sandbox, request)

    # ------------------------------------------------------------------ exec, attach, port-forward
    async def exec_sync(self, container: contract.ContainerRecord, cmd: Sequence[str]) -> contract.ExecResult:
        return await self._execs.run_sync(container, cmd)

    async def exec(
        self, container: contract.ContainerRecord, cmd: Sequence[str], io: contract.StreamIO
    ) -> int:
        return await self._execs.run(container, cmd, io)

    async def attach(self, container: contract.ContainerRecord, io: contract.StreamIO) -> None:
        await self._execs.attach(container, io)

    async def port_forward(
        self, sandbox: contract.SandboxRecord, port: int, stream: contract.PortStream
    ) -> None:
        await self._execs.port_forward(sandbox, port, stream)

    # ------------------------------------------------------------------ stats and metrics
    async def container_stats(
        self, containers: Sequence[contract.ContainerRecord]
    ) -> dict[str, contract.ContainerUsage]:
        return await self._stats.containers(containers)

    async def sandbox_stats(
        self, sandboxes: Sequence[contract.SandboxRecord], containers: Sequence[contract.ContainerRecord]
    ) -> dict[str, contract.SandboxUsage]:
        return await self._stats.sandboxes(sandboxes, containers)

    async def sandbox_metrics(
        self, sandboxes: Sequence[contract.SandboxRecord], containers: Sequence[contract.ContainerRecord]
    ) -> dict[str, contract.PodMetrics]:
        return await self._stats.metrics(sandboxes, containers)

    # ------------------------------------------------------------------ images
    async def pull_image(
        self, image: pb.ImageSpec, auth: pb.AuthConfig | None, sandbox_config: pb.PodSandboxConfig | None
    ) -> str:
        return await self._images.pull(image, auth)

    async def list_images(self) -> list[contract.ImageInfo]:
        return await self._images.list()

    async def image_status(self, image: pb.ImageSpec) -> contract.ImageInfo | None:
        return await self._images.status(image)

    async def remove_image(self, image: pb.ImageSpec) -> None:
        await self._images.remove(image)

    async def image_fs_info(self) -> pb.ImageFsInfoResponse:
        return await self._images.fs_info()

    # ------------------------------------------------------------------ test hooks
    def inject(self, fault: Fault, sandbox_id: str | None = None) -> None:
        """Inject a hypervisor fault, into the VM of ``sandbox_id`` when given."""
        self.hv.inject(fault, self._shared.pods[sandbox_id].vm if sandbox_id else None)
