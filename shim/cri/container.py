"""CreateContainer, StartContainer, StopContainer, RemoveContainer, ContainerStatus,
ListContainers, UpdateContainerResources, ReopenContainerLog, ExecSync, container stats
and the URLs of Exec, Attach and PortForward."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from typing import Any

import structlog

from backends.contract import (
    Backend,
    ContainerRecord,
    ContainerStatus,
    Exec,
)
from cri_api import api_pb2 as pb
from shim.cri import stats_messages, validate
from shim.cri.container_io import CriLogWriter, touch_log
from shim.cri.container_restore import container_checkpoint_of, restored_config
from shim.cri.errors import (
    CriError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    ResourceExhaustedError,
    UnimplementedError,
)
from shim.cri.filters import with_labels
from shim.cri.messages import container_pb, container_status_pb
from shim.cri.state import Shim
from shim.cri.store import container_name, container_to_json

log = structlog.get_logger("container")

# Whatever a command prints, ExecSync answers fit in the kubelet's 16 MiB limit.
EXEC_OUTPUT_LIMIT = 7 * 1024 * 1024
# Longer timeouts than this are taken as "wait forever"; event loop timers overflow otherwise.
MAX_TIMEOUT = 365 * 24 * 3600

_STATE_NAMES: dict[int, str] = {
    pb.CONTAINER_CREATED: "created",
    pb.CONTAINER_RUNNING: "running",
    pb.CONTAINER_EXITED: "exited",
    pb.CONTAINER_UNKNOWN: "unknown",
}


class ContainerService:
    def __init__(self, shim: Shim) -> None:
        self.shim = shim
        shim.update_from_nri = self._update_from_nri

    # ------------------------------------------------------------------ lifecycle
    async def create(self, req: pb.CreateContainerRequest) -> pb.CreateContainerResponse:
        shim = self.shim
        cfg = req.config
        validate.container_config(cfg, req.HasField("config"))
        if not req.pod_sandbox_id:
            raise InvalidArgumentError("pod_sandbox_id must not be empty")
        sb = shim.store.sandboxes.find(req.pod_sandbox_id, made=True)
        if not sb.status.ready:
            raise FailedPreconditionError(f"pod sandbox {sb.id} is not ready; cannot create containers in it")
        log_path = validate.log_path(sb.config.log_directory, cfg.log_path)
        backend = shim.backend(sb.backend)
        # An image that is a checkpoint: read and verified before anything is made.
        restoring = await container_checkpoint_of(shim, sb.backend, backend, cfg)
        if restoring is not None:
            cfg = restored_config(cfg, restoring.config)
            validate.container_config(cfg, True)
        validate.mounts_for(cfg, backend.capabilities, sb.backend)
        validate.groups_policy_for(cfg, backend.capabilities, sb.backend)
        cid = shim.fresh_id()
        name = container_name(sb, cfg.metadata)
        record = ContainerRecord(
            id=cid,
            sandbox_id=sb.id,
            backend=sb.backend,
            config=cfg,
            created_at=shim.clock(),
            log_path=log_path,
            image_name=await display_image(backend, cfg.image),
        )
        async with contextlib.AsyncExitStack() as held:
            # Joined under the sandbox's lock: a StopPodSandbox or RemovePodSandbox either
            # came first (the pod is no longer ready: refused here) or comes after, finds
            # this container among the pod's and waits for its lock, so the pod's
            # infrastructure is never torn down under a create in progress.
            async with shim.locks.hold(sb.id):
                shim.check_ready(sb, "; cannot create containers in it")
                shim.store.container_names.reserve(name, cid)
                await held.enter_async_context(shim.locks.hold(cid))
                try:
                    # Recorded before any effect: after a crash, recovery finds the
                    # uncommitted record and removes whatever the backend left.
                    shim.store.add(record)
                except BaseException:
                    shim.store.container_names.release(name, cid)
                    raise
            try:
                adjusted = await shim.nri.create_container(sb, record)
                if adjusted is not None:
                    # What the plugins made of it must still be a container this backend can run.
                    validate.container_config(adjusted, True)
                    validate.mounts_for(adjusted, backend.capabilities, sb.backend)
                    shim.store.update(record, config=adjusted)
                await backend.lifecycle.create_container(record, sb)
                if restoring is not None:
                    assert backend.checkpoint is not None  # it read the checkpoint
                    await backend.checkpoint.restore_container(record, sb, restoring)
                # Acknowledged means recorded. The creation time is when it became visible,
                # after the backend's work.
                shim.store.update(record, committed=True, created_at=shim.clock())
            except BaseException:
                await _undo_container(shim, record)
                # Plugins called before one refused (or before the backend failed) saw it made.
                await shim.nri.remove_container(sb, record)
                raise
        shim.publish(record, pb.CONTAINER_CREATED_EVENT)
        shim.nri.post_create_container(sb, record)
        return pb.CreateContainerResponse(container_id=cid)

    async def start(self, req: pb.StartContainerRequest) -> pb.StartContainerResponse:
        shim = self.shim
        c = self.find(req.container_id)
        async with shim.locks.hold(c.id):
            if c.status.state != pb.CONTAINER_CREATED:
                raise FailedPreconditionError(
                    f"container {c.id} is {_STATE_NAMES[c.status.state]}; only a created container can start"
                )
            sb = shim.store.sandboxes.get(c.sandbox_id)
            if sb is None or not sb.status.ready:
                raise FailedPreconditionError(f"pod sandbox {c.sandbox_id} of container {c.id} is not ready")
            backend = shim.backend(c.backend)
            shim.store.update(c)  # a full disk is found before the container starts
            await shim.nri.start_container(sb, c)  # a plugin's refusal leaves it created
            try:
                started = await backend.lifecycle.start_container(c, sb)
            except Exception as exc:
                # As containerd does: a container that failed to start is exited, with the reason.
                now = shim.clock()
                failed = ContainerStatus(
                    started_at=now, finished_at=now, exit_code=128, reason="StartError", message=str(exc)
                )
                shim.store.record_effect(c, status=failed)  # the start's own failure is what the client sees
                await asyncio.to_thread(touch_log, c.log_path)  # an empty log for the kubelet to read
                raise
            running = ContainerStatus(started_at=started.started_at or shim.clock(), pid=c.status.pid)
            try:
                shim.store.update(c, status=running)
            except BaseException:
                # Not recorded, so not started: the disk filled up in between.
                with contextlib.suppress(Exception):
                    await backend.lifecycle.stop_container(c, 0)
                raise
            shim.publish(c, pb.CONTAINER_STARTED_EVENT)
            shim.nri.post_start_container(sb, c)
            # After the record says RUNNING: an exit that came already is recorded after it.
            shim.follow(c, started.process)
        return pb.StartContainerResponse()

    async def stop(self, req: pb.StopContainerRequest) -> pb.StopContainerResponse:
        shim = self.shim
        if req.timeout < 0:
            raise InvalidArgumentError("timeout must not be negative")
        # Idempotent by the CRI: unknown and already-stopped containers are OK.
        c = _find_or_none(shim, req.container_id)
        if c is None or c.status.state != pb.CONTAINER_RUNNING:
            return pb.StopContainerResponse()
        async with shim.locks.hold(c.id):
            if c.status.state == pb.CONTAINER_RUNNING:
                await shim.stop_container(shim.backend(c.backend), c, min(int(req.timeout), MAX_TIMEOUT))
        return pb.StopContainerResponse()

    async def remove(self, req: pb.RemoveContainerRequest) -> pb.RemoveContainerResponse:
        # Idempotent by the CRI: an unknown container is OK.
        c = _find_or_none(self.shim, req.container_id)
        if c is not None:
            await self.shim.remove_container(c)
        return pb.RemoveContainerResponse()

    # ------------------------------------------------------------------ queries
    def status(self, req: pb.ContainerStatusRequest) -> pb.ContainerStatusResponse:
        c = self.find(req.container_id)
        resp = pb.ContainerStatusResponse(status=container_status_pb(c))
        if req.verbose:
            info: dict[str, Any] = container_to_json(c)
            info.pop("config", None)
            info["sandboxID"] = c.sandbox_id
            resp.info["info"] = json.dumps(info)
        return resp

    def list_(self, req: pb.ListContainersRequest) -> pb.ListContainersResponse:
        return pb.ListContainersResponse(containers=[container_pb(c) for c in self.select(req.filter)])

    def select(self, f: pb.ContainerFilter) -> list[ContainerRecord]:
        """The containers a List with filter ``f`` answers: created ones (committed) only; an ID
        or pod ID that is unknown or ambiguous matches nothing."""
        store = self.shim.store
        if f.id:
            c = store.containers.find(f.id, missing="quiet")
            candidates = [c] if c is not None else []
        elif f.pod_sandbox_id:
            sb = store.sandboxes.find(f.pod_sandbox_id, missing="quiet")
            candidates = store.containers_of(sb.id) if sb is not None else []
        else:
            candidates = store.containers.values()
        want_state = f.state.state if f.HasField("state") else None
        keep = [
            c
            for c in candidates
            if c.committed
            and (want_state is None or c.status.state == want_state)
            and (not f.pod_sandbox_id or c.sandbox_id.startswith(f.pod_sandbox_id))
        ]
        return with_labels(keep, f.label_selector)

    # ------------------------------------------------------------------ changes
    async def update_resources(
        self, req: pb.UpdateContainerResourcesRequest, from_nri: bool = False
    ) -> pb.UpdateContainerResourcesResponse:
        """The CRI call, or (``from_nri``) an update an NRI plugin asked for, which
        plugins are not consulted about again."""
        shim = self.shim
        c = self.find(req.container_id)
        updater = shim.backend(c.backend).resources
        if updater is None:
            raise UnimplementedError(f"runtime handler {c.backend!r} cannot update container resources")
        if not req.HasField("linux"):
            if req.HasField("windows"):
                raise InvalidArgumentError("windows resources are not supported on this Linux runtime")
            return pb.UpdateContainerResourcesResponse()
        validate.linux_resources(req.linux, "linux")
        async with shim.locks.hold(c.id):
            if c.status.state not in (pb.CONTAINER_CREATED, pb.CONTAINER_RUNNING):
                raise FailedPreconditionError(f"container {c.id} is {_STATE_NAMES[c.status.state]}")
            sb = shim.store.sandboxes.get(c.sandbox_id)
            linux = req.linux
            if not from_nri and sb is not None:
                linux = await shim.nri.update_container(sb, c, req.linux)
                if linux != req.linux:
                    validate.linux_resources(linux, "linux (as NRI plugins changed it)")
            res = pb.ContainerResources()
            res.linux.CopyFrom(linux)
            shim.store.update(c)  # a full disk refuses the update before the container sees it
            await updater.update_container_resources(c, linux)
            shim.store.record_effect(c, resources=res)
            if sb is not None:
                shim.nri.post_update_container(sb, c)
        return pb.UpdateContainerResourcesResponse()

    async def _update_from_nri(self, container_id: str, linux: pb.LinuxContainerResources) -> None:
        req = pb.UpdateContainerResourcesRequest(container_id=container_id, linux=linux)
        await self.update_resources(req, from_nri=True)

    async def reopen_log(self, req: pb.ReopenContainerLogRequest) -> pb.ReopenContainerLogResponse:
        c = self.find(req.container_id)
        if c.status.state != pb.CONTAINER_RUNNING:
            raise FailedPreconditionError(f"container {c.id} is not running; its log cannot be reopened")
        writer = self.shim.io.writer(c.id)
        if isinstance(writer, CriLogWriter):
            # The file may have been renamed by the kubelet's rotation; reopen in a
            # thread so a slow disk never stalls the event loop.
            try:
                await asyncio.to_thread(writer.reopen)
            except OSError as exc:
                raise ResourceExhaustedError(
                    f"log file {c.log_path} of container {c.id} cannot be reopened: {exc.strerror or exc}"
                ) from None
        return pb.ReopenContainerLogResponse()

    async def exec_sync(self, req: pb.ExecSyncRequest) -> pb.ExecSyncResponse:
        c, streams = self._running_with(req.container_id, "ExecSync")
        if not req.cmd:
            raise InvalidArgumentError("cmd must not be empty")
        if req.timeout < 0:
            raise InvalidArgumentError("timeout must not be negative")
        timeout = float(min(req.timeout, MAX_TIMEOUT))
        try:
            # The timeout once for every backend: the cancelled call kills what it started.
            async with asyncio.timeout(timeout or None):
                result = await streams.exec_sync(c, list(req.cmd))
        except TimeoutError:
            raise DeadlineExceededError(f"command {list(req.cmd)!r} timed out after {timeout:g}s") from None
        return pb.ExecSyncResponse(
            stdout=result.stdout[:EXEC_OUTPUT_LIMIT],
            stderr=result.stderr[:EXEC_OUTPUT_LIMIT],
            exit_code=result.exit_code,
        )

    # ------------------------------------------------------------------ streaming URLs
    def _streaming(self) -> Any:
        if self.shim.streaming is None:
            raise UnimplementedError("the streaming server is not enabled")
        return self.shim.streaming

    async def exec(self, req: pb.ExecRequest) -> pb.ExecResponse:
        c, _ = self._running_with(req.container_id, "Exec")
        if not req.cmd:
            raise InvalidArgumentError("cmd must not be empty")
        if not (req.stdin or req.stdout or req.stderr):
            raise InvalidArgumentError("one of stdin, stdout and stderr must be set")
        if req.tty and req.stderr:
            raise InvalidArgumentError("tty and stderr cannot both be set: a terminal has one output stream")
        del c
        return pb.ExecResponse(url=self._streaming().exec_url(req))

    async def attach(self, req: pb.AttachRequest) -> pb.AttachResponse:
        self._running_with(req.container_id, "Attach")
        if not (req.stdin or req.stdout or req.stderr):
            raise InvalidArgumentError("one of stdin, stdout and stderr must be set")
        if req.tty and req.stderr:
            raise InvalidArgumentError("tty and stderr cannot both be set: a terminal has one output stream")
        return pb.AttachResponse(url=self._streaming().attach_url(req))

    async def port_forward(self, req: pb.PortForwardRequest) -> pb.PortForwardResponse:
        sb = self.shim.store.sandboxes.find(req.pod_sandbox_id, made=True)
        if self.shim.backend(sb.backend).exec is None:
            raise UnimplementedError(f"runtime handler {sb.backend!r} does not support PortForward")
        if not sb.status.ready:
            raise FailedPreconditionError(f"pod sandbox {sb.id} is not ready")
        for p in req.port:
            if not 0 < p <= 65535:
                raise InvalidArgumentError(f"port {p} is not in 1-65535")
        return pb.PortForwardResponse(url=self._streaming().portforward_url(req))

    # ------------------------------------------------------------------ stats
    async def stats(self, req: pb.ContainerStatsRequest) -> pb.ContainerStatsResponse:
        c = self.find(req.container_id)
        stats = self.shim.backend(c.backend).stats
        if stats is None:
            raise UnimplementedError(f"runtime handler {c.backend!r} does not report stats")
        got = await stats.container_stats([c])
        return pb.ContainerStatsResponse(
            stats=stats_messages.container_stats(c, got.get(c.id), self.shim.cpu_rates, self.shim.clock())
        )

    async def list_stats(self, req: pb.ListContainerStatsRequest) -> pb.ListContainerStatsResponse:
        shim = self.shim
        f = req.filter
        if f.id:
            c = shim.store.containers.find(f.id, missing="quiet")
            candidates = [c] if c is not None else []
        else:
            candidates = shim.store.containers.values()
        keep = [
            c
            for c in candidates
            if c.committed and (not f.pod_sandbox_id or c.sandbox_id.startswith(f.pod_sandbox_id))
        ]
        keep = with_labels(keep, dict(f.label_selector) if f.label_selector else {})
        by_backend: dict[str, list[ContainerRecord]] = {}
        for c in keep:
            by_backend.setdefault(c.backend, []).append(c)

        async def one(name: str, group: list[ContainerRecord]) -> list[pb.ContainerStats]:
            stats = shim.backend(name).stats
            if stats is None:
                return []
            got = await stats.container_stats(group)
            now = shim.clock()
            return [stats_messages.container_stats(c, got.get(c.id), shim.cpu_rates, now) for c in group]

        if not f.id and not f.pod_sandbox_id and not f.label_selector:
            # Every container is in this answer: a good time to forget the removed ones.
            shim.cpu_rates.retain(shim.store.containers.keys(), shim.store.sandboxes.keys())
        resp = pb.ListContainerStatsResponse()
        for part in await asyncio.gather(*(one(n, g) for n, g in by_backend.items())):
            resp.stats.extend(part)
        return resp

    # ------------------------------------------------------------------ helpers
    def find(self, ref: str) -> ContainerRecord:
        """The created container whose ID is or starts with ``ref``, else NOT_FOUND."""
        return self.shim.store.containers.find(ref, made=True)

    def _running_with(self, ref: str, what: str) -> tuple[ContainerRecord, Exec]:
        """The running container, and its backend's Exec part (``what`` needs it)."""
        c = self.find(ref)
        streams = self.shim.backend(c.backend).exec
        if streams is None:
            raise UnimplementedError(f"runtime handler {c.backend!r} does not support {what}")
        if c.status.state != pb.CONTAINER_RUNNING:
            raise FailedPreconditionError(f"container {c.id} is {_STATE_NAMES[c.status.state]}, not running")
        return c, streams


def _find_or_none(shim: Shim, ref: str) -> ContainerRecord | None:
    if not ref:
        raise InvalidArgumentError("container_id must not be empty")
    return shim.store.containers.find(ref, missing="none")


async def _undo_container(shim: Shim, record: ContainerRecord) -> None:
    backend = shim.backend(record.backend)

    async def undo() -> None:
        try:
            await backend.lifecycle.remove_container(record)
        except Exception as exc:
            log.error("container.rollback_failed", container_id=record.id, error=str(exc))

    await asyncio.shield(undo())
    shim.store.remove(record)


_IMAGE_ID = re.compile(r"(sha256:)?[0-9a-f]{64}")


async def display_image(backend: Backend, spec: pb.ImageSpec) -> str:
    """The image a container's status names (ContainerStatus.image.image, which the kubelet shows
    as the pod's container image): the kubelet creates containers from the image's ID (the
    ImageRef its pull returned) and, from v1.30, names the image as the pod spec wrote it in
    user_specified_image; that name is the one to show, as containerd and CRI-O do. An ID
    without it (older kubelets, crictl) is shown as the image's first tag, if it has one."""
    image = spec.image
    if not _IMAGE_ID.fullmatch(image):
        return image
    if spec.user_specified_image:
        return spec.user_specified_image
    images = backend.images
    if images is None:
        return image
    with contextlib.suppress(CriError):
        info = await images.image_status(spec)
        if info is not None and info.repo_tags:
            return info.repo_tags[0]
    return image
