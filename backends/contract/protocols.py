"""The contract between the CRI layer and a backend: a :class:`Backend` made of parts.

Every coroutine method is called on the shim's event loop and must not block it;
blocking calls go to worker threads. A backend raises the conditions of
:mod:`backends.contract.errors`; anything else is a bug (UNKNOWN).

A ``Backend`` has a name, its :class:`Capability` flags (what it honours in the
configs it is given) and one attribute per part:

- ``lifecycle`` (:class:`Lifecycle`), always there: start, health, recovery, pods and containers;
- ``images`` (:class:`Images`), ``exec`` (:class:`Exec`: ExecSync, exec, attach,
  port-forward), ``stats`` (:class:`Stats`), ``metrics`` (:class:`Metrics`),
  ``resources`` (:class:`Resources`: UpdateContainerResources and
  UpdatePodSandboxResources) and ``checkpoint`` (:class:`Checkpoint`): each None
  where the backend has no such part. The shim answers an RPC whose part is None with
  UNIMPLEMENTED; nothing else says whether a backend can serve it.

Besides them, three plain methods every backend has (each with a neutral answer
where it has nothing to say): ``why_not``, ``set_pod_cidr`` and ``warm_figures``.
One object may serve as several parts (the fake's lifecycle is its resources too). A method's
name is unique across the parts: wrappers of a backend's calls (:mod:`backends.contract.proxy`)
name each call by it.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol, runtime_checkable

from backends.contract.pool import PoolFigures
from backends.contract.process import ContainerProcess, LogMarks, Started
from backends.contract.records import ContainerRecord, SandboxRecord
from backends.contract.usage import ContainerUsage, PodMetrics, SandboxUsage
from backends.contract.values import (
    ContainerCheckpoint,
    ExecResult,
    ExitInfo,
    Health,
    ImageInfo,
    Observed,
    PodCheckpoint,
    SandboxNetwork,
    TerminalSize,
)
from cri_api import api_pb2 as pb


class Capability(enum.Flag):
    """What a backend honours in the configs it is given (which RPCs it serves is said by
    its parts). A config asking for what the chosen backend lacks is refused by the shim,
    never by the backend.
    """

    NONE = 0
    HOST_NETWORK = enum.auto()
    USER_NAMESPACES = enum.auto()
    RECURSIVE_READ_ONLY_MOUNTS = enum.auto()
    # Honours SupplementalGroupsPolicy (Strict) and reports the effective user in ContainerStatus.
    SUPPLEMENTAL_GROUPS_POLICY = enum.auto()
    IMAGE_VOLUMES = enum.auto()  # Mount.image: an image's filesystem mounted read-only
    # Mount.mount_options: noexec, nodev, nosuid and ro applied to a host-path mount (MOUNT_OPTIONS).
    MOUNT_OPTIONS = enum.auto()


# The Mount.mount_options a backend with Capability.MOUNT_OPTIONS applies; any other is refused.
MOUNT_OPTIONS = ("noexec", "nodev", "nosuid", "ro")


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
    """Pods and containers: the part every backend has."""

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
        """Create the container (not started); sets container.image_ref, and what the shim reports
        of it: ``stop_signal`` (``decide_stop_signal``), ``image_volume_refs``, ``effective_user``."""

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
    """The handler's image store: PullImage, ListImages, ImageStatus, RemoveImage, ImageFsInfo."""

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

    # The answers without waiting, from memory, or None when only the coroutine above can give
    # them (a store that never can returns None). The shim asks these first, so that a call
    # answered from memory settles without a task.
    def list_images_now(self) -> list[ImageInfo] | None: ...

    def image_fs_info_now(self) -> pb.ImageFsInfoResponse | None: ...


@runtime_checkable
class Exec(Protocol):
    """Commands in a running container, and streams to it: ExecSync, Exec, Attach, PortForward."""

    async def exec_sync(self, container: ContainerRecord, cmd: Sequence[str]) -> ExecResult:
        """Run cmd in the container until it ends. The shim times it out by cancelling the
        call: a cancelled call kills what it started before it returns."""

    async def exec(self, container: ContainerRecord, cmd: Sequence[str], io: StreamIO) -> int:
        """Run cmd with the session's streams; return its exit code."""

    async def attach(self, container: ContainerRecord, io: StreamIO) -> None: ...

    async def port_forward(self, sandbox: SandboxRecord, port: int, stream: PortStream) -> None: ...


@runtime_checkable
class Stats(Protocol):
    """Usage figures, as measured: the shim builds the CRI messages and the CPU rate."""

    async def container_stats(self, containers: Sequence[ContainerRecord]) -> dict[str, ContainerUsage]:
        """Figures of each given container that the backend can measure."""

    async def sandbox_stats(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, SandboxUsage]:
        """Figures of each given sandbox, with its containers'; ``containers`` are all of theirs."""


@runtime_checkable
class Metrics(Protocol):
    """ListPodSandboxMetrics: the figures of cAdvisor's container_* families.

    The shim names the families and builds the metrics (``shim/cri/sandbox_metrics.py``);
    a backend reports, per pod, its running containers' samples with their
    detail and layer, and the pod's interfaces.
    """

    async def sandbox_metrics(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, PodMetrics]: ...


@runtime_checkable
class Resources(Protocol):
    """Limits changed on a running container (UpdateContainerResources) and on a pod
    (UpdatePodSandboxResources)."""

    async def update_container_resources(
        self, container: ContainerRecord, resources: pb.LinuxContainerResources
    ) -> None: ...

    async def update_sandbox_resources(
        self, sandbox: SandboxRecord, request: pb.UpdatePodSandboxResourcesRequest
    ) -> None: ...


@runtime_checkable
class Checkpoint(Protocol):
    """CheckpointContainer, CheckpointPod, RestorePod, and CreateContainer from a checkpoint.

    The shim has checked the request before any of these is called: paths are absolute and
    normal, the containers exist, belong to their pod and run, and the calls hold the locks
    of the pod and containers they name. What a checkpoint holds and how it is laid out is
    the backend's own; the backend refuses a checkpoint it cannot read (InvalidArgument) or
    restore (FailedPrecondition), and options it does not know (InvalidArgument)."""

    async def checkpoint_container(self, container: ContainerRecord, location: str, timeout: int) -> None:
        """Writes an archive of the running ``container`` at the file ``location`` (replacing
        it); on failure no file is left at ``location``."""

    async def checkpoint_pod(
        self,
        sandbox: SandboxRecord,
        containers: Sequence[ContainerRecord],
        output_dir: str,
        options: Mapping[str, str],
    ) -> None:
        """Writes one consistent checkpoint of ``sandbox`` and its running ``containers`` in
        the existing, empty directory ``output_dir``, and nowhere else: every container is
        paused before any is captured and all run again when this returns, whatever the
        outcome. On failure whatever it wrote in ``output_dir`` is removed."""

    async def open_pod_checkpoint(
        self, path: str, options: Mapping[str, str], configs: Sequence[pb.ContainerConfig]
    ) -> PodCheckpoint:
        """Reads and verifies the checkpoint that ``checkpoint_pod`` wrote in the directory
        ``path`` (never changing it), against the restore-time ``configs`` of its containers;
        nothing is created yet. The shim then makes the pod and, for each container it creates
        from ``configs``, calls ``restore_container``."""

    async def restore_container(
        self,
        container: ContainerRecord,
        sandbox: SandboxRecord,
        checkpoint: PodCheckpoint | ContainerCheckpoint,
    ) -> None:
        """Gives the CREATED ``container`` (just made in ``sandbox``) the state ``checkpoint``
        holds: a pod checkpoint's for the container of its metadata name (RestorePod), a
        container checkpoint's (CreateContainer from one). Its StartContainer resumes the
        checkpointed process instead of starting a new one."""

    def checkpoint_image(self, image: str) -> bool:
        """Whether the image ``image`` (a name or ID) of this backend's store is a container
        checkpoint: made from a CheckpointContainer archive, with the annotation
        ``io.kubernetes.cri-o.annotations.checkpoint.name``, as CRI-O and containerd know such
        images. Answered from memory on every CreateContainer: False where the backend cannot say."""

    async def open_container_checkpoint(self, source: str) -> ContainerCheckpoint:
        """Reads and verifies the container checkpoint a CreateContainer's image names: the
        archive at the absolute path ``source`` (the shim has checked that it may be read and
        is a file), or the image ``source`` for which ``checkpoint_image`` said True. Nothing is
        created yet; InvalidArgument for what is no intact checkpoint of this backend. The shim
        then creates the container and calls ``restore_container``."""


@runtime_checkable
class Backend(Protocol):
    """One runtime handler: its name, its flags, its parts (None: the part is absent)."""

    name: str

    @property
    def capabilities(self) -> Capability:
        """May grow at ``start``, once the runtime has said what it allows (docker's image volumes)."""

    @property
    def lifecycle(self) -> Lifecycle: ...

    @property
    def images(self) -> Images | None: ...

    @property
    def exec(self) -> Exec | None: ...

    @property
    def stats(self) -> Stats | None: ...

    @property
    def metrics(self) -> Metrics | None: ...

    @property
    def resources(self) -> Resources | None: ...

    @property
    def checkpoint(self) -> Checkpoint | None: ...

    def why_not(self, capability: Capability) -> str:
        """Why this backend lacks ``capability``, said in the shim's refusal (what an operator
        needs to know to choose another handler); "" when it has nothing to say."""

    def set_pod_cidr(self, cidr: str) -> None:
        """The node's pod CIDR (UpdateRuntimeConfig, or the one saved before a restart): pods
        made from now on get addresses in it, where the backend allocates them (nothing to do
        where it does not); pods that have one keep it."""

    def warm_figures(self) -> PoolFigures | None:
        """The figures of the sandboxes made ahead of their pods (``backends.contract.pool``), for
        the metrics; None when the backend keeps no such pool."""


# The names of a Backend's parts, in the order above.
PARTS = ("lifecycle", "images", "exec", "stats", "metrics", "resources", "checkpoint")
