"""A kubelet starting many pods at once: how long until all of them run, side by side in one run.

For each target it starts a standalone kubelet v1.26 (the tests/e2e/kubelet harness's
set-up: own root, ports, config) on a runtime of its own, waits until the node
is idle (and, for warm runv, until the pool holds its VMs), then drops N static
pod manifests (busybox `sleep 3600`, one container each) into its staticPodPath
at once and polls the runtime over CRI until N containers are RUNNING. It prints,
per target, the time from the drop to the first and to the last pod running and
the p50 in between, and the kubelet's own view of the burst from its /metrics:
`kubelet_pod_start_duration_seconds` (from the kubelet first seeing a pod to its
running) and `kubelet_pleg_relist_duration_seconds` (each PLEG relist: the
runtime's List and Status calls), read just before the drop and again 5 s after
the last pod ran, so that only the burst's observations count (p50/p90/p99
interpolated in the histogram's buckets as Prometheus' histogram_quantile does,
count and mean), and the CPU time spent from the drop until the last pod ran: the
machine's, and by program, the target's cri-shim apart (each process with its reaped
children). Targets:

- `runv-warm`: cri-shim, runv handler, a pool of N warm VMs (`--warm`, default N);
- `runv`: cri-shim, runv handler, every VM booted cold;
- `docker-warm`: cri-shim, docker handler, a pool of N warm pause containers; only
  host-network pods can take one, so use it with `--host-network`;
- `docker`: cri-shim, docker handler;
- `containerd`: containerd's CRI plugin (runc), when its socket answers
  (`sudo scripts/testenv/containerd-up`);
- `cri-dockerd`: cri-dockerd on the same engine as the docker targets, given its
  socket (`--cri-dockerd SOCK`; bench/README says how to run it here).

Figures only: nothing is asserted. Everything is removed at the end (the
harness deletes the manifests, waits for the kubelet, removes leftovers).

Run as root, with scripts/testenv/up's registry and a kubelet binary
(CRI_SHIM_KUBELET or `kubelet` on PATH; ../shared/testenv/TOOLS.md builds one):
    .venv/bin/python bench/kubelet_burst.py [-n 50] [--targets runv-warm,runv,docker,containerd]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import grpc  # noqa: E402
from endpoints import machine_ticks  # noqa: E402

from cri_api import api_pb2 as pb  # noqa: E402
from tests.e2e import kubelet as kh  # noqa: E402

CONTAINERD_SOCK = "/run/containerd-cri/containerd.sock"
TARGETS = ("runv-warm", "runv", "docker-warm", "docker", "containerd", "cri-dockerd")
# The targets that are a runtime already running on a socket of its own: no shim is started.
PEERS = ("containerd", "cri-dockerd")
LABEL = "cri-shim-burst"


def burst_pods(n: int, tag: str, host_network: bool = False) -> dict[str, dict[str, Any]]:
    out = {}
    for i in range(n):
        name = f"burst{i:03d}"
        out[name] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": kh.NAMESPACE, "labels": {LABEL: tag}},
            "spec": {
                "restartPolicy": "Always",
                "hostNetwork": host_network,
                "terminationGracePeriodSeconds": 2,
                "containers": [
                    {
                        "name": "app",
                        "image": kh.BUSYBOX,
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["sleep", "3600"],
                    }
                ],
            },
        }
    return out


class Burst(kh.Harness):
    """The harness's kubelet and runtime, with burst pods dropped in at once instead of its checks."""

    def __init__(
        self, target: str, n: int, warm: int, peer_socket: str, host_network: bool = False, cni: bool = False
    ) -> None:
        """``peer_socket``: the runtime's socket when ``target`` is one of PEERS; ``cni``: the
        shim's pods on a CNI bridge network (the harness's), as a cluster's are."""
        handler = (
            "docker"
            if target in PEERS
            else {"runv-warm": "runv", "docker-warm": "docker"}.get(target, target)
        )
        super().__init__(
            handler,
            node=f"burst-{target}",
            warm=warm if target.endswith("-warm") else 0,
            cni=cni and target not in PEERS,
        )
        self.target = target
        self.pods = burst_pods(n, self.tag, host_network)
        if target in PEERS:
            self.socket = Path(peer_socket)

    def start_shim(self) -> None:
        if self.target not in PEERS:
            super().start_shim()

    def _remove_leftovers(self) -> None:
        if self.target not in PEERS:
            super()._remove_leftovers()
            return
        # A peer runtime is shared with other benchmarks: only this run's pods go.
        rt = self.cri()
        try:
            for s in rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=10).items:
                if s.labels.get(LABEL) == self.tag:
                    rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=s.id), timeout=60)
                    rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=s.id), timeout=60)
        except grpc.RpcError as exc:
            self.log(f"removing leftovers failed: {exc.code()} {exc.details()}")

    def start_idle(self, settle: float) -> None:
        """Runtime and kubelet up, no pod yet; then ``settle`` s for the node (and a pool) to fill."""
        self.manifest_dir.mkdir()
        self.hostdir.mkdir()
        self.start_shim()
        try:
            self._start_kubelet()
        except RuntimeError as exc:
            if "address already in use" not in str(exc):
                raise
            # The ports were free when picked, not when the kubelet bound them: new ones.
            self.procs.pop("kubelet", None)
            self.port, self.healthz_port = kh.free_port(), kh.free_port()
            self._start_kubelet()
        time.sleep(settle)

    def _held(self) -> int:
        """Warm items ready: runv VMs (their cgroups, named w...) or docker pause containers."""
        if self.target == "docker-warm":
            import docker

            from backends.docker import labels as lbl

            api = docker.APIClient(base_url="unix:///var/run/docker.sock", version="auto", timeout=30)
            try:
                return len(
                    api.containers(filters={"label": f"{lbl.KIND}={lbl.WARM}", "name": "crishim_WARM_"})
                )
            finally:
                api.close()
        from backends.linux.cgroups import Cgroup

        parent = Cgroup(f"cri-shim-runv-e2e-{self.tag}").dirs()[0]
        try:
            return sum(1 for d in os.listdir(parent) if d.startswith("w"))
        except OSError:
            return 0

    def wait_pool(self, n: int, timeout: float) -> int:
        """Until the pool holds ``n`` warm items; how many it has."""
        deadline = time.monotonic() + timeout
        while True:
            warm = self._held()
            if warm >= n or time.monotonic() > deadline:
                return warm
            time.sleep(0.5)

    def running(self) -> set[str]:
        """Names of the pods whose app container is RUNNING."""
        rows = (
            self.cri()
            .ListContainers(
                pb.ListContainersRequest(
                    filter=pb.ContainerFilter(state=pb.ContainerStateValue(state=pb.CONTAINER_RUNNING))
                ),
                timeout=10,
            )
            .containers
        )
        return {c.labels.get("io.kubernetes.pod.name", "") for c in rows if c.metadata.name == "app"}

    def drop(self, timeout: float) -> dict[str, float]:
        """Write every manifest at once; seconds from then until each pod ran (missing: never did)."""
        staged = self.dir / "staged"
        staged.mkdir()
        for name, pod in self.pods.items():
            (staged / f"{name}.yaml").write_text(json.dumps(pod))
        t0 = time.monotonic()
        for name in self.pods:  # renames: each manifest appears whole
            os.rename(staged / f"{name}.yaml", self.manifest_dir / f"{name}.yaml")
        seen: dict[str, float] = {}
        wanted = {self.full(n) for n in self.pods}
        while len(seen) < len(wanted) and time.monotonic() - t0 < timeout:
            now = time.monotonic() - t0
            for running in self.running():
                if running in wanted and running not in seen:
                    seen[running] = now
            time.sleep(0.05)
        return seen


HISTOGRAMS = ("kubelet_pod_start_duration_seconds", "kubelet_pleg_relist_duration_seconds")
# One bucket line of the Prometheus text format: name_bucket{...le="0.5"...} 12
_BUCKET = re.compile(r'^(\w+)_bucket\{[^}]*le="([^"]+)"[^}]*\}\s+(\S+)')
_TOTAL = re.compile(r"^(\w+)_(sum|count)(?:\{[^}]*\})?\s+(\S+)")

# A histogram: its cumulative bucket counts by upper bound, its sum and count.
Histogram = tuple[dict[float, float], float, float]

TICK = os.sysconf("SC_CLK_TCK")


def process_ticks() -> dict[tuple[int, int], tuple[str, int, int]]:
    """Each process as (pid, start time) -> (comm, its own CPU jiffies, its reaped children's)."""
    out: dict[tuple[int, int], tuple[str, int, int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1 : raw.rindex(")")]
        rest = raw[raw.rindex(")") + 2 :].split()
        # rest[0] is field 3 (state): utime..cstime are fields 14-17, starttime 22.
        own = int(rest[11]) + int(rest[12])
        out[(int(name), int(rest[19]))] = (comm, own, int(rest[13]) + int(rest[14]))
    return out


class CpuUse:
    """CPU seconds spent during a window: the machine's, and by program (comm), the runtime's shim
    apart (its own, and its reaped children's).

    A process counts its own time and its reaped children's (runc under a containerd shim, CNI
    plugins under cri-shim); a process that started and ended inside the window without a
    surviving parent to reap it is not seen."""

    def __init__(self, shim_pid: int | None) -> None:
        self.shim_pid = shim_pid
        self.busy0, self.all0 = machine_ticks()
        self.procs0 = process_ticks()
        self.t0 = time.monotonic()

    def stop(self) -> None:
        self.busy1, self.all1 = machine_ticks()
        self.procs1 = process_ticks()
        self.wall = time.monotonic() - self.t0

    def by_program(self) -> dict[str, float]:
        spent: dict[str, float] = {}
        for key, (comm, own, children) in self.procs1.items():
            own0, children0 = (self.procs0[key][1:]) if key in self.procs0 else (0, 0)
            if key[0] == self.shim_pid:  # its own time, and its children's (CNI plugins, helpers)
                parts = [("cri-shim", own - own0), ("cri-shim's children", children - children0)]
            else:
                parts = [(comm, own + children - own0 - children0)]
            for label, used in parts:
                if used > 0:
                    spent[label] = spent.get(label, 0.0) + used / TICK
        return spent

    def summary(self, top: int = 5) -> str:
        busy = (self.busy1 - self.busy0) / TICK
        cores = os.cpu_count() or 1
        spent = sorted(self.by_program().items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"{name} {secs:.1f}" for name, secs in spent[:top])
        return (
            f"{busy:.1f} CPU-s busy of {self.wall * cores:.1f} ({busy / (self.wall * cores):.0%}); "
            f"most: {shown}"
        )


def histograms(text: str, names: tuple[str, ...] = HISTOGRAMS) -> dict[str, Histogram]:
    """The named histograms of a /metrics page (label sets of one name added together)."""
    out: dict[str, Histogram] = {}
    for line in text.splitlines():
        m = _BUCKET.match(line)
        if m and m.group(1) in names:
            buckets, s, c = out.setdefault(m.group(1), ({}, 0.0, 0.0))
            le = math.inf if m.group(2) == "+Inf" else float(m.group(2))
            buckets[le] = buckets.get(le, 0.0) + float(m.group(3))
            continue
        m = _TOTAL.match(line)
        if m and m.group(1) in names:
            buckets, s, c = out.setdefault(m.group(1), ({}, 0.0, 0.0))
            value = float(m.group(3))
            out[m.group(1)] = (buckets, s + value, c) if m.group(2) == "sum" else (buckets, s, c + value)
    return out


def minus(after: Histogram, before: Histogram | None) -> Histogram:
    """The observations made between two readings of one histogram."""
    if before is None:
        return after
    buckets = {le: n - before[0].get(le, 0.0) for le, n in after[0].items()}
    return buckets, after[1] - before[1], after[2] - before[2]


def quantile(h: Histogram, q: float) -> float:
    """histogram_quantile: linear within the bucket holding the q-th observation."""
    buckets = sorted(h[0].items())
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower  # past the last bound: its lower edge, as Prometheus does
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 0.0)
        lower, below = le, count
    return lower


def kubelet_version() -> str:
    try:
        out = subprocess.run([kh.kubelet_binary(), "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or "kubelet (version unknown)"
    except (OSError, subprocess.SubprocessError):
        return "kubelet (version unknown)"


class Outcome:
    """One target's burst: seconds to each pod running, and the kubelet's histograms of it."""

    def __init__(self, seen: dict[str, float], metrics: dict[str, Histogram], cpu: CpuUse) -> None:
        self.seen = seen
        self.metrics = metrics
        self.cpu = cpu


def read_histograms(b: Burst) -> dict[str, Histogram]:
    try:
        return histograms(b.api_ok("GET", "/metrics", timeout=20).decode(errors="replace"))
    except (kh.CheckFailed, OSError) as exc:
        print(f"{b.target}: /metrics unreadable: {exc}", flush=True)
        return {}


def measure(
    target: str,
    n: int,
    warm: int,
    peer_socket: str,
    settle: float,
    timeout: float,
    host_network: bool,
    cni: bool,
) -> Outcome | str:
    b = Burst(target, n, warm, peer_socket, host_network, cni)
    try:
        if target in PEERS and not os.path.exists(peer_socket):
            how = "sudo scripts/testenv/containerd-up" if target == "containerd" else "--cri-dockerd SOCK"
            return f"skipped: nothing answers on unix://{peer_socket} ({how})"
        b.start_idle(settle)
        if b.warm:
            held = b.wait_pool(b.warm, 120)
            print(f"{target}: {held} warm items ready before the drop", flush=True)
        before = read_histograms(b)
        shim = b.procs.get("cri-shim")
        cpu = CpuUse(shim.pid if shim is not None else None)
        seen = b.drop(timeout)
        cpu.stop()
        time.sleep(5.0)  # the kubelet's status manager observes a start after the runtime reports it
        after = read_histograms(b)
        return Outcome(seen, {name: minus(h, before.get(name)) for name, h in after.items()}, cpu)
    finally:
        b.stop()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--pods", type=int, default=50, help="pods dropped at once (50)")
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    ap.add_argument(
        "--warm", type=int, default=None, help="warm items of the -warm targets (default: as many as pods)"
    )
    ap.add_argument("--host-network", action="store_true", help="the pods share the host's network")
    ap.add_argument(
        "--cni",
        action="store_true",
        help="cri-shim's pods on a CNI bridge network (pod_network = cni), as containerd's are; "
        "default: each backend's builtin network",
    )
    ap.add_argument("--containerd", default=CONTAINERD_SOCK, help="containerd CRI socket")
    ap.add_argument(
        "--cri-dockerd", default="", metavar="SOCK", help="cri-dockerd's CRI socket (target cri-dockerd)"
    )
    ap.add_argument("--settle", type=float, default=10.0, help="idle seconds before the drop (10)")
    ap.add_argument("--timeout", type=float, default=180.0, help="give up on a burst after this long (180 s)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (kubelet, namespaces, the engine's socket)", file=sys.stderr)
        return 2
    warm = args.pods if args.warm is None else args.warm
    targets = [t for t in args.targets.split(",") if t]
    peer_socket = {"containerd": args.containerd, "cri-dockerd": args.cri_dockerd}
    unknown = set(targets) - set(TARGETS)
    if unknown:
        print(f"unknown targets {sorted(unknown)}", file=sys.stderr)
        return 2
    kind = "host-network " if args.host_network else "CNI-networked " if args.cni else ""
    print(
        f"{args.pods} {kind}static pods dropped at once into a standalone {kubelet_version()}; "
        f"{os.cpu_count()} CPUs; load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    results: dict[str, Outcome | str] = {}
    for target in targets:
        results[target] = measure(
            target,
            args.pods,
            warm,
            peer_socket.get(target, ""),
            args.settle,
            args.timeout,
            args.host_network,
            args.cni,
        )
        res = results[target]
        if not isinstance(res, str):
            print(
                f"{target}: {len(res.seen)}/{args.pods} running, "
                f"the last after {max(res.seen.values(), default=0):.1f} s; "
                f"from the drop until then {res.cpu.summary()}",
                flush=True,
            )
    print()
    head = f"{'target':<12} | {'all running':>11} | {'first':>7} | {'p50':>7} | {'running':>8}"
    print(head)
    print("-" * len(head))
    for target, res in results.items():
        if isinstance(res, str):
            print(f"{target:<12} | {res}")
            continue
        times = sorted(res.seen.values())
        last = f"{times[-1]:.1f} s" if len(times) == args.pods else "never"
        print(
            f"{target:<12} | {last:>11} | {pct(times, 0.0):6.1f}s | {pct(times, 0.5):6.1f}s | "
            f"{len(times):>4}/{args.pods}"
        )
    print()
    print(
        "The kubelet's histograms of the burst (observations between the drop and 5 s after the last pod ran):"
    )
    head = f"{'target':<12} | {'histogram':<38} | {'count':>6} | {'mean':>8} | {'p50':>8} | {'p90':>8} | {'p99':>8}"
    print(head)
    print("-" * len(head))
    for target, res in results.items():
        if isinstance(res, str):
            continue
        for name in HISTOGRAMS:
            h = res.metrics.get(name)
            if h is None:
                print(f"{target:<12} | {name:<38} | not exposed")
                continue
            mean = h[1] / h[2] if h[2] else math.nan
            qs = " | ".join(f"{quantile(h, q):7.3f}s" for q in (0.5, 0.9, 0.99))
            print(f"{target:<12} | {name:<38} | {h[2]:>6.0f} | {mean:7.3f}s | {qs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
