"""The narrow protocols between the CRI layer and a backend.

Every method is a coroutine on the shim's event loop and must not block it;
blocking calls go to worker threads. A backend raises the conditions of
:mod:`backends.contract.errors`; anything else is a bug (UNKNOWN).

``Backend`` is the core every runtime handler has: lifecycle, images and
recovery. What only some have is an optional protocol of its own
(``ExecSyncBackend``, ``StreamingBackend``, ``StatsBackend``,
``MetricsBackend``, ``ResourceUpdater``, ...), which the shim checks with
``isinstance`` before calling, together with the ``Capability`` flags a
backend declares (a flag may be off where the method exists: a fake
configured without it).
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

from backends.contract.pool import PoolFigures
from backends.contract.process import ContainerProcess, LogMarks, Started
from backends.contract.records import ContainerRecord, SandboxRecord
from backends.contract.usage import ContainerUsage, PodMetrics, SandboxUsage
from backends.contract.values import (
    ExecResult,
    ExitInfo,
    Health,
    ImageInfo,
    Observed,
    SandboxNetwork,
    TerminalSize,
)
from cri_api import api_pb2 as pb


class Capability(enum.Flag):
    """What a backend can do beyond the core pod/container lifecycle.

    An RPC whose capability the chosen backend lacks is answered with
    UNIMPLEMENTED by the shim, never by the backend.
    """

    NONE = 0
    EXEC_SYNC = enum.auto()
    EXEC = enum.auto()  # streaming exec
    ATTACH = enum.auto()
    PORT_FORWARD = enum.auto()
    STATS = enum.auto()  # container and sandbox stats
    METRICS = enum.auto()  # ListMetricDescriptors / ListPodSandboxMetrics
    UPDATE_RESOURCES = enum.auto()  # UpdateContainerResources
    UPDATE_SANDBOX_RESOURCES = enum.auto()
    CHECKPOINT = enum.auto()
    IMAGES = enum.auto()  # has its own image store
    HOST_NETWORK = enum.auto()
    USER_NAMESPACES = enum.auto()
    RECURSIVE_READ_ONLY_MOUNTS = enum.auto()
    # Honours SupplementalGroupsPolicy (Strict) and reports the effective user in ContainerStatus.
    SUPPLEMENTAL_GROUPS_POLICY = enum.auto()
    IMAGE_VOLUMES = enum.auto()  # Mount.image: an image's filesystem mounted read-only


class EventSink(Protocol):
    """How a backend tells the shim about changes it did not ask for.

    A container's exit is not an event: it is the end of the
    :class:`~backends.contract.process.ContainerProcess` its start returned.
    """

    def sandbox_not_ready(self, sandbox_id: str, reason: str) -> None:
        """A sandbox lost its network or VM without being asked to stop, or a stop that fails
        (its network not released) has stopped it all the same: a remove then needs no stop."""


class StreamIO(Protocol):
    """The client side of an exec or attach session, as the streaming server offers it.

    ``stdin`` is None when the client asked for no stdin; ``read_stdin``
    returns b"" at end of input (half-close). ``stderr`` output is merged
    into stdout by the caller when a TTY is used.
    """

    stdin: bool
    stdout: bool
    stderr: bool
    tty: bool

    async def read_stdin(self) -> bytes: ...

    async def write_stdout(self, data: bytes) -> None: ...

    async def write_stderr(self, data: bytes) -> None: ...

    def resizes(self) -> AsyncIterator[TerminalSize]: ...


class PortStream(Protocol):
    """One forwarded TCP connection: bytes from the client, bytes back to it."""

    async def read(self) -> bytes: ...  # b"" at end of client data

    async def write(self, data: bytes) -> None: ...


@runtime_checkable
class Lifecycle(Protocol):
    """Pods and containers: what every runtime handler does."""

    name: str
    capabilities: Capability

    async def start(self, events: EventSink) -> None:
        """Connect to the runtime. Called once before any other method."""

    async def close(self) -> None:
        """Release connections and background tasks; the runtime's objects stay."""

    async def health(self) -> Health:
        """Whether the runtime and its network can serve pods now."""

    def runtime_config(self) -> pb.RuntimeConfigResponse:
        """The cgroup driver and similar node facts."""

    # ---- recovery
    async def recover(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> tuple[dict[str, Observed], dict[str, Observed]]:
        """Report what the runtime really has for the given records (by ID).

        Also removes leftovers of this backend that match no record.
        """

    # ---- sandboxes
    async def run_sandbox(self, sandbox: SandboxRecord) -> SandboxNetwork:
        """Create and start the sandbox; on failure leave nothing behind."""

    async def stop_sandbox(self, sandbox: SandboxRecord) -> None:
        """Stop the sandbox's infrastructure and release its network. Idempotent."""

    async def remove_sandbox(self, sandbox: SandboxRecord) -> None:
        """Remove what stop left. Idempotent."""

    # ---- containers
    async def create_container(self, container: ContainerRecord, sandbox: SandboxRecord) -> None:
        """Create the container (not started); sets container.image_ref."""

    async def start_container(self, container: ContainerRecord, sandbox: SandboxRecord) -> Started:
        """Start it; return the start time and its process (output and exit), which the shim follows."""

    async def reattach(self, container: ContainerRecord, after: LogMarks | None) -> ContainerProcess | None:
        """The process of a container ``recover`` found running, for a restarted shim to follow.

        ``after``: where the shim's CRI log of it ends; output already there
        is not to come again, where the runtime can tell. None when it is not
        running any more (its exit is then the one ``recover`` reported).
        """

    async def stop_container(self, container: ContainerRecord, timeout: int) -> ExitInfo:
        """Signal TERM, wait ``timeout`` seconds, then KILL; return how it ended."""

    async def remove_container(self, container: ContainerRecord) -> None:
        """Remove a stopped or created container. Idempotent."""


@runtime_checkable
class Images(Protocol):
    """The handler's image store (the IMAGES capability: a store of its own)."""

    async def pull_image(
        self, image: pb.ImageSpec, auth: pb.AuthConfig | None, sandbox_config: pb.PodSandboxConfig | None
    ) -> str:
        """Pull and return the image reference (its ID)."""

    async def list_images(self) -> list[ImageInfo]: ...

    async def image_status(self, image: pb.ImageSpec) -> ImageInfo | None:
        """The image, or None when it is not present."""

    async def remove_image(self, image: pb.ImageSpec) -> None:
        """Remove the image with all its tags; no error when it is absent."""

    async def image_fs_info(self) -> pb.ImageFsInfoResponse: ...


@runtime_checkable
class ImagesNow(Protocol):
    """A store that can often answer from memory (optional): the answer without waiting,
    or None when only the coroutine of ``Images`` can give it. The image service asks this
    first, so that a call answered from memory settles without a task."""

    def list_images_now(self) -> list[ImageInfo] | None: ...

    def image_fs_info_now(self) -> pb.ImageFsInfoResponse | None: ...


@runtime_checkable
class Exec(Protocol):
    """Commands in a running container, and streams to it (EXEC_SYNC, EXEC, ATTACH, PORT_FORWARD)."""

    async def exec_sync(self, container: ContainerRecord, cmd: Sequence[str]) -> ExecResult:
        """Run cmd in the container until it ends. The shim times it out by cancelling the
        call: a cancelled call kills what it started before it returns."""

    async def exec(self, container: ContainerRecord, cmd: Sequence[str], io: StreamIO) -> int:
        """Run cmd with the session's streams; return its exit code."""

    async def attach(self, container: ContainerRecord, io: StreamIO) -> None: ...

    async def port_forward(self, sandbox: SandboxRecord, port: int, stream: PortStream) -> None: ...


@runtime_checkable
class Stats(Protocol):
    """Usage figures (STATS), as measured: the shim builds the CRI messages and the CPU rate."""

    async def container_stats(self, containers: Sequence[ContainerRecord]) -> dict[str, ContainerUsage]:
        """Figures of each given container that the backend can measure."""

    async def sandbox_stats(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, SandboxUsage]:
        """Figures of each given sandbox, with its containers'; ``containers`` are all of theirs."""


@runtime_checkable
class Resources(Protocol):
    """Limits changed on a running container (UPDATE_RESOURCES)."""

    async def update_container_resources(
        self, container: ContainerRecord, resources: pb.LinuxContainerResources
    ) -> None: ...


@runtime_checkable
class Backend(Lifecycle, Images, Exec, Stats, Resources, Protocol):
    """What every backend implements; the capability flags say which parts are on."""


# ---- optional: only some backends have these, and the shim asks with isinstance.


@runtime_checkable
class MetricsBackend(Protocol):
    """ListPodSandboxMetrics (METRICS): the figures of cAdvisor's container_* families.

    The shim names the families and builds the metrics (``shim/cri/sandbox_metrics.py``);
    a backend reports, per pod, its running containers' samples with their
    detail and layer, and the pod's interfaces.
    """

    async def sandbox_metrics(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, PodMetrics]: ...


@runtime_checkable
class SandboxResourceUpdater(Protocol):
    """UpdatePodSandboxResources (UPDATE_SANDBOX_RESOURCES)."""

    async def update_sandbox_resources(
        self, sandbox: SandboxRecord, request: pb.UpdatePodSandboxResourcesRequest
    ) -> None: ...


@runtime_checkable
class ExplainsLimits(Protocol):
    """A backend that says why it lacks a capability: the shim's refusal then carries the reason
    (what an operator needs to know to choose another handler)."""

    def why_not(self, capability: Capability) -> str:
        """Why this backend cannot do ``capability``; "" when it has nothing to say."""


@runtime_checkable
class PodCidrTaker(Protocol):
    """A backend whose pods take their addresses from the node's range, as the kubelet gives it."""

    def set_pod_cidr(self, cidr: str) -> None:
        """The node's pod CIDR (UpdateRuntimeConfig, or the one saved before a restart): pods made
        from now on get addresses in it; pods that have one keep it."""


@runtime_checkable
class Checkpointer(Protocol):
    """CheckpointContainer (CHECKPOINT)."""

    async def checkpoint_container(self, container: ContainerRecord, location: str, timeout: int) -> None: ...


@runtime_checkable
class WarmPool(Protocol):
    """A backend that makes sandboxes ahead of their pods (``backends.contract.pool``)."""

    def warm_figures(self) -> PoolFigures | None:
        """The pool's figures, for the metrics; None when it is off."""
