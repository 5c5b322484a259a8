"""CPU and memory of the cluster's processes, sampled from /proc while a scale run goes on.

Each sample reads, per recorded daemon, utime + stime (fields 14 and 15 of /proc/PID/stat, in clock
ticks) and the resident set (field 24, in pages), and the machine's /proc/stat CPU line (busy,
idle and steal ticks) and MemAvailable. A phase (idle, rollout, steady) is a time window: a
process's CPU over it is its ticks' difference between the first and the last sample inside the
window, divided by the window's length; its RSS is the largest seen inside it. Nothing is asserted:
the figures are printed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class ProcSample:
    ticks: int  # utime + stime
    rss: int  # bytes
    start: int  # start time in ticks since boot: a PID reused by another process is not this one


@dataclasses.dataclass(frozen=True)
class HostSample:
    busy: int  # ticks of every CPU not idle, iowait nor steal
    steal: int
    total: int
    mem_available: int  # bytes
    load1: float


@dataclasses.dataclass(frozen=True)
class Sample:
    t: float  # time.monotonic()
    procs: Mapping[str, ProcSample]
    host: HostSample


def parse_stat(text: str) -> ProcSample:
    """/proc/PID/stat: the command may hold spaces and parentheses, so fields count from the last ')'."""
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): field k is fields[k - 3]
    return ProcSample(
        ticks=int(fields[11]) + int(fields[12]), rss=int(fields[21]) * PAGE, start=int(fields[19])
    )


def parse_host(proc_stat: str, meminfo: str, loadavg: str) -> HostSample:
    cpu = next(line for line in proc_stat.splitlines() if line.startswith("cpu "))
    # user nice system idle iowait irq softirq steal guest guest_nice (guest is counted in user)
    v = [int(x) for x in cpu.split()[1:]]
    idle, iowait, steal = v[3], v[4], v[7] if len(v) > 7 else 0
    total = sum(v[:8])
    avail = next(
        int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:")
    )
    return HostSample(
        busy=total - idle - iowait - steal,
        steal=steal,
        total=total,
        mem_available=avail,
        load1=float(loadavg.split()[0]),
    )


def read_proc(pid: int) -> ProcSample | None:
    try:
        return parse_stat(Path(f"/proc/{pid}/stat").read_text())
    except (OSError, ValueError, IndexError):
        return None


def read_host() -> HostSample:
    return parse_host(
        Path("/proc/stat").read_text(), Path("/proc/meminfo").read_text(), Path("/proc/loadavg").read_text()
    )


class Sampler:
    """A thread taking a sample every `interval` seconds of the daemons `targets()` names (name → PID
    and start time, as the state file records them)."""

    def __init__(self, targets: Callable[[], Mapping[str, tuple[int, int | None]]], interval: float = 2.0):
        self.targets = targets
        self.interval = interval
        self.samples: list[Sample] = []
        self.marks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def take(self) -> Sample:
        got = {}
        for name, (pid, start) in self.targets().items():
            s = read_proc(pid)
            if s is not None and (start is None or s.start == start):
                got[name] = s
        sample = Sample(time.monotonic(), got, read_host())
        self.samples.append(sample)
        return sample

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(OSError, ValueError, StopIteration):
                self.take()

    def mark(self, phase_edge: str) -> None:
        """A sample now, with its time named (`idle-start`, `rollout-end`, ...)."""
        self.marks[phase_edge] = self.take().t

    def __enter__(self) -> Sampler:
        self.take()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclasses.dataclass(frozen=True)
class Usage:
    cpu: float  # percent of one core over the window
    rss_max: float  # MiB


@dataclasses.dataclass(frozen=True)
class HostUsage:
    busy: float  # percent of all the machine's CPUs
    steal: float  # percent of all its CPUs
    mem_available_min: float  # MiB
    load1_max: float


def window(samples: list[Sample], start: float, end: float) -> list[Sample]:
    return [s for s in samples if start <= s.t <= end]


def usage(samples: list[Sample], start: float, end: float) -> dict[str, Usage]:
    """Per daemon, its CPU and largest RSS between `start` and `end` (those seen at both ends)."""
    inside = window(samples, start, end)
    if len(inside) < 2:
        return {}
    first, last = inside[0], inside[-1]
    seconds = last.t - first.t
    out = {}
    for name, a in first.procs.items():
        b = last.procs.get(name)
        if b is None or b.start != a.start or seconds <= 0:
            continue
        rss = max(s.procs[name].rss for s in inside if name in s.procs)
        out[name] = Usage(cpu=100.0 * (b.ticks - a.ticks) / CLK_TCK / seconds, rss_max=rss / MIB)
    return out


def host_usage(samples: list[Sample], start: float, end: float) -> HostUsage | None:
    inside = window(samples, start, end)
    if len(inside) < 2:
        return None
    a, b = inside[0].host, inside[-1].host
    total = max(b.total - a.total, 1)
    return HostUsage(
        busy=100.0 * (b.busy - a.busy) / total,
        steal=100.0 * (b.steal - a.steal) / total,
        mem_available_min=min(s.host.mem_available for s in inside) / MIB,
        load1_max=max(s.host.load1 for s in inside),
    )


@dataclasses.dataclass(frozen=True)
class GroupUsage:
    """Many daemons of one kind (the kubelets): their sum, and the spread of one."""

    count: int
    cpu_sum: float
    rss_sum: float
    cpu_mean: float
    cpu_max: float
    rss_mean: float
    rss_max: float


def group(per_name: Mapping[str, Usage], prefix: str) -> GroupUsage | None:
    members = [u for name, u in per_name.items() if name.startswith(prefix)]
    if not members:
        return None
    cpus, rsss = [u.cpu for u in members], [u.rss_max for u in members]
    return GroupUsage(
        count=len(members),
        cpu_sum=sum(cpus),
        rss_sum=sum(rsss),
        cpu_mean=statistics.fmean(cpus),
        cpu_max=max(cpus),
        rss_mean=statistics.fmean(rsss),
        rss_max=max(rsss),
    )
