"""ListContainerStats / ListPodSandboxStats / ListPodSandboxMetrics, from the cgroups."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from backends.contract import ContainerRecord, SandboxRecord, container_stats_of, sandbox_stats_of
from backends.linux import cgroups, metrics
from backends.linux.usage import dir_usage
from cri_api import api_pb2 as pb

from . import convert
from . import labels as lbl
from .context import ENGINE_ID, PID, UPPER_DIR, Shared


class Stats:
    """Per-object samples (the CPU rate's previous sample, the layer usage) live in the state table."""

    def __init__(self, shared: Shared) -> None:
        self._shared = shared

    def _sample(
        self, cri_id: str, record: ContainerRecord | SandboxRecord, full: bool = False
    ) -> cgroups.Sample | None:
        pid = int(record.backend_data.get(PID) or 0)
        eid = str(record.backend_data.get(ENGINE_ID) or "")
        if not pid or not eid:
            return None
        return self._shared.cgroups.sample(pid, expect=eid, full=full)

    def _layer(self, container: ContainerRecord, now: int) -> pb.FilesystemUsage | None:
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
        return pb.FilesystemUsage(
            timestamp=now,
            fs_id=pb.FilesystemIdentifier(mountpoint=str(upper)),
            used_bytes=pb.UInt64Value(value=cached[1]),
            inodes_used=pb.UInt64Value(value=cached[2]),
        )

    def _container_stats(self, ct: ContainerRecord) -> tuple[pb.ContainerStats, cgroups.Sample | None]:
        st = container_stats_of(ct)
        now = time.time_ns()
        sample = None if ct.status.finished_at else self._sample(ct.id, ct)
        if sample is not None:
            state = self._shared.states.containers.get(ct.id)
            _fill_cpu_mem(st.cpu, st.memory, sample, state.cpu_prev if state is not None else None)
            if sample.cpu_ns is not None and state is not None:
                state.cpu_prev = (sample.timestamp, sample.cpu_ns)
        else:
            st.cpu.timestamp = now
            st.memory.timestamp = now
        layer = self._layer(ct, now)
        if layer is not None:
            st.writable_layer.CopyFrom(layer)
        return st, sample

    async def containers(self, containers: Sequence[ContainerRecord]) -> dict[str, pb.ContainerStats]:
        def work() -> dict[str, pb.ContainerStats]:
            return {ct.id: self._container_stats(ct)[0] for ct in containers}

        return await self._shared.engine.run(work)

    async def sandboxes(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> dict[str, pb.PodSandboxStats]:
        def work() -> dict[str, pb.PodSandboxStats]:
            out: dict[str, pb.PodSandboxStats] = {}
            for sb in sandboxes:
                ps = sandbox_stats_of(sb)
                now = time.time_ns()
                linux = ps.linux
                samples = []
                pause = self._sample(sb.id, sb) if sb.status.ready else None
                if pause is not None:
                    samples.append(pause)
                for ct in containers:
                    if ct.sandbox_id != sb.id:
                        continue
                    cs, sample = self._container_stats(ct)
                    linux.containers.append(cs)
                    if sample is not None:
                        samples.append(sample)
                total = _sum_samples(samples, now)
                state = self._shared.states.sandboxes.get(sb.id)
                _fill_cpu_mem(linux.cpu, linux.memory, total, state.cpu_prev if state is not None else None)
                if total.cpu_ns is not None and state is not None:
                    state.cpu_prev = (total.timestamp, total.cpu_ns)
                linux.process.timestamp = now
                linux.process.process_count.value = total.pids or 0
                pid = int(sb.backend_data.get(PID) or 0)
                if pause is not None and pid and not convert.sandbox_host_network(sb.config):
                    ifaces = cgroups.net_interfaces(pid)
                    linux.network.timestamp = now
                    for i in ifaces:
                        nu = pb.NetworkInterfaceUsage(
                            name=i.name,
                            rx_bytes=pb.UInt64Value(value=i.rx_bytes),
                            rx_errors=pb.UInt64Value(value=i.rx_errors),
                            tx_bytes=pb.UInt64Value(value=i.tx_bytes),
                            tx_errors=pb.UInt64Value(value=i.tx_errors),
                        )
                        linux.network.interfaces.append(nu)
                        if i.name == "eth0":
                            linux.network.default_interface.CopyFrom(nu)
                out[sb.id] = ps
            return out

        return await self._shared.engine.run(work)

    def _layer_metrics(self, ct: ContainerRecord, now: int) -> metrics.Layer | None:
        usage = self._layer(ct, now)
        if usage is None:
            return None
        upper = usage.fs_id.mountpoint
        try:
            st, vfs = os.stat(upper), os.statvfs(upper)
        except OSError:
            return None
        return metrics.Layer(
            device=cgroups.device_name(os.major(st.st_dev), os.minor(st.st_dev)),
            used_bytes=usage.used_bytes.value,
            capacity_bytes=vfs.f_blocks * vfs.f_frsize,
            inodes_total=vfs.f_files,
            inodes_free=vfs.f_ffree,
        )

    async def descriptors(self) -> list[pb.MetricDescriptor]:
        return metrics.descriptors()

    async def metrics(
        self, sandboxes: Sequence[SandboxRecord], containers: Sequence[ContainerRecord]
    ) -> list[pb.PodSandboxMetrics]:
        def work() -> list[pb.PodSandboxMetrics]:
            by_pod: dict[str, list[ContainerRecord]] = {}
            for ct in containers:
                by_pod.setdefault(ct.sandbox_id, []).append(ct)
            out = []
            for sb in sandboxes:
                md = sb.config.metadata
                pm = pb.PodSandboxMetrics(pod_sandbox_id=sb.id)
                pid = int(sb.backend_data.get(PID) or 0)
                if sb.status.ready and pid and not convert.sandbox_host_network(sb.config):
                    labels = (
                        "POD",
                        sb.id,
                        self._shared.images.pause_image,
                        lbl.sandbox_name(sb.id, sb.config),
                        md.namespace,
                        md.name,
                    )
                    pm.metrics.extend(metrics.network_metrics(labels, cgroups.net_interfaces(pid)))
                for ct in by_pod.get(sb.id, ()):
                    if ct.status.state != pb.CONTAINER_RUNNING:
                        continue
                    sample = self._sample(ct.id, ct, full=True)
                    if sample is None:
                        continue
                    pid = int(ct.backend_data.get(PID) or 0)
                    detail = self._shared.cgroups.detail(
                        pid, expect=str(ct.backend_data.get(ENGINE_ID) or "")
                    )
                    labels = (
                        ct.config.metadata.name,
                        ct.id,
                        ct.image_name or ct.config.image.image,
                        lbl.container_name(ct.id, ct.config),
                        md.namespace,
                        md.name,
                    )
                    found = metrics.container_metrics(
                        labels,
                        sample,
                        detail,
                        ct.status.started_at,
                        self._layer_metrics(ct, sample.timestamp),
                        cgroups.device_name,
                    )
                    pm.container_metrics.add(container_id=ct.id, metrics=found)
                out.append(pm)
            return out

        return await self._shared.engine.run(work)


def _sum_samples(samples: list[cgroups.Sample], now: int) -> cgroups.Sample:
    def total(attr: str) -> int | None:
        values = [getattr(s, attr) for s in samples if getattr(s, attr) is not None]
        return sum(values) if values else None

    return cgroups.Sample(
        timestamp=now,
        cpu_ns=total("cpu_ns"),
        memory_usage=total("memory_usage"),
        working_set=total("working_set"),
        rss=total("rss"),
        page_faults=total("page_faults"),
        major_page_faults=total("major_page_faults"),
        pids=total("pids"),
    )


def _fill_cpu_mem(
    cpu: pb.CpuUsage, mem: pb.MemoryUsage, s: cgroups.Sample, prev: tuple[int, int] | None
) -> None:
    cpu.timestamp = s.timestamp
    mem.timestamp = s.timestamp
    if s.cpu_ns is not None:
        cpu.usage_core_nano_seconds.value = s.cpu_ns
        if prev is not None and s.timestamp > prev[0] and s.cpu_ns >= prev[1]:
            cpu.usage_nano_cores.value = (s.cpu_ns - prev[1]) * 1_000_000_000 // (s.timestamp - prev[0])
    if s.working_set is not None:
        mem.working_set_bytes.value = s.working_set
    if s.memory_usage is not None:
        mem.usage_bytes.value = s.memory_usage
    if s.rss is not None:
        mem.rss_bytes.value = s.rss
    if s.page_faults is not None:
        mem.page_faults.value = s.page_faults
    if s.major_page_faults is not None:
        mem.major_page_faults.value = s.major_page_faults
    avail = cgroups.available(s)
    if avail is not None:
        mem.available_bytes.value = avail
