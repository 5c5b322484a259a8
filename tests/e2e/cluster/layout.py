"""Where the cluster lives on this machine: directories, addresses, ports, the three nodes, the binaries.

Everything is private to the harness: a root under /var/lib and one under /run, addresses on a
bridge of its own (172.30.0.0/24), ports that neither a default kubelet (10248, 10250, 10255) nor
the node e2e suite's API server (6443) uses, a cgroup root per node, one CNI bridge per node.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

ROOT = Path("/var/lib/cri-shim-cluster")
RUN = Path("/run/cri-shim-cluster")
STATE = RUN / "state.json"  # the processes started, their start times, what `up` observed
PKI = ROOT / "pki"
LOGS = ROOT / "logs"

# The nodes' addresses (and the control plane's) are on this bridge: the kernel here has no dummy links.
NODE_BRIDGE = "crishim-nodes"
NODE_NET = "172.30.0.0/24"
NODE_NET_PREFIX = 24
CONTROL_IP = "172.30.0.10"
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"  # the first address of SERVICE_CIDR: the `kubernetes` Service
# The cluster's DNS (dnsserver.py) listens on the control plane's address; pods ask the kube-dns
# Service's ClusterIP, which kube-proxy sends there (a selector-less Service with our EndpointSlice).
CLUSTER_DOMAIN = "cluster.local"
DNS_SERVICE_IP = "10.96.0.10"
DNS_PORT = 53
CLUSTER_CIDR = "10.244.0.0/16"
NODE_CIDR_MASK = 24
# FORWARD jumps here: traffic from and to the pod CIDRs crosses the host between the nodes' bridges.
FORWARD_CHAIN = "CRISHIM-CLUSTER"

ETCD_CLIENT_PORT = 12379
ETCD_PEER_PORT = 12380
APISERVER_PORT = 16443
CONTROLLER_MANAGER_PORT = 11257
SCHEDULER_PORT = 11259
PROXY_METRICS_PORT = 11249
PROXY_HEALTHZ_PORT = 11256

# The images the sandboxes and the scenarios run: the testenv's TLS mirror of registry.k8s.io
# (agnhost built from the tree) when it lists them, else the local registry's busybox and pause.
PAUSE_IMAGE = "registry.k8s.io/pause:3.10.1"
PAUSE_FALLBACK = "127.0.0.1:5000/pause:3.10"
BUSYBOX_FALLBACK = "127.0.0.1:5000/busybox:1.36"
AGNHOST = "registry.k8s.io/e2e-test-images/agnhost:2.56"
BUSYBOX = "registry.k8s.io/e2e-test-images/busybox:1.37.0-1"
E2E_IMAGES_LIST = Path("/etc/testenv/e2e-images.txt")

# runv's own network and cgroup parent, named like the kubelet harness's (host.remove_runv_network).
RUNV_TAG = "clus"
# The runv node's driver: the stub (processes) by default, or qemu (real VMs; TCG here), chosen at
# `up` (--runv-driver, or this variable for the pytest module) and recorded in the state file.
RUNV_DRIVERS = ("stub", "qemu")
RUNV_DRIVER_ENV = "CRI_SHIM_CLUSTER_RUNV_DRIVER"
# How much longer a runv pod may take on qemu: under TCG a VM boots in ~10-15 s (~1-2 s from a
# template), its image is unpacked into its shares, and the machine is shared with other VMs.
RUNV_PATIENCE = {"stub": 1.0, "qemu": 3.0}
# The `runv` RuntimeClass's overhead.podFixed, which the kubelet adds to the pod cgroup's limits and
# runv sizes the VM by (backends/runv/README.md, "Sizing", "Pod cgroups"): a VM needs more than its
# containers' limits, and a pod with memory limits whose cgroup cannot hold its VM is refused.
# stub: the handler's overhead_memory_mib (32). qemu under TCG: guest_memory_mib (96) +
# host_overhead_mib (192) + 32; a quarter of a CPU for the guest's own work beside a CPU limit.
RUNV_OVERHEAD = {"stub": {"memory": "32Mi"}, "qemu": {"memory": "320Mi", "cpu": "250m"}}
DOCKER_INSTANCE = "crishim-cluster"  # the docker handler's instance label: its containers are ours


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """One node: a kubelet and its own runtime: a cri-shim with one handler, or (the comparison) a
    containerd with its CRI plugin."""

    index: int  # 1, 2, 3
    handler: str  # docker, runv, fake; "containerd" for a containerd node
    runtime: str = "cri-shim"  # or "containerd"

    @property
    def name(self) -> str:
        return f"crishim-{self.handler}" if self.runtime == "cri-shim" else f"ctrd-{self.index}"

    @property
    def runtime_proc(self) -> str:  # the runtime's name in the state file
        return f"cri-shim-{self.handler}" if self.runtime == "cri-shim" else f"containerd-{self.index}"

    @property
    def kubelet_proc(self) -> str:
        return f"kubelet-{self.handler}" if self.runtime == "cri-shim" else f"kubelet-ctrd-{self.index}"

    @property
    def ip(self) -> str:
        return f"172.30.0.{10 + self.index}"

    @property
    def port(self) -> int:  # the kubelet's API
        return 11249 + self.index

    @property
    def healthz_port(self) -> int:
        return 11260 + self.index

    @property
    def cni(self) -> bool:
        """The node's pods are on a CNI network of its own (the fake's IPs are simulated)."""
        return self.handler != "fake"

    @property
    def bridge(self) -> str:
        return f"crishim-cni{self.index}"

    @property
    def network(self) -> str:  # the CNI network's name
        return f"crishim-cluster-{self.index}"

    @property
    def dir(self) -> Path:
        return ROOT / self.name

    @property
    def kubelet_root(self) -> Path:
        return self.dir / "kubelet"

    @property
    def state_dir(self) -> Path:  # the runtime's: the shim's state, containerd's root
        return self.dir / ("shim" if self.runtime == "cri-shim" else "containerd")

    @property
    def cni_conf_dir(self) -> Path:
        return self.dir / "net.d"

    @property
    def conflist(self) -> Path:
        return self.cni_conf_dir / "10-crishim-cluster.conflist"

    @property
    def ipam_dir(self) -> Path:
        return self.dir / "ipam"

    @property
    def pod_logs(self) -> Path:
        return self.dir / "pod-logs"

    @property
    def socket(self) -> Path:
        return RUN / f"{self.name}.sock"

    @property
    def cgroup_root(self) -> str:
        """The kubelet's cgroupRoot (kubepods below it), made in every hierarchy by the harness."""
        return f"/crishim-cluster-{self.handler if self.runtime == 'cri-shim' else self.name}"

    @property
    def labels(self) -> dict[str, str]:
        return {"cri-shim.io/handler": self.handler}


NODES = (NodeSpec(1, "docker"), NodeSpec(2, "runv"), NodeSpec(3, "fake"))
# The comparison: the same cluster with two nodes on containerd (its CRI plugin doing the CNI calls
# with the same conflists), as many as the cri-shim cluster has that take conformance pods.
CONTAINERD_NODES = (NodeSpec(1, "containerd", "containerd"), NodeSpec(2, "containerd", "containerd"))
NODE_SETS = {"cri-shim": NODES, "containerd": CONTAINERD_NODES}
ALL_NODES = NODES + CONTAINERD_NODES  # what the clean-up and `check` look for
CONTAINERD = os.environ.get("CRI_SHIM_CONTAINERD", "/usr/bin/containerd")


def node(handler: str) -> NodeSpec:
    for n in NODES:
        if n.handler == handler:
            return n
    raise KeyError(handler)


def ports() -> dict[str, int]:
    """Every TCP port the cluster listens on, by who listens."""
    out = {
        "etcd": ETCD_CLIENT_PORT,
        "etcd peer": ETCD_PEER_PORT,
        "kube-apiserver": APISERVER_PORT,
        "kube-controller-manager": CONTROLLER_MANAGER_PORT,
        "kube-scheduler": SCHEDULER_PORT,
        "kube-proxy metrics": PROXY_METRICS_PORT,
        "kube-proxy healthz": PROXY_HEALTHZ_PORT,
    }
    for n in ALL_NODES:
        out[f"kubelet {n.name}"] = n.port
        out[f"kubelet {n.name} healthz"] = n.healthz_port
    return out


@dataclasses.dataclass(frozen=True)
class Binaries:
    """The programs the cluster runs: Kubernetes' from CRI_SHIM_K8S_BIN_DIR, etcd from Debian."""

    bin_dir: str
    kubelet: str
    etcd: str

    @classmethod
    def from_env(cls) -> Binaries:
        bin_dir = os.environ.get("CRI_SHIM_K8S_BIN_DIR", "")
        kubelet = os.environ.get("CRI_SHIM_KUBELET", "")
        if not kubelet and bin_dir:
            # The tools build names it after its version; a plain `kubelet` is taken too.
            kubelet = next(
                (str(p) for p in (Path(bin_dir, "kubelet-1.35"), Path(bin_dir, "kubelet")) if p.exists()),
                "",
            )
        return cls(bin_dir, kubelet, os.environ.get("CRI_SHIM_ETCD", "/usr/bin/etcd"))

    def path(self, name: str) -> str:
        return str(Path(self.bin_dir, name))

    def problem(self) -> str | None:
        """Why the cluster cannot run with these binaries, or None."""
        if not self.bin_dir:
            return "set CRI_SHIM_K8S_BIN_DIR to the directory of kube-apiserver, kubectl, ..."
        names = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kube-proxy", "kubectl")
        for name in names:
            if not os.access(self.path(name), os.X_OK):
                return f"no {name} in {self.bin_dir} (CRI_SHIM_K8S_BIN_DIR)"
        if not self.kubelet or not os.access(self.kubelet, os.X_OK):
            return (
                f"no kubelet at {self.kubelet!r} (CRI_SHIM_KUBELET, or kubelet-1.35 in CRI_SHIM_K8S_BIN_DIR)"
            )
        return None


# ------------------------------------------------------------ scale mode: hollow nodes
# `python -m tests.e2e.cluster scale` runs the control plane without the three nodes above and N real
# kubelets, each on a hollow node of one `cri-shim hollow` process (scale.py).
HOLLOW_NAME = "cri-shim-hollow"  # the hollow process's name in the state file
HOLLOW_KUBELET_PREFIX = "kubelet-hollow-"
HOLLOW_DIR = ROOT / "hollow"
HOLLOW_SOCKET_TEMPLATE = str(RUN / "hollow-{i}.sock")
HOLLOW_CGROUP = "crishim-cluster-hollow"  # the kubelets' cgroup roots are below it, in every hierarchy
HOLLOW_IP_BASE = 100  # node i at 172.30.0.(100 + i)
HOLLOW_PORT_BASE = 14000  # node i's kubelet API at 14000 + i, its healthz at 15000 + i
HOLLOW_HEALTHZ_BASE = 15000
HOLLOW_MAX = 150  # what the /24 holds above HOLLOW_IP_BASE
HOLLOW_LABELS = {"cri-shim.io/hollow": "true"}


@dataclasses.dataclass(frozen=True)
class HollowNode:
    """Node i of the hollow process: its socket, a kubelet of its own, its directories and ports.

    It has the attributes of a NodeSpec that the kubelet's configuration reads (configs.kubelet_config),
    so one function writes every kubelet's files.
    """

    index: int  # 0 .. N-1, as `cri-shim hollow` numbers its nodes

    def __post_init__(self) -> None:
        if not 0 <= self.index < HOLLOW_MAX:
            raise ValueError(f"hollow node index {self.index} outside 0..{HOLLOW_MAX - 1}")

    @property
    def name(self) -> str:
        return f"hollow-{self.index}"

    @property
    def proc_name(self) -> str:  # its kubelet's name in the state file
        return f"{HOLLOW_KUBELET_PREFIX}{self.index}"

    @property
    def ip(self) -> str:
        return f"172.30.0.{HOLLOW_IP_BASE + self.index}"

    @property
    def port(self) -> int:
        return HOLLOW_PORT_BASE + self.index

    @property
    def healthz_port(self) -> int:
        return HOLLOW_HEALTHZ_BASE + self.index

    @property
    def dir(self) -> Path:
        return HOLLOW_DIR / self.name

    @property
    def kubelet_root(self) -> Path:
        return self.dir / "kubelet"

    @property
    def pod_logs(self) -> Path:
        return self.dir / "pod-logs"

    @property
    def socket(self) -> Path:
        return Path(HOLLOW_SOCKET_TEMPLATE.format(i=self.index))

    @property
    def cgroup_root(self) -> str:
        return f"/{HOLLOW_CGROUP}/{self.name}"

    @property
    def labels(self) -> dict[str, str]:
        return dict(HOLLOW_LABELS)


def hollow_nodes(count: int) -> list[HollowNode]:
    return [HollowNode(i) for i in range(count)]


def hollow_ports(count: int) -> dict[str, int]:
    """The TCP ports N hollow nodes' kubelets listen on, by who listens."""
    out: dict[str, int] = {}
    for n in hollow_nodes(count):
        out[f"kubelet {n.name}"] = n.port
        out[f"kubelet {n.name} healthz"] = n.healthz_port
    return out
