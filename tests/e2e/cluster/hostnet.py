"""What the cluster makes on the host, how it is taken away, and how to list what is left of it.

- the nodes' bridge (layout.NODE_BRIDGE) holding the control plane's and the nodes' addresses;
- a FORWARD chain of its own accepting the pod CIDRs, so that pods on one node's bridge reach pods
  on another's through the host's routing (each node's CNI bridge is the gateway of its pod CIDR:
  the host has a connected route to every node's pods);
- a cgroup root per node in every hierarchy (the kubelet's cgroupRoot, kubepods below it);
- what the nodes' CNI plugins made (bridges, portmap's rules naming the nodes' networks) and what
  kube-proxy made (its KUBE-* chains: ``kube-proxy --cleanup`` removes them; `leftovers` checks).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from tests.cni import realnet
from tests.e2e.cluster.layout import (
    ALL_NODES,
    CLUSTER_CIDR,
    CONTROL_IP,
    DOCKER_INSTANCE,
    FORWARD_CHAIN,
    HOLLOW_CGROUP,
    NODE_BRIDGE,
    NODE_NET_PREFIX,
    ROOT,
    RUNV_TAG,
    HollowNode,
    NodeSpec,
)

CGROUP_FS = Path("/sys/fs/cgroup")
RUNV_CGROUP = f"cri-shim-runv-e2e-{RUNV_TAG}"
# kube-proxy's iptables chains (not the kubelets' KUBE-FIREWALL, KUBE-KUBELET-CANARY or
# KUBE-IPTABLES-HINT, which other kubelets of this machine keep).
PROXY_CHAINS = re.compile(
    r"^KUBE-(SERVICES|NODEPORTS|POSTROUTING|MARK-MASQ|PROXY-CANARY|FORWARD|PROXY-FIREWALL|"
    r"EXTERNAL-SERVICES|SVC-|SEP-|EXT-|FW-|SVL-)"
)


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


# ------------------------------------------------------------ the nodes' addresses
def make_node_bridge() -> None:
    run("ip", "link", "add", NODE_BRIDGE, "type", "bridge")
    for ip in dict.fromkeys((CONTROL_IP, *(n.ip for n in ALL_NODES))):
        run("ip", "addr", "add", f"{ip}/{NODE_NET_PREFIX}", "dev", NODE_BRIDGE)
    run("ip", "link", "set", NODE_BRIDGE, "up")


def add_node_addresses(ips: list[str]) -> None:
    """More node addresses on the bridge (the hollow nodes' kubelets'); they go with it at `down`."""
    for ip in ips:
        run("ip", "addr", "add", f"{ip}/{NODE_NET_PREFIX}", "dev", NODE_BRIDGE)


def open_forward() -> None:
    run("iptables", "-w", "5", "-N", FORWARD_CHAIN)
    run("iptables", "-w", "5", "-A", FORWARD_CHAIN, "-s", CLUSTER_CIDR, "-j", "ACCEPT")
    run("iptables", "-w", "5", "-A", FORWARD_CHAIN, "-d", CLUSTER_CIDR, "-j", "ACCEPT")
    run("iptables", "-w", "5", "-I", "FORWARD", "1", "-j", FORWARD_CHAIN)


def close_forward() -> None:
    for _ in range(10):
        if run("iptables", "-w", "5", "-D", "FORWARD", "-j", FORWARD_CHAIN, check=False).returncode:
            break
    run("iptables", "-w", "5", "-F", FORWARD_CHAIN, check=False)
    run("iptables", "-w", "5", "-X", FORWARD_CHAIN, check=False)


# ------------------------------------------------------------ cgroups
def hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers, name=systemd, the unified one)."""
    with open("/proc/self/mountinfo") as fh:
        points = [line.split()[4] for line in fh if " - cgroup" in line]
    return sorted({Path(p) for p in points if p.startswith(str(CGROUP_FS) + "/")})


def make_cgroup_roots(hollow: list[HollowNode] | None = None, nodes: Sequence[NodeSpec] = ()) -> None:
    """The nodes' cgroup roots in every hierarchy; with `hollow`, those nodes' instead (below
    one parent of theirs, made first)."""
    roots = (
        [n.cgroup_root for n in nodes]
        if hollow is None
        else [HOLLOW_CGROUP] + [n.cgroup_root for n in hollow]
    )
    for h in hierarchies():
        for root in roots:
            d = h / root.strip("/")
            d.mkdir(exist_ok=True)
            if (h / "cpuset.cpus").exists():  # a new v1 cpuset starts empty: no task could join it
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (d / f).write_text((d.parent / f).read_text())


def _rmdir_tree(top: Path) -> None:
    if not top.is_dir():
        return
    for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        with contextlib.suppress(OSError):
            d.rmdir()
    with contextlib.suppress(OSError):
        top.rmdir()


def cgroup_dirs() -> list[Path]:
    names = [n.cgroup_root.strip("/") for n in ALL_NODES] + [RUNV_CGROUP, HOLLOW_CGROUP]
    return [h / name for h in hierarchies() for name in names if (h / name).exists()]


def remove_cgroups() -> None:
    for d in cgroup_dirs():
        _rmdir_tree(d)


# ------------------------------------------------------------ CNI leftovers
def _cni_lines_of_ours() -> set[realnet.Line]:
    """portmap's rules naming a node's network, and the per-pod chains they jump to."""
    lines = realnet.cni_iptables()
    names = [f'name: \\"{net}\\"' for net in dict.fromkeys(n.network for n in ALL_NODES)]
    ours = {x for x in lines if any(name in x[2] for name in names)}
    chains = {c for x in ours for c in re.findall(r"-j (CNI-DN-\S+)", x[2])}
    return ours | {x for x in lines if any(x[2].startswith((f":{c} ", f"-A {c} ")) for c in chains)}


def _remove_lines(lines: set[realnet.Line]) -> None:
    for tool, table, line in sorted(x for x in lines if x[2].startswith("-A ")):
        run(tool.removesuffix("-save"), "-w", "5", "-t", table, "-D", *shlex.split(line)[1:], check=False)
    for tool, table, line in sorted(x for x in lines if x[2].startswith(":")):
        chain = line[1:].split()[0]
        for op in ("-F", "-X"):
            run(tool.removesuffix("-save"), "-w", "5", "-t", table, op, chain, check=False)


def shared_cni_chains_exist() -> bool:
    return any(c in x[2] for x in realnet.cni_iptables() for c in realnet.SHARED_CHAINS)


def remove_cni(shared_were_there: bool) -> None:
    """The nodes' bridges, portmap's rules of their networks; portmap's shared chains if they came
    with the cluster and no network of anyone uses them now."""
    for n in ALL_NODES:
        if link_exists(n.bridge):
            run("ip", "link", "del", n.bridge, check=False)
    _remove_lines(_cni_lines_of_ours())
    now = realnet.cni_iptables()
    if not shared_were_there and not any(x[2].startswith("-A CNI-HOSTPORT-DNAT ") for x in now):
        _remove_lines({x for x in now if any(c in x[2] for c in realnet.SHARED_CHAINS)})


# ------------------------------------------------------------ mounts, logs
def mounts_under(*dirs: Path) -> list[str]:
    prefixes = [str(d).rstrip("/") for d in dirs]
    with open("/proc/self/mountinfo") as fh:
        points = [line.split()[4] for line in fh]
    return sorted({p for p in points if any(p == x or p.startswith(x + "/") for x in prefixes)})


def unmount_all(*dirs: Path) -> None:
    for _ in range(3):  # a lazy unmount may uncover what was mounted below
        points = mounts_under(*dirs)
        if not points:
            return
        for point in sorted(points, key=len, reverse=True):
            run("umount", "-l", point, check=False)


def container_log_links() -> list[Path]:
    """/var/log/containers links into a node's podLogsDir (the kubelet makes them there always)."""
    d = Path("/var/log/containers")
    out = []
    for link in d.iterdir() if d.is_dir() else []:
        with contextlib.suppress(OSError):
            if os.readlink(link).startswith(str(ROOT) + "/"):
                out.append(link)
    return out


def docker_containers() -> list[str]:
    """The engine containers of the docker node's shim (by its instance label)."""
    if shutil.which("docker") is None or not Path("/var/run/docker.sock").exists():
        return []
    proc = run(
        "docker", "ps", "-a", "--filter", f"label=io.cri-shim.instance={DOCKER_INSTANCE}",
        "--format", "{{.ID}} {{.Names}} {{.Status}}", check=False,
    )  # fmt: skip
    return [line for line in proc.stdout.splitlines() if line.strip()]


def remove_docker_containers() -> None:
    ids = [line.split()[0] for line in docker_containers()]
    if ids:
        run("docker", "rm", "-f", "-v", *ids, check=False)


# ------------------------------------------------------------ what is left
def iptables_left() -> list[str]:
    out = []
    for tool in ("iptables-save", "ip6tables-save"):
        if shutil.which(tool) is None:
            continue
        table = ""
        for line in run(tool, check=False).stdout.splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":"):
                chain = line[1:].split()[0]
                if chain == FORWARD_CHAIN or chain.startswith("CRISHIM-K-" + RUNV_TAG):
                    out.append(f"{tool} {table}: chain {chain}")
                elif PROXY_CHAINS.match(chain):
                    out.append(f"{tool} {table}: kube-proxy chain {chain}")
            elif f"-j {FORWARD_CHAIN}" in line:
                out.append(f"{tool} {table}: {line}")
    out += [f"{tool} {table}: {line}" for tool, table, line in sorted(_cni_lines_of_ours())]
    return out


def links_left() -> list[str]:
    names = list(dict.fromkeys([NODE_BRIDGE, f"rvk{RUNV_TAG}", *(n.bridge for n in ALL_NODES)]))
    out = [f"link {name}" for name in names if link_exists(name)]
    for name in names:
        if link_exists(name):
            ports = run("ip", "-o", "link", "show", "master", name, check=False).stdout.splitlines()
            out += [f"link {line.split(':')[1].strip()} on {name}" for line in ports]
    return out


# ------------------------------------------------------------ inotify instances (scale mode)
INOTIFY_INSTANCES = Path("/proc/sys/fs/inotify/max_user_instances")


def raise_inotify_instances(want: int) -> dict[str, int] | None:
    """Raise the per-user inotify instance limit to `want` when it is lower; return what to restore.

    Every kubelet holds several inotify instances (cAdvisor's, its file watches), and all run as
    root: the default 128 would stop tens of kubelets before CPU or memory does (kind documents
    the same "too many open files"). Raising a limit takes nothing from anyone else.
    """
    before = int(INOTIFY_INSTANCES.read_text())
    if before >= want:
        return None
    INOTIFY_INSTANCES.write_text(str(want))
    return {"before": before, "set": want}


def restore_inotify_instances(saved: dict[str, int] | None) -> None:
    """Put the limit back, unless someone changed it since we set it."""
    if not saved:
        return
    with contextlib.suppress(OSError, ValueError):
        if int(INOTIFY_INSTANCES.read_text()) == saved["set"]:
            INOTIFY_INSTANCES.write_text(str(saved["before"]))
