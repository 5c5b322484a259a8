"""The figures of ListContainerStats / ListPodSandboxStats / ListPodSandboxMetrics, from the cgroups."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

from backends.contract import ContainerRecord, ContainerUsage, PodMetrics, SandboxRecord, SandboxUsage
from backends.contract.usage import Interface, Layer, Sample
from backends.contract.usage import total as usage_total
from backends.linux import cgroup_usage
from backends.linux.usage import dir_usage
from cri_api import api_pb2 as pb

from . import convert
from . import labels as lbl
from .context import ENGINE_ID, PID, UPPER_DIR, Shared


class DockerStats:
    """Per-object samples (the layer usage) live in the state table."""

    def __init__(self, shared: Shared) -> None:
        self._shared = shared

    def _sample(self, record: ContainerRecord | SandboxRecord, full: bool = False) -> Sample | None:
        pid = int(record.backend_data.get(PID) or 0)
        eid = str(record.backend_data.get(ENGINE_ID) or "")
        if not pid or not eid:
            return None
        return self._shared.cgroups.sample(pid, expect=eid, full=full)

    def _layer(self, container: ContainerRecord, with_fs: bool = False) -> Layer | None:
        """The writable layer's usage (re-measured every 30 s at most); ``with_fs``: and its filesystem's."""
        upper = container.backend_data.get(UPPER_DIR)
        if not upper:
            return None
        state = self._shared.states.containers.get(container.id)
        cached = state.layer_usage if state is not None else None
        if cached is None or time.monotonic() - cached[0] > 30:
            used, inodes = dir_usage(str(upper), limit=200_000)
            cached = (time.monotonic(), used, inodes)
            if state is not None:
                state.layer_usage = cached
        layer = Layer(mountpoint=str(upper), used_bytes=cached[1], inodes_used=cached[2])
        if not with_fs:
            return layer
        try:
            st, vfs = os.stat(upper), os.statvfs(upper)
        except OSError:
            return layer
        return dataclasses.replace(
            layer,
            device=cgroup_usage.device_name(os.major(st.st_dev), os.minor(st.st_dev)),
            capacity_bytes=vfs.f_blocks * vfs.f_frsize,
            inodes_total=vfs.f_files,
            inodes_free=vfs.f_ffree,
        )

    async def container_stats(self, containers: Sequence[ContainerRecord]) -> dict[str, ContainerUsage]:
        def one(ct: ContainerRecord) -> ContainerUsage:
            sample = None if ct.status.finished_at else self._sample(ct)
            return ContainerUsage(sample or Sample(timestamp=time.time_ns()), self._layer(ct))

        def work() -> dict[str, ContainerUsage]:
            return {ct.id: one(ct) for ct in containers}

        return await self._shared.engine.run(work)

    async def sandbox_stats(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, SandboxUsage]:
        def work() -> dict[str, SandboxUsage]:
            out: dict[str, SandboxUsage] = {}
            for sb in sandboxes:
                now = time.time_ns()
                pause = self._sample(sb) if sb.status.ready else None
                samples = [pause] if pause is not None else []
                per_ct: dict[str, ContainerUsage] = {}
                for ct in containers:
                    if ct.sandbox_id != sb.id:
                        continue
                    sample = None if ct.status.finished_at else self._sample(ct)
                    per_ct[ct.id] = ContainerUsage(sample or Sample(timestamp=now), self._layer(ct))
                    if sample is not None:
                        samples.append(sample)
                pod = usage_total(samples, now)
                pod = dataclasses.replace(pod, pids=pod.pids or 0)
                pid = int(sb.backend_data.get(PID) or 0)
                interfaces: tuple[Interface, ...] = ()
                if pause is not None and pid and not convert.sandbox_host_network(sb.config):
                    interfaces = tuple(cgroup_usage.net_interfaces(pid))
                out[sb.id] = SandboxUsage(pod, interfaces, containers=per_ct)
            return out

        return await self._shared.engine.run(work)

    async def sandbox_metrics(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, PodMetrics]:
        def work() -> dict[str, PodMetrics]:
            by_pod: dict[str, list[ContainerRecord]] = {}
            for ct in containers:
                by_pod.setdefault(ct.sandbox_id, []).append(ct)
            out = {}
            for sb in sandboxes:
                pid = int(sb.backend_data.get(PID) or 0)
                interfaces = None
                if sb.status.ready and pid and not convert.sandbox_host_network(sb.config):
                    interfaces = tuple(cgroup_usage.net_interfaces(pid))
                found: dict[str, ContainerUsage] = {}
                names: dict[str, str] = {}
                for ct in by_pod.get(sb.id, ()):
                    if ct.status.state != pb.CONTAINER_RUNNING:
                        continue
                    sample = self._sample(ct, full=True)
                    if sample is None:
                        continue
                    detail = self._shared.cgroups.detail(
                        int(ct.backend_data.get(PID) or 0), expect=str(ct.backend_data.get(ENGINE_ID) or "")
                    )
                    found[ct.id] = ContainerUsage(sample, self._layer(ct, with_fs=True), detail)
                    names[ct.id] = lbl.container_name(ct.id, ct.config)
                out[sb.id] = PodMetrics(
                    name=lbl.sandbox_name(sb.id, sb.config),
                    image=self._shared.engine_images.pause_image,
                    interfaces=interfaces,
                    containers=found,
                    container_names=names,
                )
            return out

        return await self._shared.engine.run(work)
