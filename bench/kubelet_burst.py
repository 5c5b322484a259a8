"""A kubelet starting many pods at once: how long until all of them run, side by side in one run.

For each target it starts a standalone kubelet v1.26 (the tests/e2e/kubelet harness's
set-up: own root, ports, config) on a runtime of its own, waits until the node
is idle (and, for warm runv, until the pool holds its VMs), then drops N static
pod manifests (busybox `sleep 3600`, one container each) into its staticPodPath
at once and polls the runtime over CRI until N containers are RUNNING. It prints,
per target, the time from the drop to the first and to the last pod running and
the p50 in between. Targets:

- `runv-warm`: cri-shim, runv handler, a pool of N warm VMs (`--warm`, default N);
- `runv`: cri-shim, runv handler, every VM booted cold;
- `docker-warm`: cri-shim, docker handler, a pool of N warm pause containers; only
  host-network pods can take one, so use it with `--host-network`;
- `docker`: cri-shim, docker handler;
- `containerd`: containerd's CRI plugin (runc), when its socket answers
  (`sudo scripts/testenv/containerd-up`).

Figures only: nothing is asserted. Everything is removed at the end (the
harness deletes the manifests, waits for the kubelet, removes leftovers).

Run as root, with scripts/testenv/up's registry and a kubelet binary
(CRI_SHIM_KUBELET or `kubelet` on PATH; ../shared/testenv/TOOLS.md builds one):
    .venv/bin/python bench/kubelet_burst.py [-n 50] [--targets runv-warm,runv,docker,containerd]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpc  # noqa: E402

from cri_api import api_pb2 as pb  # noqa: E402
from tests.e2e import kubelet as kh  # noqa: E402

CONTAINERD_SOCK = "/run/containerd-cri/containerd.sock"
TARGETS = ("runv-warm", "runv", "docker-warm", "docker", "containerd")
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

    def __init__(self, target: str, n: int, warm: int, containerd: str, host_network: bool = False) -> None:
        handler = {"runv-warm": "runv", "docker-warm": "docker", "containerd": "docker"}.get(target, target)
        super().__init__(handler, node=f"burst-{target}", warm=warm if target.endswith("-warm") else 0)
        self.target = target
        self.containerd = containerd
        self.pods = burst_pods(n, self.tag, host_network)
        if target == "containerd":
            self.socket = Path(containerd)

    def _start_shim(self) -> None:
        if self.target != "containerd":
            super()._start_shim()

    def _remove_leftovers(self) -> None:
        if self.target != "containerd":
            super()._remove_leftovers()
            return
        # containerd is shared with other benchmarks: only this run's pods go.
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
        self._start_shim()
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
            for pod in self.running():
                if pod in wanted and pod not in seen:
                    seen[pod] = now
            time.sleep(0.05)
        return seen


def measure(
    target: str, n: int, warm: int, containerd: str, settle: float, timeout: float, host_network: bool
) -> dict[str, float] | str:
    b = Burst(target, n, warm, containerd, host_network)
    try:
        if target == "containerd" and not os.path.exists(containerd):
            return f"skipped: nothing answers on unix://{containerd} (sudo scripts/testenv/containerd-up)"
        b.start_idle(settle)
        if b.warm:
            held = b.wait_pool(b.warm, 120)
            print(f"{target}: {held} warm items ready before the drop", flush=True)
        return b.drop(timeout)
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
    ap.add_argument("--containerd", default=CONTAINERD_SOCK, help="containerd CRI socket")
    ap.add_argument("--settle", type=float, default=10.0, help="idle seconds before the drop (10)")
    ap.add_argument("--timeout", type=float, default=180.0, help="give up on a burst after this long (180 s)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (kubelet, namespaces, the engine's socket)", file=sys.stderr)
        return 2
    warm = args.pods if args.warm is None else args.warm
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        print(f"unknown targets {sorted(unknown)}", file=sys.stderr)
        return 2
    kind = "host-network " if args.host_network else ""
    print(
        f"{args.pods} {kind}static pods dropped at once into a standalone kubelet v1.26; {os.cpu_count()} CPUs"
    )
    results: dict[str, dict[str, float] | str] = {}
    for target in targets:
        results[target] = measure(
            target, args.pods, warm, args.containerd, args.settle, args.timeout, args.host_network
        )
        res = results[target]
        if not isinstance(res, str):
            print(
                f"{target}: {len(res)}/{args.pods} running, the last after {max(res.values(), default=0):.1f} s"
            )
    print()
    head = f"{'target':<12} | {'all running':>11} | {'first':>7} | {'p50':>7} | {'running':>8}"
    print(head)
    print("-" * len(head))
    for target, res in results.items():
        if isinstance(res, str):
            print(f"{target:<12} | {res}")
            continue
        times = sorted(res.values())
        last = f"{times[-1]:.1f} s" if len(times) == args.pods else "never"
        print(
            f"{target:<12} | {last:>11} | {pct(times, 0.0):6.1f}s | {pct(times, 0.5):6.1f}s | "
            f"{len(times):>4}/{args.pods}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
