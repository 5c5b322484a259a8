"""up, down and check: the cluster brought up in order, taken down leaving nothing, and what is left.

`up` order: PKI → the nodes' bridge and FORWARD chain → cgroup roots → etcd → kube-apiserver →
kube-controller-manager, kube-scheduler → RuntimeClasses → the cluster DNS (dnsserver.py, answering
the `kubernetes` Service's name) and its kube-dns Service → per node its cri-shim (or, with
``runtime="containerd"``, its containerd), then its kubelet →
kube-proxy → per CNI node: wait for the podCIDR the controller-manager allocates, see the node
NotReady (its runtime's network is not ready: no config yet), write the node's conflist with that
CIDR, wait for Ready. Every step is timed (state.json `timings`).

`down` order: kube-proxy (then ``kube-proxy --cleanup``) → kubelets (the three nodes' and the scale
mode's hollow ones, all signalled at once) → every pod and container removed through each node's
CRI (a shim that is not running is started again for it: its recovery finds what it left) → shims,
the hollow process (its pods are records in it, nothing on the host) → the cluster DNS → control
plane → etcd → the host's network, mounts, cgroups, log links, the inotify limit the scale mode
raised → the directories. Only the PIDs in the state file are signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from cri_api import api_pb2 as pb
from cri_api.api_pb2_grpc import RuntimeServiceStub
from tests.cni import realnet
from tests.e2e.cluster import configs, dnswire, hostnet, pki, procs
from tests.e2e.cluster.kubectl import Kubectl, condition, node_ready, wait_for
from tests.e2e.cluster.layout import (
    AGNHOST,
    ALL_NODES,
    BUSYBOX,
    BUSYBOX_FALLBACK,
    CLUSTER_DOMAIN,
    CONTAINERD,
    CONTROL_IP,
    CONTROLLER_MANAGER_PORT,
    DNS_PORT,
    E2E_IMAGES_LIST,
    ETCD_CLIENT_PORT,
    HOLLOW_KUBELET_PREFIX,
    HOLLOW_NAME,
    LOGS,
    NODE_BRIDGE,
    NODE_SETS,
    PAUSE_FALLBACK,
    PAUSE_IMAGE,
    PKI,
    PROXY_HEALTHZ_PORT,
    ROOT,
    RUN,
    RUNV_DRIVERS,
    RUNV_PATIENCE,
    RUNV_TAG,
    SCHEDULER_PORT,
    Binaries,
    HollowNode,
    NodeSpec,
    ports,
)
from tests.e2e.kubelet import host as kubelet_host
from tests.e2e.kubelet.config import REPO, runv_qemu_problem

Log = Callable[[str], None]


def _log(msg: str) -> None:
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------ can it run here
def _port_taken(port: int, address: str = "") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError:
            return True
    return False


def environment_problem(b: Binaries, runtime: str = "cri-shim", runv_driver: str = "stub") -> str | None:
    """Why the cluster cannot come up here now (a reason to skip), or None."""
    if os.geteuid() != 0:
        return "the cluster harness needs root"
    problem = b.problem()
    if problem:
        return problem
    if runv_driver not in RUNV_DRIVERS:
        return f"runv driver {runv_driver!r}: one of {', '.join(RUNV_DRIVERS)}"
    if runtime == "cri-shim" and runv_driver == "qemu":
        problem = runv_qemu_problem()
        if problem:
            return problem
    if runtime == "containerd":
        if not os.access(CONTAINERD, os.X_OK):
            return f"no containerd at {CONTAINERD} (scripts/testenv/containerd-up installs Debian's)"
    elif not Path("/var/run/docker.sock").exists():
        return "no Docker engine at /var/run/docker.sock (the docker node); run scripts/testenv/up"
    for tool in ("runc", "unshare", "ip", "iptables", "iptables-save", "openssl"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    why = realnet.why_not()
    if why:
        return why
    if procs.live():
        return f"a cluster of the harness is up ({', '.join(procs.live())}): run `down` first"
    busy = [f"{who} {port}" for who, port in ports().items() if _port_taken(port)]
    if busy:
        return f"ports in use: {', '.join(busy)}"
    return None


def ensure_etcd(b: Binaries, log: Log) -> None:
    """Debian's etcd-server, installed when missing (its service is not started: policy-rc.d or no
    init system here; the harness runs its own etcd)."""
    if os.access(b.etcd, os.X_OK):
        return
    log("installing Debian's etcd-server")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    proc = subprocess.run(
        ["apt-get", "install", "-y", "-q", "etcd-server"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0 or not os.access(b.etcd, os.X_OK):
        raise RuntimeError(f"apt-get install etcd-server failed: {proc.stderr.strip()[-500:]}")


def images() -> dict[str, str]:
    """The scenarios' images: the testenv's mirror of registry.k8s.io when it lists them."""
    listed = E2E_IMAGES_LIST.read_text().split() if E2E_IMAGES_LIST.exists() else []
    if AGNHOST in listed and BUSYBOX in listed and PAUSE_IMAGE in listed:
        return {"agnhost": AGNHOST, "busybox": BUSYBOX, "pause": PAUSE_IMAGE}
    return {"agnhost": "", "busybox": BUSYBOX_FALLBACK, "pause": PAUSE_FALLBACK}


# ------------------------------------------------------------ waits
def tls(client: str | None = None, verify: bool = True) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(PKI / "ca.crt"))
    if client:
        ctx.load_cert_chain(str(PKI / f"{client}.crt"), str(PKI / f"{client}.key"))
    if not verify:  # the components' self-signed serving certificates
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def get_ok(url: str, ctx: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5, context=ctx) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def wait_daemon(name: str, ready: Callable[[], bool], timeout: float) -> None:
    def probe() -> bool:
        code = procs.exited(name)
        if code is not None:
            raise RuntimeError(f"{name} exited ({code}): {tail(procs.log_path(name))}")
        return ready()

    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{name} not ready after {timeout:.0f} s: {tail(procs.log_path(name))}")
        time.sleep(0.5)


def tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def dns_answers() -> bool:
    """The cluster DNS has listed the API server: it knows the `kubernetes` Service."""
    try:
        m = dnswire.ask(
            CONTROL_IP, DNS_PORT, f"kubernetes.default.svc.{CLUSTER_DOMAIN}", dnswire.A, timeout=2
        )
    except (OSError, dnswire.WireError):
        return False
    return any(r.rtype == dnswire.A for r in m.answers)


def start_dns(k: Kubectl, timeout: float = 60) -> None:
    """The DNS server, then the kube-dns Service and EndpointSlice (kube-system may not exist yet)."""
    procs.start("cluster-dns", configs.dns_argv(), cwd=REPO)
    wait_daemon("cluster-dns", dns_answers, timeout)
    wait_for("the kube-dns Service", lambda: k.apply(*configs.kube_dns()) or True, timeout)


def shim_answers(n: NodeSpec | HollowNode) -> bool:
    if not n.socket.exists():
        return False
    with grpc.insecure_channel(f"unix://{n.socket}") as channel:
        try:
            RuntimeServiceStub(channel).Version(pb.VersionRequest(), timeout=3)
        except grpc.RpcError:
            return False
    return True


# ------------------------------------------------------------ starting the pieces
def _kubelet_binary(b: Binaries) -> str:
    """The kubelet under the name `kubelet`: the kubelet harness counts the machine's kubelets by
    it before it puts the kernel settings every kubelet changes back."""
    link = ROOT / "bin" / "kubelet"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        link.symlink_to(os.path.abspath(b.kubelet))
    return str(link)


def runv_driver() -> str:
    """The runv node's driver of the cluster that is (or was last) up: the state file says."""
    return str(procs.load().get("runv_driver") or "stub")


def patience(handler: str) -> float:
    """How many times longer than the stub's the node of `handler` may take to run a pod."""
    return RUNV_PATIENCE[runv_driver()] if handler == "runv" else 1.0


def start_shim(n: NodeSpec, timeout: float = 60) -> None:
    """The node's runtime: its cri-shim, or on a containerd node its containerd; waited for on its CRI.
    The runv node's shim runs the driver the state file names (a restart, `down`'s recovery: the same)."""
    n.dir.mkdir(parents=True, exist_ok=True)
    pause = images()["pause"]
    if n.runtime == "containerd":
        procs.start(n.runtime_proc, configs.containerd_argv(n, pause, CONTAINERD))
    else:
        procs.start(n.runtime_proc, configs.shim_argv(n, pause, runv_driver()), cwd=REPO)
    wait_daemon(n.runtime_proc, lambda: shim_answers(n), timeout * patience(n.handler))


def start_kubelet(n: NodeSpec, b: Binaries, timeout: float = 120) -> None:
    for d in (n.kubelet_root, n.pod_logs):
        d.mkdir(parents=True, exist_ok=True)
    procs.start(n.kubelet_proc, configs.kubelet_argv(n, _kubelet_binary(b)))
    url = f"http://127.0.0.1:{n.healthz_port}/healthz"
    wait_daemon(n.kubelet_proc, lambda: get_ok(url), timeout)


def restart_shim(n: NodeSpec, sig: int = signal.SIGKILL) -> str:
    """Stop the node's shim by `sig` (SIGKILL: no clean-up of its own) and start it again."""
    how = procs.stop(n.runtime_proc, grace=30, sig=sig)
    start_shim(n)
    return how


def restart_kubelet(n: NodeSpec, b: Binaries) -> str:
    how = procs.stop(n.kubelet_proc, grace=30)
    start_kubelet(n, b)
    return how


def nodes() -> tuple[NodeSpec, ...]:
    """The nodes of the cluster that is up: cri-shim's three, or the containerd comparison's."""
    return NODE_SETS[str(procs.load().get("runtime") or "cri-shim")]


def _bring_cni_node(k: Kubectl, n: NodeSpec, timeout: float) -> dict[str, Any]:
    """Wait for the node's podCIDR, see it NotReady, write its conflist, wait for Ready."""

    def allocated() -> dict[str, Any] | None:
        node = k.get("node", n.name)
        return node if node and node.get("spec", {}).get("podCIDR") else None

    node = wait_for(f"{n.name} podCIDR", allocated, timeout)
    cidr = node["spec"]["podCIDR"]

    def not_ready() -> dict[str, Any] | None:
        ready = condition(k.get("node", n.name) or {}, "Ready")
        return ready if ready is not None and ready.get("status") != "True" else None

    # Seen before the config is written: the kubelet reports the runtime's NetworkReady=false.
    before = wait_for(f"{n.name} NotReady for want of a network", not_ready, 60)
    written = time.time()
    configs.write_conflist(n, cidr)
    wait_for(f"{n.name} Ready", lambda: node_ready(k.get("node", n.name) or {}), timeout)
    after = condition(k.get("node", n.name), "Ready")
    return {"pod_cidr": cidr, "before": before, "written_at": written, "ready": after}


def start_control_plane(b: Binaries, mark: Log) -> None:
    """etcd, kube-apiserver, then kube-controller-manager and kube-scheduler, each waited for."""
    procs.start("etcd", configs.etcd_argv(b))
    etcd_ctx = tls("apiserver-etcd-client")
    wait_daemon("etcd", lambda: get_ok(f"https://127.0.0.1:{ETCD_CLIENT_PORT}/health", etcd_ctx), 60)
    mark("etcd")
    procs.start("kube-apiserver", configs.apiserver_argv(b))
    admin = tls("admin")
    wait_daemon("kube-apiserver", lambda: get_ok(f"https://{CONTROL_IP}:16443/readyz", admin), 180)
    mark("kube-apiserver")
    procs.start("kube-controller-manager", configs.controller_manager_argv(b))
    procs.start("kube-scheduler", configs.scheduler_argv(b))
    insecure = tls(verify=False)
    for name, port in (
        ("kube-controller-manager", CONTROLLER_MANAGER_PORT),
        ("kube-scheduler", SCHEDULER_PORT),
    ):
        wait_daemon(name, lambda port=port: get_ok(f"https://127.0.0.1:{port}/healthz", insecure), 120)
    mark("controller-manager and scheduler")


def up(
    b: Binaries,
    log: Log = _log,
    keep_on_failure: bool = False,
    runtime: str = "cri-shim",
    runv_driver: str = "stub",
) -> dict[str, Any]:
    """Bring the whole cluster up; on a failure take down what came up (unless `keep_on_failure`).
    `runtime` "containerd": the comparison, two nodes each on a containerd of its own. `runv_driver`
    "qemu": the runv node's pods are QEMU VMs (TCG here) instead of the stub's processes."""
    if runtime not in NODE_SETS:
        raise ValueError(f"runtime {runtime!r}: one of {', '.join(NODE_SETS)}")
    problem = environment_problem(b, runtime, runv_driver)
    if problem:
        raise RuntimeError(f"cannot bring the cluster up: {problem}")
    leftovers = check()
    if leftovers:
        raise RuntimeError("leftovers of an earlier cluster (run `down`):\n  " + "\n  ".join(leftovers))
    ensure_etcd(b, log)
    try:
        return _up(b, log, NODE_SETS[runtime], runtime, runv_driver)
    except BaseException:
        if keep_on_failure:
            log(f"bring-up failed: keeping what came up (logs in {LOGS}); `down` takes it away")
        else:
            log("bring-up failed: taking down what came up")
            down(b, log, keep_logs=True)
        raise


def _up(
    b: Binaries, log: Log, node_set: tuple[NodeSpec, ...], runtime: str, runv_driver: str
) -> dict[str, Any]:
    t0 = time.monotonic()
    timings: dict[str, float] = {}

    def mark(step: str) -> None:
        timings[step] = round(time.monotonic() - t0, 1)
        log(f"{step} ({timings[step]} s)")

    for d in (ROOT, RUN, LOGS):
        d.mkdir(parents=True, exist_ok=True)
    imgs = images()
    procs.update(
        runtime=runtime,
        runv_driver=runv_driver if runtime == "cri-shim" else None,
        started_at=time.time(),
        images=imgs,
        shared_cni_chains_before=hostnet.shared_cni_chains_exist(),
    )
    kubelet_host.save_sysctls()
    pki.make_all()
    mark("certificates")
    hostnet.make_node_bridge()
    hostnet.open_forward()
    hostnet.make_cgroup_roots(nodes=node_set)
    mark("host network and cgroup roots")

    start_control_plane(b, mark)
    k = Kubectl(b)
    classes = configs.runtime_classes(node_set, runv_driver)
    if classes:
        k.apply(*classes)
    start_dns(k)
    mark("cluster DNS")

    for n in node_set:
        start_shim(n)
    mark("cri-shims" if runtime == "cri-shim" else "containerds")
    for n in node_set:
        start_kubelet(n, b)
    mark("kubelets")
    procs.update(kube_proxy_started=True)  # down cleans its chains: ours, none other runs here
    procs.start("kube-proxy", configs.kube_proxy_argv(b, node_set[0].name))
    wait_daemon("kube-proxy", lambda: get_ok(f"http://127.0.0.1:{PROXY_HEALTHZ_PORT}/healthz"), 120)
    mark("kube-proxy")

    cni: dict[str, Any] = {}
    for n in node_set:
        if n.cni:
            cni[n.name] = _bring_cni_node(k, n, 240)
            mark(f"{n.name} Ready")
    for n in node_set:
        if not n.cni:
            wait_for(f"{n.name} Ready", lambda n=n: node_ready(k.get("node", n.name) or {}), 240)
            mark(f"{n.name} Ready")
    wait_for("the default ServiceAccount", lambda: k.get("serviceaccount", "default", "default"), 120)
    mark("up")
    procs.update(timings=timings, cni=cni, up_seconds=timings["up"])
    return procs.load()


# ------------------------------------------------------------ down
def _remove_runtime_objects(n: NodeSpec, log: Log) -> None:
    """Every container and sandbox of the node's shim, through the CRI (CNI DEL, pins, VMs)."""
    with grpc.insecure_channel(f"unix://{n.socket}") as channel:
        rt = RuntimeServiceStub(channel)
        try:
            for c in rt.ListContainers(pb.ListContainersRequest(), timeout=30).containers:
                rt.StopContainer(pb.StopContainerRequest(container_id=c.id, timeout=0), timeout=60)
                rt.RemoveContainer(pb.RemoveContainerRequest(container_id=c.id), timeout=60)
            sandboxes = rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=30).items
            for s in sandboxes:
                rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=s.id), timeout=120)
                rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=s.id), timeout=120)
            log(f"{n.name}: removed {len(sandboxes)} pod sandboxes through the CRI")
        except grpc.RpcError as exc:
            log(f"{n.name}: removing pods through the CRI failed: {exc.code()} {exc.details()}")


def _proxy_cleanup(b: Binaries, log: Log) -> None:
    """``kube-proxy --cleanup``: its chains and the jumps to them. Again while any is left (seen once:
    a restore that lost a race with another user of the tables, which this machine has)."""
    LOGS.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, 4):
        with open(procs.log_path("kube-proxy-cleanup"), "ab") as out:
            argv = [b.path("kube-proxy"), "--cleanup", "--v=2"]
            rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=120).returncode
        left = [line for line in hostnet.iptables_left() if "kube-proxy chain" in line]
        if not left:
            return
        log(f"kube-proxy --cleanup (attempt {attempt}, exit {rc}) left {len(left)} chains, e.g. {left[0]}")
        time.sleep(1)


def down(b: Binaries, log: Log = _log, keep_logs: bool = False) -> list[str]:
    """Take everything away; return what is left (`check`)."""
    data = procs.load()
    t0 = time.monotonic()
    if procs.record("kube-proxy") is not None:
        log(procs.stop("kube-proxy"))
    if data.get("kube_proxy_started") and b.bin_dir and os.access(b.path("kube-proxy"), os.X_OK):
        _proxy_cleanup(b, log)
    kubelets = [n.kubelet_proc for n in ALL_NODES] + [
        name for name in data["procs"] if name.startswith(HOLLOW_KUBELET_PREFIX)
    ]
    for line in procs.stop_all([k for k in kubelets if procs.record(k) is not None], grace=30):
        log(line)
    for n in ALL_NODES:
        name = n.runtime_proc
        if not procs.alive(name) and n.state_dir.exists():
            with contextlib.suppress(RuntimeError):
                procs.stop(name)
                start_shim(n)  # its recovery finds what the last one left
        if procs.alive(name):
            _remove_runtime_objects(n, log)
        if procs.record(name) is not None:
            log(procs.stop(name, grace=30))
    # The hollow nodes' pods are records of the fake in the process: nothing of them is on the host.
    if procs.record(HOLLOW_NAME) is not None:
        log(procs.stop(HOLLOW_NAME, grace=30))
    for name in ("cluster-dns", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
        if procs.record(name) is not None:
            log(procs.stop(name))
    for name in list(procs.load()["procs"]):  # anything else the harness started
        log(procs.stop(name))
    # What the daemons started and left running once they stopped: runv qemu's VMs (QEMU outlives
    # the shim by design, and so does its virtiofsd or 9p proxy) when a pod could not be removed
    # through the CRI. Each names a path of the cluster's on its command line (its state directory
    # under RUN); stopped by PID while it is the process seen.
    for line in procs.stop_mentioning(ROOT, RUN, grace=10):
        log(f"left by a daemon: {line}")
    hostnet.remove_docker_containers()
    hostnet.close_forward()
    hostnet.remove_cni(bool(data.get("shared_cni_chains_before", True)))
    kubelet_host.remove_runv_network(RUNV_TAG)
    if hostnet.link_exists(NODE_BRIDGE):
        hostnet.run("ip", "link", "del", NODE_BRIDGE, check=False)
    hostnet.unmount_all(ROOT, RUN)
    hostnet.remove_cgroups()
    for link in hostnet.container_log_links():
        link.unlink(missing_ok=True)
    kubelet_host.restore_sysctls()
    hostnet.restore_inotify_instances(data.get("inotify_instances"))
    if keep_logs and LOGS.is_dir():
        kept = Path(f"/tmp/cri-shim-cluster-logs.{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.copytree(LOGS, kept)
        (kept / "state.json").write_text(json.dumps(data, indent=2) + "\n")
        log(f"logs kept in {kept}")
    if not hostnet.mounts_under(ROOT, RUN):  # never remove through a mount that stayed
        shutil.rmtree(ROOT, ignore_errors=True)
        shutil.rmtree(RUN, ignore_errors=True)
    left = check()
    log(f"down in {time.monotonic() - t0:.1f} s; left: {len(left)}")
    return left


def is_up() -> bool:
    """Every daemon of a finished bring-up still runs (the state file says which)."""
    data = procs.load()
    return "up_seconds" in data and bool(data["procs"]) and all(procs.alive(name) for name in data["procs"])


def state() -> dict[str, Any]:
    return procs.load()


# ------------------------------------------------------------ check
def check() -> list[str]:
    """What is left of the cluster on this machine, each named; empty when nothing is."""
    out = [f"process {p}" for p in procs.live()]
    ours = {p.split("pid ")[1].rstrip(")") for p in procs.live()}
    out += [f"process {p}" for p in procs.mentioning(ROOT, RUN) if p.split()[1].rstrip(":") not in ours]
    out += hostnet.links_left()
    out += hostnet.iptables_left()
    out += [f"mount {m}" for m in hostnet.mounts_under(ROOT, RUN)]
    out += [f"cgroup {d}" for d in hostnet.cgroup_dirs()]
    out += [f"docker container {c}" for c in hostnet.docker_containers()]
    out += [f"log link {link}" for link in hostnet.container_log_links()]
    out += [f"directory {d}" for d in (ROOT, RUN) if d.exists()]
    return list(dict.fromkeys(out))
