"""What the harness needs of the host, and what it puts back there.

With --cni the run has a CNI network of its own (`CniNetwork`): made before
the shim starts, and removed, with what its pods held, after it stopped.

The kubelet sets vm.overcommit_memory=1, vm.panic_on_oom=0, kernel.panic=10
and kernel.panic_on_oops=1 when it starts (protectKernelDefaults=false; with
true it refuses to start on a host where they differ). The harness records the
host's values (in SYSCTLS_SAVED, once for overlapping runs) and the run that
stops while no other kubelet runs puts them back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

from tests.cni import realnet
from tests.cni.realnet import Line, Net

DEFAULT_KUBELET = "kubelet"  # looked up on PATH
SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops")
# The host's values before the first of (possibly concurrent) harness runs;
# the run that stops while no other kubelet runs puts them back.
SYSCTLS_SAVED = Path("/run/cri-shim-kubelet-harness.sysctls.json")
POD_LOGS = Path("/var/log/pods")  # the kubelet's default podLogsDir


def kubelet_binary() -> str:
    name = os.environ.get("CRI_SHIM_KUBELET") or DEFAULT_KUBELET
    return shutil.which(name) or name


# Where each handler type's table is checked: a handler whose schema has no
# `pod_network` key cannot put its pods on CNI in this tree.
_HANDLER_SCHEMAS = {"docker": "backends.docker", "runv": "backends.runv.config"}


def cni_unsupported(handler: str) -> str | None:
    """Why `handler` cannot have its pods on a CNI network in this tree, or None."""
    module = _HANDLER_SCHEMAS.get(handler)
    if module is None:
        return f"the {handler} handler runs no CNI plugins (its pod IPs are simulated)"
    if "pod_network" not in importlib.import_module(module).SCHEMA:
        return f"the {handler} handler has no CNI support in this tree ({module} has no pod_network option)"
    return None


def environment_problem(handler: str, cni: bool = False) -> str | None:
    """Why the harness cannot run here (a reason to skip), or None."""
    if cni:
        problem = cni_unsupported(handler) or realnet.why_not()
        if problem:
            return f"--cni: {problem}"
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


def save_sysctls() -> None:
    if SYSCTLS_SAVED.exists() or other_kubelets():
        return  # saved by a run still going on, or already changed by a kubelet
    values = {}
    for name in SYSCTLS:
        with contextlib.suppress(OSError):
            values[name] = Path("/proc/sys", name).read_text().strip()
    SYSCTLS_SAVED.write_text(json.dumps(values))


def restore_sysctls() -> None:
    if other_kubelets():
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


def other_kubelets() -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv0 = (d / "cmdline").read_bytes().split(b"\0")[0]
            if os.path.basename(argv0) == b"kubelet":
                pids.append(int(d.name))
    return pids


def remove_runv_network(tag: str) -> None:
    """The bridge, NAT rules and cgroup parent of the runv handler the shim config names by `tag`."""
    bridge, chain = f"rvk{tag}", f"CRISHIM-K-{tag}"
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
    cgroup = f"cri-shim-runv-e2e-{tag}"
    for root in Path("/sys/fs/cgroup").iterdir():
        with contextlib.suppress(OSError):
            (root / cgroup).rmdir()


def _cgroup_roots() -> list[Path]:
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").exists():
        return [base]
    return [p for p in base.iterdir() if p.is_dir() and not p.is_symlink()]


def make_cgroup_tree(name: str) -> None:
    """The cgroup ``name`` on every hierarchy (the kubelet wants its cgroupRoot to exist), a v1
    cpuset one given its parent's CPUs and memory nodes."""
    for root in _cgroup_roots():
        top = root / name.strip("/")
        top.mkdir(exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (root / knob).exists() and not (top / knob).read_text().strip():
                (top / knob).write_text((root / knob).read_text())


def remove_cgroup_tree(name: str) -> None:
    """The cgroup ``name`` (a path below the root) and everything below it, on every hierarchy
    (the kubelet leaves its kubepods tree behind when it stops)."""
    for root in _cgroup_roots():
        top = root / name.strip("/")
        if not top.is_dir():
            continue
        for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                path.rmdir()
        with contextlib.suppress(OSError):
            top.rmdir()


def unmount_under(prefix: str) -> None:
    with open("/proc/self/mountinfo") as fh:
        points = [line.split()[4] for line in fh]
    for point in sorted({p for p in points if p == prefix or p.startswith(prefix + "/")}, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


@functools.cache
def kubelet_minor(binary: str) -> int:
    """The minor version of a kubelet binary (`kubelet --version`: "Kubernetes v1.35.0-..."), 0 if unknown."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    m = re.search(r"v1\.(\d+)", out)
    return int(m.group(1)) if m else 0


# KubeletConfiguration.podLogsDir exists from v1.29. Each kubelet's container GC removes, every
# minute, the directories of its podLogsDir whose pod it does not know: kubelets sharing the
# default /var/log/pods delete each other's pod logs (a node e2e run beside a harness run lost
# logs that way). A kubelet that has the field gets one of its own.
POD_LOGS_DIR_SINCE = 29


def remove_pod_logs(namespace: str, pod_uids: set[str], pods: Path = POD_LOGS) -> None:
    """What the kubelet left in its pod logs directory and /var/log/containers of these pods (by UID:
    runs may overlap)."""
    ours = [d for d in pods.glob(f"{namespace}_*_*") if d.name.rsplit("_", 1)[-1] in pod_uids]
    links = Path("/var/log/containers")
    for link in links.iterdir() if links.is_dir() else []:
        with contextlib.suppress(OSError):
            target = os.readlink(link)
            if any(target.startswith(f"{d}/") for d in ours):
                link.unlink()
    for d in ours:
        shutil.rmtree(d, ignore_errors=True)


@dataclasses.dataclass
class CniNetwork:
    """The run's own CNI network: Debian's loopback + bridge + host-local + portmap
    (tests/cni/realnet.py) on a bridge ``crk0-<rand>`` and a free /24 of 10.253.0.0/16, its
    config and host-local's store under the work directory. The shim renders the config from
    a template with the pod CIDR the kubelet sends (its ``podCIDR``)."""

    net: Net
    host_port: int  # the `web` pod's hostPort
    opened: bool = False
    before: set[Line] = dataclasses.field(default_factory=set)  # the host's CNI rules before the run
    # Recorded by `release` and `remove` (None before): for the checks judged after the stop.
    store_used: bool = False  # host-local made a store for the network
    held: list[str] | None = None  # what pods still held once the shim had stopped
    remains: list[str] | None = None  # what was left of the network after its removal

    @classmethod
    def new(cls, root: Path, host_port: int) -> CniNetwork:
        return cls(Net(root, "crk", 253, gateway=True), host_port)

    def template(self) -> str:
        """The network config with host-local's subnet left to the pod CIDR."""
        return json.dumps(self.net.conflist(ipam={"ranges": [[{"subnet": "{{.PodCIDR}}"}]]}), indent=2)

    def open(self) -> None:
        self.before = realnet.cni_iptables()
        self.net.open_forward()
        self.opened = True

    def release(self, state_dir: str) -> None:
        """Record what the pods of the (stopped) shim at `state_dir` still hold."""
        self.store_used = (self.net.ipam_dir / self.net.network).is_dir()
        self.held = self.net.leftovers(state_dir)

    def remove(self) -> None:
        """Remove the bridge, portmap's rules and chains, the FORWARD rule; record what stays."""
        if not self.opened:
            return
        self.opened = False
        self.net.cleanup(self.before)
        remains = [f"iptables {table} {line}" for _, table, line in sorted(self.net.iptables())]
        now = realnet.cni_iptables()
        if not any(x[2].startswith("-A CNI-HOSTPORT-DNAT ") for x in now):
            # portmap's chains for every network, made with this run and used by none now
            remains += [
                f"iptables {table} {line}"
                for _, table, line in sorted(now - self.before)
                if any(c in line for c in realnet.SHARED_CHAINS)
            ]
        if Path("/sys/class/net", self.net.bridge).exists():
            remains.append(f"bridge {self.net.bridge}")
        self.remains = remains
