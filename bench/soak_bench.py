"""Soak benchmark of cri-shim: a day of churn, compressed.

Starts `cri-shim serve` as a child on a temporary socket and state directory
(fake: the default configuration; docker: docker_bench's configuration, the
docker handler as default with its own instance label; runv: the same plus a
runv handler of this run, as runv_bench configures it) and runs N pod +
container lifecycles, W at a time:

    RunPodSandbox, CreateContainer (sh printing "start" and 0..4, then
    sleep 3600), StartContainer, ExecSync (echo), the container's CRI log
    read until it holds those lines, ContainerStats, StopContainer,
    RemoveContainer, StopPodSandbox, RemovePodSandbox.

Meanwhile a poller plays the kubelet's PLEG and stats: ListPodSandbox,
ListContainers and ListContainerStats once per --poll-interval, timed.

At the start (after a warm-up of 50 lifecycles), half way and at the end, the
workers are drained, and with nothing running the shim's RSS (and RssAnon:
a memory limit's reclaim moves file pages in and out), open file descriptors
(/proc/PID/fd, sockets named through ss), threads (/proc/PID/status) and
asyncio tasks are read. Tasks are counted without any change to the shim:
SIGUSR1 makes it log every task's stack (shim/server.py dump_stacks) as one
line, which is parsed here and grouped by where each task waits. If fds or
tasks end above the start, a second look is taken 30 s later.

It prints those snapshots, p50/p99 of the polled RPCs in the first and last
10% of the run, lifecycle throughput, RPC errors by code, and a table of the
soak targets (RSS within +10 MiB of the start; fds and tasks back to their
idle counts; polled p99 unchanged within noise), each marked met or not.
Figures only: nothing is asserted. Everything it creates is removed at the
end, also on failure, Ctrl-C or SIGTERM.

Run as root (docker, runv: the engine's socket, namespaces, cgroups), with the
registry of scripts/testenv/up holding the images:
    .venv/bin/python bench/soak_bench.py --handler fake --lifecycles 10000
    .venv/bin/python bench/soak_bench.py --handler docker --lifecycles 1000
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from endpoints import APP_STOP_TIMEOUT, BUSYBOX, Cri, Shim, _interrupt, pct, pod_sandbox_config
from fake_bench import ROOT, rss_mib

from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc

WARMUP = 50
# What each container prints before it sleeps, and what its log must hold.
SCRIPT = "echo start; i=0; while [ $i -lt 5 ]; do echo $i; i=$((i+1)); done; sleep 3600"
EXPECTED = ["start", "0", "1", "2", "3", "4"]
LOG_WAIT = 15.0  # seconds a container's log may take to hold EXPECTED
RPC_TIMEOUT = 120.0
POLLED = ["ListPodSandbox", "ListContainers", "ListContainerStats"]
STEPS = [
    "RunPodSandbox",
    "CreateContainer",
    "StartContainer",
    "ExecSync",
    "log ready",
    "ContainerStats",
    "StopContainer",
    "RemoveContainer",
    "StopPodSandbox",
    "RemovePodSandbox",
    "lifecycle",
]
# StopContainer's grace: the fake's shell ends `sleep` on TERM at once, so a
# kubelet-like grace costs nothing there; in docker and runv, sh as PID 1
# ignores TERM and any grace would be waited out (docker_bench's reasoning).
STOP_TIMEOUT = {"fake": 10, "docker": APP_STOP_TIMEOUT, "runv": APP_STOP_TIMEOUT}
# Polled p99 "unchanged within noise": last-10% p99 at most this much over the first.
NOISE_FACTOR = 1.5
NOISE_FLOOR_MS = 2.0
RSS_BUDGET_MIB = 10.0
SETTLE = 3.0  # seconds of quiet before a snapshot (exits and log drains finish)
LATE = 30.0  # if the end is above idle: seconds more before a second look
LOG_NAME = "cri-shim.log"  # endpoints.Shim's log file, in the temp dir


# ---------------------------------------------------------------- the shim process


class FakeShim(Shim):
    """`cri-shim serve` with its default configuration (the fake handler), on a temporary socket and state.

    endpoints.Shim's stop and leftover handling, with no engine behind it.
    """

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.sock = f"{tmp}/cri-shim.sock"
        self.state_dir = f"{tmp}/state"
        self.log = open(f"{tmp}/{LOG_NAME}", "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shim.cli",
                "serve",
                "--listen",
                f"unix://{self.sock}",
                "--state-dir",
                self.state_dir,
                "--log-level",
                "warning",
                "--log-format",
                "json",
            ],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C aimed at us leaves it up for the cleanup
        )

    def engine_leftovers(self) -> list[str]:
        return []


def start_shim(handler: str, tmp: str, run_id: str) -> tuple[Shim, dict[str, Any] | None]:
    """The shim child for ``handler``, and the runv handler's configuration (runv only)."""
    if handler == "fake":
        return FakeShim(tmp), None
    if handler == "docker":
        # JSON logs make the SIGUSR1 task dump easy to read back.
        return Shim(tmp, run_id, extra_config='\n[logging]\nformat = "json"\n', own_session=True), None
    import random

    from runv_bench import DualShim, network_config, runv_config

    cfg = runv_config(tmp, run_id, network_config(tmp, run_id, f"10.95.{random.randrange(256)}.0/24"))
    return DualShim(tmp, run_id, {"runv": cfg}), cfg  # console logs: parse_stacks reads those too


# ---------------------------------------------------------------- snapshots of the shim


_SITE = re.compile(r'File "([^"]+)", line \w+, in (\S+)')


def task_site(task: dict[str, str]) -> str:
    """Where a task waits: file:function of its innermost frame (and its name, when it was given one)."""
    sites = _SITE.findall(task.get("stack", ""))
    if sites:
        path, func = sites[-1]
        if "-packages/" in path:
            path = path.split("-packages/", 1)[1]
        elif path.startswith(ROOT + "/"):
            path = path[len(ROOT) + 1 :]
        path = path.removeprefix("src/python/grpcio/")
        site = f"{path}:{func}"
    else:
        site = "<no frame>"
    name = task.get("task", "")
    if name and not re.fullmatch(r"Task-\d+", name):
        site += f" [{re.sub(r'[0-9a-f]{12,}', '<id>', name)}]"
    return site


def socket_names() -> dict[int, str]:
    """Socket inode -> what it is, from ss: a unix socket's path or its peer's, a TCP/UDP socket's ends."""
    unix: dict[int, tuple[str, str, int]] = {}  # inode -> (state, local path or "*", peer inode)
    with contextlib.suppress(OSError):
        out = subprocess.run(["ss", "-xan"], capture_output=True, text=True, timeout=30).stdout
        for line in out.splitlines()[1:]:
            f = line.split()
            if len(f) >= 8 and f[5].isdigit() and f[7].isdigit():
                unix[int(f[5])] = (f[1], f[4], int(f[7]))
    names = {}
    for ino, (state, local, peer) in unix.items():
        if local != "*":
            names[ino] = f"unix {local} ({state})"
        elif peer in unix and unix[peer][1] != "*":
            names[ino] = f"unix -> {unix[peer][1]}"
        elif peer in unix:
            names[ino] = f"unix, unnamed peer ({state})"  # a socketpair
        else:
            names[ino] = f"unix, peer gone ({state})"  # the other end closed, this one not
    with contextlib.suppress(OSError):
        out = subprocess.run(["ss", "-tuane"], capture_output=True, text=True, timeout=30).stdout
        for line in out.splitlines()[1:]:
            f, ino = line.split(), re.search(r"\bino:(\d+)", line)
            if ino and len(f) >= 6:
                names[int(ino.group(1))] = f"{f[0]} {f[4]} -> {f[5]} ({f[1]})"
    return names


def fd_kind(target: str, tmp: str, sockets: dict[int, str]) -> str:
    """An fd's target without inode numbers or container ids, the temp dir as $TMP; sockets named."""
    m = re.fullmatch(r"socket:\[(\d+)\]", target)
    if m and int(m.group(1)) in sockets:
        target = f"socket: {sockets[int(m.group(1))]}"
    kind = re.sub(r"\[\d+\]", "", target).replace(tmp, "$TMP")
    return re.sub(r"[0-9a-f]{12,}", "<id>", kind)


def parse_stacks(line: str) -> list[dict[str, str]] | None:
    """The tasks of a diagnostics.stacks log line, JSON or console format (structlog sorts keys)."""
    if "diagnostics.stacks" not in line:
        return None
    with contextlib.suppress(ValueError):
        event = json.loads(line)
        if isinstance(event, dict) and event.get("event") == "diagnostics.stacks":
            return list(event.get("tasks", []))
    m = re.search(r" tasks=(\[.*\]) threads=\{", line)
    if m:
        with contextlib.suppress(ValueError, SyntaxError):
            return list(ast.literal_eval(m.group(1)))
    return None


async def dump_tasks(pid: int, log_path: str, timeout: float = 15.0) -> list[dict[str, str]] | None:
    """SIGUSR1 the shim and read back the tasks of the diagnostics.stacks line it logs."""
    start = os.path.getsize(log_path)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        with open(log_path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        for line in text.split("\n")[:-1]:  # complete lines only
            tasks = parse_stacks(line)
            if tasks is not None:
                return tasks
    return None


def proc_status(pid: int, key: str) -> int:
    """A number of /proc/PID/status (kB for sizes), -1 if absent."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_fds(pid: int, tmp: str) -> Counter[str]:
    kinds: Counter[str] = Counter()
    sockets = socket_names()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            kinds[fd_kind(os.readlink(f"/proc/{pid}/fd/{fd}"), tmp, sockets)] += 1
    return kinds


def count_files(root: str) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


@dataclasses.dataclass
class Snapshot:
    label: str
    done: int  # measured lifecycles completed when taken
    rss_mib: float  # VmRSS
    anon_mib: float  # RssAnon: VmRSS less file pages, which a memory limit's reclaim may drop or bring back
    fd_kinds: Counter[str]
    threads: int
    tasks: list[dict[str, str]] | None  # None: the dump did not come back
    cpu_s: float  # the shim's CPU seconds so far
    records: int  # files in the shim's state directory
    engine: int | None  # engine containers of this shim instance (docker, runv)

    @property
    def fds(self) -> int:
        return sum(self.fd_kinds.values())

    @property
    def n_tasks(self) -> int | None:
        return None if self.tasks is None else len(self.tasks)

    def task_sites(self) -> Counter[str]:
        return Counter(task_site(t) for t in self.tasks or [])


# ---------------------------------------------------------------- the churn


Points = dict[str, list[tuple[int, float]]]  # name -> (lifecycles done when it began, ms)


class Soak:
    def __init__(self, shim: Shim, handler: str, tmp: str, run_id: str) -> None:
        self.shim = shim
        self.handler = handler
        self.tmp = tmp
        self.run_id = run_id
        self.logs = f"{tmp}/pod-logs"
        opts = [("grpc.max_receive_message_length", 16 << 20)]
        self.channel = grpc.aio.insecure_channel(f"unix://{shim.sock}", options=opts)
        self.rt = api_pb2_grpc.RuntimeServiceStub(self.channel)  # type: ignore[no-untyped-call]
        self.im = api_pb2_grpc.ImageServiceStub(self.channel)  # type: ignore[no-untyped-call]
        self.seq = 0
        self.done = 0  # measured lifecycles finished (failed ones included)
        self.failed = 0
        self.measuring = False
        self.steps: Points = {}
        self.poll: Points = {}
        self.errors: Counter[str] = Counter()  # "RPC CODE" -> count, warm-up included
        self.lock = asyncio.Lock()  # one poll round, or one snapshot, at a time

    async def rpc(self, name: str, call: Callable[..., Awaitable[Any]], req: Any, at: int) -> Any:
        t0 = time.perf_counter()
        try:
            resp = await call(req, timeout=RPC_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            self.errors[f"{name} {exc.code().name}"] += 1
            raise
        if self.measuring:
            self.steps.setdefault(name, []).append((at, (time.perf_counter() - t0) * 1000))
        return resp

    async def pull(self) -> None:
        spec = pb.ImageSpec(image=BUSYBOX, runtime_handler="runv" if self.handler == "runv" else "")
        status = await self.im.ImageStatus(pb.ImageStatusRequest(image=spec), timeout=60)
        if not status.HasField("image"):
            await self.im.PullImage(pb.PullImageRequest(image=spec), timeout=300)

    async def log_ready(self, path: str) -> bool:
        """Wait until the container's CRI log holds EXPECTED on stdout, in order."""
        deadline = time.monotonic() + LOG_WAIT
        while True:
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
                out, partial = [], b""
                for line in f.read().split(b"\n"):
                    parts = line.split(b" ", 3)  # time stream P|F content
                    if len(parts) == 4 and parts[1] == b"stdout":
                        partial += parts[3]
                        if parts[2] == b"F":
                            out.append(partial.decode(errors="replace"))
                            partial = b""
                if out[: len(EXPECTED)] == EXPECTED:
                    return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)

    async def lifecycle(self) -> bool:
        self.seq += 1
        name, at, rt = f"soak-{self.seq}", self.done, self.rt
        log_dir = os.path.join(self.logs, name)
        sc = pod_sandbox_config(
            name,
            f"cri-shim-soak-{self.run_id}",
            f"{self.run_id}-{self.seq}",
            log_dir,
            {"cri-shim-bench": self.run_id},
        )
        cc = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name="app"),
            image=pb.ImageSpec(image=BUSYBOX),
            command=["sh", "-c", SCRIPT],
            log_path="app.log",
            labels={"cri-shim-bench": self.run_id},
        )
        t0 = time.perf_counter()
        pod = ""
        try:
            req: Any = pb.RunPodSandboxRequest(
                config=sc, runtime_handler="runv" if self.handler == "runv" else ""
            )
            pod = (await self.rpc("RunPodSandbox", rt.RunPodSandbox, req, at)).pod_sandbox_id
            req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
            cid = (await self.rpc("CreateContainer", rt.CreateContainer, req, at)).container_id
            await self.rpc(
                "StartContainer", rt.StartContainer, pb.StartContainerRequest(container_id=cid), at
            )
            req = pb.ExecSyncRequest(container_id=cid, cmd=["echo", "soak"], timeout=30)
            resp = await self.rpc("ExecSync", rt.ExecSync, req, at)
            if resp.exit_code != 0 or resp.stdout != b"soak\n":
                self.errors["ExecSync WRONG_OUTPUT"] += 1
            t1 = time.perf_counter()
            if not await self.log_ready(os.path.join(log_dir, "app.log")):
                self.errors["log INCOMPLETE"] += 1
            elif self.measuring:
                self.steps.setdefault("log ready", []).append((at, (time.perf_counter() - t1) * 1000))
            await self.rpc(
                "ContainerStats", rt.ContainerStats, pb.ContainerStatsRequest(container_id=cid), at
            )
            req = pb.StopContainerRequest(container_id=cid, timeout=STOP_TIMEOUT[self.handler])
            await self.rpc("StopContainer", rt.StopContainer, req, at)
            await self.rpc(
                "RemoveContainer", rt.RemoveContainer, pb.RemoveContainerRequest(container_id=cid), at
            )
            req = pb.StopPodSandboxRequest(pod_sandbox_id=pod)
            await self.rpc("StopPodSandbox", rt.StopPodSandbox, req, at)
            req = pb.RemovePodSandboxRequest(pod_sandbox_id=pod)
            await self.rpc("RemovePodSandbox", rt.RemovePodSandbox, req, at)
            pod = ""
            if self.measuring:
                self.steps.setdefault("lifecycle", []).append((at, (time.perf_counter() - t0) * 1000))
            return True
        except grpc.aio.AioRpcError:
            return False
        finally:
            if pod:  # a step failed: take the pod away (its containers go with it)
                for call, r in (
                    (rt.StopPodSandbox, pb.StopPodSandboxRequest(pod_sandbox_id=pod)),
                    (rt.RemovePodSandbox, pb.RemovePodSandboxRequest(pod_sandbox_id=pod)),
                ):
                    try:
                        await call(r, timeout=RPC_TIMEOUT)
                    except grpc.aio.AioRpcError as exc:
                        self.errors[f"cleanup {exc.code().name}"] += 1
            shutil.rmtree(log_dir, ignore_errors=True)  # the kubelet's job, after RemoveContainer

    async def churn(self, count: int, workers: int) -> None:
        left = count

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                ok = await self.lifecycle()
                if self.measuring:
                    self.done += 1
                    self.failed += not ok

        await asyncio.gather(*(worker() for _ in range(workers)))

    async def poller(self, interval: float, stop: asyncio.Event) -> None:
        """The kubelet's relist and stats, once per interval."""
        calls = [
            ("ListPodSandbox", self.rt.ListPodSandbox, pb.ListPodSandboxRequest()),
            ("ListContainers", self.rt.ListContainers, pb.ListContainersRequest()),
            ("ListContainerStats", self.rt.ListContainerStats, pb.ListContainerStatsRequest()),
        ]
        loop = asyncio.get_running_loop()
        due = loop.time()
        while not stop.is_set():
            async with self.lock:
                for name, call, req in calls:
                    at, t0 = self.done, time.perf_counter()
                    try:
                        await call(req, timeout=60)
                    except grpc.aio.AioRpcError as exc:
                        self.errors[f"{name} {exc.code().name}"] += 1
                    else:
                        self.poll.setdefault(name, []).append((at, (time.perf_counter() - t0) * 1000))
            due = max(due + interval, loop.time())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), due - loop.time())

    async def snapshot(self, label: str, settle: float = SETTLE) -> Snapshot:
        async with self.lock:  # the poller waits: nothing of ours is in flight
            await asyncio.sleep(settle)
            pid = self.shim.proc.pid
            tasks = await dump_tasks(pid, f"{self.tmp}/{LOG_NAME}")
            engine = None
            if self.handler != "fake":
                engine = len(await asyncio.to_thread(self.shim.engine_leftovers))
            snap = Snapshot(
                label=label,
                done=self.done,
                rss_mib=rss_mib(pid),
                anon_mib=proc_status(pid, "RssAnon") / 1024,
                fd_kinds=proc_fds(pid, self.tmp),
                threads=proc_status(pid, "Threads"),
                tasks=tasks,
                cpu_s=proc_cpu(pid),
                records=count_files(self.shim.state_dir),
                engine=engine,
            )
        print(
            f"  {label}: RSS {snap.rss_mib:.1f} MiB (anon {snap.anon_mib:.1f}), {snap.fds} fds, {snap.threads} threads, "
            f"{snap.n_tasks if snap.tasks is not None else '?'} tasks",
            flush=True,
        )
        return snap


# ---------------------------------------------------------------- report


def window(points: list[tuple[int, float]], lo: float, hi: float) -> list[float]:
    return [ms for at, ms in points if lo <= at < hi]


def fmt(v: float) -> str:
    return "-" if v != v else f"{v:.2f}"  # NaN: no samples


def print_windows(title: str, points: Points, names: list[str], n: int) -> None:
    print(f"\n{title}")
    head = (
        f"{'':<20} | {'first 10%':>9} {'p50':>8} {'p99':>8} | {'last 10%':>9} {'p50':>8} {'p99':>8}"
        f" | {'all':>6} {'p50':>8} {'p99':>8}"
    )
    print(head)
    print("-" * len(head))
    for name in names:
        pts = points.get(name, [])
        first, last, every = window(pts, 0, 0.1 * n), window(pts, 0.9 * n, n + 1), [ms for _, ms in pts]
        line = f"{name:<20}"
        for s in (first, last):
            line += f" | {'n=' + str(len(s)):>9} {fmt(pct(s, 0.5)):>8} {fmt(pct(s, 0.99)):>8}"
        line += f" | {len(every):>6} {fmt(pct(every, 0.5)):>8} {fmt(pct(every, 0.99)):>8}"
        print(line)


def print_snapshots(snaps: list[Snapshot]) -> None:
    print("\nThe shim at idle (no pods; workers drained, poller paused)")
    head = (
        f"{'snapshot':<16} {'done':>6} {'RSS MiB':>8} {'anon MiB':>8} {'fds':>5} {'threads':>7} {'tasks':>5}"
        f" {'state files':>11} {'engine ctrs':>11} {'CPU s':>7}"
    )
    print(head)
    print("-" * len(head))
    for s in snaps:
        tasks = "?" if s.tasks is None else str(len(s.tasks))
        engine = "-" if s.engine is None else str(s.engine)
        print(
            f"{s.label:<16} {s.done:>6} {s.rss_mib:>8.1f} {s.anon_mib:>8.1f} {s.fds:>5} {s.threads:>7} {tasks:>5}"
            f" {s.records:>11} {engine:>11} {s.cpu_s:>7.1f}"
        )


def print_diff(title: str, a: Counter[str], b: Counter[str]) -> None:
    keys = sorted(k for k in set(a) | set(b) if a[k] != b[k])
    if not keys:
        print(f"{title}: no change")
        return
    print(f"{title}:")
    for k in keys:
        print(f"  {b[k] - a[k]:+5d}  ({a[k]} -> {b[k]})  {k}")


def targets(start: Snapshot, end: Snapshot, poll: Points, n: int) -> list[tuple[str, str, str, bool | None]]:
    rows: list[tuple[str, str, str, bool | None]] = []
    for what, a, b in (("RSS", start.rss_mib, end.rss_mib), ("anonymous RSS", start.anon_mib, end.anon_mib)):
        rows.append(
            (
                f"{what} within +{RSS_BUDGET_MIB:.0f} MiB of the start",
                f"{a:.1f} MiB",
                f"{b:.1f} MiB ({b - a:+.1f})",
                b - a <= RSS_BUDGET_MIB,
            )
        )
    rows.append(("open fds back to the idle count", str(start.fds), str(end.fds), end.fds <= start.fds))
    if start.tasks is None or end.tasks is None:
        rows.append(("asyncio tasks back to the idle count", "?", "?", False))
    else:
        rows.append(
            (
                "asyncio tasks back to the idle count",
                str(len(start.tasks)),
                str(len(end.tasks)),
                len(end.tasks) <= len(start.tasks),
            )
        )
    for name in POLLED:
        tenths = p99_by_tenth(poll.get(name, []), n)
        first, last = tenths[0], tenths[-1]
        ok: bool | None = last <= noise_band(tenths)
        if first != first or last != last:  # NaN: a window without samples (a run too short)
            ok = None
        rows.append((f"{name} p99 unchanged within noise", f"{fmt(first)} ms", f"{fmt(last)} ms", ok))
    return rows


def p99_by_tenth(points: list[tuple[int, float]], n: int) -> list[float]:
    return [pct(window(points, k * n / 10, (k + 1) * n / 10 if k < 9 else n + 1), 0.99) for k in range(10)]


def noise_band(tenths: list[float]) -> float:
    """The highest last-tenth p99 still "unchanged": within the first tenth's p99 x NOISE_FACTOR (or
    + NOISE_FLOOR_MS), or no higher than the p99 of some tenth in between (the run's own noise)."""
    first, middle = tenths[0], [v for v in tenths[1:9] if v == v]
    return max(first * NOISE_FACTOR, first + NOISE_FLOOR_MS, *middle)


def report(soak: Soak, snaps: list[Snapshot], n: int, elapsed: float, interval: float, handler: str) -> None:
    start, end = snaps[0], snaps[-1]
    print_snapshots(snaps)
    print(
        f"idle tasks ({start.label}): "
        + "; ".join(f"{n} x {k}" for k, n in sorted(start.task_sites().items()))
    )
    print(f"idle fds ({start.label}): " + "; ".join(f"{n} x {k}" for k, n in sorted(start.fd_kinds.items())))
    print_diff(f"fds, {start.label} -> {end.label}", start.fd_kinds, end.fd_kinds)
    grown = [k for k in end.fd_kinds if end.fd_kinds[k] > start.fd_kinds[k]]
    if handler != "fake" and grown and all("docker.sock" in k or "peer gone" in k for k in grown):
        print(
            "  (likely the engine client's kept-alive connections: up to 16 (backends/docker/engine.py\n"
            "   _MAX_IDLE) of finished calls are kept and each is closed once unused for _IDLE_AGE, 15 s)"
        )
    print_diff(
        f"tasks by where they wait, {start.label} -> {end.label}", start.task_sites(), end.task_sites()
    )
    print_windows(f"Polled RPCs, ms (every {interval:g} s, all pods of the run listed)", soak.poll, POLLED, n)
    print("p99 by tenth of the run, ms:")
    for name in POLLED:
        print(f"  {name:<20} " + " ".join(f"{fmt(v):>7}" for v in p99_by_tenth(soak.poll.get(name, []), n)))
    print_windows("Lifecycle steps, ms", soak.steps, STEPS, n)
    cpu = end.cpu_s - start.cpu_s
    print(
        f"\nthroughput: {n} lifecycles in {elapsed:.1f} s = {n / elapsed:.1f} lifecycles/s "
        f"({soak.failed} failed); shim CPU {cpu:.1f} s = {cpu / n * 1000:.1f} ms per lifecycle"
    )
    if soak.errors:
        print("errors (RPC code: count; warm-up included):")
        for k, v in sorted(soak.errors.items()):
            print(f"  {k}: {v}")
    else:
        print("errors: none")

    rows = targets(start, end, soak.poll, n)
    print(f"\nTargets after {n} lifecycles on {handler} (start = after the warm-up; end = {end.label})")
    head = f"{'target':<46} | {'start':>12} | {'end':>20} | result"
    print(head)
    print("-" * len(head))
    for what, a, b, ok in rows:
        result = "n/a (no samples)" if ok is None else "met" if ok else "NOT MET"
        print(f"{what:<46} | {a:>12} | {b:>20} | {result}")
    print(
        f"(noise: last-10% p99 <= max({NOISE_FACTOR:g} x first-10% p99, first + {NOISE_FLOOR_MS:g} ms, "
        "the p99 of any tenth in between); "
        "fds and tasks: not above the idle count at the start)"
    )


# ---------------------------------------------------------------- main


async def soak_run(args: argparse.Namespace, shim: Shim, tmp: str, run_id: str) -> None:
    main_task = asyncio.current_task()
    assert main_task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
    soak = Soak(shim, args.handler, tmp, run_id)
    try:
        for _ in range(600):
            try:
                await soak.rt.Version(pb.VersionRequest(), timeout=2)
                break
            except grpc.aio.AioRpcError:
                if shim.proc.poll() is not None:
                    raise RuntimeError(
                        f"cri-shim exited {shim.proc.returncode}; its log: {tmp}/{LOG_NAME}"
                    ) from None
                await asyncio.sleep(0.1)
        ver = await soak.rt.Version(pb.VersionRequest(), timeout=5)
        print(
            f"run {run_id}: handler {args.handler}, {args.lifecycles} lifecycles, {args.workers} workers, "
            f"shim pid {shim.proc.pid} ({ver.runtime_name} {ver.runtime_version}), {os.cpu_count()} CPUs, "
            f"python {sys.version.split()[0]}",
            flush=True,
        )
        await soak.pull()
        t0 = time.perf_counter()
        await soak.churn(WARMUP, args.workers)
        print(f"warm-up: {WARMUP} lifecycles in {time.perf_counter() - t0:.1f} s", flush=True)
        snaps = [await soak.snapshot("start")]

        n, half = args.lifecycles, args.lifecycles // 2
        stop = asyncio.Event()
        soak.measuring = True
        poller = asyncio.create_task(soak.poller(args.poll_interval, stop))
        elapsed = 0.0
        try:
            for label, count in (("middle", half), ("end", n - half)):
                t0 = time.perf_counter()
                await soak.churn(count, args.workers)
                elapsed += time.perf_counter() - t0
                print(f"{soak.done}/{n} lifecycles, {soak.done / elapsed:.1f}/s", flush=True)
                if label == "end":
                    stop.set()
                    await poller
                snaps.append(await soak.snapshot(label))
        finally:
            stop.set()
            await poller
        start, end = snaps[0], snaps[-1]
        if end.fds > start.fds or (end.n_tasks or 0) > (start.n_tasks or 0):
            snaps.append(await soak.snapshot(f"end +{LATE:.0f} s", LATE))
        report(soak, snaps, n, elapsed, args.poll_interval, args.handler)
    finally:
        await soak.channel.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--handler", choices=["fake", "docker", "runv"], default="fake", help="runtime handler (fake)"
    )
    ap.add_argument(
        "--lifecycles", type=int, default=10000, help="measured pod + container lifecycles (10000)"
    )
    ap.add_argument("--workers", type=int, default=8, help="lifecycles in flight at once (8)")
    ap.add_argument("--poll-interval", type=float, default=1.0, help="seconds between poll rounds (1)")
    ap.add_argument(
        "--keep-tmp", action="store_true", help="keep the temp dir (shim log, state) for inspection"
    )
    args = ap.parse_args()
    if args.handler != "fake" and os.geteuid() != 0:
        print("run as root (the engine's socket; runv: namespaces, cgroups)", file=sys.stderr)
        return 2

    run_id = uuid.uuid4().hex[:8]
    tmp = tempfile.mkdtemp(prefix="cri-shim-soak-", dir="/tmp")
    os.makedirs(f"{tmp}/pod-logs")
    shim: Shim | None = None
    runv_cfg: dict[str, Any] | None = None
    failed = False
    signal.signal(signal.SIGTERM, _interrupt)  # until the event loop takes SIGTERM over
    try:
        shim, runv_cfg = start_shim(args.handler, tmp, run_id)
        asyncio.run(soak_run(args, shim, tmp, run_id))
    except (KeyboardInterrupt, asyncio.CancelledError):
        failed = True
        print("interrupted; cleaning up", file=sys.stderr)
    except Exception:
        failed = args.keep_tmp = True
        raise
    finally:
        if shim is not None:
            if shim.proc.poll() is None:
                cri = Cri("cleanup", shim.sock, run_id, f"{tmp}/pod-logs")
                cri.cleanup()  # the pods labelled with this run, if any is left
                cri.close()
            shim.stop()
            shim.remove_engine_leftovers()
        if runv_cfg is not None:
            from runv_bench import remove_leftovers

            remove_leftovers([runv_cfg])
        if args.keep_tmp:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
