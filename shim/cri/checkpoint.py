"""CheckpointContainer, CheckpointPod and RestorePod: the requests checked, the backend's
``checkpoint`` part called under the locks of what it names.

Where a checkpoint may be written and read: :mod:`shim.cri.checkpoint_paths`.
CheckpointContainer writes the file ``location`` (its directory must exist; an existing file is
replaced); CheckpointPod writes in ``output_path``, an existing, empty directory, as the CRI says;
RestorePod reads the directory ``checkpoint_path``.

A handler without a ``checkpoint`` part answers UNIMPLEMENTED, naming the handler. A backend
that has the part but cannot checkpoint here (docker and runv without a working CRIU) answers
FAILED_PRECONDITION, saying why.

CheckpointContainer's ``timeout`` (seconds; 0: none of its own) and the call's gRPC deadline both
bound the checkpoint: on expiry the answer is DEADLINE_EXCEEDED, the container runs as before and
no archive, whole or partial, is at ``location`` (a file that was there stays as it was).

RestorePod makes the pod and its containers as RunPodSandbox and CreateContainer do (the same
checks, records and events), only after the backend has read and verified the checkpoint; any
failure after that removes what the call made (sandbox, containers, their records and names)
before the error is answered.

CreateContainer from a checkpoint: :mod:`shim.cri.container_restore`.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from backends.contract import Checkpoint, ContainerRecord, SandboxRecord
from cri_api import api_pb2 as pb
from shim.cri import validate
from shim.cri.checkpoint_paths import allowed_path, archive_to_write, directory
from shim.cri.container import MAX_TIMEOUT, ContainerService
from shim.cri.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnimplementedError,
)
from shim.cri.sandbox import SandboxService
from shim.cri.state import Shim

log = structlog.get_logger("checkpoint")


def _unique(field: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if not name:
            raise InvalidArgumentError(f"{field} must not hold an empty name")
        if name in seen:
            raise InvalidArgumentError(f"{field} names {name!r} twice")
        seen.add(name)


class CheckpointService:
    def __init__(self, shim: Shim, sandboxes: SandboxService, containers: ContainerService) -> None:
        self.shim = shim
        self.sandboxes = sandboxes
        self.containers = containers

    def _part(self, backend_name: str, rpc: str) -> Checkpoint:
        part = self.shim.backend(backend_name).checkpoint
        if part is None:
            raise UnimplementedError(
                f"runtime handler {backend_name!r} does not support checkpointing ({rpc})"
            )
        return part

    # ------------------------------------------------------------------ CheckpointContainer
    async def checkpoint_container(
        self, req: pb.CheckpointContainerRequest
    ) -> pb.CheckpointContainerResponse:
        shim = self.shim
        if not req.container_id:
            raise InvalidArgumentError("container_id must not be empty")
        c = shim.store.containers.find(req.container_id, made=True)
        part = self._part(c.backend, "CheckpointContainer")
        location = allowed_path(shim, "location", req.location)
        if req.timeout < 0:
            raise InvalidArgumentError(f"timeout {req.timeout} must not be negative")
        timeout = min(int(req.timeout), MAX_TIMEOUT)
        await asyncio.to_thread(archive_to_write, "location", location)
        async with shim.locks.hold(c.id):
            if shim.store.containers.get(c.id) is not c:
                raise NotFoundError(f"container {c.id} was removed")
            if c.status.state != pb.CONTAINER_RUNNING:
                raise FailedPreconditionError(
                    f"container {c.id} is not running; only a running one is checkpointed"
                )
            # The backend leaves nothing at ``location`` when it is cancelled: by this timeout,
            # or by the call's deadline (the transport cancels the call).
            bound = asyncio.timeout(timeout or None)
            try:
                async with bound:
                    await part.checkpoint_container(c, location, timeout)
            except TimeoutError:
                if not bound.expired():
                    raise
                raise DeadlineExceededError(
                    f"the checkpoint of container {c.id} did not finish within its timeout of {timeout} s; "
                    f"nothing was written at {location} and the container runs on"
                ) from None
        return pb.CheckpointContainerResponse()

    # ------------------------------------------------------------------ CheckpointPod
    async def checkpoint_pod(self, req: pb.CheckpointPodRequest) -> pb.CheckpointPodResponse:
        shim = self.shim
        if not req.pod_sandbox_id:
            raise InvalidArgumentError("pod_sandbox_id must not be empty")
        sb = shim.store.sandboxes.find(req.pod_sandbox_id, made=True)
        part = self._part(sb.backend, "CheckpointPod")
        output = allowed_path(shim, "output_path", req.output_path)
        ids = list(req.container_ids)
        if not ids:
            raise InvalidArgumentError("container_ids must name at least one container")
        _unique("container_ids", ids)
        await asyncio.to_thread(directory, "output_path", output, True)
        async with contextlib.AsyncExitStack() as held:
            await held.enter_async_context(shim.locks.hold(sb.id))
            shim.check_ready(sb, "; cannot checkpoint it")
            containers = self._pod_containers(sb, ids)
            # One lock order (by ID) for every call that holds several containers' locks.
            for c in sorted(containers, key=lambda c: c.id):
                await held.enter_async_context(shim.locks.hold(c.id))
            for c in containers:
                if shim.store.containers.get(c.id) is not c:
                    raise NotFoundError(f"container {c.id} was removed")
                if c.status.state != pb.CONTAINER_RUNNING:
                    raise FailedPreconditionError(
                        f"container {c.id} ({c.config.metadata.name}) is not running; "
                        "CheckpointPod captures running containers only"
                    )
            await part.checkpoint_pod(sb, containers, output, dict(req.options))
        return pb.CheckpointPodResponse()

    def _pod_containers(self, sb: SandboxRecord, ids: list[str]) -> list[ContainerRecord]:
        out = []
        for ref in ids:
            c = self.shim.store.containers.find(ref, made=True)
            if c.sandbox_id != sb.id:
                raise InvalidArgumentError(f"container {c.id} belongs to pod {c.sandbox_id}, not to {sb.id}")
            out.append(c)
        if len({c.id for c in out}) != len(out):
            raise InvalidArgumentError("container_ids name one container twice")
        return out

    # ------------------------------------------------------------------ RestorePod
    async def restore_pod(self, req: pb.RestorePodRequest) -> pb.RestorePodResponse:
        shim = self.shim
        validate.sandbox_config(req.config, req.HasField("config"))
        configs = list(req.container_configs)
        if not configs:
            raise InvalidArgumentError(
                "container_configs must hold one configuration per checkpointed container"
            )
        for cfg in configs:
            validate.container_config(cfg, True)
        _unique("container_configs' metadata", [cfg.metadata.name for cfg in configs])
        path = allowed_path(shim, "checkpoint_path", req.checkpoint_path)
        await asyncio.to_thread(directory, "checkpoint_path", path, False)
        try:
            backend_name = shim.registry.resolve_name(req.runtime_handler)
        except LookupError as exc:
            raise InvalidArgumentError(f"runtime_handler: {exc}") from None
        part = self._part(backend_name, "RestorePod")
        checkpoint = await part.open_pod_checkpoint(path, dict(req.options), configs)
        wanted = sorted(cfg.metadata.name for cfg in configs)
        if sorted(checkpoint.container_names) != wanted:
            raise InvalidArgumentError(
                f"container_configs name {wanted}; the checkpoint holds {sorted(checkpoint.container_names)}"
            )
        made = await self.sandboxes.run(
            pb.RunPodSandboxRequest(config=req.config, runtime_handler=req.runtime_handler)
        )
        sid = made.pod_sandbox_id
        resp = pb.RestorePodResponse(pod_sandbox_id=sid)
        try:
            for cfg in configs:
                created = await self.containers.create(
                    pb.CreateContainerRequest(pod_sandbox_id=sid, config=cfg, sandbox_config=req.config)
                )
                cid = created.container_id
                async with shim.locks.hold(cid):
                    c = shim.store.containers.get(cid)
                    sb = shim.store.sandboxes.get(sid)
                    if c is None or sb is None:
                        raise NotFoundError(f"restored container {cid} was removed while restoring")
                    await part.restore_container(c, sb, checkpoint)
                resp.restored_containers.add(name=cfg.metadata.name, container_id=cid)
        except BaseException as exc:
            log.info("restore.undone", pod_sandbox_id=sid, error=str(exc) or type(exc).__name__)
            await asyncio.shield(self.sandboxes.remove(pb.RemovePodSandboxRequest(pod_sandbox_id=sid)))
            raise
        return resp
