"""Container statistics read straight from cgroup files (v1 and v2) and /proc.

One engine stats call per container is what makes dockerd burn CPU under
cri-dockerd with a few hundred containers; reading a handful of small files
per container costs microseconds and no engine round trip. A process's
cgroups are found from /proc/PID/cgroup, so the cgroup driver and parent do
not matter.
"""

from __future__ import annotations

import dataclasses
import os
import time

_UNLIMITED = 1 << 60
_NS_PER_TICK = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
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


def _mounts() -> tuple[dict[str, str], str | None]:
    """v1 controller -> mount point, and the cgroup2 mount point."""
    v1: dict[str, str] = {}
    v2: str | None = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            fstype, _src, *opts = right.split()
            mount_point = fields[4]
            if fstype == "cgroup2":
                v2 = v2 or mount_point
            elif fstype == "cgroup":
                for opt in (opts[0] if opts else "").split(","):
                    if opt not in ("rw", "ro") and not opt.startswith("name=") and "=" not in opt:
                        v1.setdefault(opt, mount_point)
    return v1, v2


class CgroupReader:
    def __init__(self) -> None:
        self._v1, self._v2 = _mounts()

    def _paths(self, pid: int, expect: str) -> tuple[dict[str, str], str | None] | None:
        v1: dict[str, str] = {}
        v2: str | None = None
        with open(f"/proc/{pid}/cgroup") as f:
            text = f.read()
        if expect not in text:
            return None  # the PID now belongs to another process
        for line in text.splitlines():
            _, ctrls, path = line.split(":", 2)
            if ctrls == "":
                if self._v2:
                    v2 = self._v2 + path
                continue
            for c in ctrls.split(","):
                if c in self._v1:
                    v1[c] = self._v1[c] + path
        return v1, v2

    def sample(self, pid: int, expect: str = "") -> Sample | None:
        """The cgroup counters of the container whose process is ``pid``; None if it is gone.

        ``expect`` (the engine container ID) must appear in the process's
        cgroup paths, so that a reused PID is not taken for the container.
        """
        now = time.time_ns()
        try:
            paths = self._paths(pid, expect)
        except (OSError, ValueError):
            return None
        if paths is None:
            return None
        v1, v2 = paths
        out: dict[str, int | None] = {}
        if "cpuacct" in v1:
            out["cpu_ns"] = _int(v1["cpuacct"], "cpuacct.usage")
            ticks = _kv(v1["cpuacct"], "cpuacct.stat")  # in USER_HZ
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
        if "cpu" in v1:
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
        elif v2:
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
                memory_failcnt=_int(base, "memory.failcnt"),
                oom_kills=_kv(base, "memory.oom_control").get("oom_kill"),
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
                oom_kills=_kv(v2, "memory.events").get("oom_kill"),
            )
        if "pids" in v1:
            out["pids"] = _int(v1["pids"], "pids.current")
        elif v2:
            out["pids"] = _int(v2, "pids.current")
        return Sample(timestamp=now, **out)


def _cpu_max(text: str | None) -> tuple[int | None, int | None]:
    """cgroup v2 cpu.max ("max 100000" or "50000 100000") as (quota, period); -1 for no quota."""
    if not text:
        return None, None
    quota, _, period = text.strip().partition(" ")
    try:
        return (-1 if quota == "max" else int(quota)), int(period)
    except ValueError:
        return None, None


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


def available(sample: Sample) -> int | None:
    if sample.memory_limit is None or sample.working_set is None or sample.memory_limit >= _UNLIMITED:
        return None
    return max(0, sample.memory_limit - sample.working_set)


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


def tree_usage(path: str, limit: int = 200_000) -> tuple[int, int]:
    """Bytes and inodes under ``path`` (a writable layer), counting at most ``limit`` entries."""
    total = inodes = 0
    stack = [path]
    while stack and inodes < limit:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue
        with it:
            for entry in it:
                inodes += 1
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += st.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
    return total, inodes
