"""The contract between the CRI layer (`shim/`) and a runtime backend.

The shim owns every CRI rule: IDs, names, the state machine, validation,
filters, idempotency, persistence, log paths. A backend only performs
effects on its runtime and reports what happened. It receives the shim's
records, which carry the original CRI config messages, and may keep its
own small bookkeeping in ``record.backend_data`` (persisted by the shim).

Errors: a backend raises the condition exceptions of :mod:`shim.errors`
(``NotFoundError`` for an image that does not exist, ``UnavailableError``
when its runtime is down, ``DeadlineExceededError`` for an expired
ExecSync, ...). Anything else is a bug and is reported as UNKNOWN.

Asynchrony: every method is a coroutine on the shim's event loop and must
not block it; blocking SDK calls go to worker threads.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

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


# --------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True, slots=True)
class SandboxStatus:
    """The mutable part of a sandbox, replaced as a whole."""

    ready: bool = True
    ip: str = ""
    additional_ips: tuple[str, ...] = ()


@dataclasses.dataclass(slots=True, eq=False)
class SandboxRecord:
    id: str
    handler: str  # runtime handler name as the client asked for it ("" resolved)
    backend: str  # name of the backend serving it
    config: pb.PodSandboxConfig
    created_at: int  # ns since the epoch
    status: SandboxStatus = SandboxStatus(ready=False)
    backend_data: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Set once the backend's run_sandbox returned; a record without it at
    # recovery is a half-created leftover.
    committed: bool = False
    # The shim's encoded List entry and the status it was built from (shim/wire.py).
    wire: tuple[object, bytes] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def state(self) -> pb.PodSandboxState:
        return pb.SANDBOX_READY if self.status.ready else pb.SANDBOX_NOTREADY


@dataclasses.dataclass(frozen=True, slots=True)
class ContainerStatus:
    """The mutable part of a container; the CRI state is derived from it.

    finished_at set -> EXITED, started_at set -> RUNNING, else CREATED.
    """

    started_at: int = 0
    finished_at: int = 0
    exit_code: int = 0
    reason: str = ""
    message: str = ""
    pid: int = 0  # informational, for backends whose processes are on the host
    unknown: bool = False  # the runtime lost track of it

    @property
    def state(self) -> pb.ContainerState:
        if self.unknown:
            return pb.CONTAINER_UNKNOWN
        if self.finished_at:
            return pb.CONTAINER_EXITED
        if self.started_at:
            return pb.CONTAINER_RUNNING
        return pb.CONTAINER_CREATED


@dataclasses.dataclass(slots=True, eq=False)
class ContainerRecord:
    id: str
    sandbox_id: str
    backend: str
    config: pb.ContainerConfig
    created_at: int
    log_path: str  # absolute; "" when the kubelet asked for no log
    image_ref: str = ""  # image ID the container was created from
    image_name: str = ""  # the image as the client named it
    status: ContainerStatus = ContainerStatus()
    resources: pb.ContainerResources | None = None  # after UpdateContainerResources
    backend_data: dict[str, Any] = dataclasses.field(default_factory=dict)
    committed: bool = False
    wire: tuple[object, bytes] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def state(self) -> pb.ContainerState:
        return self.status.state


def container_stats_of(c: ContainerRecord) -> pb.ContainerStats:
    """Stats of a container with its attributes filled in and no figures yet."""
    cfg = c.config
    return pb.ContainerStats(
        attributes=pb.ContainerAttributes(
            id=c.id, metadata=cfg.metadata, labels=dict(cfg.labels), annotations=dict(cfg.annotations)
        )
    )


def sandbox_stats_of(sb: SandboxRecord) -> pb.PodSandboxStats:
    """Stats of a pod sandbox with its attributes filled in and no figures yet."""
    cfg = sb.config
    return pb.PodSandboxStats(
        attributes=pb.PodSandboxAttributes(
            id=sb.id, metadata=cfg.metadata, labels=dict(cfg.labels), annotations=dict(cfg.annotations)
        )
    )


# --------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True, slots=True)
class Health:
    runtime_ready: bool
    network_ready: bool
    reason: str = ""
    message: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class SandboxNetwork:
    ip: str = ""
    additional_ips: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class ExitInfo:
    exit_code: int
    finished_at: int  # ns
    reason: str = ""  # Completed / Error / OOMKilled / ...
    message: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int
    stdout: bytes = b""
    stderr: bytes = b""


@dataclasses.dataclass(frozen=True, slots=True)
class Observed:
    """What a backend found of one record during recovery."""

    exists: bool
    running: bool = False
    exit: ExitInfo | None = None
    started_at: int = 0
    status: SandboxStatus | None = None


# --------------------------------------------------------------------------- callbacks


class LogSink(Protocol):
    """Where a backend sends a container's output.

    The shim owns the CRI log file behind it (format, splitting of long
    lines into partial records, rotation on ReopenContainerLog).
    """

    def write(self, stream: str, data: bytes, at: int = 0) -> None:
        """Append raw bytes of ``stream`` ("stdout" or "stderr").

        ``at``: when the container wrote them (ns since the epoch), if the
        runtime knows; else the time of the call is used.
        """

    def close(self) -> None:
        """Flush any unterminated line; called once when the output ends."""


class EventSink(Protocol):
    """How a backend tells the shim about changes it did not ask for."""

    def container_exited(self, container_id: str, info: ExitInfo) -> None:
        """A container stopped on its own (or was killed by the runtime)."""

    def sandbox_not_ready(self, sandbox_id: str, reason: str) -> None:
        """A sandbox lost its network or VM without being asked to stop."""

    def log_sink(self, container_id: str) -> LogSink | None:
        """The log sink of a container, e.g. to re-attach its output after a restart."""


# --------------------------------------------------------------------------- streaming


@dataclasses.dataclass(frozen=True, slots=True)
class TerminalSize:
    width: int
    height: int


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


# --------------------------------------------------------------------------- the protocol


@runtime_checkable
class Backend(Protocol):
    """A runtime behind a runtime handler name."""

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

    async def start_container(self, container: ContainerRecord, sandbox: SandboxRecord, logs: LogSink) -> int:
        """Start it and stream its output to ``logs``; return the start time (ns)."""

    async def stop_container(self, container: ContainerRecord, timeout: int) -> ExitInfo:
        """Signal TERM, wait ``timeout`` seconds, then KILL; return how it ended."""

    async def remove_container(self, container: ContainerRecord) -> None:
        """Remove a stopped or created container. Idempotent."""

    async def exec_sync(self, container: ContainerRecord, cmd: Sequence[str], timeout: float) -> ExecResult:
        """Run cmd in the container; raise DeadlineExceededError (killing it) past timeout>0."""

    async def update_container_resources(
        self, container: ContainerRecord, resources: pb.LinuxContainerResources
    ) -> None: ...

    async def container_stats(self, containers: Sequence[ContainerRecord]) -> dict[str, pb.ContainerStats]:
        """Stats for each given container that the backend can measure."""

    async def sandbox_stats(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, pb.PodSandboxStats]:
        """Stats for each given sandbox; ``containers`` are all of theirs."""

    # ---- streaming
    async def exec(self, container: ContainerRecord, cmd: Sequence[str], io: StreamIO) -> int:
        """Run cmd with the session's streams; return its exit code."""

    async def attach(self, container: ContainerRecord, io: StreamIO) -> None: ...

    async def port_forward(self, sandbox: SandboxRecord, port: int, stream: PortStream) -> None: ...

    # ---- images
    async def pull_image(
        self, image: pb.ImageSpec, auth: pb.AuthConfig | None, sandbox_config: pb.PodSandboxConfig | None
    ) -> str:
        """Pull and return the image reference (its ID)."""

    async def list_images(self) -> list[pb.Image]: ...

    async def image_status(self, image: pb.ImageSpec) -> pb.Image | None:
        """The image, or None when it is not present."""

    async def remove_image(self, image: pb.ImageSpec) -> None:
        """Remove the image with all its tags; no error when it is absent."""

    async def image_fs_info(self) -> pb.ImageFsInfoResponse: ...


BackendFactory = Callable[[str, dict[str, Any]], Backend]
"""Builds a backend from (handler name, its config table)."""

Hook = Callable[[], Awaitable[None]]
