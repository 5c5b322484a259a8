"""Fault injection that any backend can wear: a spy, delays and failures in front of it.

``FaultInjector(inner)`` implements the same protocols as the backend it
wraps (lifecycle, images, exec, stats, resources, and the optional ones —
``MetricsBackend``, ``SandboxResourceUpdater``, ``Checkpointer``,
``PodCidrTaker``, ``ExplainsLimits`` — only when
the inner backend has them, so the shim's ``isinstance`` checks see what the
inner backend can do). Every call then, in order:

1. is recorded in ``calls`` (a bounded deque of :class:`Call`);
2. waits the latency set for its method, if any;
3. raises the next error queued for its method, if any (a FIFO per method,
   so a test can say "fail twice, then succeed"), without reaching the inner
   backend;
4. otherwise goes to the inner backend.

Configured from Python (``set_latency``, ``inject_error``) or from a
handler's options (``latency = {run_sandbox = 0.05}``,
``errors = {start_container = ["UNAVAILABLE: boom"]}``, ``max_calls``).

Arguments are recorded compactly: records by ID, image specs by name,
batches by their size; streams, sinks and auth are left out. A call log
must not keep thousands of removed pods alive.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self, TypeVar, cast

from backends.contract import (
    Backend,
    Capability,
    Checkpointer,
    ContainerProcess,
    ContainerRecord,
    ContainerUsage,
    EventSink,
    ExecResult,
    ExitInfo,
    ExplainsLimits,
    Health,
    ImageInfo,
    ImagesNow,
    LogMarks,
    MetricsBackend,
    Observed,
    PodCidrTaker,
    PodMetrics,
    PortStream,
    SandboxNetwork,
    SandboxRecord,
    SandboxResourceUpdater,
    SandboxUsage,
    Started,
    StreamIO,
    errors,
)
from cri_api import api_pb2 as pb

_CODES: dict[str, type[errors.CriError]] = {
    "NOT_FOUND": errors.NotFoundError,
    "ALREADY_EXISTS": errors.AlreadyExistsError,
    "INVALID_ARGUMENT": errors.InvalidArgumentError,
    "FAILED_PRECONDITION": errors.FailedPreconditionError,
    "UNIMPLEMENTED": errors.UnimplementedError,
    "UNAVAILABLE": errors.UnavailableError,
    "DEADLINE_EXCEEDED": errors.DeadlineExceededError,
    "RESOURCE_EXHAUSTED": errors.ResourceExhaustedError,
    "INTERNAL": errors.InternalError,
}


def error_from_spec(spec: str) -> errors.CriError:
    """ "CODE: message" → the condition exception (for the config file)."""
    code, _, message = spec.partition(":")
    cls = _CODES.get(code.strip().upper())
    if cls is None:
        raise ValueError(f"unknown error code {code!r} (known: {', '.join(_CODES)})")
    return cls(message.strip() or f"injected {code.strip()}")


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    method: str
    args: tuple[Any, ...]
    at: int


_T = TypeVar("_T")


class _Faults:
    """The spy and the injection state, shared by the wrapper and its optional parts."""

    _inner: Backend
    calls: collections.deque[Call]
    clock: Callable[[], int]
    _latency: dict[str, float]
    _errors: collections.defaultdict[str, collections.deque[BaseException]]

    def set_latency(self, method: str, seconds: float) -> None:
        self._latency[method] = seconds

    def inject_error(self, method: str, error: BaseException) -> None:
        self._errors[method].append(error)

    def calls_to(self, method: str) -> list[Call]:
        return [c for c in self.calls if c.method == method]

    def configure(self, options: Mapping[str, Any]) -> None:
        """Apply ``latency`` and ``errors`` from a handler's options."""
        for method, seconds in dict(options.get("latency", {})).items():
            self.set_latency(method, float(seconds))
        for method, specs in dict(options.get("errors", {})).items():
            for spec in specs:
                self.inject_error(method, error_from_spec(str(spec)))

    def _injected(self, method: str) -> bool:
        """Whether a latency or an error waits for ``method``: then only its coroutine may answer."""
        return bool(self._latency.get(method) or self._errors.get(method))

    async def _enter(self, method: str, *args: Any) -> None:
        self.calls.append(Call(method, args, self.clock()))
        delay = self._latency.get(method)
        if delay:
            await asyncio.sleep(delay)
        queue = self._errors.get(method)
        if queue:
            raise queue.popleft()


class FaultInjector(_Faults):
    """A Backend in front of ``inner``: records calls, delays them, fails them on demand."""

    def __new__(cls, inner: Backend, *args: Any, **kwargs: Any) -> Self:
        # The optional protocols are passed through only when the inner backend has them.
        parts = tuple(part for proto, part in _OPTIONAL if isinstance(inner, proto))
        return super().__new__(_with_parts(cls, parts) if parts else cls)

    def __init__(
        self,
        inner: Backend,
        options: Mapping[str, Any] | None = None,
        *,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        options = options or {}
        self._inner = inner
        self.clock = clock
        self.calls = collections.deque(maxlen=int(options.get("max_calls", 10000)))
        self._latency = {}
        self._errors = collections.defaultdict(collections.deque)
        self.configure(options)

    @property
    def wrapped(self) -> Backend:
        return self._inner

    @property
    def name(self) -> str:
        return self._inner.name

    @name.setter
    def name(self, value: str) -> None:
        self._inner.name = value

    @property
    def capabilities(self) -> Capability:
        return self._inner.capabilities

    @capabilities.setter
    def capabilities(self, value: Capability) -> None:
        self._inner.capabilities = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._inner!r})"

    # ------------------------------------------------------------------ lifecycle
    async def start(self, events: EventSink) -> None:
        await self._enter("start")
        await self._inner.start(events)

    async def close(self) -> None:
        await self._enter("close")
        await self._inner.close()

    async def health(self) -> Health:
        await self._enter("health")
        return await self._inner.health()

    def runtime_config(self) -> pb.RuntimeConfigResponse:
        return self._inner.runtime_config()

    async def recover(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> tuple[dict[str, Observed], dict[str, Observed]]:
        await self._enter("recover", len(sandboxes), len(containers))
        return await self._inner.recover(sandboxes, containers)

    async def run_sandbox(self, sandbox: SandboxRecord) -> SandboxNetwork:
        await self._enter("run_sandbox", sandbox.id)
        return await self._inner.run_sandbox(sandbox)

    async def stop_sandbox(self, sandbox: SandboxRecord) -> None:
        await self._enter("stop_sandbox", sandbox.id)
        await self._inner.stop_sandbox(sandbox)

    async def remove_sandbox(self, sandbox: SandboxRecord) -> None:
        await self._enter("remove_sandbox", sandbox.id)
        await self._inner.remove_sandbox(sandbox)

    async def create_container(self, container: ContainerRecord, sandbox: SandboxRecord) -> None:
        await self._enter("create_container", container.id, sandbox.id)
        await self._inner.create_container(container, sandbox)

    async def start_container(self, container: ContainerRecord, sandbox: SandboxRecord) -> Started:
        await self._enter("start_container", container.id)
        return await self._inner.start_container(container, sandbox)

    async def reattach(self, container: ContainerRecord, after: LogMarks | None) -> ContainerProcess | None:
        await self._enter("reattach", container.id)
        return await self._inner.reattach(container, after)

    async def stop_container(self, container: ContainerRecord, timeout: int) -> ExitInfo:
        await self._enter("stop_container", container.id, timeout)
        return await self._inner.stop_container(container, timeout)

    async def remove_container(self, container: ContainerRecord) -> None:
        await self._enter("remove_container", container.id)
        await self._inner.remove_container(container)

    # ------------------------------------------------------------------ images
    async def pull_image(
        self, image: pb.ImageSpec, auth: pb.AuthConfig | None, sandbox_config: pb.PodSandboxConfig | None
    ) -> str:
        await self._enter("pull_image", image.image)
        return await self._inner.pull_image(image, auth, sandbox_config)

    async def list_images(self) -> list[ImageInfo]:
        await self._enter("list_images")
        return await self._inner.list_images()

    async def image_status(self, image: pb.ImageSpec) -> ImageInfo | None:
        await self._enter("image_status", image.image)
        return await self._inner.image_status(image)

    async def remove_image(self, image: pb.ImageSpec) -> None:
        await self._enter("remove_image", image.image)
        await self._inner.remove_image(image)

    async def image_fs_info(self) -> pb.ImageFsInfoResponse:
        await self._enter("image_fs_info")
        return await self._inner.image_fs_info()

    # ------------------------------------------------------------------ exec and streams
    async def exec_sync(self, container: ContainerRecord, cmd: Sequence[str]) -> ExecResult:
        await self._enter("exec_sync", container.id, tuple(cmd))
        return await self._inner.exec_sync(container, cmd)

    async def exec(self, container: ContainerRecord, cmd: Sequence[str], io: StreamIO) -> int:
        await self._enter("exec", container.id, tuple(cmd))
        return await self._inner.exec(container, cmd, io)

    async def attach(self, container: ContainerRecord, io: StreamIO) -> None:
        await self._enter("attach", container.id)
        await self._inner.attach(container, io)

    async def port_forward(self, sandbox: SandboxRecord, port: int, stream: PortStream) -> None:
        await self._enter("port_forward", sandbox.id, port)
        await self._inner.port_forward(sandbox, port, stream)

    # ------------------------------------------------------------------ stats and resources
    async def container_stats(self, containers: Sequence[ContainerRecord]) -> dict[str, ContainerUsage]:
        await self._enter("container_stats", len(containers))
        return await self._inner.container_stats(containers)

    async def sandbox_stats(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, SandboxUsage]:
        await self._enter("sandbox_stats", len(sandboxes))
        return await self._inner.sandbox_stats(sandboxes, containers)

    async def update_container_resources(
        self, container: ContainerRecord, resources: pb.LinuxContainerResources
    ) -> None:
        await self._enter("update_container_resources", container.id, resources)
        await self._inner.update_container_resources(container, resources)


# ---------------------------------------------------------------------- optional protocols


class _MetricsFaults(_Faults):
    async def sandbox_metrics(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, PodMetrics]:
        await self._enter("sandbox_metrics", len(sandboxes))
        return await cast(MetricsBackend, self._inner).sandbox_metrics(sandboxes, containers)


class _SandboxResourceFaults(_Faults):
    async def update_sandbox_resources(
        self, sandbox: SandboxRecord, request: pb.UpdatePodSandboxResourcesRequest
    ) -> None:
        await self._enter("update_sandbox_resources", sandbox.id)
        await cast(SandboxResourceUpdater, self._inner).update_sandbox_resources(sandbox, request)


class _PodCidrFaults(_Faults):
    def set_pod_cidr(self, cidr: str) -> None:
        self.calls.append(Call("set_pod_cidr", (cidr,), self.clock()))  # recorded; nothing to delay
        cast(PodCidrTaker, self._inner).set_pod_cidr(cidr)


class _CheckpointFaults(_Faults):
    async def checkpoint_container(self, container: ContainerRecord, location: str, timeout: int) -> None:
        await self._enter("checkpoint_container", container.id, location, timeout)
        await cast(Checkpointer, self._inner).checkpoint_container(container, location, timeout)


class _ImagesNowFaults(_Faults):
    """Answers from the inner store's memory, recorded as the call; None (the coroutine, which
    delays or fails it) while a latency or an error is set for the call."""

    def list_images_now(self) -> list[ImageInfo] | None:
        return self._now("list_images", cast(ImagesNow, self._inner).list_images_now)

    def image_fs_info_now(self) -> pb.ImageFsInfoResponse | None:
        return self._now("image_fs_info", cast(ImagesNow, self._inner).image_fs_info_now)

    def _now(self, method: str, answer: Callable[[], _T | None]) -> _T | None:
        if self._injected(method):
            return None
        got = answer()
        if got is not None:  # (None: the inner store cannot say now; its coroutine is recorded)
            self.calls.append(Call(method, (), self.clock()))
        return got


class _ExplainsFaults(_Faults):
    def why_not(self, capability: Capability) -> str:
        return cast(ExplainsLimits, self._inner).why_not(capability)  # a fact, not a call to fail


_OPTIONAL: tuple[tuple[type, type[_Faults]], ...] = (
    (MetricsBackend, _MetricsFaults),
    (SandboxResourceUpdater, _SandboxResourceFaults),
    (Checkpointer, _CheckpointFaults),
    (PodCidrTaker, _PodCidrFaults),
    (ExplainsLimits, _ExplainsFaults),
    (ImagesNow, _ImagesNowFaults),
)


_F = TypeVar("_F", bound=FaultInjector)
_CLASSES: dict[tuple[type, tuple[type, ...]], type] = {}


def _with_parts(cls: type[_F], parts: tuple[type[_Faults], ...]) -> type[_F]:
    """``cls`` with the methods of the optional protocols in ``parts`` (one class per combination)."""
    made = _CLASSES.get((cls, parts))
    if made is None:
        suffix = "".join(p.__name__.removeprefix("_").removesuffix("Faults") for p in parts)
        made = type(f"{cls.__name__}With{suffix}", (cls, *parts), {"__module__": cls.__module__})
        _CLASSES[(cls, parts)] = made
    return cast(type[_F], made)
