"""The CRI's stats messages, built once for every backend from the figures it measured.

A backend reports samples (:mod:`backends.contract.usage`): cumulative CPU
time, memory counters, its writable layer, a pod's interfaces. The CRI also
wants the CPU rate (``usage_nano_cores``), which the kubelet's summary API
and metrics-server read. It is the change since the previous sample of the
same container or pod, so it is computed here, where every sample passes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from backends.contract import ContainerRecord, SandboxRecord
from backends.contract.usage import ContainerUsage, Interface, Sample, SandboxUsage, available
from cri_api import api_pb2 as pb

NS = 1_000_000_000


class CpuRates:
    """The previous CPU sample of each container and pod, and the rate since then."""

    def __init__(self) -> None:
        self._prev: dict[str, tuple[int, int]] = {}  # key -> (timestamp, cumulative ns)

    def rate(self, key: str, now: int, used: int) -> int | None:
        """Cores in use (in ns per s) since the previous sample of ``key``; None for the first."""
        prev = self._prev.get(key)
        if prev is None or now > prev[0]:
            self._prev[key] = (now, used)
        if prev is None:
            return None
        then, before = prev
        if now > then and used >= before:
            return (used - before) * NS // (now - then)
        return None

    def retain(self, container_ids: Iterable[str], sandbox_ids: Iterable[str]) -> None:
        """Forget the samples of what no longer exists."""
        keep = set(container_ids) | {"pod/" + s for s in sandbox_ids}
        for key in [k for k in self._prev if k not in keep]:
            del self._prev[key]


def _u64(value: int) -> pb.UInt64Value:
    return pb.UInt64Value(value=max(0, value))


def _cpu(sample: Sample, own_rate: int | None, rates: CpuRates, key: str) -> pb.CpuUsage:
    cpu = pb.CpuUsage(timestamp=sample.timestamp)
    if sample.cpu_ns is not None:
        cpu.usage_core_nano_seconds.CopyFrom(_u64(sample.cpu_ns))
        rate = rates.rate(key, sample.timestamp, sample.cpu_ns)  # the sample counts either way
        if own_rate is not None:
            rate = own_rate
        if rate is not None:
            cpu.usage_nano_cores.CopyFrom(_u64(rate))
    elif own_rate is not None:
        cpu.usage_nano_cores.CopyFrom(_u64(own_rate))
    return cpu


def _memory(sample: Sample) -> pb.MemoryUsage:
    mem = pb.MemoryUsage(timestamp=sample.timestamp)
    for field, value in (
        ("working_set_bytes", sample.working_set),
        ("usage_bytes", sample.memory_usage),
        ("rss_bytes", sample.rss),
        ("page_faults", sample.page_faults),
        ("major_page_faults", sample.major_page_faults),
        ("available_bytes", available(sample)),
    ):
        if value is not None:
            getattr(mem, field).CopyFrom(_u64(value))
    return mem


def _interface(i: Interface) -> pb.NetworkInterfaceUsage:
    return pb.NetworkInterfaceUsage(
        name=i.name,
        rx_bytes=_u64(i.rx_bytes),
        rx_errors=_u64(i.rx_errors),
        tx_bytes=_u64(i.tx_bytes),
        tx_errors=_u64(i.tx_errors),
    )


def container_stats(
    c: ContainerRecord, usage: ContainerUsage | None, rates: CpuRates, now: int
) -> pb.ContainerStats:
    """A container's stats; without figures (not measured, not running) only times."""
    cfg = c.config
    st = pb.ContainerStats(
        attributes=pb.ContainerAttributes(
            id=c.id, metadata=cfg.metadata, labels=dict(cfg.labels), annotations=dict(cfg.annotations)
        )
    )
    sample = usage.sample if usage is not None else Sample(timestamp=now)
    st.cpu.CopyFrom(_cpu(sample, usage.cpu_nano_cores if usage is not None else None, rates, c.id))
    st.memory.CopyFrom(_memory(sample))
    layer = usage.layer if usage is not None else None
    if layer is not None:
        st.writable_layer.CopyFrom(
            pb.FilesystemUsage(
                timestamp=sample.timestamp,
                fs_id=pb.FilesystemIdentifier(mountpoint=layer.mountpoint),
                used_bytes=_u64(layer.used_bytes),
                inodes_used=_u64(layer.inodes_used),
            )
        )
    return st


def sandbox_stats(
    sb: SandboxRecord,
    usage: SandboxUsage | None,
    containers: Sequence[ContainerRecord],
    rates: CpuRates,
    now: int,
) -> pb.PodSandboxStats:
    """A pod's stats: its total, network and processes, and its containers' (those measured)."""
    cfg = sb.config
    st = pb.PodSandboxStats(
        attributes=pb.PodSandboxAttributes(
            id=sb.id, metadata=cfg.metadata, labels=dict(cfg.labels), annotations=dict(cfg.annotations)
        )
    )
    if usage is None:
        return st
    linux = st.linux
    sample = usage.sample
    linux.cpu.CopyFrom(_cpu(sample, usage.cpu_nano_cores, rates, "pod/" + sb.id))
    linux.memory.CopyFrom(_memory(sample))
    if sample.pids is not None:
        linux.process.timestamp = sample.timestamp
        linux.process.process_count.CopyFrom(_u64(sample.pids))
    if usage.interfaces:
        linux.network.timestamp = sample.timestamp
        for i in usage.interfaces:
            nu = _interface(i)
            linux.network.interfaces.append(nu)
            if i.name == usage.default_interface:
                linux.network.default_interface.CopyFrom(nu)
    for c in containers:
        if c.sandbox_id == sb.id and c.id in usage.containers:
            linux.containers.append(container_stats(c, usage.containers[c.id], rates, now))
    return st
