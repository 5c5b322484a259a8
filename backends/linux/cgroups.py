"""cgroups (v1 and v2), read and made straight in cgroupfs: the one cgroup mechanism.

- :class:`CgroupReader`: a container's statistics from the cgroups of its process. One
  engine stats call per container is what makes dockerd burn CPU under cri-dockerd with a
  few hundred containers; reading a handful of small files per container costs
  microseconds and no engine round trip. A process's cgroups are found from
  /proc/PID/cgroup, so the cgroup driver and parent do not matter.
- :class:`Cgroup`: one cgroup by its path, made, sized, read and removed (a runv VM's,
  and the OOM count of a container's in the runv guest).

Both find the hierarchies in /proc/self/mountinfo and read the files with the same
helpers. Standard library and ``backends.contract.usage`` only: the runv agent ships this
package into its VM.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Sequence
from typing import NamedTuple

from backends.contract.usage import UNLIMITED, Detail, Device, Interface, Sample, available
from backends.linux import procfs

__all__ = [
    "Cgroup",
    "CgroupReader",
    "Detail",
    "Device",
    "HugetlbError",
    "Interface",
    "Sample",
    "available",
    "cgroupfs_path",
    "net_interfaces",
]

_UNLIMITED = UNLIMITED
_NS_PER_TICK = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


class HugetlbError(Exception):
    """Hugepage limits could not be applied."""


def _enable_along(root: str, leaf: str, controller: str) -> None:
    """Enable ``controller`` in cgroup.subtree_control of every cgroup from ``root`` down to
    ``leaf``'s parent (cgroup v2 offers a controller to a child only if its parent enables it)."""
    rel = os.path.relpath(os.path.dirname(leaf), root)
    parts = [] if rel == "." else rel.split(os.sep)
    path = root
    for part in ["", *parts]:
        path = os.path.join(path, part) if part else path
        if controller in (_read(path, "cgroup.subtree_control") or "").split():
            continue
        try:
            with open(os.path.join(path, "cgroup.subtree_control"), "w") as f:
                f.write(f"+{controller}")
        except OSError as exc:
            raise HugetlbError(f"cannot enable {controller} in {path}: {exc}") from exc


class Hierarchies(NamedTuple):
    """Where the cgroup hierarchies are mounted."""

    v1: dict[str, str]  # v1 controller -> mount point
    v2: str | None  # the cgroup2 mount point
    every: tuple[str, ...]  # each hierarchy's mount point once, named v1 ones too


def _mounts() -> Hierarchies:
    v1: dict[str, str] = {}
    v2: str | None = None
    every: list[str] = []
    for mount in procfs.mounts():
        if mount.fstype not in ("cgroup", "cgroup2"):
            continue
        if mount.point not in every:
            every.append(mount.point)
        if mount.fstype == "cgroup2":
            v2 = v2 or mount.point
            continue
        for opt in mount.super_options.split(","):
            if opt not in ("rw", "ro") and not opt.startswith("name=") and "=" not in opt:
                v1.setdefault(opt, mount.point)
    return Hierarchies(v1, v2, tuple(sorted(every)))


@functools.cache
def hierarchies() -> Hierarchies:
    """This process's cgroup mounts, read once: they do not move under a running process."""
    return _mounts()


class CgroupReader:
    def __init__(self) -> None:
        self._v1, self._v2, _ = hierarchies()

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

    def _current_paths(self, pid: int, expect: str) -> tuple[dict[str, str], str | None] | None:
        """:meth:`_paths`, None also when ``pid`` is gone or its cgroup file unreadable."""
        try:
            return self._paths(pid, expect)
        except (OSError, ValueError):
            return None

    def set_hugetlb(self, pid: int, expect: str, limits: Sequence[tuple[str, int]]) -> list[str]:
        """Write hugepage limits (page size as the kernel names it: "2MB", "1GB") into the
        cgroup of ``pid``; what could not be applied, and why (HugetlbError if a write fails).

        The engine has no hugetlb setting. With cgroup v2 the controller is
        enabled along the container's parents first, as runc does for the
        controllers it uses. A host without the controller, or without a page
        size, is passed over with a reason, as runc passes over a cgroup v1
        controller that is not mounted: the kubelet sends a limit of 0 for every
        page size on every container.
        """
        try:
            paths = self._paths(pid, expect)
        except (FileNotFoundError, ProcessLookupError):
            # The container already exited (an init container that only writes a file): there
            # is nothing left to limit, and it did start.
            return []
        except (OSError, ValueError) as exc:
            raise HugetlbError(f"cannot read the cgroups of PID {pid}: {exc}") from exc
        if paths is None:
            return []  # exited, and the PID went to another process
        v1, v2 = paths
        if "hugetlb" in v1:
            base, name = v1["hugetlb"], "hugetlb.{}.limit_in_bytes"
        elif v2 and self._v2 and "hugetlb" in (_read(self._v2, "cgroup.controllers") or "").split():
            _enable_along(self._v2, v2, "hugetlb")
            base, name = v2, "hugetlb.{}.max"
        else:
            return ["the hugetlb cgroup controller is not available on this host"]
        skipped = []
        for size, limit in limits:
            path = os.path.join(base, name.format(size))
            try:
                with open(path, "w") as f:
                    f.write(str(limit))
            except OSError as exc:
                if not os.path.isdir(base):
                    # The container exited meanwhile and its cgroup was removed (ENOENT, or
                    # ENODEV from a file removed while open): nothing is left to limit, and it
                    # did start.
                    return []
                if isinstance(exc, FileNotFoundError):
                    skipped.append(f"the kernel has no {size} huge pages ({path} is missing)")
                    continue
                raise HugetlbError(f"cannot limit {size} huge pages to {limit}: {exc}") from exc
        return skipped

    def detail(self, pid: int, expect: str = "") -> Detail | None:
        """The rest of what ListPodSandboxMetrics reports of ``pid``'s container; None if it is gone."""
        paths = self._current_paths(pid, expect)
        return None if paths is None else _detail(*paths)

    def sample(self, pid: int, expect: str = "", full: bool = False) -> Sample | None:
        """The cgroup counters of the container whose process is ``pid``; None if it is gone.

        ``expect`` (the engine container ID) must appear in the process's
        cgroup paths, so that a reused PID is not taken for the container.
        ``full`` adds what only metrics report (CPU split and throttling,
        CPU limits, memory limit hits and OOM kills): six more files.
        """
        paths = self._current_paths(pid, expect)
        return None if paths is None else _sample(*paths, full=full)


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


class Cgroup:
    """One cgroup by its path below the hierarchies' roots: the same path in each.

    On a host with v1 controllers mounted (a hybrid host too) it lives in the v1 hierarchies
    of :attr:`CONTROLLERS`; on a cgroup2-only host, in the unified one.
    """

    CONTROLLERS = ("memory", "cpu", "cpuacct", "pids")  # what sizing and usage need on v1
    CPU_PERIOD = 100_000

    def __init__(self, rel: str) -> None:
        self.rel = rel.strip("/")
        self._mounts = hierarchies()
        self.v2 = bool(self._mounts.v2) and not self._mounts.v1

    def _paths(self) -> tuple[dict[str, str], str | None]:
        """Its directories as :func:`_sample` takes them: v1 controller -> directory, v2 directory."""
        if self.v2:
            return {}, os.path.join(str(self._mounts.v2), self.rel)
        return {c: os.path.join(mp, self.rel) for c, mp in self._mounts.v1.items()}, None

    def dirs(self) -> list[str]:
        """The directories it is made in."""
        v1, v2 = self._paths()
        if v2:
            return [v2]
        return list(dict.fromkeys(v1[c] for c in self.CONTROLLERS if c in v1))  # co-mounted: once

    def all_dirs(self) -> list[str]:
        """Its directory in every hierarchy, including ones runc makes container cgroups in."""
        return self.dirs() if self.v2 else [os.path.join(mp, self.rel) for mp in self._mounts.every]

    def create(self) -> None:
        """Make it in every hierarchy (on v1: each controller's, the named and the unified ones),
        so that a process joining it leaves its parent's cgroups everywhere: a pod's VM is then
        below the pod's cgroup in each. A new v1 cpuset cgroup takes its parent's CPUs and
        memory nodes (it is empty otherwise, and no process could join it)."""
        cpuset = None if self.v2 else self._mounts.v1.get("cpuset")
        for d in self.all_dirs():
            if cpuset is not None and d == os.path.join(cpuset, self.rel):
                _make_cpuset_v1(cpuset, self.rel)
            else:
                os.makedirs(d, exist_ok=True)

    def procs_files(self) -> list[str]:
        """The files a process writes its PID to, to join it (in every hierarchy)."""
        return [os.path.join(d, "cgroup.procs") for d in self.all_dirs()]

    def parent_limits(self) -> tuple[int | None, int | None]:
        """What the cgroups above it allow: the lowest CFS quota in µs a :attr:`CPU_PERIOD` and
        the lowest memory limit in bytes along the chain to the root (None: no limit)."""
        v1, v2 = self._paths()
        quota: int | None = None
        memory: int | None = None
        cpu_dir = v2 or v1.get("cpu")
        mem_dir = v2 or v1.get("memory")
        for base, root in ((cpu_dir, "cpu"), (mem_dir, "memory")):
            if not base:
                continue
            top = str(self._mounts.v2) if v2 else self._mounts.v1[root]
            d = os.path.dirname(base)
            while len(d) > len(top) and d.startswith(top):
                if root == "cpu":
                    if v2:
                        q, period = _cpu_max(_read(d, "cpu.max"))
                    else:
                        q, period = _int(d, "cpu.cfs_quota_us"), _int(d, "cpu.cfs_period_us")
                    if q is not None and q > 0 and period:
                        scaled = q * self.CPU_PERIOD // period
                        quota = scaled if quota is None else min(quota, scaled)
                else:
                    limit = _int(d, "memory.max" if v2 else "memory.limit_in_bytes")
                    if limit is not None and limit < _UNLIMITED:
                        memory = limit if memory is None else min(memory, limit)
                d = os.path.dirname(d)
        return quota, memory

    def _quota(self, vcpus: int) -> int:
        """``vcpus`` CPUs as a CFS quota, no more than the cgroups above allow (v1 refuses a
        child's quota above its parent's with EINVAL; v2 would only not apply it)."""
        cap, _ = self.parent_limits()
        quota = vcpus * self.CPU_PERIOD
        return quota if cap is None else max(1000, min(quota, cap))

    def _memory(self, memory: int) -> int:
        """``memory`` bytes, no more than the cgroups above allow."""
        _, cap = self.parent_limits()
        return memory if cap is None else min(memory, cap)

    def set_limits(self, vcpus: int, memory: int) -> None:
        """A CFS quota of ``vcpus`` CPUs and a memory limit of ``memory`` bytes, each within what
        its parents allow."""
        v1, v2 = self._paths()
        quota = self._quota(vcpus)
        memory = self._memory(memory)
        if v2:
            _write(v2, "cpu.max", f"{quota} {self.CPU_PERIOD}")
            _write(v2, "memory.max", str(memory))
            return
        _write(v1["cpu"], "cpu.cfs_period_us", str(self.CPU_PERIOD))
        _write(v1["cpu"], "cpu.cfs_quota_us", str(quota))
        _write(v1["memory"], "memory.limit_in_bytes", str(memory))

    def adopt(self, source: Cgroup) -> None:
        """Move every process of ``source`` (and of the cgroups below it) into this one, in every
        hierarchy; on v1 their memory charges come along (``memory.move_charge_at_immigrate``;
        v2 leaves pages charged where they were first used)."""
        if not self.v2 and "memory" in self._mounts.v1:
            with contextlib.suppress(OSError):
                memory_dir = os.path.join(self._mounts.v1["memory"], self.rel)
                _write(memory_dir, "memory.move_charge_at_immigrate", "3")
        for _ in range(3):  # a process forked meanwhile is moved by the next round
            pids = sorted(set(source.pids()))
            if not pids:
                return
            for pid in pids:
                for f in self.procs_files():
                    with contextlib.suppress(ProcessLookupError):
                        _write(os.path.dirname(f), "cgroup.procs", str(pid))

    def resize(
        self, vcpus: int | None, memory: int | None, shares: int = 0, cpus: str = "", mems: str = ""
    ) -> None:
        """A pod's new limits (UpdatePodSandboxResources on its VM's cgroup): a CFS quota of
        ``vcpus`` CPUs, ``memory`` bytes, CPU ``shares`` (cpu.weight on v2, as runc converts),
        a cpuset (``cpus``, ``mems``); None, 0 or "" leaves one as it is. All or nothing: on an
        OSError what was written is written back before it is raised (a memory limit the kernel
        cannot reclaim down to is EBUSY on v1)."""
        v1, v2 = self._paths()
        writes: list[tuple[str, str, str]] = []
        if v2:
            if vcpus:
                writes.append((v2, "cpu.max", f"{self._quota(vcpus)} {self.CPU_PERIOD}"))
            if shares:
                writes.append((v2, "cpu.weight", str(1 + ((shares - 2) * 9999) // 262142)))
            if memory:
                writes.append((v2, "memory.max", str(self._memory(memory))))
            if cpus or mems:
                _enable_along(str(self._mounts.v2), v2, "cpuset")
                writes += [(v2, f"cpuset.{k}", v) for k, v in (("cpus", cpus), ("mems", mems)) if v]
            _write_all(writes)
            return
        if vcpus:
            writes.append((v1["cpu"], "cpu.cfs_period_us", str(self.CPU_PERIOD)))
            writes.append((v1["cpu"], "cpu.cfs_quota_us", str(self._quota(vcpus))))
        if shares:
            writes.append((v1["cpu"], "cpu.shares", str(shares)))
        if memory:
            writes.append((v1["memory"], "memory.limit_in_bytes", str(self._memory(memory))))
        if (cpus or mems) and "cpuset" not in v1:
            raise OSError(f"no cpuset cgroup hierarchy on this host for {cpus or mems!r}")
        if cpus or mems:
            writes += _cpuset_v1_writes(self._mounts.v1["cpuset"], self.rel, cpus, mems)
        _write_all(writes)
        if cpus or mems:
            # The VM's own processes (not its containers', already below) join its cpuset.
            _join_v1(os.path.join(self._mounts.v1["cpuset"], self.rel), v1.get("cpu") or v1["memory"])

    def memory_usage(self) -> int:
        """Bytes of memory charged to it now (0 when that cannot be read)."""
        return _sample(*self._paths()).memory_usage or 0

    def usage(self) -> tuple[int, int]:
        """CPU time (ns) and memory (bytes) used in it; 0 for what cannot be read."""
        sample = _sample(*self._paths())
        return sample.cpu_ns or 0, sample.memory_usage or 0

    def oom_kills(self) -> int:
        return _oom_kills(*self._paths()) or 0

    def pids(self) -> list[int]:
        """The processes in it and in the cgroups under it, in every hierarchy."""
        out: list[int] = []
        for d in self.all_dirs():
            for root, _dirs, files in os.walk(d):
                if "cgroup.procs" in files:
                    out += [int(x) for x in _lines(root, "cgroup.procs")]
        return out

    def remove(self) -> None:
        """rmdir bottom-up; a cgroup with live processes stays (and is reported by pids())."""
        for d in self.all_dirs():
            if not os.path.isdir(d):
                continue
            for root, dirs, _files in os.walk(d, topdown=False):
                for sub in dirs:
                    with contextlib.suppress(OSError):
                        os.rmdir(os.path.join(root, sub))
            with contextlib.suppress(OSError):
                os.rmdir(d)


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


def _write_all(writes: list[tuple[str, str, str]]) -> None:
    """Write each (directory, file, value) in order; on an OSError write back, in reverse order,
    what the ones done held before, then raise it."""
    done: list[tuple[str, str, str]] = []
    try:
        for base, name, value in writes:
            before = (_read(base, name) or "").strip()
            _write(base, name, value)
            done.append((base, name, before))
    except OSError:
        for base, name, before in reversed(done):
            with contextlib.suppress(OSError):
                _write(base, name, before)
        raise


def cpu_list(text: str) -> set[int]:
    """The CPUs (or memory nodes) of a list such as "0-3,5"."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            out.update(range(int(first), int(last or first) + 1))
    return out


def cpu_list_text(ids: set[int]) -> str:
    return ",".join(str(i) for i in sorted(ids))


def _cpuset_v1_writes(root: str, rel: str, cpus: str, mems: str) -> list[tuple[str, str, str]]:
    """The writes that give the v1 cpuset cgroup ``rel`` these CPUs and memory nodes.

    A new v1 cpuset cgroup is empty (no task can join it), so the chain down to ``rel`` is made
    with its parents' sets; and each cgroup below (runc's, of the VM's containers) must stay a
    subset of its parent, so they are narrowed first, bottom-up, to what they share with the new
    set (all of it when they share nothing)."""
    path = os.path.join(root, rel)
    _make_cpuset_v1(root, rel)
    writes: list[tuple[str, str, str]] = []
    for below, _dirs, _files in os.walk(path, topdown=False):
        for name, value in (("cpuset.cpus", cpus), ("cpuset.mems", mems)):
            if not value:
                continue
            if below == path:
                writes.append((below, name, value))
                continue
            shared = cpu_list(_read(below, name) or "") & cpu_list(value)
            writes.append((below, name, cpu_list_text(shared) if shared else value))
    return writes


def _make_cpuset_v1(root: str, rel: str) -> None:
    """Make the v1 cpuset cgroup ``rel`` and the chain down to it, each with its parent's CPUs
    and memory nodes where it has none yet."""
    path = root
    for part in rel.split("/"):
        parent, path = path, os.path.join(path, part)
        os.makedirs(path, exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if not (_read(path, name) or "").strip():
                _write(path, name, (_read(parent, name) or "").strip())


def own_path(pid: int | str = "self") -> str:
    """The cgroup ``pid`` is in (its memory controller's on v1, else the unified one's)."""
    with open(f"/proc/{pid}/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    for _, ctrls, path in lines:
        if "memory" in ctrls.split(","):
            return path
    return next((path for _, ctrls, path in lines if ctrls == ""), "/")


def cgroupfs_path(parent: str) -> str:
    """A cgroup parent as its path below the hierarchies' roots: a cgroupfs path as it is, a
    systemd slice (``kubepods-burstable-pod<UID>.slice``, as the kubelet's systemd driver names
    a pod) where systemd puts it: each dash-separated prefix a slice of its own
    (``kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<UID>.slice``)."""
    parent = parent.strip("/")
    if not parent.endswith(".slice") or "/" in parent:
        return parent
    name = parent[: -len(".slice")]
    if name in ("", "-"):
        return ""
    parts = name.split("-")
    return "/".join("-".join(parts[: i + 1]) + ".slice" for i in range(len(parts)))


def _join_v1(cpuset_dir: str, own_dir: str) -> None:
    """Move the processes of ``own_dir`` (its cgroup.procs: not those of cgroups below it) into
    ``cpuset_dir``."""
    for pid in _lines(own_dir, "cgroup.procs"):
        with contextlib.suppress(ProcessLookupError):
            _write(cpuset_dir, "cgroup.procs", pid)


def _write(base: str, name: str, value: str) -> None:
    with open(os.path.join(base, name), "w") as f:
        f.write(value)


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
