"""The CRI layer's shared state: store, backends, events, locks, container IO.

The services (`runtime`, `sandbox`, `container`, `image`) are thin
modules over one ``Shim``. It also is the backends' ``EventSink`` (a pod
that lost its VM or network), and it follows every running container's
process (:mod:`shim.cri.container_io`): an exit is recorded, persisted and published as a
CRI event once, after the output is in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import structlog

from backends.contract import (
    Backend,
    ContainerProcess,
    ContainerRecord,
    ContainerStatus,
    ExitInfo,
    SandboxRecord,
)
from backends.registry import HandlerRegistry
from cri_api import api_pb2 as pb
from shim.config import Config
from shim.cri.container_io import ContainerIO, CriLogWriter, last_log_marks
from shim.cri.errors import CriError, FailedPreconditionError, NotFoundError, UnavailableError
from shim.cri.events import EventHub
from shim.cri.messages import container_status_pb, sandbox_status_pb
from shim.cri.stats_messages import CpuRates
from shim.cri.store import Store, new_id
from shim.nri.service import Nri

log = structlog.get_logger("shim")


class KeyedLocks:
    """One asyncio.Lock per ID, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock_, users = self._locks[key]
            if users <= 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock_, users - 1)


class Shim:
    def __init__(
        self,
        config: Config,
        registry: HandlerRegistry,
        store: Store,
        *,
        clock: Callable[[], int] = time.time_ns,
        id_factory: Callable[[], str] = new_id,
    ) -> None:
        self.config = config
        self.registry = registry
        self.store = store
        self.clock = clock
        self.new_id = id_factory
        self.locks = KeyedLocks()
        self.events = EventHub()
        self.io = ContainerIO(self._process_exited)
        self.pod_cidr = ""
        self.streaming: object | None = None  # shim.streaming.StreamingServer once wired
        # NRI plugins (shim/nri): without any connected, every event is a no-op. The resource
        # updates they ask for go through UpdateContainerResources' own path, which the
        # container service hands over when it is made (``update_from_nri``).
        self.update_from_nri: Callable[[str, pb.LinuxContainerResources], Awaitable[None]] | None = None
        self.nri = Nri(config.nri, self._nri_snapshot, self._nri_update)
        self.cpu_rates = CpuRates()

    # ------------------------------------------------------------------ lookups
    def backend(self, name: str) -> Backend:
        try:
            return self.registry.get(name)
        except LookupError:
            raise UnavailableError(f"backend {name!r} of this record is not configured any more") from None

    def fresh_id(self) -> str:
        while True:
            i = self.new_id()
            if self.store.sandboxes.get(i) is None and self.store.containers.get(i) is None:
                return i

    def hand_pod_cidr(self) -> None:
        """Give the node's pod CIDR to every backend (those that allocate pod addresses take it)."""
        if not self.pod_cidr:
            return
        for name, backend in self.registry.items():
            try:
                backend.set_pod_cidr(self.pod_cidr)
            except (ValueError, CriError) as exc:
                # A CNI config template that cannot be rendered, say: the network is then
                # not ready, and Status says so.
                log.warning("pod_cidr.refused", handler=name, cidr=self.pod_cidr, error=str(exc))

    # ------------------------------------------------------------------ container IO
    def follow(self, c: ContainerRecord, process: ContainerProcess) -> None:
        """Follow a running container's process: its output into its log, its exit into its record."""
        self.io.follow(c.id, process, CriLogWriter(c.log_path) if c.log_path else None)

    async def reattach(self, backend: Backend, c: ContainerRecord) -> bool:
        """Follow a container a restarted shim found running; False if it is not running any more."""
        marks = await asyncio.to_thread(last_log_marks, c.log_path)
        process = await backend.lifecycle.reattach(c, marks)
        if process is None:
            return False
        self.follow(c, process)
        return True

    async def stop_container(self, backend: Backend, c: ContainerRecord, timeout: int) -> None:
        """Stop a running container and record its exit once its output is in the log."""
        info = await backend.lifecycle.stop_container(c, timeout)
        await self.io.drain(c.id)
        self.record_exit(c, info)

    async def remove_container(self, c: ContainerRecord) -> None:
        """The one removal of a container, for RemoveContainer and RemovePodSandbox alike: under
        its lock, stopped at once if it runs (the CRI asks a forcible removal), the runtime's
        container, then the record, then its IO; after the lock, the DELETED event and NRI."""
        async with self.locks.hold(c.id):
            if self.store.containers.get(c.id) is not c:
                return  # removed meanwhile
            backend = self.backend(c.backend)
            if c.status.state == pb.CONTAINER_RUNNING:
                await self.stop_container(backend, c, 0)
            await backend.lifecycle.remove_container(c)
            self.store.remove(c)
            self.io.close(c.id)
        self.publish(c, pb.CONTAINER_DELETED_EVENT)
        await self.nri.remove_container(self.store.sandboxes.get(c.sandbox_id), c)

    def _process_exited(self, container_id: str, info: ExitInfo) -> None:
        c = self.store.containers.get(container_id)
        if c is None or c.status.finished_at:
            return
        self.record_exit(c, info)

    def check_ready(self, sb: SandboxRecord, why: str) -> None:
        """Under sb's lock, before a change to the pod: sb is still the store's and still ready,
        else NotFound or FailedPrecondition, their message ending with ``why``."""
        if self.store.sandboxes.get(sb.id) is not sb:
            raise NotFoundError(f"pod sandbox {sb.id} was removed{why}")
        if not sb.status.ready:
            raise FailedPreconditionError(f"pod sandbox {sb.id} is not ready{why}")

    # ------------------------------------------------------------------ EventSink
    def sandbox_not_ready(self, sandbox_id: str, reason: str) -> None:
        sb = self.store.sandboxes.get(sandbox_id)
        if sb is None or not sb.status.ready:
            return
        # It happened: a full disk only delays the record.
        self.store.record_effect(sb, status=dataclasses.replace(sb.status, ready=False))
        log.warning("sandbox.not_ready", sandbox_id=sandbox_id, reason=reason)

    # ------------------------------------------------------------------ state changes
    def record_exit(self, c: ContainerRecord, info: ExitInfo) -> None:
        """Move a container to EXITED once, persist it and publish the event."""
        if c.status.finished_at:
            return
        s = c.status
        exited = ContainerStatus(
            started_at=s.started_at or 0,
            finished_at=max(info.finished_at, s.started_at, c.created_at),
            exit_code=info.exit_code,
            reason=info.reason or ("Completed" if info.exit_code == 0 else "Error"),
            message=info.message,
            pid=0,
        )
        # The exit happened: the record in memory says so whatever the disk says; the
        # disk's is written when it takes it.
        self.store.record_effect(c, status=exited)
        self.io.close(c.id)
        self.publish(c, pb.CONTAINER_STOPPED_EVENT)
        self.nri.stop_container(self.store.sandboxes.get(c.sandbox_id), c)

    # ------------------------------------------------------------------ NRI
    def _nri_snapshot(self) -> tuple[list[SandboxRecord], list[ContainerRecord]]:
        """What a joining NRI plugin is told exists: what the CRI lists."""
        sandboxes = [sb for sb in self.store.sandboxes.values() if sb.committed]
        containers = [c for c in self.store.containers.values() if c.committed]
        return sandboxes, containers

    async def _nri_update(self, container_id: str, linux: pb.LinuxContainerResources) -> None:
        """A resource update an NRI plugin asked for: as UpdateContainerResources does it."""
        if self.update_from_nri is None:
            raise UnavailableError("container resources cannot be updated yet: no container service")
        await self.update_from_nri(container_id, linux)

    def publish(self, c: ContainerRecord, kind: pb.ContainerEventType) -> None:
        if not self.events.subscriber_count:
            return
        event = pb.ContainerEventResponse(
            container_id=c.id, container_event_type=kind, created_at=self.clock()
        )
        sb = self.store.sandboxes.get(c.sandbox_id)
        if sb is not None:
            event.pod_sandbox_status.CopyFrom(sandbox_status_pb(sb))
            for other in self.store.containers_of(sb.id):
                event.containers_statuses.append(container_status_pb(other))
        if kind == pb.CONTAINER_DELETED_EVENT:
            # Already gone from the store; the event still describes it.
            event.containers_statuses.append(container_status_pb(c))
        self.events.publish(event)
