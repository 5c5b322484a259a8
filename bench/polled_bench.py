"""The calls a kubelet polls, side by side: cri-shim (grpcio), cri-shim (native), containerd-CRI.

Three CRI endpoints in one run:
- `cri-shim serve --transport grpcio` on the docker backend,
- `cri-shim serve --transport native` on the docker backend (each shim a child
  process on a temporary socket, state directory and config: endpoints.Shim),
- containerd's CRI plugin (unix:///run/containerd-cri/containerd.sock, already
  running; only the pods this run makes are touched).

For each N in --pods (20,110) every endpoint holds N pods, each with one
running container (busybox `sleep 3600` from the test registry; the shims'
pause image is docker_bench's, containerd's is its own config's), and every
endpoint lists about --images images (50: distinct images made in the test
registry and pulled through CRI where fewer are listed, removed at the end; the
shims' engine holds the test images already, containerd's store few, and
ListImages would otherwise compare 30 images with 2). The machine is
then let settle (--settle, --quiet: until its CPUs are at most 20% busy over 2 s,
at most 60 s), so that what is measured is a node polled in its steady state, not
the engines' aftermath of 3N new containers. Then:
- latency: p50 and p99 of each polled RPC over --samples sequential calls
  (ListPodSandbox, ListContainers, ContainerStatus and PodSandboxStatus of a
  random container / pod each call, ListContainerStats, ListPodSandboxStats,
  ImageFsInfo, ListImages, and Version as the floor), and the geometric mean of
  the eight polled p50s. The List* calls carry this run's pod label as filter
  on every endpoint alike (--unfiltered: none, as a kubelet sends them), so that
  pods others left on a shared runtime are neither counted nor able to fail the
  call; the runtime still walks everything it holds. The calls are taken in rounds: each round gives every
  RPC --block calls on each endpoint in turn, and which endpoint goes first
  rotates each round, so that the drift of a shared machine falls on all alike. As a control,
  each endpoint's p99 of its even rounds over that of its odd rounds (chance, in the same minutes);
- throughput: calls/s of ListContainers and ContainerStatus with --callers
  concurrent callers for --seconds, endpoints in turns, made two ways: grpcio's
  client (threads, one channel and connection each; 200-300 us of this process's
  CPU a call, so that on 2 cores the callers weigh more than the runtime), and
  bench/h2_callers.py (a few us a call, as a Go client, so the runtime's own cost
  shows) twice: --callers connections with one call in flight each (independent
  clients), then all --callers calls in flight on one connection (as a kubelet's
  goroutines share its one). Each also gives the CPU a call cost the runtime's
  process (/proc/PID/stat) and the callers;
- memory: RSS (VmRSS) of each runtime's process, idle before any pod and at each
  N. The shim's is its child's pid; containerd's is read from a pid file beside
  its socket if there is one, else from the process holding its listening socket
  (the socket's inode in /proc/net/unix, found among /proc/PID/fd), or --containerd-pid.

It prints a table per N with the ratio shim/containerd of each figure. Figures
only: nothing is asserted. Everything it creates (pods on every endpoint, the
shims, their engine containers, the temp directory) is removed at the end, also
on failure, Ctrl-C or SIGTERM.

Run as root, with scripts/testenv/up (engine, registry) and containerd-CRI up:
    .venv/bin/python bench/polled_bench.py [--pods 20,110] [--samples 3000] [--seconds 5]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import glob
import math
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import h2_callers
from endpoints import (
    CONTAINERD_SOCK,
    Cri,
    Shim,
    _interrupt,
    answering,
    fill_images,
    image_count,
    pct,
    registry_images,
    remove_bench_images,
    wait_quiet,
)

from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc

# The polled RPCs (the geometric mean is over these), then the floor.
POLLED = [
    "ListPodSandbox",
    "ListContainers",
    "ContainerStatus",
    "PodSandboxStatus",
    "ListContainerStats",
    "ListPodSandboxStats",
    "ImageFsInfo",
    "ListImages",
]
FLOOR = "Version"
THROUGHPUT = ["ListContainers", "ContainerStatus"]
RUNTIME = "/runtime.v1.RuntimeService/"
# How the callers of a throughput phase are made: grpcio's client, a thread and connection
# each; h2_callers, a thread and connection each with one call in flight (independent
# clients, each call costing the callers a few microseconds); or h2_callers with all the
# calls in flight on one connection (as a kubelet's goroutines share its one).
CALLERS = ("grpcio", "h2conns", "h2")
STATS = {"ListContainerStats", "ListPodSandboxStats"}
# The peers the shims are compared with, and their short names in the ratio columns.
SHORT = {"containerd": "ctrd", "cri-dockerd": "crid"}
# Pods started at once on one endpoint while filling it (the engine serializes most of it anyway).
START_WORKERS = 4


class Endpoint:
    """One CRI endpoint under test: its client, its pods and containers, its runtime's pid."""

    def __init__(self, name: str, cri: Cri, pid: int, cgroup_root: str) -> None:
        self.name = name
        self.cri = cri
        self.pid = pid
        self.cgroup_root = cgroup_root
        self.pods: list[str] = []
        self.containers: list[str] = []
        self.lock = threading.Lock()

    def add_pod(self) -> None:
        """One pod with one running container (sleep 3600)."""
        c = self.cri
        with self.lock:  # Cri.pod_config numbers the pods
            sc = c.pod_config()
        # A cgroup parent as a kubelet gives one (containerd's ListPodSandboxStats fails on a pod
        # without): under a root of this run's, removed at the end.
        sc.linux.cgroup_parent = f"/{self.cgroup_root}/{self.name}-{sc.metadata.uid}"
        pod = c.run_pod(sc)
        cid = c.create(pod, sc, "app")
        c.rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
        with self.lock:
            self.pods.append(pod)
            self.containers.append(cid)

    def fill(self, n: int) -> float:
        """Pods up to ``n``; seconds it took."""
        t0 = time.perf_counter()
        pool = concurrent.futures.ThreadPoolExecutor(START_WORKERS)
        try:
            futures = [pool.submit(self.add_pod) for _ in range(n - len(self.pods))]
            for f in futures:
                f.result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return time.perf_counter() - t0

    def list_requests(self, unfiltered: bool) -> dict[str, Any]:
        """The List* requests: by default filtered on this run's pod label, so that each endpoint
        returns its N pods and containers and no one else's (the runtime still walks all it holds)."""
        if unfiltered:
            sel: dict[str, str] = {}
        else:
            sel = {"cri-shim-bench": self.cri.run_id}
        return {
            "ListPodSandbox": pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter(label_selector=sel)),
            "ListContainers": pb.ListContainersRequest(filter=pb.ContainerFilter(label_selector=sel)),
            "ListContainerStats": pb.ListContainerStatsRequest(
                filter=pb.ContainerStatsFilter(label_selector=sel)
            ),
            "ListPodSandboxStats": pb.ListPodSandboxStatsRequest(
                filter=pb.PodSandboxStatsFilter(label_selector=sel)
            ),
        }

    def calls(self, rng: random.Random, unfiltered: bool) -> dict[str, Callable[[], Any]]:
        """One call of each measured RPC (the *Status ones on a random object each time)."""
        rt, im = self.cri.rt, self.cri.im
        req = self.list_requests(unfiltered)
        return {
            "ListPodSandbox": lambda: rt.ListPodSandbox(req["ListPodSandbox"], timeout=60),
            "ListContainers": lambda: rt.ListContainers(req["ListContainers"], timeout=60),
            "ContainerStatus": lambda: rt.ContainerStatus(
                pb.ContainerStatusRequest(container_id=rng.choice(self.containers)), timeout=60
            ),
            "PodSandboxStatus": lambda: rt.PodSandboxStatus(
                pb.PodSandboxStatusRequest(pod_sandbox_id=rng.choice(self.pods)), timeout=60
            ),
            "ListContainerStats": lambda: rt.ListContainerStats(req["ListContainerStats"], timeout=600),
            "ListPodSandboxStats": lambda: rt.ListPodSandboxStats(req["ListPodSandboxStats"], timeout=600),
            "ImageFsInfo": lambda: im.ImageFsInfo(pb.ImageFsInfoRequest(), timeout=60),
            "ListImages": lambda: im.ListImages(pb.ListImagesRequest(), timeout=60),
            FLOOR: lambda: rt.Version(pb.VersionRequest(), timeout=60),
        }

    def counts(self, unfiltered: bool) -> str:
        rt, im = self.cri.rt, self.cri.im
        req = self.list_requests(unfiltered)
        pods = len(rt.ListPodSandbox(req["ListPodSandbox"], timeout=60).items)
        ctrs = rt.ListContainers(req["ListContainers"], timeout=60).containers
        running = sum(1 for c in ctrs if c.state == pb.CONTAINER_RUNNING)
        every = len(rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=60).items)
        images = len(im.ListImages(pb.ListImagesRequest(), timeout=60).images)
        return (
            f"the List calls return {pods} pods and {len(ctrs)} containers ({running} running); "
            f"{every} pods in all; {images} images listed"
        )


# ---------------------------------------------------------------- memory


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return math.nan


def socket_owner(path: str) -> tuple[int, str]:
    """The pid of the runtime serving the unix socket ``path``, and how it was found."""
    sock_dir = os.path.dirname(path)
    for pidfile in sorted(glob.glob(f"{sock_dir}/*.pid")):
        with contextlib.suppress(OSError, ValueError), open(pidfile) as f:
            pid = int(f.read().strip())
            if os.path.exists(f"/proc/{pid}"):
                return pid, f"pid file {pidfile}"
    inodes = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == path:
                inodes.add(f"socket:[{fields[6]}]")
    owners = []
    for fd_dir in glob.glob("/proc/[0-9]*/fd"):
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") in inodes:
                    owners.append(int(fd_dir.split("/")[2]))
                    break
            except OSError:
                continue
    if not owners:
        raise RuntimeError(f"no process holds the listening socket {path} (give --containerd-pid)")
    pid = min(owners)
    return pid, f"the process holding {path}'s listening socket (inode in /proc/net/unix)"


def remove_cgroups(root: str) -> None:
    """The cgroup directories under ``root`` (this run's) in every hierarchy, deepest first."""
    for top in sorted(
        {
            os.path.realpath(d)
            for d in glob.glob(f"/sys/fs/cgroup/*/{root}") + glob.glob(f"/sys/fs/cgroup/{root}")
        }
    ):
        for dirpath, _, _ in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
            try:
                os.rmdir(dirpath)
            except OSError as exc:
                print(f"  cleanup: cgroup {dirpath}: {exc.strerror}", file=sys.stderr)


def comm(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace").strip()


# ---------------------------------------------------------------- latency and throughput

Samples = dict[str, list[float]]


def latency(
    eps: list[Endpoint], samples: int, stats_samples: int, block: int, seed: int, unfiltered: bool
) -> dict[str, Samples]:
    """Sequential calls of every RPC on every endpoint, interleaved in rounds; the two
    *Stats RPCs ``stats_samples`` times, spread over the rounds (containerd's take seconds).
    An RPC that an endpoint answers UNIMPLEMENTED (cri-dockerd's ListPodSandboxStats) has no
    samples there."""
    res: dict[str, Samples] = {e.name: {} for e in eps}
    calls = {e.name: e.calls(random.Random(seed), unfiltered) for e in eps}
    for e in eps:  # first calls, untimed (connections, caches)
        for op, call in list(calls[e.name].items()):
            try:
                call()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                print(f"{e.name}: {op} is not implemented there", flush=True)
                del calls[e.name][op]
                res[e.name][op] = []
    ops = [*POLLED, FLOOR]
    rounds = math.ceil(samples / block)
    stats_block = max(1, math.ceil(stats_samples / rounds))
    for r in range(rounds):
        k = r % len(eps)
        order = eps[k:] + eps[:k]
        for op in ops:
            want, size = (stats_samples, stats_block) if op in STATS else (samples, block)
            for e in order:
                call = calls[e.name].get(op)
                if call is None:
                    continue
                out = res[e.name].setdefault(op, [])
                for _ in range(min(size, want - len(out))):
                    t0 = time.perf_counter()
                    call()
                    out.append((time.perf_counter() - t0) * 1000)
    return res


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process ``pid`` has used (all its threads; /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Rate(NamedTuple):
    """One throughput phase: calls/s, failed calls, and the CPU each call cost the runtime's
    process and the callers (this process) in microseconds."""

    calls_s: float
    errors: int
    server_us: float
    callers_us: float


def throughput(e: Endpoint, op: str, callers: int, seconds: float, seed: int, unfiltered: bool) -> Rate:
    """Calls/s of ``op`` with ``callers`` threads, each on a channel (and connection) of its own."""
    done = [0] * callers
    errors = [0] * callers
    stop = threading.Event()
    start = threading.Barrier(callers + 1)
    list_req = e.list_requests(unfiltered)["ListContainers"]

    def caller(i: int) -> None:
        # A local subchannel pool: otherwise channels to one target share a connection.
        ch = grpc.insecure_channel(f"unix://{e.cri.sock}", options=[("grpc.use_local_subchannel_pool", 1)])
        rt = api_pb2_grpc.RuntimeServiceStub(ch)  # type: ignore[no-untyped-call]
        rng = random.Random(seed + i)
        try:
            try:
                rt.Version(pb.VersionRequest(), timeout=60)  # connected before the clock starts
            except grpc.RpcError:
                start.abort()  # the phase fails at once rather than waiting for this caller
                raise
            start.wait()
            while not stop.is_set():
                try:
                    if op == "ListContainers":
                        rt.ListContainers(list_req, timeout=60)
                    else:
                        req = pb.ContainerStatusRequest(container_id=rng.choice(e.containers))
                        rt.ContainerStatus(req, timeout=60)
                    done[i] += 1
                except grpc.RpcError:
                    errors[i] += 1
        finally:
            ch.close()

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(callers)]
    for t in threads:
        t.start()
    start.wait(120)
    t0 = time.perf_counter()
    server0, callers0, done0 = cpu_seconds(e.pid), time.process_time(), sum(done)
    try:
        time.sleep(seconds)
    finally:
        stop.set()
        n = sum(done) - done0  # calls that ended inside the window (those in flight finish after)
        elapsed = time.perf_counter() - t0
        server_us = (cpu_seconds(e.pid) - server0) / max(n, 1) * 1e6
        callers_us = (time.process_time() - callers0) / max(n, 1) * 1e6
        for t in threads:
            t.join(120)
    return Rate(n / elapsed, sum(errors), server_us, callers_us)


def throughput_h2(
    e: Endpoint, op: str, callers: int, seconds: float, seed: int, unfiltered: bool, one_conn: bool = True
) -> Rate:
    """Calls/s of ``op`` made by h2_callers (a few microseconds of CPU a call: the runtime's own
    cost bounds the rate): ``callers`` calls at once on one connection, or (``one_conn`` false)
    ``callers`` connections with a call in flight each."""
    if op == "ListContainers":
        bodies = [e.list_requests(unfiltered)["ListContainers"].SerializeToString()]
    else:
        ids = list(e.containers)
        random.Random(seed).shuffle(ids)
        bodies = [pb.ContainerStatusRequest(container_id=c).SerializeToString() for c in ids]
    server0, callers0 = cpu_seconds(e.pid), time.process_time()
    conns, depth = (1, callers) if one_conn else (callers, 1)
    rate, errors, n = h2_callers.throughput(e.cri.sock, f"{RUNTIME}{op}", bodies, conns, depth, seconds)
    server_us = (cpu_seconds(e.pid) - server0) / max(n, 1) * 1e6
    callers_us = (time.process_time() - callers0) / max(n, 1) * 1e6
    return Rate(rate, errors, server_us, callers_us)


# ---------------------------------------------------------------- report


def split_rounds(samples: list[float], block: int) -> tuple[list[float], list[float]]:
    """The samples taken in even rounds and those in odd ones (``block`` calls a round, in order)."""
    even = [v for i, v in enumerate(samples) if (i // block) % 2 == 0]
    odd = [v for i, v in enumerate(samples) if (i // block) % 2 == 1]
    return even, odd


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def report(
    n: int,
    eps: list[Endpoint],
    lat: dict[str, Samples],
    tput: dict[tuple[str, str, str], Rate],
    rss_idle: dict[str, float],
    rss_now: dict[str, float],
    args: argparse.Namespace,
) -> None:
    # Each cri-shim against each peer: containerd, and cri-dockerd when it is in the run.
    pairs = [
        (e.name, r.name, SHORT[r.name]) for e in eps if e.name not in SHORT for r in eps if r.name in SHORT
    ]
    print(
        f"\n=== N = {n} pods, one running container each; ms, n={args.samples} sequential calls per RPC "
        f"and endpoint ({args.stats_samples} for the two *Stats), in rounds of {args.block}"
    )
    head = f"{'RPC':<22}" + "".join(f" | {e.name + ' p50':>16} {'p99':>8}" for e in eps)
    head += "".join(f" | {s + '/' + short + ' p50':>17} {'p99':>6}" for s, _, short in pairs)
    print(head)
    print("-" * len(head))
    for op in [*POLLED, FLOOR]:
        line = f"{op:<22}"
        for e in eps:
            v = lat[e.name][op]
            line += f" | {pct(v, 0.5):16.2f} {pct(v, 0.99):8.2f}"
        for s, ref, _ in pairs:
            v, c = lat[s][op], lat[ref][op]
            line += f" | {pct(v, 0.5) / pct(c, 0.5):16.2f}x {pct(v, 0.99) / pct(c, 0.99):5.2f}x"
        print(line)
    # The two stats RPCs weigh most on containerd; the second mean shows the rest alone.
    # Over the RPCs every endpoint answers (cri-dockerd has no ListPodSandboxStats).
    common = [op for op in POLLED if all(lat[e.name][op] for e in eps)]
    for label, ops in (
        ("geomean of polled p50", common),
        ("  the same, no *Stats", [op for op in common if not op.endswith("Stats")]),
    ):
        gm = {e.name: geomean([pct(lat[e.name][op], 0.5) for op in ops]) for e in eps}
        line = f"{label:<22}" + "".join(f" | {gm[e.name]:16.2f} {'':>8}" for e in eps)
        line += "".join(f" | {gm[s] / gm[ref]:16.2f}x {'':>6}" for s, ref, _ in pairs)
        print(line)
    # How far a p99 ratio moves by chance: each endpoint against itself, the p99 of its calls
    # in even rounds over that of its calls in odd rounds (the same machine, the same minutes).
    quick = [op for op in [*POLLED, FLOOR] if op not in STATS]
    print(f"p99 of each endpoint's even rounds / its odd rounds ({', '.join(quick)}):")
    for e in eps:
        ratios = []
        for op in quick:
            even, odd = split_rounds(lat[e.name][op], args.block)
            ratios.append(pct(even, 0.99) / pct(odd, 0.99))
        line = f"  {e.name:<20}" + " ".join(f"{r:5.2f}x" for r in ratios)
        line += f"   (from {min(ratios):.2f}x to {max(ratios):.2f}x)"
        print(line)
    print()
    for op in THROUGHPUT:
        for how in CALLERS:
            if how == "grpcio":
                label = f"{op} x{args.callers} grpcio"
            elif how == "h2conns":
                label = f"{op} x{args.callers} conns"
            else:
                label = f"{op} {args.callers} on 1 conn"
            line = f"{label:<32}"
            rates = {e.name: tput[(e.name, op, how)] for e in eps}
            for e in eps:
                r = rates[e.name]
                line += f" | {e.name} {r.calls_s:8.0f}" + (f" ({r.errors} errors)" if r.errors else "")
            line += "".join(
                f" | {s}/{short} {rates[s].calls_s / rates[ref].calls_s:5.2f}x" for s, ref, short in pairs
            )
            print(line)
            # Who the CPU went to: a runtime that costs less a call is ahead only as far as the
            # callers (sharing the machine's cores) leave it room.
            for who, field in (("runtime", "server_us"), ("callers", "callers_us")):
                label = f"  {who} CPU per call, us"
                line = f"{label:<32}"
                line += "".join(f" | {e.name} {getattr(rates[e.name], field):8.0f}" for e in eps)
                line += "".join(
                    f" | {s}/{short} {getattr(rates[s], field) / getattr(rates[ref], field):5.2f}x"
                    for s, ref, short in pairs
                )
                print(line)
    for label, rss in (("RSS idle, MiB", rss_idle), (f"RSS at {n} pods, MiB", rss_now)):
        line = f"{label:<32}"
        line += "".join(f" | {e.name} {rss[e.name]:8.1f}" for e in eps)
        line += "".join(f" | {s}/{short} {rss[s] / rss[ref]:5.2f}x" for s, ref, short in pairs)
        print(line)


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", default="20,110", help="pod counts, ascending, comma-separated (20,110)")
    ap.add_argument(
        "--samples",
        type=int,
        default=3000,
        help="sequential calls per RPC and endpoint (3000): the p99 of 500 is the 5th slowest call, and "
        "each endpoint's own p99 moved 0.08-4.3x between its even and odd rounds; of 3000, 0.5-1.37x",
    )
    ap.add_argument(
        "--stats-samples",
        type=int,
        default=20,
        help="calls of ListContainerStats and ListPodSandboxStats per endpoint (20): containerd's "
        "ListPodSandboxStats takes seconds at 110 pods on a busy machine",
    )
    ap.add_argument(
        "--images",
        type=int,
        default=50,
        help="images each endpoint lists while measured (50; 0: as found), distinct ones of the "
        "test registry pulled through CRI and removed after, so that ListImages lists alike everywhere",
    )
    ap.add_argument("--block", type=int, default=10, help="calls per RPC and endpoint in one round (10)")
    ap.add_argument("--seconds", type=float, default=5, help="seconds of each throughput phase (5)")
    ap.add_argument(
        "--settle",
        type=float,
        default=60,
        help="after the pods are made, wait up to this long for the machine to be quiet (60 s; 0: not at all)",
    )
    ap.add_argument(
        "--quiet", type=float, default=0.2, help="quiet: the CPUs at most this busy over 2 s (0.2 = 20%%)"
    )
    ap.add_argument("--callers", type=int, default=8, help="concurrent callers for throughput (8)")
    ap.add_argument("--containerd", default=CONTAINERD_SOCK, help="containerd CRI socket path")
    ap.add_argument("--containerd-pid", type=int, default=0, help="containerd's pid (found if 0)")
    ap.add_argument(
        "--cri-dockerd",
        default="",
        metavar="SOCK",
        help="also cri-dockerd's CRI socket, on the same engine as the shims (its pid: the socket's owner)",
    )
    ap.add_argument("--seed", type=int, default=1, help="seed of the random pod/container choice (1)")
    ap.add_argument(
        "--unfiltered",
        action="store_true",
        help="List* calls without the run's label filter, as a kubelet sends them (then every endpoint "
        "also lists what others left on it)",
    )
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (shim logs) for inspection")
    args = ap.parse_args()
    sizes = sorted({int(x) for x in args.pods.split(",") if x.strip()})
    if not sizes or sizes[0] < 1:
        ap.error("--pods: positive counts, e.g. 20,110")

    run_id = uuid.uuid4().hex[:8]
    tmp = tempfile.mkdtemp(prefix="cri-shim-polled-", dir="/tmp")
    logs = f"{tmp}/pod-logs"
    os.makedirs(logs)
    cgroup_root = f"cri-shim-polled-{run_id}"
    shims: list[Shim] = []
    eps: list[Endpoint] = []
    imaged: list[Endpoint] = []  # endpoints the bench's images were pulled into
    failed = False
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        ctrd = Cri("containerd", args.containerd, run_id, logs)
        if not ctrd.answers():
            ctrd.close()
            print(f"nothing answers on unix://{args.containerd}", file=sys.stderr)
            return 1
        if args.containerd_pid:
            ctrd_pid, how = args.containerd_pid, "--containerd-pid"
        else:
            ctrd_pid, how = socket_owner(args.containerd)
        for transport in ("grpcio", "native"):
            os.makedirs(f"{tmp}/{transport}")
            # Own session: a Ctrl-C at the bench leaves the shim up to remove its pods.
            sm = Shim(f"{tmp}/{transport}", f"{run_id}-{transport}", own_session=True, transport=transport)
            shims.append(sm)
            c = Cri(transport, sm.sock, run_id, logs)
            eps.append(Endpoint(transport, c, sm.proc.pid, cgroup_root))
            try:
                c.wait_ready(60)
            except grpc.RpcError:
                print(
                    f"cri-shim ({transport}) did not answer; its log: {sm.tmp}/cri-shim.log", file=sys.stderr
                )
                args.keep_tmp = True
                raise
        eps.append(Endpoint("containerd", ctrd, ctrd_pid, cgroup_root))
        if args.cri_dockerd:
            crid = answering("cri-dockerd", args.cri_dockerd, run_id, logs)
            if crid is None:
                return 1
            eps.append(Endpoint("cri-dockerd", crid, socket_owner(args.cri_dockerd)[0], cgroup_root))
        ver = ctrd.rt.Version(pb.VersionRequest(), timeout=5)
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(
            f"run {run_id}, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}: {os.cpu_count()} CPUs, "
            f"load average {load}, python {sys.version.split()[0]}, "
            f"containerd-CRI {ver.runtime_name} {ver.runtime_version}"
        )
        for e in eps:
            print(f"  {e.name}: pid {e.pid} ({comm(e.pid)})")
        print(f"  containerd's pid from {how}")
        for e in eps:
            e.cri.pull()
        rss_idle = {e.name: rss_mib(e.pid) for e in eps}
        if args.images > 0:
            refs = registry_images(args.images)
            for e in eps:
                imaged.append(e)
                pulled = fill_images(e.cri, refs, args.images)
                print(f"{e.name}: {len(pulled)} images pulled, {image_count(e.cri)} listed", flush=True)
        seed = args.seed
        for n in sizes:
            for e in eps:
                took = e.fill(n)
                print(f"{e.name}: {n} pods in {took:.1f} s; {e.counts(args.unfiltered)}", flush=True)
            if args.settle > 0:
                waited, busy = wait_quiet(args.settle, args.quiet)
                print(f"settled {waited:.0f} s: the CPUs {busy:.0%} busy over the last 2 s", flush=True)
            lat = latency(eps, args.samples, args.stats_samples, args.block, seed, args.unfiltered)
            tput: dict[tuple[str, str, str], Rate] = {}
            for k, (op, how) in enumerate((op, how) for op in THROUGHPUT for how in CALLERS):
                order = eps[k % len(eps) :] + eps[: k % len(eps)]
                for e in order:
                    if how == "grpcio":
                        rate = throughput(e, op, args.callers, args.seconds, seed, args.unfiltered)
                    else:
                        rate = throughput_h2(
                            e, op, args.callers, args.seconds, seed, args.unfiltered, one_conn=how == "h2"
                        )
                    tput[(e.name, op, how)] = rate
            rss_now = {e.name: rss_mib(e.pid) for e in eps}
            print(f"load average now {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
            report(n, eps, lat, tput, rss_idle, rss_now, args)
            seed += 1
    except KeyboardInterrupt:
        failed = True
        print("interrupted; cleaning up", file=sys.stderr)
    except Exception:
        failed = True
        raise
    finally:
        for e in imaged:
            remove_bench_images(e.cri)
        for e in eps:
            e.cri.cleanup()
            e.cri.close()
        for sm in shims:
            sm.stop()
            sm.remove_engine_leftovers()
        remove_cgroups(cgroup_root)
        if args.keep_tmp:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
