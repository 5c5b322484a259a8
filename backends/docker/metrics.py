"""ListMetricDescriptors / ListPodSandboxMetrics for engine containers, from cgroups.

With the kubelet's PodAndContainerStatsFromCRI gate, its /metrics/cadvisor
endpoint is served from these two calls instead of its own cAdvisor. The
families keep cAdvisor's names and labels, so dashboards and alerts written
against cAdvisor keep working. Values travel as unsigned integers: seconds
are whole seconds, rounded down.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from cri_api import api_pb2 as pb

from .cgroups import _UNLIMITED, Interface, Sample

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
    return 0 if value is not None and value >= _UNLIMITED else value


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
    Family("container_processes", "Processes (and threads) in the container.", G, lambda s: s.pids),
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

# Families from the shim's records rather than from the cgroup sample.
START_TIME = ("container_start_time_seconds", "When the container started, in seconds since the epoch.", G)
LAST_SEEN = ("container_last_seen", "When the container was last seen running (epoch seconds).", G)
FS_USAGE = ("container_fs_usage_bytes", "Bytes used by the container's writable layer.", G)

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
    out = [pb.MetricDescriptor(name=f.name, help=f.help, label_keys=LABELS) for f in CONTAINER]
    for name, help_, _kind in (START_TIME, LAST_SEEN, FS_USAGE):
        out.append(pb.MetricDescriptor(name=name, help=help_, label_keys=LABELS))
    for name, help_, _get in NETWORK:
        out.append(pb.MetricDescriptor(name=name, help=help_, label_keys=NETWORK_LABELS))
    return out


def container_metrics(
    labels: Sequence[str], sample: Sample, started_at: int, layer_bytes: int | None
) -> list[pb.Metric]:
    """One running container's metrics; ``labels`` are the values of LABELS."""
    out = []
    for f in CONTAINER:
        v = f.value(sample)
        if v is not None:
            out.append(_metric(f.name, f.kind, labels, v))
    if started_at:
        out.append(_metric(START_TIME[0], START_TIME[2], labels, started_at // _S))
    out.append(_metric(LAST_SEEN[0], LAST_SEEN[2], labels, sample.timestamp // _S))
    if layer_bytes is not None:
        out.append(_metric(FS_USAGE[0], FS_USAGE[2], labels, layer_bytes))
    return out


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
