"""CreateContainer / StartContainer / StopContainer / RemoveContainer / UpdateContainerResources."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any

import structlog

from backends.contract import ContainerRecord, ExitInfo, LogMarks, SandboxRecord, Started, decide_stop_signal
from backends.contract.errors import CriError, FailedPreconditionError, InvalidArgumentError, NotFoundError
from backends.linux import cgroups
from cri_api import api_pb2 as pb

from . import convert, pod_files
from . import labels as lbl
from .context import ENGINE_ID, PID, RESOLV, UPPER_DIR, Shared, engine_id, exit_info
from .engine_api import parse_time
from .events import EventWatcher
from .logs import DockerProcess
from .pod_files import POD_FILES

log = structlog.get_logger(__name__)


class Containers:
    def __init__(self, shared: Shared, events: EventWatcher) -> None:
        self._shared = shared
        self._events = events
        self._hugetlb_said: set[str] = set()  # reasons hugepage limits were passed over, logged once

    async def create_container(self, container: ContainerRecord, sandbox: SandboxRecord) -> None:
        shared = self._shared
        config = container.config
        ref = container.image_ref or config.image.image
        try:
            container.image_ref = await shared.engine_images.resolve(ref)
        except NotFoundError as exc:
            raise NotFoundError(f"image {ref!r} not found") from exc
        pause_id = sandbox.backend_data.get(ENGINE_ID)
        if not pause_id:
            raise FailedPreconditionError(f"sandbox {sandbox.id} has no pause container")
        # The engine would choose the same (the config's, else the image's, else SIGTERM); choosing
        # it here and naming it in the engine's config makes what ContainerStatus says the truth.
        stop_signal = decide_stop_signal(
            container, await shared.engine_images.stop_signal(container.image_ref)
        )
        ns = config.linux.security_context.namespace_options
        target = await shared.engine_id_of(ns.target_id) if ns.pid == pb.TARGET and ns.target_id else ""
        cfg = convert.container_config(
            container.id,
            container.sandbox_id,
            container.created_at,
            config,
            sandbox.config,
            image_id=container.image_ref,
            image_name=container.image_name or config.image.image,
            log_path=container.log_path,
            pause_engine_id=str(pause_id),
            target_engine_id=target,
            runtime=shared.runtime(sandbox.handler),
            cgroup_parent=shared.cgroup_parent,
            facts=shared.facts,
            instance=shared.instance,
            stop_signal=stop_signal,
        )
        files = sandbox.backend_data.get(POD_FILES)
        if files:
            cfg["HostConfig"]["Binds"] += pod_files.binds(str(files), config)
        resolv = sandbox.backend_data.get(RESOLV)
        if resolv and convert.sandbox_host_network(sandbox.config):
            # With the host's network each container gets its own copy of the
            # host's resolv.conf; the pod's DNS config lives in the pause one.
            cfg["HostConfig"]["Binds"].append(f"{resolv}:/etc/resolv.conf:ro")
        try:
            await self._image_volumes(container, cfg)
            self._flagged_mounts(container, cfg)
            eid = await shared.create(lbl.container_name(container.id, config), cfg, container.backend_data)
        except BaseException:
            shared.volumes.release(container.id)
            raise
        shared.states.container(container.id, eid)

    async def _image_volumes(self, container: ContainerRecord, cfg: dict[str, Any]) -> None:
        """Each image volume as a read-only bind of the image's layers (image_volumes.py)."""
        shared = self._shared
        for i, mnt in enumerate(container.config.mounts):
            if not (mnt.HasField("image") and mnt.image.image):
                continue
            try:
                image_id = await shared.engine_images.resolve(mnt.image.image)
            except NotFoundError as exc:
                raise NotFoundError(
                    f"image {mnt.image.image!r} of mount {mnt.container_path} not found"
                ) from exc
            info = await shared.engine.image_inspect(image_id)
            source = shared.volumes.stack(container.id, i, mnt, info)
            if ":" in source or ":" in mnt.container_path:
                raise InvalidArgumentError(f"mount paths may not contain ':' ({mnt.container_path})")
            cfg["HostConfig"]["Binds"].append(f"{source}:{mnt.container_path}:ro,rprivate")
            # ContainerStatus reports which image each image volume is (Mount.image.image_ref).
            container.image_volume_refs[mnt.container_path] = image_id

    def _flagged_mounts(self, container: ContainerRecord, cfg: dict[str, Any]) -> None:
        """Each mount with mount_options bound from a copy that has their flags (image_volumes.py)."""
        binds: list[str] = cfg["HostConfig"]["Binds"]
        for i, mnt in enumerate(container.config.mounts):
            if not mnt.mount_options or not mnt.host_path:
                continue
            plain = convert.bind(mnt)
            source = self._shared.volumes.flagged(container.id, i, mnt)
            flagged = pb.Mount()
            flagged.CopyFrom(mnt)
            flagged.host_path = source
            flagged.readonly = mnt.readonly or "ro" in mnt.mount_options
            binds[binds.index(plain)] = convert.bind(flagged)

    async def start_container(self, container: ContainerRecord, sandbox: SandboxRecord) -> Started:
        shared = self._shared
        eid = engine_id(container)
        shared.states.container(container.id, eid).died = False
        await shared.engine.start_container(eid)
        info = await shared.engine.inspect_container(eid)
        state = info["State"]
        container.backend_data[PID] = int(state.get("Pid") or 0)
        # Informational, kept by the shim across the status it sets next.
        container.status = dataclasses.replace(container.status, pid=container.backend_data[PID])
        upper = ((info.get("GraphDriver") or {}).get("Data") or {}).get("UpperDir")
        if upper:
            container.backend_data[UPPER_DIR] = upper
        started = parse_time(state.get("StartedAt")) or time.time_ns()
        if state.get("Running"):
            try:
                await self.apply_hugepages(container, eid, container.config.linux.resources)
            except FailedPreconditionError:
                # The container must not run without the limits it asked for.
                with contextlib.suppress(CriError):
                    await shared.engine.stop_container(eid, 0)
                raise
        st = shared.states.container(container.id, eid)
        st.tty = bool(info["Config"].get("Tty"))
        process = st.process = DockerProcess(shared, st, st.tty, None)
        st.watched = True
        if st.died or (not state.get("Running") and parse_time(state.get("FinishedAt"))):
            # Exited before we watched it: its die event was heard then (or came before we looked).
            st.died = False
            shared.spawn(self._events.report_exit(st))
        return Started(started, process)

    async def reattach(self, container: ContainerRecord, after: LogMarks | None) -> DockerProcess | None:
        """The process of a container recovery found running (and watches)."""
        st = self._shared.states.containers.get(container.id)
        if st is None or not (st.watched or st.exit):
            return None
        process = st.process = DockerProcess(self._shared, st, st.tty, after)
        if st.exit is not None:
            process.exited(st.exit)
        return process

    async def stop_container(self, container: ContainerRecord, timeout: int) -> ExitInfo:
        shared = self._shared
        eid = engine_id(container)
        st = shared.states.container(container.id, eid)
        st.stopping, st.watched = True, False
        try:
            with contextlib.suppress(NotFoundError):
                await shared.engine.stop_container(eid, timeout)
            process = st.process
            if process is not None:
                process.stopped()  # the rest of its output is read while we ask how it ended
            try:
                info = exit_info((await shared.engine.inspect_container(eid))["State"])
            except NotFoundError:
                info = ExitInfo(exit_code=137, finished_at=time.time_ns(), reason="Error", message="gone")
            if process is not None:
                process.exit.set(info)
            return info
        finally:
            st.watched = False
            st.stopping = False

    async def remove_container(self, container: ContainerRecord) -> None:
        self._shared.states.drop_container(container.id)
        # Without an engine ID (a create that failed or was given up), look the container up by its label.
        eid = container.backend_data.get(ENGINE_ID) or await self._shared.engine_id_of(container.id)
        if eid:
            await self._shared.remove(str(eid))
        self._shared.volumes.release(container.id)

    async def apply_hugepages(
        self, container: ContainerRecord, eid: str, resources: pb.LinuxContainerResources
    ) -> None:
        """Hugepage limits, written into the cgroup of the running container (the engine has none)."""
        limits = [(h.page_size, h.limit) for h in resources.hugepage_limits]
        pid = int(container.backend_data.get(PID) or 0)
        if not limits or not pid:
            return
        work = functools.partial(self._shared.cgroups.set_hugetlb, pid, eid, limits)
        try:
            skipped = await self._shared.engine.run(work)
        except cgroups.HugetlbError as exc:
            raise FailedPreconditionError(f"hugepage limits of container {container.id}: {exc}") from exc
        for why in skipped:
            # The kubelet asks for limits on every container: say each reason once.
            if why not in self._hugetlb_said:
                self._hugetlb_said.add(why)
                log.warning("hugepage limits not applied", container_id=container.id, reason=why)

    async def update_container_resources(
        self, container: ContainerRecord, resources: pb.LinuxContainerResources
    ) -> None:
        eid = engine_id(container)
        if container.status.state == pb.CONTAINER_RUNNING:
            await self.apply_hugepages(container, eid, resources)
        await self._shared.engine.update_container(eid, convert.resources(resources))
