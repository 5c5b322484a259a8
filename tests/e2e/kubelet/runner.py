"""The harness itself: a private cri-shim and a standalone kubelet on it, started and cleaned up.

The harness starts a cri-shim of its own (own socket, state directory and, for
runv, its own bridge, iptables chain and cgroup parent; with `cni`, a CNI
network of its own, host.CniNetwork) and a standalone
kubelet pointed at it: no kubeconfig, so the kubelet runs the static pods of
a directory the harness fills. A standalone kubelet kills every pod of its
runtime that it did not create, hence the private shim. The checks reach both
through the clients and waits here.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
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
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from websockets.sync.client import ClientConnection, connect
from websockets.typing import Subprotocol

from cri_api import api_pb2 as pb
from cri_api import api_pb2_grpc
from tests.e2e.kubelet import host
from tests.e2e.kubelet.checks import CheckFailed, short
from tests.e2e.kubelet.config import REPO, kubelet_config, shim_command, shim_config
from tests.e2e.kubelet.logs import klog_errors, shim_problems
from tests.e2e.kubelet.pods import (
    NAMESPACE,
    PAUSE,
    STARTING,
    container_status,
    describe,
    init_failing,
    manifests,
    settled,
)

HANDLERS = ("fake", "docker", "runv")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        transport: str = "native",
        hollow: int = 0,
        cni: bool = False,
        pause: str = PAUSE,
        available_images: list[str] | None = None,
        qos: bool = False,
    ) -> None:
        unsupported = host.cni_unsupported(handler) if cni else None
        if unsupported:
            raise ValueError(unsupported)
        self.handler = handler
        self.pause = pause  # the shim's pause image
        # fake: the only images its pulls find (None: every image), as a registry that has only those
        self.available_images = available_images
        self.transport = transport  # the shim's [server] transport
        self.hollow = hollow  # fake: serve this many hollow nodes; the kubelet runs on the last
        self.warm = warm  # runv: warm VMs; docker: warm pause containers (0: every pod starts cold)
        self.driver = driver  # runv: "stub" or "qemu" (real VMs; slow under TCG)
        self.guest_dir = guest_dir
        # The kubelet's own pod cgroups (cgroupsPerQOS) under a root of the run's own, and a pod
        # with a busy loop: the pod-level usage of /stats/summary comes from the pod's cgroup.
        self.qos = qos
        self.kubelet_bin = kubelet or host.kubelet_binary()
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
        self.port = free_port()
        self.healthz_port = free_port()
        self.state_dir = self.dir / "state"
        self.shim_log = self.dir / "shim.log"
        self.kubelet_log = self.dir / "kubelet.log"
        # The kubelet's pod logs: a directory of the run's own where the kubelet can be told
        # (config.kubelet_config), else the shared default.
        self.kubelet_minor = host.kubelet_minor(self.kubelet_bin)
        self.pod_logs_dir = (
            self.dir / "pod-logs" if self.kubelet_minor >= host.POD_LOGS_DIR_SINCE else host.POD_LOGS
        )
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._files: list[Any] = []
        self._channel: grpc.Channel | None = None
        self._ssl = ssl.create_default_context()
        self._ssl.check_hostname = False
        self._ssl.verify_mode = ssl.CERT_NONE
        # The pods on a CNI network of the run's own, rendered with the kubelet's podCIDR (None: the
        # handler's own network).
        self.cni = host.CniNetwork.new(self.dir / "cni", free_port()) if cni else None
        # v1.33+ (ContainerStopSignals): a pod with a stop signal, and the gate on in its config.
        self.stop_signals = self.kubelet_minor >= 33
        self.pods = manifests(
            str(self.hostdir),
            self.cni.host_port if self.cni else 0,
            stop_signals=self.stop_signals,
            busy=qos,
        )
        self.teardown: Teardown | None = None
        # Scales the waits of the checks: a VM under emulation takes seconds where the stub takes ms.
        self.patience = 6.0 if driver == "qemu" else 1.0
        self.pod_uids: set[str] = set()  # seen in /pods: whose /var/log entries are ours
        # The kubelet's podLogsDir (v1.29+) under the work directory instead of /var/log/pods, where
        # every other kubelet of the host removes, within a minute, the directories of pods it does not
        # know (its container GC): a run of hours beside other kubelets needs its own.
        self.kubelet_error_counts: collections.Counter[str] | None = None
        self.shim_error_counts: collections.Counter[str] | None = None

    # ------------------------------------------------------------ names
    @property
    def cgroup_root(self) -> str:
        """The kubelet's cgroupRoot with ``qos``: its kubepods hierarchy goes below it."""
        return f"/cri-shim-e2e-{self.tag}"

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
        if self.qos:
            host.make_cgroup_tree(self.cgroup_root)
        (self.hostdir / "hello.txt").write_text(self.host_token + "\n")
        if self.cni is not None:
            self.cni.open()
        self.start_shim()
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

    def start_shim(self) -> None:
        argv = [
            *shim_command(),
            "serve",
            "--config",
            shim_config(self),
            "--listen",
            f"unix://{self.socket}",
            "--state-dir",
            str(self.state_dir),
            "--default-handler",
            self.handler,
        ]
        if self.hollow:
            # One process, many nodes: the kubelet's node is the last, the others idle beside it.
            argv = [
                *shim_command(),
                "hollow",
                "--nodes",
                str(self.hollow),
                "--config",
                shim_config(self),
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
        host.save_sysctls()
        argv = [
            self.kubelet_bin,
            f"--config={kubelet_config(self)}",
            f"--root-dir={self.dir / 'kubelet'}",
            f"--container-runtime-endpoint=unix://{self.socket}",
            f"--hostname-override={self.node}",
            f"--pod-infra-container-image={self.pause}",
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
            pending = [name for name in waited if not settled(pods.get(self.full(name)))]
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
            host.restore_sysctls()
            self._remove_leftovers()
            if self._channel is not None:
                self._channel.close()
                self._channel = None
            self._stop("cri-shim", 20)
            if self.cni is not None and self.cni.opened:
                self.cni.release(str(self.state_dir))  # before the pins are unmounted below
            for f in self._files:
                f.close()
            self._files.clear()
            if self.handler == "runv":
                host.remove_runv_network(self.tag)
            host.unmount_under(str(self.dir))
            if self.qos:
                host.remove_cgroup_tree(self.cgroup_root)
            if self.cni is not None:
                self.cni.remove()
            # The kubelet's /var/log/{pods,containers} entries of our node (its
            # containers' logs stay in the shim's and kubelet's logs here).
            host.remove_pod_logs(NAMESPACE, self.pod_uids, self.pod_logs_dir)
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
        # A removal the kubelet began just before it stopped may still be under way in the shim
        # (FAILED_PRECONDITION "already in progress"): go on with the rest, then look again.
        errors: list[str] = []
        for _ in range(5):
            errors = []
            try:
                containers = rt.ListContainers(pb.ListContainersRequest(), timeout=10).containers
                sandboxes = rt.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=10).items
            except grpc.RpcError as exc:
                errors = [f"list: {exc.code()} {exc.details()}"]
                time.sleep(2)
                continue
            if not containers and not sandboxes:
                return
            for c in containers:
                try:
                    rt.StopContainer(pb.StopContainerRequest(container_id=c.id, timeout=0), timeout=30)
                    rt.RemoveContainer(pb.RemoveContainerRequest(container_id=c.id), timeout=30)
                except grpc.RpcError as exc:
                    errors.append(f"container {c.id[:12]}: {exc.code()} {exc.details()}")
            for s in sandboxes:
                try:
                    rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=s.id), timeout=60)
                    rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=s.id), timeout=60)
                except grpc.RpcError as exc:
                    errors.append(f"sandbox {s.id[:12]}: {exc.code()} {exc.details()}")
            if errors:
                time.sleep(2)
        if errors:
            self.log(f"removing leftovers failed: {'; '.join(errors[:5])}")

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
            raise CheckFailed(f"{method} {path}: HTTP {status}: {short(body)}")
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
                if not init and init_failing(p.get("status", {})):
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
        raise CheckFailed(f"{pod}/{container} log lacks {needle!r}: {short(text.encode())}")

    # ------------------------------------------------------------ teardown
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
