"""The fake runtime: complete CRI behaviour in memory, plus a spy.

Composed of one part per concern:

- :mod:`backends.fake.lifecycle`: sandboxes, containers, running programs, exits, logs;
- :mod:`backends.fake.images`: the image store (persisted in the state directory);
- :mod:`backends.fake.program`: what a container runs, the built-in shell, exec rules;
- :mod:`backends.fake.exec`: ExecSync, exec, attach, port-forward;
- :mod:`backends.fake.stats`: usage figures;
- :mod:`backends.fake.faults`: the spy and injection (``calls``, ``set_latency``,
  ``inject_error``) that ``FakeBackend`` wears around the rest, as any backend can.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

from backends.contract import (
    Capability,
    ContainerProcess,
    ContainerRecord,
    ContainerUsage,
    EventSink,
    ExecResult,
    ExitInfo,
    Health,
    ImageInfo,
    LogMarks,
    Observed,
    PortStream,
    SandboxNetwork,
    SandboxRecord,
    SandboxUsage,
    Started,
    StreamIO,
)
from backends.fake.exec import FakeExec
from backends.fake.faults import Call, FaultInjector, _ImagesNowFaults
from backends.fake.images import ImageStore
from backends.fake.lifecycle import FakeLifecycle
from backends.fake.program import Programs
from backends.fake.stats import FakeStats
from cri_api import api_pb2 as pb

CAPABILITIES = (
    Capability.EXEC_SYNC
    | Capability.EXEC
    | Capability.ATTACH
    | Capability.PORT_FORWARD
    | Capability.STATS
    | Capability.UPDATE_RESOURCES
    | Capability.UPDATE_SANDBOX_RESOURCES
    | Capability.IMAGES
    | Capability.HOST_NETWORK
)


class FakeRuntime:
    """The fake's parts as one Backend, without the spy: each method goes to the part that owns it."""

    def __init__(
        self, name: str, options: Mapping[str, Any], clock: Callable[[], int] = time.time_ns
    ) -> None:
        self.name = name
        self.capabilities = CAPABILITIES
        self.programs = Programs(name, options)
        self.images = ImageStore(options, clock)
        self.lifecycle = FakeLifecycle(options, self.images, self.programs, clock)
        self.streams = FakeExec(options, self.lifecycle, self.programs)
        self.stats = FakeStats(self.lifecycle, self.images.containers_dir, clock)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, events: EventSink) -> None:
        await self.lifecycle.start(events)
        self.images.load()

    async def close(self) -> None:
        await self.lifecycle.close()

    async def health(self) -> Health:
        return await self.lifecycle.health()

    def runtime_config(self) -> pb.RuntimeConfigResponse:
        return self.lifecycle.runtime_config()

    def set_pod_cidr(self, cidr: str) -> None:
        """Pods take addresses from the kubelet's range for this node (a hollow node's too)."""
        self.lifecycle.set_pod_cidr(cidr)

    async def recover(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> tuple[dict[str, Observed], dict[str, Observed]]:
        return await self.lifecycle.recover(sandboxes, containers)

    async def run_sandbox(self, sandbox: SandboxRecord) -> SandboxNetwork:
        return await self.lifecycle.run_sandbox(sandbox)

    async def stop_sandbox(self, sandbox: SandboxRecord) -> None:
        await self.lifecycle.stop_sandbox(sandbox)

    async def remove_sandbox(self, sandbox: SandboxRecord) -> None:
        await self.lifecycle.remove_sandbox(sandbox)

    async def create_container(self, container: ContainerRecord, sandbox: SandboxRecord) -> None:
        await self.lifecycle.create_container(container, sandbox)

    async def start_container(self, container: ContainerRecord, sandbox: SandboxRecord) -> Started:
        return await self.lifecycle.start_container(container, sandbox)

    async def reattach(self, container: ContainerRecord, after: LogMarks | None) -> ContainerProcess | None:
        return await self.lifecycle.reattach(container, after)

    async def stop_container(self, container: ContainerRecord, timeout: int) -> ExitInfo:
        return await self.lifecycle.stop_container(container, timeout)

    async def remove_container(self, container: ContainerRecord) -> None:
        await self.lifecycle.remove_container(container)

    async def update_container_resources(
        self, container: ContainerRecord, resources: pb.LinuxContainerResources
    ) -> None:
        await self.lifecycle.update_container_resources(container, resources)

    # ------------------------------------------------------------------ images
    async def pull_image(
        self, image: pb.ImageSpec, auth: pb.AuthConfig | None, sandbox_config: pb.PodSandboxConfig | None
    ) -> str:
        return await self.images.pull_image(image, auth, sandbox_config)

    async def list_images(self) -> list[ImageInfo]:
        return await self.images.list_images()

    async def image_status(self, image: pb.ImageSpec) -> ImageInfo | None:
        return await self.images.image_status(image)

    async def remove_image(self, image: pb.ImageSpec) -> None:
        await self.images.remove_image(image)

    async def image_fs_info(self) -> pb.ImageFsInfoResponse:
        return self.images.fs_info(len(self.lifecycle.containers))

    # ImagesNow: the store is memory, so ListImages and ImageFsInfo are answered without a task.
    def list_images_now(self) -> list[ImageInfo]:
        return self.images.infos()

    def image_fs_info_now(self) -> pb.ImageFsInfoResponse:
        return self.images.fs_info(len(self.lifecycle.containers))

    # ------------------------------------------------------------------ exec and streams
    async def exec_sync(self, container: ContainerRecord, cmd: Sequence[str]) -> ExecResult:
        return await self.streams.exec_sync(container, cmd)

    async def exec(self, container: ContainerRecord, cmd: Sequence[str], io: StreamIO) -> int:
        return await self.streams.exec(container, cmd, io)

    async def attach(self, container: ContainerRecord, io: StreamIO) -> None:
        await self.streams.attach(container, io)

    async def port_forward(self, sandbox: SandboxRecord, port: int, stream: PortStream) -> None:
        await self.streams.port_forward(sandbox, port, stream)

    # ------------------------------------------------------------------ stats
    async def container_stats(self, containers: Sequence[ContainerRecord]) -> dict[str, ContainerUsage]:
        return await self.stats.container_stats(containers)

    async def sandbox_stats(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, SandboxUsage]:
        return await self.stats.sandbox_stats(sandboxes, containers)

    async def update_sandbox_resources(
        self, sandbox: SandboxRecord, request: pb.UpdatePodSandboxResourcesRequest
    ) -> None:
        pass  # accepted (the shim records them): the fake enforces no limits


class FakeBackend(FaultInjector, _ImagesNowFaults):
    """The fake runtime wearing fault injection: what the ``fake`` handler type creates.

    Options: those of the parts (``state_dir``, ``pull_seconds``, ``pause_image``,
    ``images``, ``missing_images``, ``programs``, ``exec``, ``port_responses``,
    ``pod_cidr``, ``cgroup_driver``) and of the injector (``latency``, ``errors``,
    ``max_calls``).
    """

    def __new__(cls, name: str, options: Mapping[str, Any], clock: Callable[[], int] = time.time_ns) -> Self:
        # Of the optional protocols the fake has PodCidrTaker and SandboxResourceUpdater, written
        # out below, and ImagesNow (its store is memory), from the injector's part.
        return object.__new__(cls)

    def set_pod_cidr(self, cidr: str) -> None:
        self.calls.append(Call("set_pod_cidr", (cidr,), self.clock()))
        self.runtime.set_pod_cidr(cidr)

    async def update_sandbox_resources(
        self, sandbox: SandboxRecord, request: pb.UpdatePodSandboxResourcesRequest
    ) -> None:
        await self._enter("update_sandbox_resources", sandbox.id)
        await self.runtime.update_sandbox_resources(sandbox, request)

    def __init__(
        self, name: str, options: Mapping[str, Any], clock: Callable[[], int] = time.time_ns
    ) -> None:
        self.runtime = FakeRuntime(name, options, clock)
        self.options = dict(options)
        super().__init__(self.runtime, options, clock=clock)

    # The fake's own helpers, for tests.
    @property
    def pulls(self) -> list[tuple[str, pb.AuthConfig | None]]:
        """Each image pull with the auth it carried."""
        return self.runtime.images.pulls

    @property
    def events(self) -> EventSink | None:
        return self.runtime.lifecycle.events

    @property
    def runtime_ready(self) -> bool:
        return self.runtime.lifecycle.runtime_ready

    @runtime_ready.setter
    def runtime_ready(self, value: bool) -> None:
        self.runtime.lifecycle.runtime_ready = value

    @property
    def network_ready(self) -> bool:
        return self.runtime.lifecycle.network_ready

    @network_ready.setter
    def network_ready(self, value: bool) -> None:
        self.runtime.lifecycle.network_ready = value

    def add_exec_rule(self, cmd: Sequence[str], result: ExecResult, delay: float = 0.0) -> None:
        self.runtime.programs.add_exec_rule(cmd, result, delay)
