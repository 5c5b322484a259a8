"""A cluster of cri-shim nodes on this machine: a real control plane and three kubelets, each on its own cri-shim.

Opt-in, as root, with the binaries from the environment (nothing of the Kubernetes tree is in
this checkout): ``CRI_SHIM_K8S_BIN_DIR`` names the directory of kube-apiserver,
kube-controller-manager, kube-scheduler, kube-proxy and kubectl (v1.35); ``CRI_SHIM_KUBELET`` the
kubelet (default: ``kubelet-1.35`` or ``kubelet`` in that directory); etcd is Debian's
``etcd-server`` (installed when missing).

    python -m tests.e2e.cluster up       # leaves the cluster running; prints the admin kubeconfig
    python -m tests.e2e.cluster up --runtime containerd   # the comparison: two containerd nodes
    python -m tests.e2e.cluster up --runv-driver qemu     # the runv node on QEMU VMs (TCG here: slow)
    python -m tests.e2e.cluster check    # what of the cluster is on the machine (nothing after down)
    python -m tests.e2e.cluster down [--keep]   # takes everything away (--keep: the logs, to /tmp)
    python -m tests.e2e.cluster scale --nodes N  # N kubelets on one `cri-shim hollow`: figures, then down

What runs: etcd (TLS, client certificates), kube-apiserver (TLS, a service-account issuer and keys,
Node,RBAC authorization, NodeRestriction, client certificates for the admin, the components and the
kubelets), kube-controller-manager (allocating each node a /24 of 10.244.0.0/16), kube-scheduler,
kube-proxy (iptables; one for the host, since the nodes share its network namespace), a cluster
DNS server of the harness's behind the kube-dns Service at 10.96.0.10, and three
nodes, each a kubelet v1.35 with its own cri-shim: ``crishim-docker`` (docker), ``crishim-runv``
(runv, stub driver; qemu with ``--runv-driver qemu``), ``crishim-fake`` (fake). docker and runv
pods are on a CNI network per node
(bridge + host-local over the node's podCIDR + portmap), whose config the harness writes once the
node has its podCIDR; the host routes between the nodes' bridges. RuntimeClasses ``runv`` and
``fake`` schedule onto their nodes. ``layout`` says where everything lives.

``up --runtime containerd`` brings up the same control plane, DNS and kube-proxy with two nodes
``ctrd-1`` and ``ctrd-2`` instead, each a kubelet v1.35 on a containerd of its own (Debian's 1.6,
its CRI plugin doing the CNI calls with the same per-node conflist): the conformance suite's
comparison on the same harness.

Modules: ``layout`` (paths, addresses, ports, nodes, binaries), ``pki`` (CA, certificates,
kubeconfigs), ``configs`` (each component's files and command line), ``procs`` (the daemons and the
state file), ``hostnet`` (bridges, iptables, cgroups, mounts on the host; what is left),
``kubectl`` (the admin's kubectl and waits), ``bringup`` (up, down, check), ``dnswire``,
``dnszone``, ``dnsserver`` (the cluster's DNS: wire format, records, the server process), ``scale``
and ``sampling`` (the scale mode: N real kubelets on hollow nodes, the processes' CPU and memory),
``__main__``.
"""

from tests.e2e.cluster.bringup import (
    check,
    down,
    environment_problem,
    images,
    is_up,
    restart_kubelet,
    restart_shim,
    state,
    up,
)
from tests.e2e.cluster.kubectl import Kubectl, KubectlError, wait_for
from tests.e2e.cluster.layout import NODES, Binaries, NodeSpec, node
from tests.e2e.cluster.pki import admin_kubeconfig

__all__ = [
    "NODES",
    "Binaries",
    "Kubectl",
    "KubectlError",
    "NodeSpec",
    "admin_kubeconfig",
    "check",
    "down",
    "environment_problem",
    "images",
    "is_up",
    "node",
    "restart_kubelet",
    "restart_shim",
    "state",
    "up",
    "wait_for",
]
