"""Benchmark of the runv handler (one VM per pod), with docker alongside.

``--qemu N`` adds the qemu driver's boot, start and memory figures beside the stub's (real VMs,
under TCG where KVM does not work).

In one run it measures
- in-process, on a ``RunvBackend`` at the default sizing (1 vCPU / 128 MiB a
  pod, node capacity 16 vCPU per host CPU and MemTotal):
  VM boot latency (the driver's ``create``: cgroup, ``unshare``, the agent
  up), RunPodSandbox of the backend (boot + agent hello + network + setup),
  pod + container start, the memory of an idle VM (its cgroup's usage: agent
  plus one sleeping container, and agent alone), and the pod density reached
  before RESOURCE_EXHAUSTED (pods are booted until the node refuses one);
- through gRPC, against one ``cri-shim serve`` child process configured with
  runv handlers and a docker handler: RunPodSandbox + CreateContainer +
  StartContainer with ``runtime_handler`` "runv" (cold VMs cloned from the
  stub's VM template), "runv-untemplated" (cold VMs booted by unshare and a new
  interpreter, ``template = false``), "runv-warm" (a pool), "docker" and, when
  its socket answers, containerd's CRI plugin, alternating, so machine noise
  (this machine is shared) falls on all alike; then the idle cost of the warm
  pool and of the template processes.

It prints p50/p90 per step and the ratio runv/docker. Figures only: nothing is
asserted. Everything it creates (pods, VMs, cgroups, run directories, the
bridge and its iptables rules, engine containers) is removed at the end, also
on failure or Ctrl-C.

Run as root (namespaces, cgroups, runc, the engine's socket), with the
registry of scripts/testenv/up holding the images:
    .venv/bin/python bench/runv_bench.py [-n 10] [--vms 5] [--density-max 256]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from backends import contract  # noqa: E402
from backends.linux import procfs  # noqa: E402
from backends.linux.cgroups import Cgroup  # noqa: E402
from backends.runv.backend import RunvBackend  # noqa: E402
from backends.runv.hypervisor import MIB, VM, VMSpec  # noqa: E402
from backends.runv.network import BridgeNetwork  # noqa: E402
from cri_api import api_pb2 as pb  # noqa: E402
from shim.cri.container_io import ContainerIO  # noqa: E402
from shim.cri.errors import ResourceExhaustedError  # noqa: E402

# The same child-process pattern, images and percentile as the docker benchmark.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from endpoints import (  # noqa: E402
    BUSYBOX,
    CONTAINERD_SOCK,
    Cri,
    Samples,
    Shim,
    _interrupt,
    clock,
    pct,
    pod_sandbox_config,
)

STEPS = ["RunPodSandbox", "CreateContainer", "StartContainer", "total"]
WARM = "runv-warm"
UNTEMPLATED = "runv-untemplated"  # every VM booted by unshare and a new interpreter ([stub] template = false)
POOL_SIZE = 2
HANDLERS = ("runv", UNTEMPLATED, WARM, "docker")


def ms(seconds: list[float]) -> list[float]:
    return [s * 1000 for s in seconds]


# ---------------------------------------------------------------- in-process runv backend


class _Events:
    """EventSink: this benchmark only lets containers sleep, so nothing needs recording."""

    def sandbox_not_ready(self, sandbox_id: str, reason: str) -> None:
        print(f"  pod {sandbox_id[:12]} not ready: {reason}", file=sys.stderr)


def _sandbox(name: str) -> contract.SandboxRecord:
    cfg = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, uid=f"{name}-uid", namespace="runv-bench"),
        hostname=name,
    )
    return contract.SandboxRecord(
        id=uuid.uuid4().hex + uuid.uuid4().hex,
        handler="runv",
        backend="runv",
        config=cfg,
        created_at=time.time_ns(),
    )


def _container(sb: contract.SandboxRecord) -> contract.ContainerRecord:
    cfg = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name="app"),
        image=pb.ImageSpec(image=BUSYBOX),
        command=["sleep", "3600"],
    )
    return contract.ContainerRecord(
        id=uuid.uuid4().hex + uuid.uuid4().hex,
        sandbox_id=sb.id,
        backend="runv",
        config=cfg,
        created_at=time.time_ns(),
        log_path="",
    )


def network_config(tmp: str, run_id: str, subnet: str) -> dict[str, Any]:
    """A bridge, subnet, chain and IPAM directory of this run only (shared by both runv backends)."""
    return {
        "bridge": f"rvb{run_id}",
        "subnet": subnet,
        "ipam_dir": f"{tmp}/ipam",
        "hostport_chain": f"CRISHIM-B-{run_id}",
    }


def runv_config(tmp: str, tag: str, net: dict[str, Any]) -> dict[str, Any]:
    # run_dir is short and under /tmp: agent socket paths must fit in sun_path.
    # No capacity here: the node's defaults are what the density figure is about.
    return {
        "root": f"{tmp}/{tag}-root",
        "run_dir": f"/tmp/rvb-{tag}",
        "agent_timeout": 10.0,
        "network": net,
        "stub": {"cgroup_parent": f"cri-shim-bench-{tag}"},
    }


def qemu_config(tmp: str, tag: str, net: dict[str, Any], guest_dir: str) -> dict[str, Any]:
    cfg = runv_config(tmp, tag, net)
    cfg["driver"] = "qemu"
    cfg["agent_timeout"] = 60.0
    cfg["qemu"] = {
        "cgroup_parent": cfg["stub"]["cgroup_parent"],
        **({"guest_dir": guest_dir} if guest_dir else {}),
    }
    return cfg


async def in_process(cfg: dict[str, Any], vms: int, density_max: int) -> dict[str, float]:
    """Boot, start and memory figures of one driver; the density run too unless ``density_max`` is 0."""
    backend = RunvBackend("runv", cfg)
    figures: dict[str, float] = {}
    await backend.lifecycle.start(_Events())
    followed = ContainerIO(lambda _cid, _info: None)
    boots: list[float] = []
    # The driver's create alone, apart from what run_sandbox adds around it.
    create: Callable[[VMSpec], Awaitable[VM]] = backend.hv.create

    async def timed_create(spec: VMSpec) -> VM:
        t0 = time.perf_counter()
        vm = await create(spec)
        boots.append(time.perf_counter() - t0)
        return vm

    backend.hv.create = timed_create  # type: ignore[method-assign]
    run_sb: list[float] = []
    starts: list[float] = []
    pods: list[contract.SandboxRecord] = []
    try:
        t0 = time.perf_counter()
        await backend.images.pull_image(pb.ImageSpec(image=BUSYBOX), None, None)
        print(f"runv image store: pulled {BUSYBOX} in {time.perf_counter() - t0:.1f} s")
        # One untimed pod first (first-use costs: imports, bridge, chain).
        warm = _sandbox("warm")
        await backend.lifecycle.run_sandbox(warm)
        await backend.lifecycle.remove_sandbox(warm)
        boots.clear()
        for i in range(vms):
            sb = _sandbox(f"b{i}")
            t0 = time.perf_counter()
            await backend.lifecycle.run_sandbox(sb)
            pods.append(sb)
            t1 = time.perf_counter()
            ct = _container(sb)
            await backend.lifecycle.create_container(ct, sb)
            started = await backend.lifecycle.start_container(ct, sb)
            followed.follow(ct.id, started.process, None)  # as the shim does; `sleep` writes nothing
            t2 = time.perf_counter()
            run_sb.append(t1 - t0)
            starts.append(t2 - t0)
        await asyncio.sleep(2.0)  # let the agents and containers settle to idle
        mems = [backend.hv.usage(backend._shared.pods[sb.id].vm)[1] for sb in pods]
        driver = backend.hv.name
        if driver == "qemu":  # what the boots used, known once they are done
            driver += f" ({backend.hv.accel})"  # type: ignore[attr-defined]
        print(f"\nIn-process RunvBackend, {driver} driver, default sizing (n={vms}), ms")
        for label, key, v in (
            ("VM boot (driver create)", "boot", ms(boots)),
            ("RunPodSandbox (backend)", "run", ms(run_sb)),
            ("pod+container start", "start", ms(starts)),
        ):
            print(
                f"  {label:<26} p50 {pct(v, 0.5):8.1f}   p90 {pct(v, 0.9):8.1f}   "
                f"p99 {pct(v, 0.99):8.1f}   max {max(v):8.1f}"
            )
            figures[key] = pct(v, 0.5)
        mean = sum(mems) / len(mems)
        figures["memory"] = mean
        print(
            f"  memory per idle VM (its cgroup's usage, VM + agent + one sleeping container): "
            f"mean {mean / MIB:.1f} MiB, min {min(mems) / MIB:.1f}, max {max(mems) / MIB:.1f}"
        )
        _, total_c, _, total_m = backend.hv.capacity()
        if density_max <= 0:
            per_pod = backend.hv.capacity()[2] / len(pods)
            print(
                f"  pods per node: {int(min(total_c, total_m // per_pod))} by reservation "
                f"({per_pod / MIB:.0f} MiB each of {total_m // MIB} MiB, {total_c} vCPUs), "
                f"{int(total_m // mean)} by measured idle memory (not booted: each VM costs CPU under TCG)"
            )
            return figures

        # Density: boot sandbox-only pods at the default size until the node refuses one.
        refused = ""
        t0 = time.perf_counter()
        while len(pods) < density_max:
            sb = _sandbox(f"d{len(pods)}")
            try:
                await backend.lifecycle.run_sandbox(sb)
            except ResourceExhaustedError as exc:
                refused = str(exc)
                break
            pods.append(sb)
        took = time.perf_counter() - t0
        await asyncio.sleep(2.0)
        bare = [backend.hv.usage(backend._shared.pods[sb.id].vm)[1] for sb in pods[vms:]]
        used_c, _, used_m, _ = backend.hv.capacity()
        print(
            f"  node capacity {total_c} vCPU / {total_m // MIB} MiB; a pod without limits: 1 vCPU / 128 MiB"
        )
        if refused:
            print(
                f"  density: {len(pods)} pods running, pod {len(pods) + 1} got RESOURCE_EXHAUSTED ({refused})"
            )
        else:
            print(f"  density: stopped at --density-max {density_max} pods without RESOURCE_EXHAUSTED")
        print(
            f"  reserved at that point: {used_c} vCPU / {used_m // MIB} MiB; "
            f"{len(pods) - vms} extra pods booted in {took:.1f} s"
        )
        if bare:
            print(
                f"  memory per idle VM without containers (agent only): mean {sum(bare) / len(bare) / MIB:.1f} MiB"
            )
        return figures
    finally:
        for sb in pods:
            try:
                await backend.lifecycle.remove_sandbox(sb)
            except Exception as exc:
                print(f"  cleanup: {sb.id[:12]}: {exc!r}", file=sys.stderr)
        await backend.lifecycle.close()


# ---------------------------------------------------------------- cri-shim child with both handlers


class DualShim(Shim):
    """`cri-shim serve` with runv handlers (one per config: cold, warm) and docker, on a temporary socket."""

    def __init__(self, tmp: str, run_id: str, runv: dict[str, dict[str, Any]]) -> None:
        text = ""
        for handler, cfg in runv.items():
            net, stub = cfg["network"], cfg["stub"]
            text += (
                f"\n[handlers.{handler}]\n"
                'type = "runv"\n'
                f'root = "{cfg["root"]}"\n'
                f'run_dir = "{cfg["run_dir"]}"\n'
                f"agent_timeout = {cfg['agent_timeout']}\n"
                f"\n[handlers.{handler}.stub]\n"
                f'cgroup_parent = "{stub["cgroup_parent"]}"\n'
                + ("" if stub.get("template", True) else "template = false\n")
                + f"\n[handlers.{handler}.network]\n"
                + "".join(f'{k} = "{v}"\n' for k, v in net.items())
            )
            if cfg.get("pool"):
                text += f"\n[handlers.{handler}.pool]\n" + "".join(
                    f"{k} = {v}\n" for k, v in cfg["pool"].items()
                )
        # Its own session: the shim must stay up until it has removed the pods,
        # or their VMs would outlive it.
        super().__init__(tmp, run_id, extra_config=text, own_session=True)


class Client(Cri):
    """endpoints.Cri (socket, stubs, pod bookkeeping, cleanup), per handler."""

    def __init__(self, sock: str, run_id: str, log_dir: str) -> None:
        super().__init__("cri-shim", sock, run_id, log_dir)

    def pull_for(self, handler: str) -> float:
        """Pull the app image for `handler` unless it has it; seconds taken."""
        spec = pb.ImageSpec(image=BUSYBOX, runtime_handler=handler)
        t0 = time.perf_counter()
        if not self.im.ImageStatus(pb.ImageStatusRequest(image=spec), timeout=60).HasField("image"):
            self.im.PullImage(pb.PullImageRequest(image=spec), timeout=300)
        return time.perf_counter() - t0

    def start_pod(self, handler: str, samples: Samples) -> None:
        self.seq += 1
        name = f"bench-{handler}-{self.seq}"
        sc = pod_sandbox_config(
            name,
            f"cri-shim-bench-{self.run_id}",
            f"{self.run_id}-{self.seq}",
            os.path.join(self.log_dir, name),
            {"cri-shim-bench": self.run_id},
        )
        cc = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name="app"),
            image=pb.ImageSpec(image=BUSYBOX),
            command=["sleep", "3600"],
            log_path="app.log",
        )
        t0 = time.perf_counter()
        with clock(samples, "RunPodSandbox"):
            resp = self.rt.RunPodSandbox(
                pb.RunPodSandboxRequest(config=sc, runtime_handler=handler), timeout=120
            )
        pod = str(resp.pod_sandbox_id)
        self.pods.add(pod)
        self.last_pod = pod
        with clock(samples, "CreateContainer"):
            req = pb.CreateContainerRequest(pod_sandbox_id=pod, config=cc, sandbox_config=sc)
            cid = self.rt.CreateContainer(req, timeout=120).container_id
        with clock(samples, "StartContainer"):
            self.rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
        samples.setdefault("total", []).append((time.perf_counter() - t0) * 1000)


def containerd_pod(ctrd: Cri, samples: Samples) -> None:
    """The same pod + container start on containerd's CRI plugin (runc), for scale."""
    sc = ctrd.pod_config()
    t0 = time.perf_counter()
    with clock(samples, "RunPodSandbox"):
        pod = ctrd.run_pod(sc)
    with clock(samples, "CreateContainer"):
        cid = ctrd.create(pod, sc, "app")
    with clock(samples, "StartContainer"):
        ctrd.rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=120)
    samples.setdefault("total", []).append((time.perf_counter() - t0) * 1000)


def was_warm(client: Client, pod: str) -> bool:
    """Whether the pod got a warm VM (the shim's verbose status shows the backend's data)."""
    resp = client.rt.PodSandboxStatus(
        pb.PodSandboxStatusRequest(pod_sandbox_id=pod, verbose=True), timeout=30
    )
    return bool(json.loads(resp.info.get("info", "{}")).get("backend_data", {}).get("warm"))


def _memory_and_ticks(pids: list[int]) -> tuple[int, int, int]:
    """PSS (shared pages split), RSS and CPU ticks of ``pids`` together."""
    pss = rss = ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{pid}/smaps_rollup") as fh:
                for line in fh:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
                    elif line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return pss, rss, ticks


def pool_idle_cost(cgroup_parent: str, seconds: float = 10.0) -> None:
    """RSS and CPU of the warm VMs' processes (agents) while nothing happens."""
    pids = sorted(set(Cgroup(cgroup_parent).pids()))  # v1: each controller lists them
    _, _, t0 = _memory_and_ticks(pids)
    time.sleep(seconds)
    pids = sorted(set(Cgroup(cgroup_parent).pids()))
    pss, _, t1 = _memory_and_ticks(pids)
    hz = os.sysconf("SC_CLK_TCK")
    cpu_pct = (t1 - t0) / hz / seconds * 100
    print(
        f"idle cost of the pool ({POOL_SIZE} warm VMs, {len(pids)} processes): PSS {pss / MIB:.1f} MiB "
        f"({pss / MIB / POOL_SIZE:.1f} MiB a VM), "
        f"CPU {cpu_pct:.2f} % of one core over {seconds:g} s"
    )


def template_idle_cost(shim_pid: int, seconds: float = 10.0) -> None:
    """Memory and CPU of the shim's VM template processes (one per templated handler) at rest."""
    pids = []
    for pid in procfs.children(shim_pid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as fh:
            if b"backends.runv.drivers.template_server" in fh.read():
                pids.append(pid)
    if not pids:
        print("idle cost of the VM template: no template process found")
        return
    _, _, t0 = _memory_and_ticks(pids)
    time.sleep(seconds)
    pss, rss, t1 = _memory_and_ticks(pids)
    cpu_pct = (t1 - t0) / os.sysconf("SC_CLK_TCK") / seconds * 100
    print(
        f"idle cost of the VM template ({len(pids)} processes, one per templated handler): "
        f"PSS {pss / MIB / len(pids):.1f} MiB, RSS {rss / MIB / len(pids):.1f} MiB each, "
        f"CPU {cpu_pct:.2f} % of one core over {seconds:g} s"
    )


def side_by_side(client: Client, n: int, ctrd: Cri | None, refill_wait: float) -> None:
    for h in HANDLERS:
        print(f"{h}: image ready in {client.pull_for(h):.1f} s")
    if ctrd is not None:
        ctrd.pull()
    first: Samples = {}
    for h in HANDLERS:  # one untimed pod each (first-use costs)
        client.start_pod(h, first)
    client.cleanup()
    if ctrd is not None:
        containerd_pod(ctrd, first)
        ctrd.cleanup()
    names = [*HANDLERS, *(["containerd"] if ctrd is not None else [])]
    res: dict[str, Samples] = {h: {} for h in names}
    warm_hits = 0
    for i in range(n):
        time.sleep(refill_wait)  # the warm handler's pool refills between rounds, as on an idle node
        # Alternate who goes first as well, in case the order itself matters.
        for h in names if i % 2 == 0 else names[::-1]:
            if h == "containerd":
                assert ctrd is not None
                containerd_pod(ctrd, res[h])
                continue
            client.pull_for(h)  # the engine is shared: someone may have removed the image
            client.start_pod(h, res[h])
            if h == WARM:
                warm_hits += was_warm(client, client.last_pod)
        # Pods are removed as we go, so that the n-th pod does not start beside n-1 others.
        client.cleanup()
        if ctrd is not None:
            ctrd.cleanup()
    print(
        f"\nPod + container start through gRPC, ms (n={n}; {WARM}: a pool of {POOL_SIZE} warm VMs, "
        f"{warm_hits}/{n} pods got one; runv: cold boots from the VM template; "
        f"{UNTEMPLATED}: cold boots by unshare)"
    )
    head = f"{'step':<16} |" + "".join(f" {h + ' p50':>15} {'p99':>8} |" for h in names)
    print(head)
    print("-" * len(head))
    for step in STEPS:
        row = f"{step:<16} |"
        for h in names:
            v = res[h].get(step, [])
            row += f" {pct(v, 0.5):15.1f} {pct(v, 0.99):8.1f} |"
        print(row)
    rsb = {h: pct(res[h].get("RunPodSandbox", []), 0.5) for h in names}
    print(
        f"RunPodSandbox p50, warm/cold runv: {rsb[WARM] / rsb['runv']:.2f}x; "
        f"cold runv templated/untemplated: {rsb['runv'] / rsb[UNTEMPLATED]:.2f}x",
        end="",
    )
    if ctrd is not None:
        print(
            f"; templated runv/containerd: {rsb['runv'] / rsb['containerd']:.2f}x"
            f"; warm runv/containerd: {rsb[WARM] / rsb['containerd']:.2f}x",
            end="",
        )
    print()


# ---------------------------------------------------------------- cleanup and main


def remove_leftovers(cfgs: list[dict[str, Any]]) -> None:
    """What a crash may leave behind: VM processes (ours) in our cgroups, cgroups, run dirs, the bridge."""
    for cfg in cfgs:
        cg = Cgroup(cfg["stub"]["cgroup_parent"])
        pids = cg.pids()
        if pids:
            print(f"  killing {len(pids)} leftover VM processes of {cg.rel}", file=sys.stderr)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if pids:
            time.sleep(0.5)
        cg.remove()
        for d in cg.all_dirs():
            with contextlib.suppress(OSError):
                os.rmdir(d)
        shutil.rmtree(cfg["run_dir"], ignore_errors=True)
    asyncio.run(BridgeNetwork(cfgs[0]["network"]).remove_bridge())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--iterations", type=int, default=10, help="pods per handler, runv vs docker (10)")
    ap.add_argument(
        "--vms", type=int, default=5, help="pods for the in-process boot/start/memory figures (5)"
    )
    ap.add_argument(
        "--density-max", type=int, default=256, help="stop the density run here at the latest (256)"
    )
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (shim log) for inspection")
    ap.add_argument("--containerd", default=CONTAINERD_SOCK, help="containerd CRI socket, when it answers")
    ap.add_argument(
        "--refill-wait",
        type=float,
        default=1.5,
        help="seconds between rounds, for the warm pool to refill (1.5)",
    )
    ap.add_argument(
        "--in-process", action=argparse.BooleanOptionalAction, default=True, help="boot/density part"
    )
    ap.add_argument(
        "--qemu",
        type=int,
        default=0,
        metavar="N",
        help="also boot N VMs with the qemu driver, beside the stub's figures (0: off)",
    )
    ap.add_argument("--guest-dir", default="", help="the qemu driver's guest image (default: the driver's)")
    ap.add_argument("--side-by-side", action=argparse.BooleanOptionalAction, default=True, help="gRPC part")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("run as root (namespaces, cgroups, runc, the engine's socket)", file=sys.stderr)
        return 2

    run_id = uuid.uuid4().hex[:8]
    tmp = tempfile.mkdtemp(prefix="cri-shim-rvbench-", dir="/tmp")
    os.makedirs(f"{tmp}/pod-logs")
    net = network_config(tmp, run_id, f"10.95.{random.randrange(256)}.0/24")
    local = runv_config(tmp, f"{run_id}a", net)
    child = runv_config(tmp, f"{run_id}b", net)
    warm = runv_config(tmp, f"{run_id}c", net)
    warm["pool"] = {"size": POOL_SIZE, "max_cpu": 0}
    untemplated = runv_config(tmp, f"{run_id}u", net)
    untemplated["stub"]["template"] = False
    shim: DualShim | None = None
    ctrd: Cri | None = None
    client: Client | None = None
    failed = False
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        print(f"run {run_id}: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, bridge {net['bridge']}")
        if args.in_process:
            stub = asyncio.run(in_process(local, args.vms, args.density_max))
            if args.qemu:
                qemu = asyncio.run(
                    in_process(qemu_config(tmp, f"{run_id}q", net, args.guest_dir), args.qemu, 0)
                )
                print(
                    "\nqemu / stub, p50: "
                    + ", ".join(f"{k} {qemu[k] / stub[k]:.1f}x" for k in qemu if stub.get(k))
                )
        if not args.side_by_side:
            return 0

        print()
        shim = DualShim(tmp, run_id, {"runv": child, UNTEMPLATED: untemplated, WARM: warm})
        client = Client(shim.sock, run_id, f"{tmp}/pod-logs")
        try:
            client.wait_ready(60)
        except grpc.RpcError:
            print(f"cri-shim did not answer on {shim.sock}; its log: {tmp}/cri-shim.log", file=sys.stderr)
            args.keep_tmp = True
            raise
        ctrd = Cri("containerd", args.containerd, run_id, f"{tmp}/pod-logs")
        if not ctrd.answers():
            print(f"containerd-CRI: skipped, nothing answers on unix://{args.containerd}")
            ctrd = None
        side_by_side(client, args.iterations, ctrd, args.refill_wait)
        time.sleep(args.refill_wait)
        pool_idle_cost(warm["stub"]["cgroup_parent"])
        template_idle_cost(shim.proc.pid)
    except KeyboardInterrupt:
        failed = True
        print("interrupted; cleaning up", file=sys.stderr)
    except Exception:
        failed = True
        raise
    finally:
        if client is not None:
            client.cleanup()
            client.channel.close()
        if ctrd is not None:
            ctrd.cleanup()
            ctrd.channel.close()
        if shim is not None:
            shim.stop()
            shim.remove_engine_leftovers()
        remove_leftovers([local, child, untemplated, warm, qemu_config(tmp, f"{run_id}q", net, "")])
        if args.keep_tmp:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
