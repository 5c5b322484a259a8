"""What the harness needs of the host, and what it puts back there.

The kubelet sets vm.overcommit_memory=1, vm.panic_on_oom=0, kernel.panic=10
and kernel.panic_on_oops=1 when it starts (protectKernelDefaults=false; with
true it refuses to start on a host where they differ). The harness records the
host's values (in SYSCTLS_SAVED, once for overlapping runs) and the run that
stops while no other kubelet runs puts them back.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

DEFAULT_KUBELET = "kubelet"  # looked up on PATH
SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops")
# The host's values before the first of (possibly concurrent) harness runs;
# the run that stops while no other kubelet runs puts them back.
SYSCTLS_SAVED = Path("/run/cri-shim-kubelet-harness.sysctls.json")


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


def unmount_under(prefix: str) -> None:
    with open("/proc/self/mountinfo") as fh:
        points = [line.split()[4] for line in fh]
    for point in sorted({p for p in points if p == prefix or p.startswith(prefix + "/")}, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def remove_pod_logs(namespace: str, pod_uids: set[str]) -> None:
    """What the kubelet left in /var/log/{pods,containers} of these pods (by UID: runs may overlap)."""
    pods = Path("/var/log/pods")
    ours = [d for d in pods.glob(f"{namespace}_*_*") if d.name.rsplit("_", 1)[-1] in pod_uids]
    links = Path("/var/log/containers")
    for link in links.iterdir() if links.is_dir() else []:
        with contextlib.suppress(OSError):
            target = os.readlink(link)
            if any(target.startswith(f"{d}/") for d in ours):
                link.unlink()
    for d in ours:
        shutil.rmtree(d, ignore_errors=True)
