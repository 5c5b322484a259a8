"""What the backend's parts share: the engine, the settings, the state table, and the
engine helpers every RPC family uses (create with rollback, remove, look-ups).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine
from typing import Any

from backends.contract import ContainerRecord, EventSink, ExitInfo, SandboxRecord
from backends.contract.errors import AlreadyExistsError, FailedPreconditionError, NotFoundError
from backends.linux import cgroups

from . import convert
from . import labels as lbl
from .engine_api import EngineAPI, parse_time
from .image_volumes import ImageVolumes
from .images import EngineImages
from .network import CniPods
from .pod_files import PodFiles
from .state import States

ENGINE_ID = "engine_id"
PID = "pid"
RESOLV = "resolv_conf"
UPPER_DIR = "upper_dir"


def exit_info(state: dict[str, Any]) -> ExitInfo:
    code = int(state.get("ExitCode") or 0)
    if state.get("OOMKilled"):
        reason = "OOMKilled"
    elif code == 0:
        reason = "Completed"
    else:
        reason = "Error"
    finished = parse_time(state.get("FinishedAt")) or time.time_ns()
    # The engine stamps StartedAt after the process runs, so a very short one
    # can seem to finish before it started.
    finished = max(finished, parse_time(state.get("StartedAt")))
    return ExitInfo(
        exit_code=code,
        finished_at=finished,
        reason=reason,
        message=str(state.get("Error") or ""),
    )


def engine_id(record: SandboxRecord | ContainerRecord) -> str:
    eid = record.backend_data.get(ENGINE_ID)
    if not eid:
        kind = "sandbox" if isinstance(record, SandboxRecord) else "container"
        raise NotFoundError(f"{kind} {record.id} has no engine container")
    return str(eid)


class Shared:
    """The engine, settings and state of one backend instance."""

    def __init__(
        self,
        engine: EngineAPI,
        engine_images: EngineImages,
        *,
        instance: str,
        network: str,
        runtimes: dict[str, str],
        cgroup_parent: str,
        volumes: ImageVolumes | None = None,
        cni: CniPods | None = None,
        pod_files: PodFiles | None = None,
    ) -> None:
        self.engine = engine
        self.volumes = volumes or ImageVolumes("")
        self.pod_files = pod_files or PodFiles("")
        self.engine_images = engine_images
        self.instance = instance
        self.network = network  # the engine network of pods when CNI does not wire them
        self.cni = cni
        self.runtimes = runtimes
        self.cgroup_parent = cgroup_parent
        self.facts = convert.probe_host()
        self.cgroups = cgroups.CgroupReader()
        self.states = States()
        self.events: EventSink | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        self.closed = False

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def runtime(self, handler: str) -> str | None:
        return self.runtimes.get(handler) or self.runtimes.get("") or None

    def ip_of(self, info: dict[str, Any]) -> str:
        settings = info.get("NetworkSettings") or {}
        networks = settings.get("Networks") or {}
        net: dict[str, Any] = networks.get(self.network) or next(iter(networks.values()), {})
        return str((net or {}).get("IPAddress") or settings.get("IPAddress") or "")

    # ---------------------------------------------------------------- engine helpers

    async def remove(self, engine_id: str) -> None:
        # A stopped container (the usual case: the kubelet stops before it removes)
        # goes without force, which costs the engine a kill attempt (~3 ms);
        # a running one is refused with 409 and then forced.
        with contextlib.suppress(NotFoundError):
            try:
                await self.engine.remove_container(engine_id)
            except (FailedPreconditionError, AlreadyExistsError):
                await self.engine.remove_container(engine_id, force=True)

    async def create(self, name: str, cfg: dict[str, Any], data: dict[str, Any]) -> str:
        """Create an engine container and note its ID in ``data`` (a record's backend_data).

        A leftover of the same name (a crash mid-create) is replaced. If the
        call is cancelled (the client gave up), the engine still finishes a
        create it has received: its answer is awaited all the same, so that
        the record knows the ID and the rollback removes the container.
        """

        async def create() -> str:
            try:
                return await self.engine.create_container(name, cfg)
            except AlreadyExistsError:
                await self.remove(name)
                return await self.engine.create_container(name, cfg)

        task = asyncio.ensure_future(create())
        try:
            data[ENGINE_ID] = await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.engine.call_timeout):
                    data[ENGINE_ID] = await task
            raise
        return str(data[ENGINE_ID])

    async def ours(self) -> list[dict[str, Any]]:
        return await self.engine.list_containers(lbl.ours(self.instance))

    async def engine_id_of(self, cri_id: str) -> str:
        """The engine ID of a CRI object by its label ("" when there is none)."""
        rows = await self.engine.list_containers(
            {"label": [f"{lbl.ID}={cri_id}", f"{lbl.INSTANCE}={self.instance}"]}
        )
        return str(rows[0]["Id"]) if rows else ""
