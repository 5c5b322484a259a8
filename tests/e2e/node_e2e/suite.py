"""One run of the node e2e suite against a private cri-shim: checks, set-up, the run, clean-up."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from cri_api import api_pb2 as pb
from cri_api.api_pb2_grpc import RuntimeServiceStub
from tests.e2e.kubelet import host
from tests.e2e.kubelet.runner import Harness

# The suite's images expect this sandbox image (registry.k8s.io resolves to the testenv mirror).
PAUSE = "registry.k8s.io/pause:3.10.1"
# The testenv mirror's node e2e images (../shared/testenv/e2e-images writes it): one reference a
# line, comments after "#". The fake's pulls find these alone, as the other runtimes' pulls from the
# mirror do: the specs that expect a pull to fail (a nonexistent image, a private registry) see it fail.
E2E_IMAGES = Path("/etc/testenv/e2e-images.txt")
BUSYBOX = "registry.k8s.io/e2e-test-images/busybox:1.37.0-1"  # scripts/testenv/node-e2e-images' own
# The kubelet's healthz, API and read-only ports and the suite's API server.
PORTS = (10248, 10250, 10255, 6443)
KUBELET_ROOT = "/var/lib/kubelet"  # fixed in the suite (services/kubelet.go)
LABELS = "NodeConformance && !Serial && !Flaky && !Slow"
# A 1.35 kubelet refuses cgroup v1 (this machine's cgroups are hybrid) unless told;
# root lacks CAP_SYS_RESOURCE here, so a negative oom_score_adj fails.
CONFIG_EXTRA = "\n# added by tests/e2e/node_e2e\nfailCgroupV1: false\noomScoreAdj: 0\n"
# Empty --system-cgroups: otherwise the kubelet moves every process of the machine into /system.
KUBELET_FLAGS = "--system-cgroups= --cluster-domain=cluster.local"


@dataclasses.dataclass(frozen=True)
class Binaries:
    suite: str  # e2e_node.test
    kubelet: str
    kubelet_config: str  # the tree's test/e2e_node/jenkins/default-kubelet-config.yaml
    ginkgo: str = ""  # the tree's ginkgo CLI: needed only to run specs in parallel (--procs)

    @classmethod
    def from_env(cls) -> Binaries:
        return cls(
            os.environ.get("E2E_NODE_TEST", ""),
            os.environ.get("CRI_SHIM_KUBELET", ""),
            os.environ.get("E2E_NODE_KUBELET_CONFIG", ""),
            os.environ.get("E2E_NODE_GINKGO", ""),
        )

    def problem(self, procs: int = 1) -> str | None:
        needed = [
            ("the node e2e suite", self.suite, "E2E_NODE_TEST"),
            ("a kubelet", self.kubelet, "CRI_SHIM_KUBELET"),
        ]
        if procs > 1:
            needed.append(("the ginkgo CLI of the suite's tree", self.ginkgo, "E2E_NODE_GINKGO"))
        for what, path, env in needed:
            if not path or not os.access(path, os.X_OK):
                return f"no {what} at {path!r} (set {env})"
        if not os.path.isfile(self.kubelet_config):
            return (
                f"no base kubelet config at {self.kubelet_config!r} (set E2E_NODE_KUBELET_CONFIG to the "
                "tree's test/e2e_node/jenkins/default-kubelet-config.yaml)"
            )
        return None


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


def kubelets_on_default_root() -> list[int]:
    """Kubelets (and node e2e suites) whose root directory is /var/lib/kubelet."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = [a.decode(errors="replace") for a in (d / "cmdline").read_bytes().split(b"\0")]
            name = os.path.basename(argv[0])
            if name == "e2e_node.test" and int(d.name) != os.getpid():
                pids.append(int(d.name))
            elif name == "kubelet":
                roots = [a.split("=", 1)[1] for a in argv if a.startswith("--root-dir=")]
                roots += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--root-dir"]
                if not roots or os.path.normpath(roots[-1]) == KUBELET_ROOT:
                    pids.append(int(d.name))
    return pids


def environment_problem(
    handler: str | None, binaries: Binaries, procs: int = 1, endpoint: str | None = None
) -> str | None:
    """Why the suite cannot run here now (a reason to skip), or None.

    ``handler`` None: the runtime is not a shim of ours but the one at ``endpoint``."""
    problem = binaries.problem(procs)
    if problem is None and handler is not None:
        problem = host.environment_problem(handler)
    if problem is None and endpoint is not None and not Path(endpoint.removeprefix("unix://")).is_socket():
        problem = f"no runtime socket at {endpoint}"
    if problem:
        return problem
    busy = [p for p in PORTS if port_in_use(p)]
    if busy:
        return f"ports {busy} are in use: the suite's kubelet and API server need {list(PORTS)} free"
    pids = kubelets_on_default_root()
    if pids:
        return f"{KUBELET_ROOT} is in use by another kubelet or node e2e suite (pids {pids})"
    return None


@contextlib.contextmanager
def systemd_run_hidden() -> Iterator[None]:
    """Take systemd-run's exec bits away for the run: the suite starts its kubelet through it
    when it finds it, and PID 1 is not systemd here. The mode comes back in any case."""
    path = shutil.which("systemd-run")
    if path is None:
        yield
        return
    mode = os.stat(path).st_mode
    os.chmod(path, mode & ~(stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH))
    try:
        yield
    finally:
        os.chmod(path, stat.S_IMODE(mode))


def suite_argv(
    endpoint: str, node: str, b: Binaries, out: Path, labels: str, focus: str | None, procs: int = 1
) -> list[str]:
    """The suite's command line; with ``procs`` > 1 through the ginkgo CLI, which runs that many
    processes of the suite (the first starts the API server and the kubelet, the others share them)."""
    bin_dir = out / "bin"
    bin_dir.mkdir(exist_ok=True)
    link = bin_dir / "kubelet"  # the suite runs `kubelet` from --k8s-bin-dir
    link.unlink(missing_ok=True)
    link.symlink_to(os.path.abspath(b.kubelet))
    config = out / "kubelet-config.yaml"
    config.write_text(Path(b.kubelet_config).read_text() + CONFIG_EXTRA)
    suite_flags = [
        "--prepull-images=false",
        f"--container-runtime-endpoint={endpoint}",
        f"--node-name={node}",
        "--dns-domain=cluster.local",
        f"--k8s-bin-dir={bin_dir}",
        f"--kubelet-config-file={config}",
        f"--kubelet-flags={KUBELET_FLAGS}",
        f"--report-dir={out}",
    ]
    ginkgo_flags = [
        f"label-filter={labels}",
        f"json-report={out / 'report.json'}",
        "no-color",
        "v",
    ]
    if focus:
        ginkgo_flags.append(f"focus={focus}")
    if procs > 1:
        # The CLI takes its flags bare and merges the processes' reports into one.
        return [b.ginkgo, f"--procs={procs}", *(f"--{f}" for f in ginkgo_flags), b.suite, "--", *suite_flags]
    return [b.suite, *suite_flags, *(f"--ginkgo.{f}" for f in ginkgo_flags)]


def run_suite(argv: list[str], out: Path, timeout: float, who: str = "node-e2e") -> int:
    """A ginkgo suite in a session of its own (ginkgo, its processes and what they start, such as the
    kubelet), run in `out`, where the suite writes its kubeconfig, token file and kubelet config; after
    `timeout` (or on Ctrl-C of ours) it is interrupted as ginkgo expects, which writes its report."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "suite.log", "ab") as fh:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=out,
        )
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            print(f"[{who}] over {timeout:.0f} s: interrupting the suite (pid {proc.pid})", file=sys.stderr)
            return interrupt(proc)
        except BaseException:  # Ctrl-C of the runner: the suite stops with it
            interrupt(proc)
            raise


def interrupt(proc: subprocess.Popen[bytes]) -> int:
    """SIGINT to the suite's session (ginkgo then cleans up and writes its report), SIGKILL two
    minutes later: a spec's clean-up can hang."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        return proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def sandboxes(endpoint: str) -> list[pb.PodSandbox]:
    """The runtime's pod sandboxes (the suite stops its kubelet before it cleans up: some remain)."""
    with grpc.insecure_channel(endpoint) as channel:
        try:
            return list(
                RuntimeServiceStub(channel).ListPodSandbox(pb.ListPodSandboxRequest(), timeout=10).items
            )
        except grpc.RpcError as exc:
            print(f"[node-e2e] ListPodSandbox failed: {exc.code()}", file=sys.stderr)
            return []


def remove_sandboxes(endpoint: str, ids: list[str]) -> None:
    """Stop and remove these sandboxes (with their containers) through the CRI."""
    with grpc.insecure_channel(endpoint) as channel:
        rt = RuntimeServiceStub(channel)
        for sid in ids:
            try:
                rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=60)
                rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=60)
            except grpc.RpcError as exc:
                print(f"[node-e2e] removing sandbox {sid[:13]}: {exc.code()}", file=sys.stderr)


def _run_on(endpoint: str, node: str, b: Binaries, out: Path, opts: RunOptions) -> int:
    argv = suite_argv(endpoint, node, b, out, opts.labels, opts.focus, opts.procs)
    (out / "command.txt").write_text(" ".join(argv) + "\n")
    started = time.monotonic()
    with systemd_run_hidden():
        rc = run_suite(argv, out, opts.timeout)
    print(f"[node-e2e] suite exited {rc} after {time.monotonic() - started:.0f} s", file=sys.stderr)
    return rc


@dataclasses.dataclass(frozen=True)
class RunOptions:
    timeout: float
    labels: str = LABELS
    focus: str | None = None
    procs: int = 1  # parallel processes of the suite (ginkgo CLI)
    driver: str = "stub"  # runv: the hypervisor driver ("qemu": real VMs)


def available_images(listing: Path = E2E_IMAGES) -> list[str] | None:
    """The images the mirror has, for a fake shim (with the sandbox and busybox images the run
    itself uses); None when the list is absent: then the fake finds every image."""
    try:
        text = listing.read_text()
    except FileNotFoundError:
        return None
    images = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    listed = [image.split()[0] for image in images if image]
    return list(dict.fromkeys([*listed, PAUSE, BUSYBOX]))


def run(
    handler: str | None,
    b: Binaries,
    out: Path,
    opts: RunOptions,
    endpoint: str | None = None,
) -> tuple[int, list[pb.PodSandboxMetadata]]:
    """Run the suite on a private shim with ``handler`` as its default (started and stopped here), or,
    with ``handler`` None, on the runtime at ``endpoint`` (containerd, for the comparison).

    Returns the suite's exit code and the sandboxes it left behind (removed)."""
    out = out.resolve()  # the suite runs in it: its paths must not be relative
    out.mkdir(parents=True, exist_ok=True)
    host.save_sysctls()  # the kubelet changes four; put back at the end
    if handler is None:
        if endpoint is None:
            raise ValueError("a handler or an endpoint")
        before = {s.id for s in sandboxes(endpoint)}
        try:
            rc = _run_on(endpoint, "node-e2e-peer", b, out, opts)
        finally:
            # Only what appeared during the run: the peer runtime may hold others' pods.
            new = [s for s in sandboxes(endpoint) if s.id not in before]
            remove_sandboxes(endpoint, [s.id for s in new])
            host.restore_sysctls()
        return rc, [s.metadata for s in new]
    images = available_images() if handler == "fake" else None
    if handler == "fake" and images is None:
        print(f"[node-e2e] no {E2E_IMAGES}: the fake's pulls find every image", file=sys.stderr)
    h = Harness(
        handler,
        kubelet=b.kubelet,
        node=f"node-e2e-{handler}",
        pause=PAUSE,
        driver=opts.driver,
        available_images=images,
    )
    h.shim_log = out / "shim.log"  # kept with the results; the harness removes its own directory
    left: list[pb.PodSandboxMetadata] = []
    rc = -1
    try:
        h.start_shim()
        shutil.copy(h.dir / "cri-shim.toml", out / "cri-shim.toml")
        rc = _run_on(f"unix://{h.socket}", h.node, b, out, opts)
        left = [s.metadata for s in sandboxes(f"unix://{h.socket}")]
    finally:
        h.stop()  # removes every container and sandbox through the CRI, then stops the shim
        for m in left:
            host.remove_pod_logs(m.namespace, {m.uid})
    return rc, left
