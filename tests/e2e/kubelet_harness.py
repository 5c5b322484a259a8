"""A real kubelet (v1.26, standalone) against a private cri-shim: end-to-end checks.

The harness starts a cri-shim of its own (own socket, state directory and, for
runv, its own bridge, iptables chain and cgroup parent) and a standalone
kubelet pointed at it: no kubeconfig, so the kubelet runs the static pods of
a directory the harness fills. A standalone kubelet kills every pod of its
runtime that it did not create, hence the private shim.

Two groups of checks, each a function of the harness returning a `Result`:

- static pods (``pod-*``): what the kubelet makes of its pods through the CRI,
  read from its ``/pods`` API (which shows static pods' statuses) and, for
  teardown, from the shim's own CRI;
- the kubelet's HTTPS API (``api-*``): pods, running pods, logs, ExecSync,
  exec and port-forward over WebSocket (proxied by the kubelet to the shim's
  streaming server), stats.

Run as root:  .venv/bin/python -m tests.e2e.kubelet_harness --handler runv [--keep]
Prints a table check -> pass/fail with a reason, the kubelet's error lines
(klog level E, grouped and counted) and the shim's error events; exits 1 when
a check failed. ``CRI_SHIM_KUBELET`` names the kubelet binary (default: the
``kubelet`` on PATH); ../shared/testenv/TOOLS.md says how to build v1.26.1.

The kubelet sets vm.overcommit_memory=1, vm.panic_on_oom=0, kernel.panic=10
and kernel.panic_on_oops=1 when it starts (protectKernelDefaults=false; with
true it refuses to start on a host where they differ). The harness records the
host's values (in SYSCTLS_SAVED, once for overlapping runs) and the run that
stops while no other kubelet runs puts them back.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect
from websockets.typing import Subprotocol

from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
DEFAULT_KUBELET = "kubelet"  # looked up on PATH
BUSYBOX = "127.0.0.1:5000/busybox:1.36"
PAUSE = "127.0.0.1:5000/pause:3.10"
NAMESPACE = "default"
HANDLERS = ("fake", "docker", "runv")
SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops")
# The host's values before the first of (possibly concurrent) harness runs;
# the run that stops while no other kubelet runs puts them back.
SYSCTLS_SAVED = Path("/run/cri-shim-kubelet-harness.sysctls.json")
# Waiting reasons of a container on its way up; any other one is an error.
STARTING = {"", "ContainerCreating", "PodInitializing"}
RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2}) ")
KLOG_ERROR = re.compile(r"^E\d{4} \d{2}:\d{2}:\d{2}\.\d+\s+\d+ (?P<msg>.*)$")
PORT_FORWARD_PORT = 8080


def kubelet_binary() -> str:
    name = os.environ.get("CRI_SHIM_KUBELET") or DEFAULT_KUBELET
    return shutil.which(name) or name


def environment_problem(handler: str) -> str | None:
    """Why the harness cannot run here (a reason to skip), or None."""
    if os.geteuid() != 0:
        return "the kubelet harness needs root"
    kubelet = kubelet_binary()
    if not os.access(kubelet, os.X_OK):
        return f"no kubelet binary at {kubelet} (set CRI_SHIM_KUBELET)"
    try:
        with urllib.request.urlopen("http://127.0.0.1:5000/v2/_catalog", timeout=3) as resp:
            repos = json.load(resp).get("repositories") or []
    except (OSError, ValueError) as exc:
        return f"no local registry on 127.0.0.1:5000 ({exc}); run scripts/testenv/up"
    if not {"busybox", "pause"} <= set(repos):
        return f"the local registry lacks busybox or pause (has {repos}); run scripts/testenv/up"
    if handler == "docker" and not os.path.exists("/var/run/docker.sock"):
        return "no Docker engine at /var/run/docker.sock; run scripts/testenv/up"
    if handler == "runv":
        for tool in ("runc", "unshare", "ip", "iptables"):
            if shutil.which(tool) is None:
                return f"runv needs {tool}"
    return None


# ---------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class Result:
    ok: bool
    reason: str


class CheckFailed(Exception):
    """Raised by a check (or its helpers) to fail with a reason."""


def passed(reason: str) -> Result:
    return Result(True, reason)


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    group: str  # "pod" or "api"
    number: int
    fn: Callable[[Harness], Result]
    timeout: float
    doc: str


CHECKS: list[Check] = []


@dataclasses.dataclass
class Teardown:
    """The `gone` pod's removal, watched from the CRI by a thread of its own."""

    before: tuple[list[str], list[str]]  # sandboxes, containers before the manifest went
    started: float
    left: tuple[list[str], list[str]] = ([], [])
    stopped_after: float | None = None
    removed_after: float | None = None
    error: str = ""
    thread: threading.Thread | None = None


def check(group: str, number: int, timeout: float = 30.0) -> Callable[[Callable[[Harness], Result]], Any]:
    def register(fn: Callable[[Harness], Result]) -> Callable[[Harness], Result]:
        name = fn.__name__.removeprefix("check_").replace("_", "-")
        doc = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else name
        CHECKS.append(Check(f"{group}-{name}", group, number, fn, timeout, doc))
        return fn

    return register


# ---------------------------------------------------------------------- pods


def _container(name: str, command: list[str], **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": BUSYBOX, "imagePullPolicy": "IfNotPresent", "command": command, **extra}


def _sh(script: str) -> list[str]:
    return ["sh", "-c", script]


def manifests(hostdir: str) -> dict[str, dict[str, Any]]:
    """The static pods, by short name (the kubelet names them NAME-NODE).

    Commands stick to what the fake backend's built-in shell runs (echo,
    sleep, exit, cat, `sh -c "a; b"`) where a check on fake relies on them.
    """
    pods: dict[str, dict[str, Any]] = {
        "net": {"containers": [_container("main", _sh("echo line-one; echo line-two; sleep 3600"))]},
        "hostnet": {"hostNetwork": True, "containers": [_container("main", ["sleep", "3600"])]},
        "init": {
            "initContainers": [
                _container(
                    "init",
                    _sh("echo init-done > /data/marker"),
                    volumeMounts=[{"name": "data", "mountPath": "/data"}],
                )
            ],
            "containers": [
                _container(
                    "app",
                    _sh("cat /data/marker; sleep 3600"),
                    volumeMounts=[{"name": "data", "mountPath": "/data"}],
                )
            ],
            "volumes": [{"name": "data", "emptyDir": {}}],
        },
        "crash": {"containers": [_container("main", _sh("echo crashing; exit 3"))]},
        "etchosts": {"containers": [_container("main", _sh("cat /etc/hosts; sleep 3600"))]},
        "termmsg": {
            "restartPolicy": "Never",
            "containers": [_container("main", _sh("printf bye-from-termlog > /dev/termination-log; exit 0"))],
        },
        "hostpath": {
            "containers": [
                _container(
                    "main",
                    _sh("cat /host/hello.txt; sleep 3600"),
                    volumeMounts=[{"name": "host", "mountPath": "/host", "readOnly": True}],
                )
            ],
            "volumes": [{"name": "host", "hostPath": {"path": hostdir, "type": "Directory"}}],
        },
        "two": {
            "containers": [
                _container("sleeper", ["sleep", "3600"]),
                _container(
                    "echo",
                    ["nc", "-ll", "-p", str(PORT_FORWARD_PORT), "-e", "cat"],
                    ports=[{"containerPort": PORT_FORWARD_PORT, "protocol": "TCP"}],
                ),
            ]
        },
        "gone": {"containers": [_container("main", ["sleep", "3600"])]},
    }
    out = {}
    for name, spec in pods.items():
        spec.setdefault("restartPolicy", "Always")
        # sleep as PID 1 ignores SIGTERM: keep the kill (and teardown) short.
        spec["terminationGracePeriodSeconds"] = 2
        out[name] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"e2e": "kubelet-harness"}},
            "spec": spec,
        }
    return out


# ---------------------------------------------------------------------- harness


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kubelet_config(h: Harness) -> str:
    # JSON is YAML: the kubelet reads either.
    cfg = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": "127.0.0.1",
        "port": h.port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": h.healthz_port,
        "staticPodPath": str(h.manifest_dir),
        "fileCheckFrequency": "2s",
        "syncFrequency": "10s",
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        "authentication": {
            "anonymous": {"enabled": True},
            "webhook": {"enabled": False},
            "x509": {},
        },
        "authorization": {"mode": "AlwaysAllow"},
        # No kubepods cgroup hierarchy: the runtime places pods itself.
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "protectKernelDefaults": False,
        # Stays true (the default): false also drops cAdvisor's disk metrics,
        # and /stats/summary then fails ("failed to get rootFs info").
        "localStorageCapacityIsolation": True,
        # root lacks CAP_SYS_RESOURCE here: a negative oom_score_adj fails.
        "oomScoreAdj": 0,
        # Leave the host's iptables alone.
        "makeIPTablesUtilChains": False,
        "serializeImagePulls": False,
        # A busy shared disk must not evict or garbage-collect the test images.
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "resolvConf": "/etc/resolv.conf",
    }
    path = h.dir / "kubelet.yaml"
    path.write_text(json.dumps(cfg, indent=2))
    return str(path)


def _shim_config(h: Harness) -> str:
    lines = [
        "[server]",
        f'transport = "{h.transport}"',
        "[images]",
        f'pause_image = "{PAUSE}"',
        "[streaming]",
        'address = "127.0.0.1"',
        "[logging]",
        'level = "info"',
    ]
    if h.handler == "runv":
        tag = h.tag
        lines += [
            "[handlers.runv]",
            'type = "runv"',
            f'root = "{h.dir}/runv"',
            f'run_dir = "{h.dir}/rv"',  # short: agent socket paths must fit in sun_path
            "[handlers.runv.network]",
            f'bridge = "rvk{tag}"',
            f'subnet = "10.94.{h.subnet_octet}.0/24"',
            f'ipam_dir = "{h.dir}/ipam"',
            f'hostport_chain = "CRISHIM-K-{tag}"',
            "[handlers.runv.stub]",
            f'cgroup_parent = "cri-shim-runv-e2e-{tag}"',
        ]
        if h.driver == "qemu":
            lines.insert(lines.index('type = "runv"') + 1, 'driver = "qemu"')
            lines += ["[handlers.runv.qemu]", f'cgroup_parent = "cri-shim-runv-e2e-{tag}"']
            if h.guest_dir:
                lines.append(f'guest_dir = "{h.guest_dir}"')
        if h.warm:
            lines += ["[handlers.runv.pool]", f"size = {h.warm}"]
    elif h.handler == "docker" and h.warm:
        # Warm pause containers serve the host-network pods (backends/docker/warm.py).
        lines += ["[handlers.docker]", 'type = "docker"', "[handlers.docker.pool]", f"size = {h.warm}"]
    path = h.dir / "cri-shim.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _shim_command() -> list[str]:
    exe = REPO / ".venv" / "bin" / "cri-shim"
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-c", "import sys; from shim.cli import main; sys.exit(main())"]


def _save_sysctls() -> None:
    if SYSCTLS_SAVED.exists() or _other_kubelets():
        return  # saved by a run still going on, or already changed by a kubelet
    values = {}
    for name in SYSCTLS:
        with contextlib.suppress(OSError):
            values[name] = Path("/proc/sys", name).read_text().strip()
    SYSCTLS_SAVED.write_text(json.dumps(values))


def _other_kubelets() -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv0 = (d / "cmdline").read_bytes().split(b"\0")[0]
            if os.path.basename(argv0) == b"kubelet":
                pids.append(int(d.name))
    return pids


class Harness:
    """A private cri-shim and a standalone kubelet on it, with the static pods of `manifests`."""

    def __init__(
        self,
        handler: str,
        *,
        kubelet: str | None = None,
        keep: bool = False,
        node: str | None = None,
        log: Callable[[str], None] | None = None,
        warm: int = 0,
        driver: str = "stub",
        guest_dir: str = "",
        transport: str = "grpcio",
        hollow: int = 0,
    ) -> None:
        self.handler = handler
        self.transport = transport  # the shim's [server] transport
        self.hollow = hollow  # fake: serve this many hollow nodes; the kubelet runs on the last
        self.warm = warm  # runv: warm VMs; docker: warm pause containers (0: every pod starts cold)
        self.driver = driver  # runv: "stub" or "qemu" (real VMs; slow under TCG)
        self.guest_dir = guest_dir
        self.kubelet_bin = kubelet or kubelet_binary()
        self.keep = keep
        self.node = node or f"e2e-{handler}"
        self.log = log or (lambda msg: print(f"[harness] {msg}", file=sys.stderr, flush=True))
        self.tag = f"{random.randrange(16**4):04x}"
        self.subnet_octet = random.randrange(256)
        self.dir = Path(tempfile.mkdtemp(prefix="k-", dir="/tmp"))
        self.socket = self.dir / (f"n-{hollow - 1}.sock" if hollow else "cri.sock")
        self.manifest_dir = self.dir / "manifests"
        self.hostdir = self.dir / "hostdir"
        self.host_token = f"from-host-{self.tag}"
        self.port = _free_port()
        self.healthz_port = _free_port()
        self.shim_log = self.dir / "shim.log"
        self.kubelet_log = self.dir / "kubelet.log"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._files: list[Any] = []
        self._channel: grpc.Channel | None = None
        self._ssl = ssl.create_default_context()
        self._ssl.check_hostname = False
        self._ssl.verify_mode = ssl.CERT_NONE
        self.pods = manifests(str(self.hostdir))
        self.teardown: Teardown | None = None
        # Scales the waits of the checks: a VM under emulation takes seconds where the stub takes ms.
        self.patience = 6.0 if driver == "qemu" else 1.0
        self.pod_uids: set[str] = set()  # seen in /pods: whose /var/log entries are ours
        self.kubelet_error_counts: collections.Counter[str] | None = None
        self.shim_error_counts: collections.Counter[str] | None = None

    # ------------------------------------------------------------ names
    def full(self, pod: str) -> str:
        return f"{pod}-{self.node}"

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> Harness:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, settle_timeout: float = 90.0) -> None:
        self.log(f"work dir {self.dir}, node {self.node}, kubelet port {self.port}")
        self.manifest_dir.mkdir()
        self.hostdir.mkdir()
        (self.hostdir / "hello.txt").write_text(self.host_token + "\n")
        self._start_shim()
        for name, pod in self.pods.items():
            (self.manifest_dir / f"{name}.yaml").write_text(json.dumps(pod, indent=2))
        self._start_kubelet()
        self.settle(settle_timeout)

    def _spawn(self, name: str, argv: list[str], logfile: Path) -> subprocess.Popen[bytes]:
        out = open(logfile, "ab")  # closed in stop()
        self._files.append(out)
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=str(REPO)
        )
        self.procs[name] = proc
        self.log(f"started {name} (pid {proc.pid}), log {logfile}")
        return proc

    def _start_shim(self) -> None:
        argv = [
            *_shim_command(),
            "serve",
            "--config",
            _shim_config(self),
            "--listen",
            f"unix://{self.socket}",
            "--state-dir",
            str(self.dir / "state"),
            "--default-handler",
            self.handler,
        ]
        if self.hollow:
            # One process, many nodes: the kubelet's node is the last, the others idle beside it.
            argv = [
                *_shim_command(),
                "hollow",
                "--nodes",
                str(self.hollow),
                "--config",
                _shim_config(self),
                "--socket-template",
                str(self.dir / "n-{i}.sock"),
                "--state-root",
                str(self.dir / "state"),
                "--transport",
                self.transport,
            ]
        proc = self._spawn("cri-shim", argv, self.shim_log)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"cri-shim exited ({proc.returncode}):\n{self._tail(self.shim_log)}")
            if self.socket.exists():
                try:
                    self.cri().Version(pb.VersionRequest(), timeout=2)
                    return
                except grpc.RpcError:
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"cri-shim did not answer within 30 s:\n{self._tail(self.shim_log)}")

    def _start_kubelet(self) -> None:
        if not os.access(self.kubelet_bin, os.X_OK):
            raise RuntimeError(f"no kubelet binary at {self.kubelet_bin}")
        _save_sysctls()
        argv = [
            self.kubelet_bin,
            f"--config={_kubelet_config(self)}",
            f"--root-dir={self.dir / 'kubelet'}",
            f"--container-runtime-endpoint=unix://{self.socket}",
            f"--hostname-override={self.node}",
            f"--pod-infra-container-image={PAUSE}",
            "--v=2",
        ]
        proc = self._spawn("kubelet", argv, self.kubelet_log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"kubelet exited ({proc.returncode}):\n{self._tail(self.kubelet_log)}")
            try:
                status, _ = self.api("GET", "/healthz", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"kubelet API did not answer within 60 s:\n{self._tail(self.kubelet_log)}")

    def settle(self, timeout: float) -> None:
        """Wait until every pod's containers are up, done, or stuck on an error."""
        deadline = time.monotonic() + timeout
        # A VM cannot be on the host's network: the qemu driver refuses that pod for good.
        waited = [name for name in self.pods if not (name == "hostnet" and self.driver == "qemu")]
        pending: list[str] = waited
        while time.monotonic() < deadline:
            pods = self.kubelet_pods()
            pending = [name for name in waited if not _settled(pods.get(self.full(name)))]
            if not pending:
                self.log("all pods settled")
                return
            time.sleep(1)
        # Something hangs (a pull, a boot): the checks will not wait as long.
        self.patience *= 0.25
        self.log(f"pods not settled after {timeout:.0f} s: {pending}")

    def stop(self) -> None:
        try:
            self._remove_pods()
        finally:
            self._stop("kubelet", 15)
            self._restore_sysctls()
            self._remove_leftovers()
            if self._channel is not None:
                self._channel.close()
                self._channel = None
            self._stop("cri-shim", 20)
            for f in self._files:
                f.close()
            self._files.clear()
            if self.handler == "runv":
                self._remove_runv_network()
            self._unmount_under(str(self.dir))
            # The kubelet's /var/log/{pods,containers} entries of our node (its
            # containers' logs stay in the shim's and kubelet's logs here).
            self._remove_pod_logs()
            # Read the logs before the work directory goes.
            self.kubelet_error_counts = klog_errors(self.kubelet_log)
            self.shim_error_counts = shim_problems(self.shim_log)
            if self.keep:
                self.log(f"kept {self.dir}")
            else:
                shutil.rmtree(self.dir, ignore_errors=True)

    def _remove_pods(self) -> None:
        """Delete the manifests; wait for the kubelet to stop what it ran."""
        kubelet = self.procs.get("kubelet")
        if kubelet is None or kubelet.poll() is not None or not self.manifest_dir.exists():
            return
        for f in self.manifest_dir.iterdir():
            f.unlink()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                ready = [
                    s.metadata.name
                    for s in self.cri().ListPodSandbox(pb.ListPodSandboxRequest(), timeout=5).items
                    if s.state == pb.SANDBOX_READY
                ]
                running = [
                    c.metadata.name
                    for c in self.cri().ListContainers(pb.ListContainersRequest(), timeout=5).containers
                    if c.state == pb.CONTAINER_RUNNING
                ]
            except grpc.RpcError as exc:
                self.log(f"CRI list failed during teardown: {exc.code()}")
                return
            if not ready and not running:
                self.log("the kubelet stopped every pod")
                return
            time.sleep(1)
        self.log(f"pods still running 60 s after their manifests went: {ready} {running}")

    def _remove_leftovers(self) -> None:
        """What the kubelet left in the runtime (stopped, not yet collected): remove it."""
        if "cri-shim" not in self.procs or self.procs["cri-shim"].poll() is not None:
            return
        rt = self.cri()
        try:
            for c in rt.ListContainers(pb.ListContainersRequest(), timeout=10).containers:
                rt.StopContainer(pb.StopContainerRequest(container_id=c.id, timeout=0), timeout=30)
                rt.RemoveContainer(pb.RemoveContainerRequest(container_id=c.id), timeout=30)
            for s in rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=10).items:
                rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=s.id), timeout=60)
                rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=s.id), timeout=60)
        except grpc.RpcError as exc:
            self.log(f"removing leftovers failed: {exc.code()} {exc.details()}")

    def _stop(self, name: str, grace: float) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.log(f"{name} (pid {proc.pid}) ignored SIGTERM for {grace:.0f} s: SIGKILL")
                proc.kill()
                proc.wait()
        self.log(f"stopped {name} (pid {proc.pid}, exit {proc.returncode})")

    def _restore_sysctls(self) -> None:
        if "kubelet" in self.procs or _other_kubelets():
            return
        try:
            saved = json.loads(SYSCTLS_SAVED.read_text())
        except (OSError, ValueError):
            return
        for name, value in saved.items():
            path = Path("/proc/sys", name)
            with contextlib.suppress(OSError):
                if path.read_text().strip() != value:
                    path.write_text(value)
        SYSCTLS_SAVED.unlink(missing_ok=True)

    def _remove_runv_network(self) -> None:
        bridge, chain = f"rvk{self.tag}", f"CRISHIM-K-{self.tag}"
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, check=False)
        rules = (
            ("PREROUTING", ["-m", "addrtype", "--dst-type", "LOCAL", "-j", chain]),
            ("OUTPUT", ["-m", "addrtype", "--dst-type", "LOCAL", "-j", chain]),
            ("POSTROUTING", ["-s", "127.0.0.0/8", "-o", bridge, "-j", "MASQUERADE"]),
        )
        for hook, rule in rules:
            for _ in range(10):
                cmd = ["iptables", "-w", "5", "-t", "nat", "-D", hook, *rule]
                if subprocess.run(cmd, capture_output=True, check=False).returncode != 0:
                    break
        for op in ("-F", "-X"):
            subprocess.run(["iptables", "-w", "5", "-t", "nat", op, chain], capture_output=True, check=False)
        cgroup = f"cri-shim-runv-e2e-{self.tag}"
        for root in Path("/sys/fs/cgroup").iterdir():
            with contextlib.suppress(OSError):
                (root / cgroup).rmdir()

    @staticmethod
    def _unmount_under(prefix: str) -> None:
        with open("/proc/self/mountinfo") as fh:
            points = [line.split()[4] for line in fh]
        for point in sorted({p for p in points if p == prefix or p.startswith(prefix + "/")}, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)

    def _remove_pod_logs(self) -> None:
        """What the kubelet left in /var/log/{pods,containers} of our pods (by UID: runs may overlap)."""
        pods = Path("/var/log/pods")
        ours = [d for d in pods.glob(f"{NAMESPACE}_*_*") if d.name.rsplit("_", 1)[-1] in self.pod_uids]
        links = Path("/var/log/containers")
        for link in links.iterdir() if links.is_dir() else []:
            with contextlib.suppress(OSError):
                target = os.readlink(link)
                if any(target.startswith(f"{d}/") for d in ours):
                    link.unlink()
        for d in ours:
            shutil.rmtree(d, ignore_errors=True)

    @staticmethod
    def _tail(path: Path, n: int = 30) -> str:
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    # ------------------------------------------------------------ clients
    def cri(self) -> api_pb2_grpc.RuntimeServiceStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(f"unix://{self.socket}")
        return api_pb2_grpc.RuntimeServiceStub(self._channel)

    def api(self, method: str, path: str, timeout: float = 10) -> tuple[int, bytes]:
        req = urllib.request.Request(
            f"https://127.0.0.1:{self.port}{path}", method=method, data=b"" if method == "POST" else None
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=self._ssl) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            with exc:
                return exc.code, exc.read()

    def api_ok(self, method: str, path: str, timeout: float = 10) -> bytes:
        try:
            status, body = self.api(method, path, timeout)
        except OSError as exc:
            raise CheckFailed(f"{method} {path}: {exc}") from None
        if status != 200:
            raise CheckFailed(f"{method} {path}: HTTP {status}: {_short(body)}")
        return body

    def kubelet_pods(self) -> dict[str, dict[str, Any]]:
        try:
            status, body = self.api("GET", "/pods", timeout=10)
        except OSError:
            return {}
        if status != 200:
            return {}
        pods = {p["metadata"]["name"]: p for p in json.loads(body).get("items") or []}
        self.pod_uids.update(str(p["metadata"].get("uid")) for p in pods.values())
        return pods

    def ws(self, path: str, subprotocols: list[str], timeout: float = 10) -> ClientConnection:
        return connect(
            f"wss://127.0.0.1:{self.port}{path}",
            ssl=self._ssl,
            subprotocols=[Subprotocol(p) for p in subprotocols],
            compression=None,
            open_timeout=timeout,
            close_timeout=2,
            max_size=None,
        )

    def logs(self, pod: str, container: str, query: str = "") -> str:
        path = f"/containerLogs/{NAMESPACE}/{self.full(pod)}/{container}" + (f"?{query}" if query else "")
        return self.api_ok("GET", path).decode(errors="replace")

    # ------------------------------------------------------------ waiting
    def wait_container(
        self,
        pod: str,
        container: str,
        pred: Callable[[dict[str, Any]], bool],
        timeout: float,
        *,
        init: bool = False,
        tolerate: frozenset[str] = frozenset(),
    ) -> dict[str, Any]:
        """The container's status once `pred` holds; CheckFailed with its last status otherwise.

        A container waiting on an error (CreateContainerError,
        RunContainerError, ErrImagePull, ...; except the reasons in
        `tolerate`) fails at once, as does an app container behind a failing
        init container: after `settle` such a state does not heal within a
        check's time.
        """
        timeout *= self.patience
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | None = None
        while True:
            p = self.kubelet_pods().get(self.full(pod))
            if p is not None:
                last = container_status(p, container, init=init)
                if last is not None and pred(last):
                    return last
                waiting = (last or {}).get("state", {}).get("waiting")
                reason = (waiting or {}).get("reason", "")
                if waiting is not None and reason not in STARTING and reason not in tolerate:
                    raise CheckFailed(f"{pod}/{container}: {describe(last)}")
                if not init and _init_failing(p.get("status", {})):
                    inits = p["status"].get("initContainerStatuses") or []
                    raise CheckFailed(
                        f"{pod}/{container} blocked by its init containers: "
                        + "; ".join(f"{s.get('name')}: {describe(s)}" for s in inits)
                    )
            if time.monotonic() >= deadline:
                if p is None:
                    raise CheckFailed(f"pod {self.full(pod)} not in the kubelet's /pods")
                raise CheckFailed(f"{pod}/{container} after {timeout:.0f} s: {describe(last)}")
            time.sleep(1)

    def wait_running(self, pod: str, container: str, timeout: float = 20) -> dict[str, Any]:
        return self.wait_container(pod, container, lambda s: "running" in s.get("state", {}), timeout)

    def wait_log(self, pod: str, container: str, needle: str, timeout: float = 20) -> str:
        self.wait_container(pod, container, lambda s: "waiting" not in s.get("state", {}), timeout)
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.logs(pod, container)
            if needle in text:
                return text
            time.sleep(1)
        raise CheckFailed(f"{pod}/{container} log lacks {needle!r}: {_short(text.encode())}")

    # ------------------------------------------------------------ checks
    def run_checks(
        self, names: set[str] | None = None, budget: float = 180.0
    ) -> list[tuple[Check, Result, float]]:
        """Run the checks, one at a time; those that would start after `budget` seconds do not run."""
        end = time.monotonic() + budget
        selected = [c for c in CHECKS if names is None or c.name in names]
        # Teardown is slow (the kubelet's garbage collector runs once a
        # minute): start it first, judge it last.
        if any(c.fn is check_teardown for c in selected):
            self.begin_teardown()
        ordered = sorted(selected, key=lambda c: c.fn is check_teardown)
        results = []
        for c in ordered:
            t0 = time.monotonic()
            if t0 >= end:
                result = Result(False, f"not run: the checks' budget of {budget:.0f} s is spent")
            else:
                result = run_one(self, c, min(c.timeout, end - t0 + 5))
            elapsed = time.monotonic() - t0
            self.log(f"{c.name}: {'pass' if result.ok else 'FAIL'} ({elapsed:.1f} s) {result.reason}")
            results.append((c, result, elapsed))
        order = {c.name: i for i, c in enumerate(CHECKS)}
        return sorted(results, key=lambda r: order[r[0].name])

    def begin_teardown(self) -> Teardown:
        """Delete the `gone` pod's manifest; a thread watches it leave the runtime."""
        if self.teardown is not None:
            return self.teardown
        try:
            self.wait_running("gone", "main", timeout=20)
        except CheckFailed as exc:
            self.log(f"teardown pod not running before its removal: {exc}")
        t = Teardown(before=self._runtime_objects_of("gone"), started=time.monotonic())
        (self.manifest_dir / "gone.yaml").unlink(missing_ok=True)
        t.thread = threading.Thread(target=self._watch_teardown, args=(t,), name="teardown", daemon=True)
        t.thread.start()
        self.teardown = t
        return t

    def _watch_teardown(self, t: Teardown, limit: float = 120) -> None:
        while time.monotonic() - t.started < limit:
            try:
                t.left = self._runtime_objects_of("gone")
            except grpc.RpcError as exc:
                t.error = f"CRI list failed: {exc.code()}"
                return
            elapsed = time.monotonic() - t.started
            live = [x for x in t.left[0] if x.endswith("SANDBOX_READY")]
            live += [x for x in t.left[1] if x.endswith("CONTAINER_RUNNING")]
            if not live and t.stopped_after is None:
                t.stopped_after = elapsed
            if not t.left[0] and not t.left[1]:
                t.removed_after = elapsed
                return
            time.sleep(1)

    def _runtime_objects_of(self, pod: str) -> tuple[list[str], list[str]]:
        label = {"io.kubernetes.pod.name": self.full(pod)}
        rt = self.cri()
        sandboxes = rt.ListPodSandbox(
            pb.ListPodSandboxRequest(filter=pb.PodSandboxFilter(label_selector=label)), timeout=10
        ).items
        containers = rt.ListContainers(
            pb.ListContainersRequest(filter=pb.ContainerFilter(label_selector=label)), timeout=10
        ).containers
        return (
            [f"{s.id[:12]}:{pb.PodSandboxState.Name(s.state)}" for s in sandboxes],
            [f"{c.metadata.name}:{c.id[:12]}:{pb.ContainerState.Name(c.state)}" for c in containers],
        )

    # ------------------------------------------------------------ reports
    def kubelet_errors(self) -> collections.Counter[str]:
        if self.kubelet_error_counts is not None:
            return self.kubelet_error_counts
        return klog_errors(self.kubelet_log)

    def shim_errors(self) -> collections.Counter[str]:
        if self.shim_error_counts is not None:
            return self.shim_error_counts
        return shim_problems(self.shim_log)


def run_one(h: Harness, c: Check, timeout: float) -> Result:
    """Run a check in a thread of its own, bounded by `timeout`."""
    box: list[Result] = []

    def target() -> None:
        try:
            box.append(c.fn(h))
        except CheckFailed as exc:
            box.append(Result(False, str(exc)))
        except Exception as exc:
            box.append(Result(False, f"{type(exc).__name__}: {exc}"))

    t = threading.Thread(target=target, name=c.name, daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        return Result(False, f"timed out after {timeout:.0f} s")
    return box[0]


# ---------------------------------------------------------------------- status helpers


def container_status(pod: dict[str, Any], name: str, *, init: bool = False) -> dict[str, Any] | None:
    key = "initContainerStatuses" if init else "containerStatuses"
    for s in pod.get("status", {}).get(key) or []:
        if s.get("name") == name:
            return dict(s)
    return None


def describe(status: dict[str, Any] | None) -> str:
    if status is None:
        return "no container status"
    state = status.get("state") or {}
    parts = []
    for kind, detail in state.items():
        reason = detail.get("reason", "")
        msg = detail.get("message", "")
        extra = f" exit {detail['exitCode']}" if "exitCode" in detail else ""
        parts.append(f"{kind} {reason}{extra} {msg}".strip())
    parts.append(f"restarts {status.get('restartCount', 0)}")
    return "; ".join(parts)[:400]


def _settled(pod: dict[str, Any] | None) -> bool:
    if pod is None:
        return False
    spec, status = pod.get("spec", {}), pod.get("status", {})
    if status.get("phase") in ("Succeeded", "Failed"):
        return True
    groups = [("initContainers", "initContainerStatuses"), ("containers", "containerStatuses")]
    for spec_key, status_key in groups:
        by_name = {s.get("name"): s for s in status.get(status_key) or []}
        for c in spec.get(spec_key) or []:
            s = by_name.get(c["name"])
            if s is None:
                # App containers have no status while an init container fails.
                if spec_key == "containers" and _init_failing(status):
                    continue
                return False
            waiting = (s.get("state") or {}).get("waiting")
            if waiting is not None and waiting.get("reason", "") in STARTING:
                if spec_key == "containers" and _init_failing(status):
                    continue
                return False
    return True


def _init_failing(status: dict[str, Any]) -> bool:
    for s in status.get("initContainerStatuses") or []:
        waiting = (s.get("state") or {}).get("waiting")
        if waiting is not None and waiting.get("reason", "") not in STARTING:
            return True
        terminated = (s.get("state") or {}).get("terminated")
        if terminated is not None and terminated.get("exitCode") != 0:
            return True
    return False


def _short(body: bytes, n: int = 200) -> str:
    text = body.decode(errors="replace").strip().replace("\n", "\\n")
    return text if len(text) <= n else text[:n] + "..."


_NORMALIZE = [
    (re.compile(r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"), "<uid>"),
    (re.compile(r"\b[0-9a-f]{12,64}\b"), "<id>"),
    (re.compile(r"\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:?\d{2})?"), "<time>"),
    (re.compile(r"/tmp/k-[A-Za-z0-9_]+"), "<dir>"),
    (re.compile(r"\b\d+(\.\d+)?(ms|s|µs)\b"), "<dur>"),
    (re.compile(r"attempt=\d+|Attempt:\d+"), "attempt=<n>"),
    (re.compile(r"127\.0\.0\.1:(?!5000\b)\d+"), "127.0.0.1:<port>"),
    # kuberuntime_manager's dump of a whole container spec: its name is enough
    (re.compile(r"&Container\{Name:([^,]+),.*\} (start failed)"), r"&Container{Name:\1,...} \2"),
]


def _normalize(line: str, limit: int = 260) -> str:
    for pattern, repl in _NORMALIZE:
        line = pattern.sub(repl, line)
    return line if len(line) <= limit else line[:limit] + "..."


def _grouped(path: Path, key: Callable[[str], str | None]) -> collections.Counter[str]:
    """The lines of a log that ``key`` picks, under the key it gives them, counted."""
    counts: collections.Counter[str] = collections.Counter()
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return counts
    for line in text.splitlines():
        picked = key(line)
        if picked is not None:
            counts[_normalize(picked)] += 1
    return counts


def shim_problems(path: Path) -> collections.Counter[str]:
    """The shim's warnings and errors, and its RPCs that did not answer OK, grouped."""

    def key(line: str) -> str | None:
        if re.search(r"\[(warning|error|critical)\s*\]|\b(Traceback|ERROR|WARNING)\b", line) or (
            " rpc " in line and "code=OK" not in line
        ):
            line = re.sub(r"^\S+Z \[(\w+)\s*\]\s+", r"\1 ", line)
            return re.sub(r"\s+ms=\S+", "", line)
        return None

    return _grouped(path, key)


def klog_errors(path: Path) -> collections.Counter[str]:
    """klog lines at level E, grouped by source location and message (IDs and times folded)."""

    def key(line: str) -> str | None:
        m = KLOG_ERROR.match(line)
        return m.group("msg") if m else None

    return _grouped(path, key)


# ---------------------------------------------------------------------- static-pod checks


@check("pod", 1)
def check_pod_network(h: Harness) -> Result:
    """a pod-network pod is Running with a pod IP"""
    s = h.wait_running("net", "main")
    pod = h.kubelet_pods()[h.full("net")]
    deadline = time.monotonic() + 15
    while not pod["status"].get("podIP") or pod["status"].get("phase") != "Running":
        if time.monotonic() > deadline:
            raise CheckFailed(f"phase {pod['status'].get('phase')}, podIP {pod['status'].get('podIP')!r}")
        time.sleep(1)
        pod = h.kubelet_pods()[h.full("net")]
    return passed(
        f"Running, podIP {pod['status']['podIP']}, started {s['state']['running'].get('startedAt')}"
    )


@check("pod", 2)
def check_host_network(h: Harness) -> Result:
    """a hostNetwork pod is Running (runv qemu: refused, as a VM has its own network)"""
    if h.driver == "qemu":
        refusal = "does not support host networking"
        pod = h.kubelet_pods().get(h.full("hostnet"), {})
        if pod.get("status", {}).get("phase") == "Running":
            raise CheckFailed("a host-network pod runs on the qemu driver")
        if refusal not in h.shim_log.read_text(errors="replace"):
            raise CheckFailed(f"no RunPodSandbox refusal ({refusal!r}) in the shim's log")
        return passed(
            f"refused as designed (UNIMPLEMENTED: {refusal}); phase {pod.get('status', {}).get('phase')}"
        )
    h.wait_running("hostnet", "main")
    pod = h.kubelet_pods()[h.full("hostnet")]
    detail = f"phase {pod['status'].get('phase')}, podIP {pod['status'].get('podIP', '')!r}"
    if h.handler == "docker" and h.warm:
        # The shim's pool holds pause containers for such pods: this one must have taken one.
        items = h.cri().ListPodSandbox(pb.ListPodSandboxRequest(), timeout=10).items
        ready = [s for s in items if s.metadata.name == h.full("hostnet") and s.state == pb.SANDBOX_READY]
        if not ready:
            raise CheckFailed("no ready sandbox of the host-network pod in ListPodSandbox")
        req = pb.PodSandboxStatusRequest(pod_sandbox_id=ready[0].id, verbose=True)
        info = json.loads(h.cri().PodSandboxStatus(req, timeout=10).info["info"])
        warm_id = info.get("backend_data", {}).get("warm_id")
        if not warm_id:
            raise CheckFailed("the host-network pod started cold although the pool holds pause containers")
        detail += f", took warm pause container {warm_id}"
    return passed(detail)


@check("pod", 3)
def check_init_container(h: Harness) -> Result:
    """an init container completes before the app container starts"""
    app = h.wait_running("init", "app")
    init = h.wait_container("init", "init", lambda s: "terminated" in s.get("state", {}), 10, init=True)
    term = init["state"]["terminated"]
    if term.get("exitCode") != 0:
        raise CheckFailed(f"init container: {describe(init)}")
    finished, started = term.get("finishedAt", ""), app["state"]["running"].get("startedAt", "")
    if not finished or not started or started < finished:
        raise CheckFailed(f"app started {started} before the init container finished {finished}")
    return passed(f"init {term.get('reason')} at {finished}; app started {started}")


@check("pod", 4)
def check_empty_dir(h: Harness) -> Result:
    """an emptyDir is shared between the init and the app container"""
    h.wait_log("init", "app", "init-done")
    return passed("app's log shows the init container's marker: init-done")


@check("pod", 5, timeout=60)
def check_crash_loop(h: Harness) -> Result:
    """a crashing container is restarted, lastState exit code 3"""

    def restarted(s: dict[str, Any]) -> bool:
        return s.get("restartCount", 0) >= 1 and "terminated" in (s.get("lastState") or {})

    s = h.wait_container("crash", "main", restarted, 50, tolerate=frozenset({"CrashLoopBackOff"}))
    code = s["lastState"]["terminated"].get("exitCode")
    if code != 3:
        raise CheckFailed(f"lastState.terminated.exitCode {code}, want 3: {describe(s)}")
    return passed(f"restartCount {s['restartCount']}, lastState exit 3, now {describe(s)}")


@check("pod", 6)
def check_etc_hosts(h: Harness) -> Result:
    """the kubelet's /etc/hosts is mounted (the pod's hostname in it)"""
    text = h.wait_log("etchosts", "main", h.full("etchosts"))
    header = "Kubernetes-managed hosts file" in text
    return passed(f"/etc/hosts names {h.full('etchosts')}" + (", kubelet-managed header" if header else ""))


@check("pod", 7)
def check_termination_message(h: Harness) -> Result:
    """a termination message written to /dev/termination-log is in the status"""
    s = h.wait_container("termmsg", "main", lambda s: "terminated" in s.get("state", {}), 20)
    term = s["state"]["terminated"]
    if term.get("message", "") != "bye-from-termlog":
        raise CheckFailed(f"message {term.get('message')!r}, want 'bye-from-termlog'; {describe(s)}")
    return passed(f"terminated exit {term.get('exitCode')}, message {term['message']!r}")


@check("pod", 8)
def check_hostpath_volume(h: Harness) -> Result:
    """a hostPath volume's file is read by the container"""
    h.wait_log("hostpath", "main", h.host_token)
    return passed(f"container read {h.host_token!r} from {h.hostdir}/hello.txt")


@check("pod", 9)
def check_two_containers(h: Harness) -> Result:
    """a pod with two containers has both Running"""
    h.wait_running("two", "sleeper")
    h.wait_running("two", "echo")
    return passed("sleeper and echo Running")


@check("pod", 10, timeout=130)
def check_teardown(h: Harness) -> Result:
    """a removed manifest's pod and containers leave the runtime"""
    t = h.begin_teardown()
    sandboxes, containers = t.before
    if not sandboxes:
        raise CheckFailed("the teardown pod had no sandbox in the runtime before its removal")
    assert t.thread is not None
    t.thread.join(max(0.0, t.started + 125 - time.monotonic()))
    stopped = f"stopped after {t.stopped_after:.0f} s" if t.stopped_after is not None else "never stopped"
    if t.removed_after is None:
        raise CheckFailed(
            f"{t.error or stopped}; still in the runtime after 120 s: sandboxes {t.left[0]} "
            f"containers {t.left[1]}"
        )
    return passed(
        f"{len(sandboxes)} sandbox(es), {len(containers)} container(s): {stopped}, "
        f"removed after {t.removed_after:.0f} s (the kubelet's GC runs once a minute)"
    )


# ---------------------------------------------------------------------- kubelet API checks


@check("api", 1)
def check_pods(h: Harness) -> Result:
    """/pods lists the static pods"""
    body = json.loads(h.api_ok("GET", "/pods"))
    names = {p["metadata"]["name"] for p in body.get("items") or []}
    want = {h.full(n) for n in h.pods if n != "gone"}
    missing = sorted(want - names)
    if missing:
        raise CheckFailed(f"missing {missing}; has {sorted(names)}")
    return passed(f"{len(names)} pods, all {len(want)} static pods present")


@check("api", 2)
def check_running_pods(h: Harness) -> Result:
    """/runningpods/ lists the pods running in the runtime"""
    h.wait_running("net", "main")
    body = json.loads(h.api_ok("GET", "/runningpods/"))
    names = {p["metadata"]["name"] for p in body.get("items") or []}
    if h.full("net") not in names:
        raise CheckFailed(f"{h.full('net')} missing; has {sorted(names)}")
    return passed(
        f"{len(names)} running pods: {', '.join(sorted(n.removesuffix('-' + h.node) for n in names))}"
    )


@check("api", 3)
def check_container_logs(h: Harness) -> Result:
    """/containerLogs returns the container's output"""
    text = h.wait_log("net", "main", "line-two")
    if "line-one\nline-two" not in text:
        raise CheckFailed(f"unexpected log: {_short(text.encode())}")
    return passed(f"{_short(text.encode())!r}")


@check("api", 4)
def check_container_logs_timestamps(h: Harness) -> Result:
    """/containerLogs?timestamps=true: every line starts with an RFC3339 time"""
    h.wait_log("net", "main", "line-two")
    text = h.logs("net", "main", "timestamps=true")
    lines = [line for line in text.splitlines() if line]
    bad = [line for line in lines if not RFC3339.match(line)]
    if not lines or bad:
        raise CheckFailed(f"lines without a time: {bad[:3]} (of {len(lines)})")
    return passed(f"{len(lines)} lines, e.g. {lines[0]!r}")


@check("api", 5)
def check_run(h: Harness) -> Result:
    """POST /run (ExecSync) returns the command's output"""
    h.wait_running("net", "main")
    body = h.api_ok("POST", f"/run/{NAMESPACE}/{h.full('net')}/main?cmd=echo+hi")
    if body.strip() != b"hi":
        raise CheckFailed(f"output {body!r}, want b'hi\\n'")
    return passed(f"output {body!r}")


def _exec_session(
    h: Harness, query: str, stdin: bytes | None, until: bytes, timeout: float = 15
) -> tuple[bytes, bytes, str]:
    """stdout, stderr and the status of an exec over WebSocket (v4.channel.k8s.io)."""
    h.wait_running("net", "main")
    path = f"/exec/{NAMESPACE}/{h.full('net')}/main?{query}"
    out, err, status = b"", b"", ""
    deadline = time.monotonic() + timeout
    try:
        with h.ws(path, ["v4.channel.k8s.io"]) as ws:
            if ws.subprotocol != "v4.channel.k8s.io":
                raise CheckFailed(f"negotiated subprotocol {ws.subprotocol!r}")
            if stdin is not None:
                ws.send(b"\x00" + stdin)
            while time.monotonic() < deadline:
                try:
                    msg = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
                except TimeoutError:
                    break
                data = msg.encode() if isinstance(msg, str) else msg
                if not data:
                    continue
                channel, payload = data[0], data[1:]
                if channel == 1:
                    out += payload
                elif channel == 2:
                    err += payload
                elif channel == 3:
                    status += payload.decode(errors="replace")
                    if until in out:
                        break
    except ConnectionClosed:
        pass
    except OSError as exc:
        raise CheckFailed(f"WebSocket {path}: {exc}") from None
    except Exception as exc:
        if type(exc).__name__ == "InvalidStatus":
            raise CheckFailed(f"WebSocket {path}: {exc}") from None
        raise
    return out, err, status


@check("api", 6)
def check_exec_websocket(h: Harness) -> Result:
    """WebSocket /exec: output on channel 1, Success on channel 3"""
    out, err, status = _exec_session(h, "command=echo&command=hello&output=1", None, b"hello")
    if out.strip() != b"hello":
        raise CheckFailed(f"stdout {out!r}, stderr {err!r}, status {status!r}")
    if '"Success"' not in status:
        raise CheckFailed(f"stdout ok, status {status!r}")
    return passed(f"stdout {out!r}, status {json.loads(status).get('status')}")


@check("api", 7)
def check_exec_websocket_stdin(h: Harness) -> Result:
    """WebSocket /exec with stdin: a line sent on channel 0 comes back"""
    line = b"ping-" + h.tag.encode() + b"\n"
    out, err, status = _exec_session(h, "command=head&command=-n1&input=1&output=1", line, line)
    if out != line:
        raise CheckFailed(f"stdout {out!r}, want {line!r}; stderr {err!r}, status {status!r}")
    return passed(f"echoed {line!r}, status {_status_word(status)}")


def _status_word(status: str) -> str:
    try:
        return str(json.loads(status).get("status"))
    except ValueError:
        return repr(status)


@check("api", 8)
def check_port_forward_websocket(h: Harness) -> Result:
    """WebSocket /portForward: bytes sent to a server in the pod come back"""
    h.wait_running("two", "echo")
    port = PORT_FORWARD_PORT
    path = f"/portForward/{NAMESPACE}/{h.full('two')}?port={port}"
    payload = b"forwarded-" + h.tag.encode() + b"\n"
    deadline = time.monotonic() + 15
    got, errors, headers = b"", b"", {0: b"", 1: b""}
    try:
        with h.ws(path, ["v4.channel.k8s.io", "portforward.k8s.io"]) as ws:
            sent = False
            while time.monotonic() < deadline and payload not in got:
                try:
                    msg = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
                except TimeoutError:
                    break
                data = msg.encode() if isinstance(msg, str) else msg
                if not data:
                    continue
                channel, body = data[0], data[1:]
                if channel in headers and len(headers[channel]) < 2:
                    # each channel first carries the port, 2 bytes little-endian
                    take = 2 - len(headers[channel])
                    headers[channel] += body[:take]
                    body = body[take:]
                if channel == 0:
                    got += body
                elif channel == 1:
                    errors += body
                if not sent and len(headers[0]) == 2 and len(headers[1]) == 2:
                    ws.send(b"\x00" + payload)
                    sent = True
    except ConnectionClosed:
        pass
    except OSError as exc:
        raise CheckFailed(f"WebSocket {path}: {exc}") from None
    except Exception as exc:
        if type(exc).__name__ == "InvalidStatus":
            raise CheckFailed(f"WebSocket {path}: {exc}") from None
        raise
    ports = {ch: int.from_bytes(v, "little") if len(v) == 2 else None for ch, v in headers.items()}
    if ports != {0: port, 1: port}:
        raise CheckFailed(f"port headers {ports}, want {port} on channels 0 and 1; error {errors!r}")
    if payload not in got:
        raise CheckFailed(f"sent {payload!r}, got {got!r}; error channel {errors!r}")
    return passed(f"port headers {port}/{port}, echoed {payload!r}")


@check("api", 9, timeout=45)
def check_stats_summary(h: Harness) -> Result:
    """/stats/summary has CPU and memory for a running container"""
    h.wait_running("net", "main")
    deadline = time.monotonic() + 40
    found: dict[str, Any] | None = None
    error = ""
    while time.monotonic() < deadline:
        # Early on the kubelet answers 500 (cAdvisor has no root filesystem stats yet).
        try:
            summary = json.loads(h.api_ok("GET", "/stats/summary", timeout=20))
        except CheckFailed as exc:
            error = str(exc)
            time.sleep(3)
            continue
        for p in summary.get("pods") or []:
            if p.get("podRef", {}).get("name") != h.full("net"):
                continue
            for c in p.get("containers") or []:
                if c.get("name") == "main":
                    found = c
        if found is not None:
            cpu, mem = found.get("cpu") or {}, found.get("memory") or {}
            has_cpu = cpu.get("usageNanoCores") is not None or cpu.get("usageCoreNanoSeconds") is not None
            if has_cpu and mem.get("workingSetBytes") is not None:
                return passed(
                    f"usageNanoCores {cpu.get('usageNanoCores')}, "
                    f"usageCoreNanoSeconds {cpu.get('usageCoreNanoSeconds')}, "
                    f"workingSetBytes {mem['workingSetBytes']}"
                )
        time.sleep(3)
    if found is None:
        raise CheckFailed(error or f"no stats for {h.full('net')}/main in /stats/summary")
    raise CheckFailed(f"incomplete stats: cpu {found.get('cpu')}, memory {found.get('memory')}")


# ---------------------------------------------------------------------- report


def report(
    handler: str, results: list[tuple[Check, Result, float]], h: Harness, out: Any = sys.stdout
) -> None:
    width = max(len(c.name) for c, _, _ in results) if results else 10
    print(f"\n== kubelet e2e, handler {handler} (node {h.node}) ==", file=out)
    for group, title in (("pod", "static pods"), ("api", "kubelet API")):
        rows = [r for r in results if r[0].group == group]
        if not rows:
            continue
        n_ok = sum(1 for _, r, _ in rows if r.ok)
        print(f"-- {title}: {n_ok}/{len(rows)} passed", file=out)
        for c, r, elapsed in rows:
            word = "pass" if r.ok else "FAIL"
            print(f"  {c.number:>2} {c.name:<{width}}  {word}  {elapsed:5.1f}s  {r.reason}", file=out)
    for title, counts in (
        ("kubelet E-lines", h.kubelet_errors()),
        ("cri-shim warnings, errors, non-OK RPCs", h.shim_errors()),
    ):
        total = sum(counts.values())
        print(f"-- {title}: {total} lines, {len(counts)} distinct", file=out)
        for line, n in counts.most_common():
            print(f"  {n:>5}  {line}", file=out)


def run(
    handler: str,
    keep: bool = False,
    names: set[str] | None = None,
    out: Any = sys.stdout,
    warm: int = 0,
    driver: str = "stub",
    guest_dir: str = "",
    transport: str = "grpcio",
    hollow: int = 0,
) -> tuple[list[tuple[Check, Result, float]], Harness]:
    """Start everything, run the checks, print the report, stop everything."""
    h = Harness(
        handler, keep=keep, warm=warm, driver=driver, guest_dir=guest_dir, transport=transport, hollow=hollow
    )
    results: list[tuple[Check, Result, float]] = []
    try:
        h.start(settle_timeout=900.0 if driver == "qemu" else 90.0)
        results = h.run_checks(names)
    finally:
        try:
            h.stop()
        finally:
            report(handler, results, h, out)
            if keep:
                print(f"-- logs: {h.kubelet_log} {h.shim_log}", file=out)
    return results, h


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """SIGALRM after `seconds`: a stuck run still stops what it started (in run's finally)."""

    def alarm(signum: int, frame: object) -> None:
        raise TimeoutError(f"the harness ran over {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.e2e.kubelet_harness", description=__doc__.split("\n")[0]
    )
    p.add_argument("--handler", choices=HANDLERS, default="runv")
    p.add_argument("--keep", action="store_true", help="keep the work directory and logs")
    p.add_argument("--check", action="append", help="run only this check (repeatable), e.g. pod-crash-loop")
    p.add_argument(
        "--warm",
        type=int,
        default=0,
        help="runv: warm VMs, docker: warm pause containers kept ready (0: off)",
    )
    p.add_argument("--driver", choices=("stub", "qemu"), default="stub", help="runv: the hypervisor driver")
    p.add_argument(
        "--transport", choices=("grpcio", "native"), default="grpcio", help="the shim's [server] transport"
    )
    p.add_argument(
        "--hollow",
        type=int,
        default=0,
        help="fake: `cri-shim hollow --nodes N`, the kubelet on the last node",
    )
    p.add_argument("--guest-dir", default="", help="runv qemu: the guest image (default: the driver's)")
    p.add_argument(
        "--max-seconds", type=float, default=420, help="a last resort: give up (and clean up) after this long"
    )
    args = p.parse_args(argv)
    if args.hollow and args.handler != "fake":
        p.error("--hollow needs --handler fake: only fake nodes can be hollow")
    problem = environment_problem(args.handler)
    if problem:
        print(f"cannot run: {problem}", file=sys.stderr)
        return 2
    names = set(args.check) if args.check else None
    with _deadline(args.max_seconds):
        results, _ = run(
            args.handler,
            keep=args.keep,
            names=names,
            warm=args.warm,
            driver=args.driver,
            guest_dir=args.guest_dir,
            transport=args.transport,
            hollow=args.hollow,
        )
    return 0 if results and all(r.ok for _, r, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
