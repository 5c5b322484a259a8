"""The docker backend's Lifecycle part, which is its Resources part too.

Its own: the engine's connection (start, close, health, the cgroup driver it reports) and
recovery. The pods and containers are its two halves, :class:`.sandbox.Sandboxes` and
:class:`.container.Containers`, whose methods are the CRI's (``run_sandbox``...,
``create_container``...): the part is both of them, with no call passed on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

import structlog

from backends.contract import ContainerRecord, EventSink, Health, Observed, SandboxNetwork, SandboxRecord
from backends.contract.errors import CriError, FailedPreconditionError, InvalidArgumentError
from cri_api import api_pb2 as pb

from . import recovery
from .container import Containers
from .context import Shared
from .events import EventWatcher
from .exec import Execs
from .image_fs import StoreUsage
from .sandbox import Sandboxes
from .warm import WarmPauses

log = structlog.get_logger(__name__)


class DockerLifecycle(Sandboxes, Containers):
    def __init__(
        self,
        shared: Shared,
        *,
        handler: str,
        warm: WarmPauses | None,
        events: EventWatcher,
        execs: Execs,
        store_usage: StoreUsage,
        cgroup_driver: str,
    ) -> None:
        Sandboxes.__init__(self, shared, warm)
        Containers.__init__(self, shared, events)
        self._handler = handler
        self._execs = execs
        self._store_usage = store_usage
        self.cgroup_driver = pb.SYSTEMD if cgroup_driver == "systemd" else pb.CGROUPFS
        self._configured_driver = cgroup_driver

    async def start(self, events: EventSink) -> None:
        shared = self._shared
        shared.events = events
        with contextlib.suppress(CriError):
            info = await shared.engine.info(deadline=10)
            driver = info.get("CgroupDriver")
            if driver in ("systemd", "cgroupfs"):
                # The engine's: it is what reads the cgroup_parent the kubelet gives, so the kubelet
                # (which follows RuntimeConfig) must hear it, whatever the configuration says.
                self.cgroup_driver = pb.SYSTEMD if driver == "systemd" else pb.CGROUPFS
                if self._configured_driver and driver != self._configured_driver:
                    log.warning(
                        "docker.cgroup_driver_differs",
                        handler=self._handler,
                        configured=self._configured_driver,
                        engine=driver,
                        reported=driver,
                    )
            shared.volumes.check(str(info.get("Driver") or ""))  # image volumes: the backend's flag
        shared.spawn(self._events.watch())
        shared.spawn(self._store_usage.watch())
        if self.warm is not None:
            self.warm.pool.start()

    async def close(self) -> None:
        shared = self._shared
        if self.warm is not None:
            with contextlib.suppress(CriError):
                await self.warm.pool.close()  # its pause containers go with it
        shared.closed = True
        for t in list(shared.tasks):
            t.cancel()
        await asyncio.gather(*shared.tasks, return_exceptions=True)
        self._execs.close()
        await shared.engine.close()

    async def health(self) -> Health:
        try:
            await self._shared.engine.ping(deadline=5)
        except CriError as exc:
            return Health(False, False, reason="DockerDaemonNotReady", message=exc.message)
        cni = self._shared.cni
        if cni is not None and cni.adds:
            # Read again each time: ready within a Status poll of the network add-on's config.
            ready = await cni.readiness()
            if not ready.ready:
                return Health(True, False, reason=ready.reason, message=ready.message)
        return Health(True, True)

    def runtime_config(self) -> pb.RuntimeConfigResponse:
        return pb.RuntimeConfigResponse(linux=pb.LinuxRuntimeConfiguration(cgroup_driver=self.cgroup_driver))

    async def recover(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> tuple[dict[str, Observed], dict[str, Observed]]:
        made = self.warm.made if self.warm is not None else set()  # live: read after the engine's list
        return await recovery.recover(self._shared, sandboxes, containers, made)

    async def run_sandbox(self, sandbox: SandboxRecord) -> SandboxNetwork:
        self._check_cgroup_parent(sandbox.config.linux.cgroup_parent)
        return await super().run_sandbox(sandbox)

    def _check_cgroup_parent(self, parent: str) -> None:
        """A cgroup parent in the other driver's form (a kubelet that did not follow
        RuntimeConfig) would put the pod outside the kubelet's hierarchy, or fail in the engine
        with its own words: refused here, saying which driver the engine uses."""
        if not parent:
            return
        if self.cgroup_driver == pb.SYSTEMD and not parent.endswith(".slice"):
            raise InvalidArgumentError(
                f"cgroup_parent {parent!r} is not a systemd slice (NAME.slice): the engine uses the systemd "
                "cgroup driver, as RuntimeConfig says; the kubelet's cgroupDriver must be systemd"
            )
        if self.cgroup_driver == pb.CGROUPFS and parent.endswith(".slice") and "/" not in parent:
            raise InvalidArgumentError(
                f"cgroup_parent {parent!r} is a systemd slice name: the engine uses the cgroupfs cgroup "
                "driver, as RuntimeConfig says; the kubelet's cgroupDriver must be cgroupfs"
            )

    async def update_sandbox_resources(
        self, sandbox: SandboxRecord, request: pb.UpdatePodSandboxResourcesRequest
    ) -> None:
        """Nothing for the engine to do, as with containerd's runc pods: the engine has no
        pod-level object, and the pod's cgroup is the kubelet's (its ``cgroup_parent``, holding
        the pause and app containers), which the kubelet resized before this call. The shim
        records the resources and tells NRI plugins. A pod with no cgroup parent (made by hand,
        not by a kubelet) has no pod-level cgroup at all: that is refused rather than "applied"."""
        if not sandbox.config.linux.cgroup_parent:
            raise FailedPreconditionError(
                f"pod sandbox {sandbox.id} has no cgroup_parent: on the docker handler the pod-level "
                "cgroup is the kubelet's, and this pod has none to hold its resources"
            )
