"""A cgroup's usage counters, read straight from cgroupfs: CPU, memory, processes, block I/O.

The readers take a cgroup's directories as found by :mod:`backends.linux.cgroups`
(``v1``: controller -> directory, ``v2``: the unified directory) and read the handful of
small files a container's statistics and metrics come from; :func:`net_interfaces` reads
the counters of a process's network namespace. Below :mod:`backends.linux.cgroups`, which
imports the readers and the small file helpers from here. Standard library and
``backends.contract.usage`` only: the runv agent ships this package into its VM.
"""

from __future__ import annotations

import functools
import os
import time

from backends.contract.usage import UNLIMITED, Detail, Device, Interface, Sample, available

__all__ = [
    "Detail",
    "Device",
    "Interface",
    "Sample",
    "available",
    "device_name",
    "net_interfaces",
]

_UNLIMITED = UNLIMITED
_NS_PER_TICK = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def _sample(v1: dict[str, str], v2: str | None, full: bool = False) -> Sample:
    """The counters of the cgroup at ``v1`` (controller -> directory) and ``v2`` (directory)."""
    now = time.time_ns()
    out: dict[str, int | None] = {}
    if "cpuacct" in v1:
        out["cpu_ns"] = _int(v1["cpuacct"], "cpuacct.usage")
        ticks = _kv(v1["cpuacct"], "cpuacct.stat") if full else {}  # in USER_HZ
        if "user" in ticks:
            out["cpu_user_ns"] = ticks["user"] * _NS_PER_TICK
        if "system" in ticks:
            out["cpu_system_ns"] = ticks["system"] * _NS_PER_TICK
    elif v2:
        stat = _kv(v2, "cpu.stat")
        if "usage_usec" in stat:
            out["cpu_ns"] = stat["usage_usec"] * 1000
        if "user_usec" in stat:
            out["cpu_user_ns"] = stat["user_usec"] * 1000
        if "system_usec" in stat:
            out["cpu_system_ns"] = stat["system_usec"] * 1000
    if full and "cpu" in v1:
        base = v1["cpu"]
        stat = _kv(base, "cpu.stat")
        out.update(
            cpu_periods=stat.get("nr_periods"),
            cpu_throttled_periods=stat.get("nr_throttled"),
            cpu_throttled_ns=stat.get("throttled_time"),
            cpu_shares=_int(base, "cpu.shares"),
            cpu_quota_us=_int(base, "cpu.cfs_quota_us"),
            cpu_period_us=_int(base, "cpu.cfs_period_us"),
        )
    elif full and v2:
        stat = _kv(v2, "cpu.stat")
        weight = _int(v2, "cpu.weight")
        quota, period = _cpu_max(_read(v2, "cpu.max"))
        out.update(
            cpu_periods=stat.get("nr_periods"),
            cpu_throttled_periods=stat.get("nr_throttled"),
            cpu_throttled_ns=None if "throttled_usec" not in stat else stat["throttled_usec"] * 1000,
            # The inverse of the runc/kubelet mapping shares -> weight.
            cpu_shares=None if weight is None else 2 + ((weight - 1) * 262142) // 9999,
            cpu_quota_us=quota,
            cpu_period_us=period,
        )
    if "memory" in v1:
        base = v1["memory"]
        usage = _int(base, "memory.usage_in_bytes")
        stat = _kv(base, "memory.stat")
        inactive = stat.get("total_inactive_file", 0)
        out.update(
            memory_usage=usage,
            working_set=None if usage is None else max(0, usage - inactive),
            rss=stat.get("total_rss"),
            page_faults=stat.get("total_pgfault"),
            major_page_faults=stat.get("total_pgmajfault"),
            memory_limit=_int(base, "memory.limit_in_bytes"),
            memory_cache=stat.get("total_cache"),
            memory_swap=stat.get("total_swap"),
            memory_failcnt=_int(base, "memory.failcnt") if full else None,
            oom_kills=_oom_kills(v1, v2) if full else None,
        )
    elif v2:
        usage = _int(v2, "memory.current")
        stat = _kv(v2, "memory.stat")
        out.update(
            memory_usage=usage,
            working_set=None if usage is None else max(0, usage - stat.get("inactive_file", 0)),
            rss=stat.get("anon"),
            page_faults=stat.get("pgfault"),
            major_page_faults=stat.get("pgmajfault"),
            memory_limit=_int(v2, "memory.max"),
            memory_cache=stat.get("file"),
            memory_swap=_int(v2, "memory.swap.current"),
            memory_failcnt=_kv(v2, "memory.events").get("max"),
            oom_kills=_oom_kills(v1, v2),
        )
    if "pids" in v1:
        out["pids"] = _int(v1["pids"], "pids.current")
    elif v2:
        out["pids"] = _int(v2, "pids.current")
    return Sample(timestamp=now, **out)


def _oom_kills(v1: dict[str, str], v2: str | None) -> int | None:
    """The OOM kills the kernel counted in a cgroup (None: no memory controller, or gone)."""
    if "memory" in v1:
        return _kv(v1["memory"], "memory.oom_control").get("oom_kill")
    return _kv(v2, "memory.events").get("oom_kill") if v2 else None


@functools.cache
def device_name(major: int, minor: int) -> str:
    """/dev/NAME of a block device number, as its uevent names it; "MAJ:MIN" if it has none."""
    try:
        with open(f"/sys/dev/block/{major}:{minor}/uevent") as f:
            for line in f:
                if line.startswith("DEVNAME="):
                    return "/dev/" + line.strip().partition("=")[2]
    except OSError:
        pass
    return f"{major}:{minor}"


def _lines(base: str, name: str) -> list[str]:
    return (_read(base, name) or "").split()


# Device's read bytes, write bytes, reads and writes, as each cgroup version names them.
_V1_KEYS = ("read_bytes", "write_bytes", "read_ops", "write_ops")
_V2_KEYS = ("rbytes", "wbytes", "rios", "wios")


def _device(major: int, minor: int, figures: dict[str, int], keys: tuple[str, str, str, str]) -> Device:
    read_bytes, write_bytes, reads, writes = (figures.get(k, 0) for k in keys)
    return Device(major, minor, read_bytes, write_bytes, reads, writes, device_name(major, minor))


def _blkio_v1(base: str) -> tuple[Device, ...]:
    """blkio.throttle.io_service{_bytes,d}_recursive: "MAJ:MIN Read N" lines."""
    found: dict[tuple[int, int], dict[str, int]] = {}
    for name, key in (("blkio.throttle.io_service_bytes_recursive", "bytes"),
                      ("blkio.throttle.io_serviced_recursive", "ops")):  # fmt: skip
        for line in (_read(base, name) or "").splitlines():
            parts = line.split()
            if len(parts) != 3 or ":" not in parts[0] or parts[1] not in ("Read", "Write"):
                continue
            try:
                major, minor = (int(x) for x in parts[0].split(":"))
                value = int(parts[2])
            except ValueError:
                continue
            found.setdefault((major, minor), {})[f"{parts[1].lower()}_{key}"] = value
    return tuple(_device(major, minor, v, _V1_KEYS) for (major, minor), v in sorted(found.items()))


def _io_v2(base: str) -> tuple[Device, ...]:
    """io.stat: "MAJ:MIN rbytes=N wbytes=N rios=N wios=N ..." lines."""
    out = []
    for line in (_read(base, "io.stat") or "").splitlines():
        head, *fields = line.split()
        try:
            major, minor = (int(x) for x in head.split(":"))
            kv = {k: int(v) for k, _, v in (f.partition("=") for f in fields)}
        except ValueError:
            continue
        out.append(_device(major, minor, kv, _V2_KEYS))
    return tuple(out)


def _fds(pids: list[str]) -> tuple[int, int]:
    """Open file descriptors and sockets of the processes ``pids``."""
    fds = sockets = 0
    for pid in pids:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        fds += len(names)
        for n in names:
            try:
                if os.readlink(f"/proc/{pid}/fd/{n}").startswith("socket:"):
                    sockets += 1
            except OSError:
                continue
    return fds, sockets


def _threads(pids: list[str]) -> int:
    total = 0
    for pid in pids:
        try:
            total += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return total


def _no_limit(value: int | None) -> int | None:
    return 0 if value is not None and value >= _UNLIMITED else value


def _cpu_max(text: str | None) -> tuple[int | None, int | None]:
    """cgroup v2 cpu.max ("max 100000" or "50000 100000") as (quota, period); -1 for no quota."""
    if not text:
        return None, None
    quota, _, period = text.strip().partition(" ")
    try:
        return (-1 if quota == "max" else int(quota)), int(period)
    except ValueError:
        return None, None


def _detail(v1: dict[str, str], v2: str | None) -> Detail:
    procs_dir = v1.get("pids") or v1.get("memory") or v2
    pids = _lines(procs_dir, "cgroup.procs") if procs_dir else []
    fds, sockets = _fds(pids)
    out: dict[str, object] = {
        "processes": len(pids),
        "threads": _threads(pids),
        "file_descriptors": fds,
        "sockets": sockets,
    }
    pids_dir = v1.get("pids") or v2
    if pids_dir:
        out["threads_max"] = _no_limit(_int(pids_dir, "pids.max"))
    if "memory" in v1:
        base = v1["memory"]
        stat = _kv(base, "memory.stat")
        out.update(
            memory_kernel=_int(base, "memory.kmem.usage_in_bytes"),
            memory_mapped_file=stat.get("total_mapped_file"),
            memory_max_usage=_int(base, "memory.max_usage_in_bytes"),
            memory_swap_limit=_no_limit(_int(base, "memory.memsw.limit_in_bytes")),
            page_faults_local=stat.get("pgfault"),
            major_page_faults_local=stat.get("pgmajfault"),
        )
    elif v2:
        stat = _kv(v2, "memory.stat")
        kernel = stat.get("kernel")
        if kernel is None and "slab" in stat:
            kernel = stat.get("kernel_stack", 0) + stat["slab"] + stat.get("sock", 0) + stat.get("percpu", 0)
        out.update(
            memory_kernel=kernel,
            memory_mapped_file=stat.get("file_mapped"),
            memory_max_usage=_int(v2, "memory.peak"),
            memory_swap_limit=_no_limit(_int(v2, "memory.swap.max")),
            page_faults_local=stat.get("pgfault"),
            major_page_faults_local=stat.get("pgmajfault"),
        )
    if "blkio" in v1:
        out["devices"] = _blkio_v1(v1["blkio"])
    elif v2:
        out["devices"] = _io_v2(v2)
    return Detail(**out)  # type: ignore[arg-type]


def _read(base: str, name: str) -> str | None:
    try:
        with open(os.path.join(base, name)) as f:
            return f.read()
    except OSError:
        return None


def _int(base: str, name: str) -> int | None:
    text = _read(base, name)
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _kv(base: str, name: str) -> dict[str, int]:
    text = _read(base, name) or ""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        try:
            out[key] = int(value)
        except ValueError:
            continue
    return out


def net_interfaces(pid: int) -> list[Interface]:
    """Counters of the network namespace ``pid`` lives in (its /proc/PID/net/dev)."""
    try:
        with open(f"/proc/{pid}/net/dev") as f:
            lines = f.read().splitlines()[2:]
    except OSError:
        return []
    out = []
    for line in lines:
        name, _, rest = line.partition(":")
        v = rest.split()
        if len(v) < 16 or name.strip() == "lo":
            continue
        out.append(
            Interface(
                name.strip(),
                rx_bytes=int(v[0]),
                rx_errors=int(v[2]),
                tx_bytes=int(v[8]),
                tx_errors=int(v[10]),
                rx_packets=int(v[1]),
                rx_dropped=int(v[3]),
                tx_packets=int(v[9]),
                tx_dropped=int(v[11]),
            )
        )
    return out
