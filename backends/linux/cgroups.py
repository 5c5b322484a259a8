"""cgroups (v1 and v2), found and made straight in cgroupfs: the one cgroup mechanism.

- :class:`CgroupReader`: a container's statistics from the cgroups of its process. One
  engine stats call per container is what makes dockerd burn CPU under cri-dockerd with a
  few hundred containers; reading a handful of small files per container costs
  microseconds and no engine round trip. A process's cgroups are found from
  /proc/PID/cgroup, so the cgroup driver and parent do not matter.
- :class:`Cgroup`: one cgroup by its path, made, sized, read and removed (a runv VM's,
  and the OOM count of a container's in the runv guest).

Both find the hierarchies in /proc/self/mountinfo; the counters themselves are read by
:mod:`backends.linux.cgroup_usage`, with the same small file helpers. Standard library and
``backends.contract.usage`` only: the runv agent ships this package into its VM.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence
from typing import NamedTuple

from backends.contract.usage import UNLIMITED, Detail, Sample
from backends.linux import procfs
from backends.linux.cgroup_usage import _cpu_max, _detail, _int, _lines, _oom_kills, _read, _sample

__all__ = [
    "Cgroup",
    "CgroupReader",
    "HugetlbError",
    "cgroupfs_path",
]

_UNLIMITED = UNLIMITED


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
