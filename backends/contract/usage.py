"""Usage figures as a backend measures them: samples, not protobufs.

A backend hands the shim what it read (cgroup counters, interface counters,
its writable layer's size); the shim builds the CRI messages from them once
for every backend (``shim/cri/stats_messages.py`` for the stats RPCs, with the CPU rate
from the previous sample; ``shim/cri/sandbox_metrics.py`` for ListPodSandboxMetrics).
None means "not measured": the field is left out of the message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

UNLIMITED = 1 << 60  # a limit at or above this is no limit (cgroup v1's "unlimited" is near 2**63)


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """A container's (or a pod's) cgroup counters at one time."""

    timestamp: int  # ns
    cpu_ns: int | None = None
    memory_usage: int | None = None
    working_set: int | None = None
    rss: int | None = None
    page_faults: int | None = None
    major_page_faults: int | None = None
    memory_limit: int | None = None
    pids: int | None = None
    # For ListPodSandboxMetrics (cAdvisor's container_* families).
    cpu_user_ns: int | None = None
    cpu_system_ns: int | None = None
    cpu_periods: int | None = None
    cpu_throttled_periods: int | None = None
    cpu_throttled_ns: int | None = None
    cpu_shares: int | None = None  # v1 shares; v2 weight converted back to shares
    cpu_quota_us: int | None = None  # -1: no quota
    cpu_period_us: int | None = None
    memory_cache: int | None = None
    memory_swap: int | None = None
    memory_failcnt: int | None = None
    oom_kills: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Device:
    """Block I/O of a cgroup on one device."""

    major: int
    minor: int
    read_bytes: int = 0
    write_bytes: int = 0
    reads: int = 0
    writes: int = 0
    name: str = ""  # /dev/NAME as the host (or VM) names it; "" if unknown


@dataclasses.dataclass(frozen=True, slots=True)
class Detail:
    """What ListPodSandboxMetrics needs beyond a Sample (dearer to read: every process's fds)."""

    processes: int | None = None
    threads: int | None = None
    threads_max: int | None = None  # 0: no limit
    file_descriptors: int | None = None
    sockets: int | None = None
    memory_kernel: int | None = None
    memory_mapped_file: int | None = None
    memory_max_usage: int | None = None
    memory_swap_limit: int | None = None
    page_faults_local: int | None = None  # this cgroup alone (v1); the Sample's are hierarchical
    major_page_faults_local: int | None = None
    devices: tuple[Device, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Interface:
    name: str
    rx_bytes: int
    rx_errors: int
    tx_bytes: int
    tx_errors: int
    rx_packets: int = 0
    rx_dropped: int = 0
    tx_packets: int = 0
    tx_dropped: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Layer:
    """A container's writable layer, and the filesystem it is on (the metrics' fs families)."""

    mountpoint: str
    used_bytes: int
    inodes_used: int
    device: str = ""  # "" when the filesystem is not known: no fs metrics
    capacity_bytes: int = 0
    inodes_total: int = 0
    inodes_free: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ContainerUsage:
    """One container's figures; ``detail`` only where metrics were asked for."""

    sample: Sample
    layer: Layer | None = None
    detail: Detail | None = None
    cpu_nano_cores: int | None = None  # a rate of the backend's own (the fake); else the shim's


@dataclasses.dataclass(frozen=True, slots=True)
class SandboxUsage:
    """A pod's figures: its total, its network, and each of its containers' own."""

    sample: Sample
    interfaces: tuple[Interface, ...] = ()
    default_interface: str = "eth0"
    containers: Mapping[str, ContainerUsage] = dataclasses.field(default_factory=dict)
    cpu_nano_cores: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class PodMetrics:
    """What ListPodSandboxMetrics reports of one pod, with the values of its label keys.

    ``name``: cAdvisor's ``name`` label (the runtime's own name of the pod's
    infrastructure, and of each container in ``container_names``); ``image``:
    the pod's infrastructure image, if any.
    """

    name: str = ""
    image: str = ""
    interfaces: tuple[Interface, ...] | None = None  # None: the host's network, not the pod's
    containers: Mapping[str, ContainerUsage] = dataclasses.field(default_factory=dict)
    container_names: Mapping[str, str] = dataclasses.field(default_factory=dict)


def available(sample: Sample) -> int | None:
    """Memory left under the limit, or None without a limit."""
    if sample.memory_limit is None or sample.working_set is None or sample.memory_limit >= UNLIMITED:
        return None
    return max(0, sample.memory_limit - sample.working_set)


def total(samples: list[Sample], now: int) -> Sample:
    """A pod's sample: the sum of its parts' (a counter nobody measured stays None)."""

    def add(attr: str) -> int | None:
        values = [getattr(s, attr) for s in samples if getattr(s, attr) is not None]
        return sum(values) if values else None

    return Sample(
        timestamp=now,
        cpu_ns=add("cpu_ns"),
        memory_usage=add("memory_usage"),
        working_set=add("working_set"),
        rss=add("rss"),
        page_faults=add("page_faults"),
        major_page_faults=add("major_page_faults"),
        pids=add("pids"),
    )
