"""DockerBackend: CRI pods and containers on a Docker Engine.

A sandbox is a pause container; app containers join its network, IPC and
UTS namespaces. The engine container ID of each record is kept in
``record.backend_data["engine_id"]`` and every engine container carries
its CRI ID in a label (see :mod:`.labels`).

This class only composes the parts, one per RPC family: :mod:`.sandbox`,
:mod:`.container`, :mod:`.exec`, :mod:`.stats`, :mod:`.images` (its list
mirrored by :mod:`.image_mirror`), :mod:`.image_fs`, :mod:`.events`,
:mod:`.logs`, :mod:`.recovery`; they share the engine and the per-object
state table (:mod:`.context`, :mod:`.state`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence

import structlog

from backends.contract import (
    Capability,
    ContainerRecord,
    ContainerUsage,
    EventSink,
    ExecResult,
    ExitInfo,
    Health,
    ImageInfo,
    LogMarks,
    Observed,
    PodMetrics,
    PortStream,
    SandboxNetwork,
    SandboxRecord,
    SandboxUsage,
    Started,
    StreamIO,
)
from backends.contract.errors import CriError, FailedPreconditionError, InvalidArgumentError
from backends.contract.pool import PoolFigures
from cri_api import api_pb2 as pb

from . import recovery
from .container import Containers
from .context import Shared, exit_info
from .engine import EngineClient
from .engine_api import EngineAPI, parse_time
from .events import EventWatcher
from .exec import Execs
from .image_fs import StoreUsage
from .image_volumes import ImageVolumes
from .images import Images
from .logs import DockerProcess, LogResume
from .network import CniPods
from .pod_files import PodFiles
from .sandbox import Sandboxes
from .stats import Stats
from .warm import PoolSettings, WarmPauses

__all__ = ["DockerBackend", "LogResume", "exit_info", "parse_time"]

log = structlog.get_logger(__name__)


class DockerBackend:
    """The ``docker`` runtime handler."""

    capabilities = (
        Capability.EXEC_SYNC
        | Capability.EXEC
        | Capability.ATTACH
        | Capability.PORT_FORWARD
        | Capability.STATS
        | Capability.METRICS
        | Capability.UPDATE_RESOURCES
        | Capability.UPDATE_SANDBOX_RESOURCES
        | Capability.IMAGES
        | Capability.HOST_NETWORK
    )

    def __init__(
        self,
        name: str,
        *,
        endpoint: str = "unix:///var/run/docker.sock",
        pause_image: str = "registry.k8s.io/pause:3.10",
        network: str = "bridge",
        runtimes: dict[str, str] | None = None,
        pull_no_progress_timeout: float = 120.0,
        cgroup_parent: str = "",
        call_timeout: float = 60.0,
        instance: str = "",
        cgroup_driver: str = "",
        engine: EngineAPI | None = None,
        state_dir: str = "",
        pool: PoolSettings | None = None,
        cni: CniPods | None = None,
    ) -> None:
        self.name = name
        self.instance = instance or name
        # ``engine``: another implementation of the engine API (the recording fake in tests).
        self.engine: EngineAPI = engine or EngineClient(endpoint, call_timeout=call_timeout)
        self.images = Images(self.engine, pause_image, pull_no_progress_timeout)
        self._shared = Shared(
            self.engine,
            self.images,
            instance=self.instance,
            network=network,
            runtimes=dict(runtimes or {}),
            cgroup_parent=cgroup_parent,
            volumes=ImageVolumes(os.path.join(state_dir, "image-volumes") if state_dir else ""),
            cni=cni,
            pod_files=PodFiles(os.path.join(state_dir, "pod-files") if state_dir else ""),
        )
        self.states = self._shared.states
        self._events = EventWatcher(self._shared)
        pool = pool or PoolSettings()
        self.warm = WarmPauses(self._shared, pool, name) if pool.size > 0 else None
        self._sandboxes = Sandboxes(self._shared, self.warm)
        self._containers = Containers(self._shared, self._events)
        self._execs = Execs(self._shared)
        self._stats = Stats(self._shared)
        self._store_usage = StoreUsage(self.engine, self._shared.spawn)
        self._cgroup_driver = pb.SYSTEMD if cgroup_driver == "systemd" else pb.CGROUPFS
        self._configured_driver = cgroup_driver

    def why_not(self, capability: Capability) -> str:
        """The engine's limits, said in the shim's refusals."""
        if capability & Capability.USER_NAMESPACES:
            return (
                "the Docker Engine's user namespaces are daemon-wide (dockerd --userns-remap maps every "
                "container alike); it cannot map a pod's IDs as the kubelet asks (hostUsers: false): use a "
                "runv handler, or hostUsers: true"
            )
        return ""

    # ---------------------------------------------------------------- lifecycle

    async def start(self, events: EventSink) -> None:
        self._shared.events = events
        with contextlib.suppress(CriError):
            info = await self.engine.info(deadline=10)
            driver = info.get("CgroupDriver")
            if driver in ("systemd", "cgroupfs"):
                # The engine's: it is what reads the cgroup_parent the kubelet gives, so the kubelet
                # (which follows RuntimeConfig) must hear it, whatever the configuration says.
                self._cgroup_driver = pb.SYSTEMD if driver == "systemd" else pb.CGROUPFS
                if self._configured_driver and driver != self._configured_driver:
                    log.warning(
                        "docker.cgroup_driver_differs",
                        handler=self.name,
                        configured=self._configured_driver,
                        engine=driver,
                        reported=driver,
                    )
            self._shared.volumes.check(str(info.get("Driver") or ""))
            if self._shared.volumes.usable:
                self.capabilities = type(self).capabilities | Capability.IMAGE_VOLUMES
        self._shared.spawn(self._events.watch())
        self._shared.spawn(self._store_usage.watch())
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
        await self.engine.close()

    async def health(self) -> Health:
        try:
            await self.engine.ping(deadline=5)
        except CriError as exc:
            return Health(False, False, reason="DockerDaemonNotReady", message=exc.message)
        cni = self._shared.cni
        if cni is not None and cni.adds:
            # Read again each time: ready within a Status poll of the network add-on's config.
            ready = await cni.readiness()
            if not ready.ready:
                return Health(True, False, reason=ready.reason, message=ready.message)
        return Health(True, True)

    def set_pod_cidr(self, cidr: str) -> None:
        """On CNI, the node's pod CIDR goes to the plugins (``ipRanges``, the config template);
        the engine's own network keeps its own range."""
        cni = self._shared.cni
        if cni is not None and cni.adds:
            cni.set_pod_cidr(cidr)

    def warm_figures(self) -> PoolFigures | None:
        return self.warm.pool.figures() if self.warm is not None else None

    def runtime_config(self) -> pb.RuntimeConfigResponse:
        return pb.RuntimeConfigResponse(linux=pb.LinuxRuntimeConfiguration(cgroup_driver=self._cgroup_driver))

    async def recover(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> tuple[dict[str, Observed], dict[str, Observed]]:
        made = self.warm.made if self.warm is not None else set()  # live: read after the engine's list
        return await recovery.recover(self._shared, sandboxes, containers, made)

    # ---------------------------------------------------------------- sandboxes

    async def run_sandbox(self, sandbox: SandboxRecord) -> SandboxNetwork:
        self._check_cgroup_parent(sandbox.config.linux.cgroup_parent)
        return await self._sandboxes.run(sandbox)

    def _check_cgroup_parent(self, parent: str) -> None:
        """A cgroup parent in the other driver's form (a kubelet that did not follow
        RuntimeConfig) would put the pod outside the kubelet's hierarchy, or fail in the engine
        with its own words: refused here, saying which driver the engine uses."""
        if not parent:
            return
        if self._cgroup_driver == pb.SYSTEMD and not parent.endswith(".slice"):
            raise InvalidArgumentError(
                f"cgroup_parent {parent!r} is not a systemd slice (NAME.slice): the engine uses the systemd "
                "cgroup driver, as RuntimeConfig says; the kubelet's cgroupDriver must be systemd"
            )
        if self._cgroup_driver == pb.CGROUPFS and parent.endswith(".slice") and "/" not in parent:
            raise InvalidArgumentError(
                f"cgroup_parent {parent!r} is a systemd slice name: the engine uses the cgroupfs cgroup "
                "driver, as RuntimeConfig says; the kubelet's cgroupDriver must be cgroupfs"
            )

    async def stop_sandbox(self, sandbox: SandboxRecord) -> None:
        await self._sandboxes.stop(sandbox)

    async def remove_sandbox(self, sandbox: SandboxRecord) -> None:
        await self._sandboxes.remove(sandbox)

    # ---------------------------------------------------------------- containers

    async def create_container(self, container: ContainerRecord, sandbox: SandboxRecord) -> None:
        await self._containers.create(container, sandbox)

    async def start_container(self, container: ContainerRecord, sandbox: SandboxRecord) -> Started:
        return await self._containers.start(container)

    async def reattach(self, container: ContainerRecord, after: LogMarks | None) -> DockerProcess | None:
        return self._containers.reattach(container, after)

    async def stop_container(self, container: ContainerRecord, timeout: int) -> ExitInfo:
        return await self._containers.stop(container, timeout)

    async def remove_container(self, container: ContainerRecord) -> None:
        await self._containers.remove(container)

    async def update_container_resources(
        self, container: ContainerRecord, resources: pb.LinuxContainerResources
    ) -> None:
        await self._containers.update_resources(container, resources)

    # ---------------------------------------------------------------- exec, attach, port-forward

    async def exec_sync(self, container: ContainerRecord, cmd: Sequence[str]) -> ExecResult:
        return await self._execs.run_sync(container, cmd)

    async def exec(self, container: ContainerRecord, cmd: Sequence[str], io: StreamIO) -> int:
        return await self._execs.run(container, cmd, io)

    async def attach(self, container: ContainerRecord, io: StreamIO) -> None:
        await self._execs.attach(container, io)

    async def port_forward(self, sandbox: SandboxRecord, port: int, stream: PortStream) -> None:
        await self._execs.port_forward(sandbox, port, stream)

    # ---------------------------------------------------------------- stats and metrics

    async def container_stats(self, containers: Sequence[ContainerRecord]) -> dict[str, ContainerUsage]:
        return await self._stats.containers(containers)

    async def sandbox_stats(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, SandboxUsage]:
        return await self._stats.sandboxes(sandboxes, containers)

    async def sandbox_metrics(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, PodMetrics]:
        return await self._stats.metrics(sandboxes, containers)

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

    # ---------------------------------------------------------------- images

    async def pull_image(
        self, image: pb.ImageSpec, auth: pb.AuthConfig | None, sandbox_config: pb.PodSandboxConfig | None
    ) -> str:
        return await self.images.pull(image.image, auth)

    async def list_images(self) -> list[ImageInfo]:
        return await self.images.list()

    def list_images_now(self) -> list[ImageInfo] | None:
        return self.images.list_now()

    def image_fs_info_now(self) -> pb.ImageFsInfoResponse | None:
        return self._store_usage.fs_info_now()

    async def image_status(self, image: pb.ImageSpec) -> ImageInfo | None:
        return await self.images.status(image.image)

    async def remove_image(self, image: pb.ImageSpec) -> None:
        await self.images.remove(image.image)

    async def image_fs_info(self) -> pb.ImageFsInfoResponse:
        return await self._store_usage.fs_info()
