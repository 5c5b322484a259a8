"""ListMetricDescriptors / ListPodSandboxMetrics, built once for every backend from its samples.

With the kubelet's PodAndContainerStatsFromCRI gate, its /metrics/cadvisor
endpoint is served from these two calls instead of its own cAdvisor. The
families keep cAdvisor's names and labels, so dashboards and alerts written
against cAdvisor keep working. Values travel as unsigned integers: seconds
are whole seconds, rounded down.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from backends.contract import ContainerRecord, SandboxRecord
from backends.contract.usage import (
    UNLIMITED,
    ContainerUsage,
    Detail,
    Device,
    Interface,
    Layer,
    PodMetrics,
    Sample,
)
from cri_api import api_pb2 as pb

LABELS = ("container", "id", "image", "name", "namespace", "pod")
NETWORK_LABELS = (*LABELS, "interface")
_S = 1_000_000_000


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    help: str
    kind: pb.MetricType
    value: Callable[[Sample], int | None]


def _seconds(ns: int | None) -> int | None:
    return None if ns is None else ns // _S


def _limit(value: int | None) -> int | None:
    return 0 if value is not None and value >= UNLIMITED else value


def _quota(value: int | None) -> int | None:
    return value if value is not None and value > 0 else None  # no quota: no sample, as cAdvisor


C, G = pb.COUNTER, pb.GAUGE

CONTAINER: tuple[Family, ...] = (
    Family(
        "container_cpu_usage_seconds_total",
        "CPU time used by the container, in seconds.",
        C,
        lambda s: _seconds(s.cpu_ns),
    ),
    Family(
        "container_cpu_user_seconds_total",
        "CPU time the container spent in user mode, in seconds.",
        C,
        lambda s: _seconds(s.cpu_user_ns),
    ),
    Family(
        "container_cpu_system_seconds_total",
        "CPU time the container spent in the kernel, in seconds.",
        C,
        lambda s: _seconds(s.cpu_system_ns),
    ),
    Family(
        "container_cpu_cfs_periods_total",
        "CFS enforcement periods that have elapsed.",
        C,
        lambda s: s.cpu_periods,
    ),
    Family(
        "container_cpu_cfs_throttled_periods_total",
        "CFS periods in which the container was throttled.",
        C,
        lambda s: s.cpu_throttled_periods,
    ),
    Family(
        "container_cpu_cfs_throttled_seconds_total",
        "Time the container spent throttled, in seconds.",
        C,
        lambda s: _seconds(s.cpu_throttled_ns),
    ),
    Family(
        "container_memory_usage_bytes",
        "Memory charged to the container, page cache included, in bytes.",
        G,
        lambda s: s.memory_usage,
    ),
    Family(
        "container_memory_working_set_bytes",
        "Memory in use less inactive file pages, in bytes.",
        G,
        lambda s: s.working_set,
    ),
    Family("container_memory_rss", "Anonymous memory (RSS) of the container, in bytes.", G, lambda s: s.rss),
    Family(
        "container_memory_cache",
        "Page cache charged to the container, in bytes.",
        G,
        lambda s: s.memory_cache,
    ),
    Family("container_memory_swap", "Swap used by the container, in bytes.", G, lambda s: s.memory_swap),
    Family(
        "container_memory_failcnt",
        "Times the container's memory usage reached its limit.",
        C,
        lambda s: s.memory_failcnt,
    ),
    Family(
        "container_oom_events_total",
        "Processes of the container killed by the OOM killer.",
        C,
        lambda s: s.oom_kills,
    ),
    Family(
        "container_spec_memory_limit_bytes",
        "Memory limit of the container, in bytes; 0 when unlimited.",
        G,
        lambda s: _limit(s.memory_limit),
    ),
    Family("container_spec_cpu_shares", "CPU shares of the container.", G, lambda s: s.cpu_shares),
    Family(
        "container_spec_cpu_quota",
        "CFS quota of the container, in microseconds per period.",
        G,
        lambda s: _quota(s.cpu_quota_us),
    ),
    Family(
        "container_spec_cpu_period",
        "CFS period of the container, in microseconds.",
        G,
        lambda s: s.cpu_period_us,
    ),
)

# Families from the shim's records, the Detail, the filesystem and block I/O.
START_TIME = ("container_start_time_seconds", "When the container started, in seconds since the epoch.")
LAST_SEEN = ("container_last_seen", "When the container was last seen running (epoch seconds).")
DETAIL: tuple[tuple[str, str, pb.MetricType, Callable[[Detail], int | None]], ...] = (
    ("container_processes", "Processes in the container.", G, lambda d: d.processes),
    ("container_threads", "Threads in the container.", G, lambda d: d.threads),
    (
        "container_threads_max",
        "Most threads the container may have; 0 when unlimited.",
        G,
        lambda d: d.threads_max,
    ),
    (
        "container_file_descriptors",
        "Open file descriptors of the container's processes.",
        G,
        lambda d: d.file_descriptors,
    ),
    ("container_sockets", "Open sockets of the container's processes.", G, lambda d: d.sockets),
    (
        "container_memory_kernel_usage",
        "Kernel memory charged to the container, in bytes.",
        G,
        lambda d: d.memory_kernel,
    ),
    (
        "container_memory_mapped_file",
        "File pages mapped by the container, in bytes.",
        G,
        lambda d: d.memory_mapped_file,
    ),
    (
        "container_memory_max_usage_bytes",
        "Highest memory usage recorded for the container, in bytes.",
        G,
        lambda d: d.memory_max_usage,
    ),
    (
        "container_spec_memory_swap_limit_bytes",
        "Memory plus swap limit of the container; 0 when unlimited.",
        G,
        lambda d: d.memory_swap_limit,
    ),
)
FAILURES = ("container_memory_failures_total", "Page faults of the container, by type and scope.")
FAILURE_LABELS = (*LABELS, "failure_type", "scope")
DEVICE_LABELS = (*LABELS, "device")
FS: tuple[tuple[str, str, pb.MetricType, Callable[[Layer], int]], ...] = (
    ("container_fs_usage_bytes", "Bytes used by the container's writable layer.", G, lambda f: f.used_bytes),
    (
        "container_fs_limit_bytes",
        "Size of the filesystem holding the writable layer, in bytes.",
        G,
        lambda f: f.capacity_bytes,
    ),
    (
        "container_fs_inodes_total",
        "Inodes of the filesystem holding the writable layer.",
        G,
        lambda f: f.inodes_total,
    ),
    (
        "container_fs_inodes_free",
        "Free inodes of the filesystem holding the writable layer.",
        G,
        lambda f: f.inodes_free,
    ),
)
IO: tuple[tuple[str, str, Callable[[Device], int]], ...] = (
    ("container_fs_reads_bytes_total", "Bytes the container read from the device.", lambda d: d.read_bytes),
    ("container_fs_reads_total", "Reads the container completed on the device.", lambda d: d.reads),
    ("container_fs_writes_bytes_total", "Bytes the container wrote to the device.", lambda d: d.write_bytes),
    ("container_fs_writes_total", "Writes the container completed on the device.", lambda d: d.writes),
)
BLKIO = (
    "container_blkio_device_usage_total",
    "Bytes of block I/O of the container, by device and operation.",
)
BLKIO_LABELS = (*LABELS, "device", "major", "minor", "operation")


NETWORK: tuple[tuple[str, str, Callable[[Interface], int]], ...] = (
    ("container_network_receive_bytes_total", "Bytes received on the interface.", lambda i: i.rx_bytes),
    ("container_network_receive_packets_total", "Packets received on the interface.", lambda i: i.rx_packets),
    (
        "container_network_receive_packets_dropped_total",
        "Received packets dropped on the interface.",
        lambda i: i.rx_dropped,
    ),
    (
        "container_network_receive_errors_total",
        "Errors while receiving on the interface.",
        lambda i: i.rx_errors,
    ),
    ("container_network_transmit_bytes_total", "Bytes sent on the interface.", lambda i: i.tx_bytes),
    ("container_network_transmit_packets_total", "Packets sent on the interface.", lambda i: i.tx_packets),
    (
        "container_network_transmit_packets_dropped_total",
        "Sent packets dropped on the interface.",
        lambda i: i.tx_dropped,
    ),
    (
        "container_network_transmit_errors_total",
        "Errors while sending on the interface.",
        lambda i: i.tx_errors,
    ),
)


def descriptors() -> list[pb.MetricDescriptor]:
    def d(name: str, help_: str, keys: Sequence[str]) -> pb.MetricDescriptor:
        return pb.MetricDescriptor(name=name, help=help_, label_keys=keys)

    out = [d(f.name, f.help, LABELS) for f in CONTAINER]
    out += [d(name, help_, LABELS) for name, help_ in (START_TIME, LAST_SEEN)]
    out += [d(name, help_, LABELS) for name, help_, _k, _g in DETAIL]
    out.append(d(*FAILURES, FAILURE_LABELS))
    out += [d(name, help_, DEVICE_LABELS) for name, help_, _k, _g in FS]
    out += [d(name, help_, DEVICE_LABELS) for name, help_, _g in IO]
    out.append(d(*BLKIO, BLKIO_LABELS))
    out += [d(name, help_, NETWORK_LABELS) for name, help_, _g in NETWORK]
    return out


def container_metrics(labels: Sequence[str], usage: ContainerUsage, started_at: int) -> list[pb.Metric]:
    """One running container's metrics; ``labels`` are the values of LABELS."""
    sample, detail, layer = usage.sample, usage.detail, usage.layer
    out = []
    for f in CONTAINER:
        v = f.value(sample)
        if v is not None:
            out.append(_metric(f.name, f.kind, labels, v))
    if started_at:
        out.append(_metric(START_TIME[0], G, labels, started_at // _S))
    out.append(_metric(LAST_SEEN[0], G, labels, sample.timestamp // _S))
    if detail is not None:
        for name, _help, kind, get in DETAIL:
            v = get(detail)
            if v is not None:
                out.append(_metric(name, kind, labels, v))
        faults = (
            ("pgfault", "container", detail.page_faults_local),
            ("pgmajfault", "container", detail.major_page_faults_local),
            ("pgfault", "hierarchy", sample.page_faults),
            ("pgmajfault", "hierarchy", sample.major_page_faults),
        )
        for kind_, scope, v in faults:
            if v is not None:
                out.append(_metric(FAILURES[0], C, (*labels, kind_, scope), v))
        for dev in detail.devices:
            name = dev.name or f"{dev.major}:{dev.minor}"
            for metric, _help, get_io in IO:
                out.append(_metric(metric, C, (*labels, name), get_io(dev)))
            for op, v in (("Read", dev.read_bytes), ("Write", dev.write_bytes)):
                out.append(_metric(BLKIO[0], C, (*labels, name, str(dev.major), str(dev.minor), op), v))
    if layer is not None and layer.device:
        for name, _help, kind, get_fs in FS:
            out.append(_metric(name, kind, (*labels, layer.device), get_fs(layer)))
    return out


def pod_metrics(
    sb: SandboxRecord, found: PodMetrics | None, containers: Sequence[ContainerRecord]
) -> pb.PodSandboxMetrics:
    """A pod's metrics from what its backend measured (nothing: an empty entry)."""
    pm = pb.PodSandboxMetrics(pod_sandbox_id=sb.id)
    if found is None:
        return pm
    md = sb.config.metadata
    if found.interfaces is not None:
        pm.metrics.extend(
            network_metrics(("POD", sb.id, found.image, found.name, md.namespace, md.name), found.interfaces)
        )
    for c in containers:
        usage = found.containers.get(c.id) if c.sandbox_id == sb.id else None
        if usage is None:
            continue
        labels = (
            c.config.metadata.name,
            c.id,
            c.image_name or c.config.image.image,
            found.container_names.get(c.id, c.id),
            md.namespace,
            md.name,
        )
        pm.container_metrics.add(
            container_id=c.id, metrics=container_metrics(labels, usage, c.status.started_at)
        )
    return pm


def network_metrics(labels: Sequence[str], interfaces: Sequence[Interface]) -> list[pb.Metric]:
    """The pod's network counters, per interface; ``labels`` are the values of LABELS."""
    out = []
    for iface in interfaces:
        values = (*labels, iface.name)
        for name, _help, get in NETWORK:
            out.append(_metric(name, pb.COUNTER, values, get(iface)))
    return out


def _metric(name: str, kind: pb.MetricType, labels: Sequence[str], value: int) -> pb.Metric:
    value = max(0, value)
    return pb.Metric(name=name, metric_type=kind, label_values=labels, value=pb.UInt64Value(value=value))
