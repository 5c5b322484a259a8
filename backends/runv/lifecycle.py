"""The runv backend's Lifecycle part, which is its Resources part too.

Its own: the hypervisor's start and close, health, the cgroup driver it reports, and
recovery (then the warm pool starts). The pods and containers are its two halves,
:class:`.sandbox.Sandboxes` and :class:`.container.Containers`, whose methods are the CRI's
(``run_sandbox``..., ``create_container``..., and the two resource updates): the part is
both of them, with no call passed on.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Sequence

from backends import contract
from backends.contract.pool import Pool
from backends.runv.drivers.stub import StubHypervisor
from backends.runv.images.service import VmImages
from cri_api import api_pb2 as pb

from . import recovery
from .container import Containers
from .context import Shared
from .sandbox import Sandboxes
from .state import Pod
from .warm import WarmVMs


class VmLifecycle(Sandboxes, Containers):
    def __init__(
        self, shared: Shared, warm: WarmVMs, images: VmImages, *, runc: str, cgroup_driver: str
    ) -> None:
        Sandboxes.__init__(self, shared, warm)
        Containers.__init__(self, shared, images)
        self._runc = runc
        # What RuntimeConfig reports: the kubelet makes its pod cgroups with that driver; a VM's
        # cgroup goes below the pod's either way (a systemd slice name is taken where systemd
        # puts it in cgroupfs: backends.linux.cgroups.cgroupfs_path).
        self._cgroup_driver = pb.SYSTEMD if cgroup_driver == "systemd" else pb.CGROUPFS

    @property
    def _pool(self) -> Pool[Pod]:
        return self._warm.pool

    async def start(self, events: contract.EventSink) -> None:
        shared = self._shared
        shared.events = events
        os.makedirs(shared.containers_dir, exist_ok=True)
        if isinstance(shared.hv, StubHypervisor):
            shared.hv.prepare()  # its VM template comes up while the shim does

    async def close(self) -> None:
        # Warm VMs belong to no pod: they go. Pods' VMs keep running (recovered on the
        # next start); only our side goes away.
        await self._pool.close()
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
        await self._shared.hv.close()
        if not pods:
            self._shared.hv.tidy()  # no VM left: drop the empty run dir and cgroup parent
        pods.clear()

    async def health(self) -> contract.Health:
        if shutil.which(self._runc) is None:
            return contract.Health(False, True, "RuncMissing", "runc is not installed")
        cni = self._shared.cni
        if cni is not None and cni.adds:
            # Read again each time: ready within a Status poll of the network add-on's config.
            ready = await cni.readiness()
            if not ready.ready:
                return contract.Health(True, False, reason=ready.reason, message=ready.message)
        return contract.Health(True, True)

    def runtime_config(self) -> pb.RuntimeConfigResponse:
        return pb.RuntimeConfigResponse(linux=pb.LinuxRuntimeConfiguration(cgroup_driver=self._cgroup_driver))

    async def recover(
        self, sandboxes: Sequence[contract.SandboxRecord], containers: Sequence[contract.ContainerRecord]
    ) -> tuple[dict[str, contract.Observed], dict[str, contract.Observed]]:
        observed = await recovery.recover(self._shared, sandboxes, containers)
        # Only now: a warm VM booted before recovery would have been taken for a leftover.
        self._pool.start()
        return observed
