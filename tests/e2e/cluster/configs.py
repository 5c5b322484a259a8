"""The files and command lines of the cluster's components: etcd, the control plane, kube-proxy, and
per node a kubelet and a cri-shim, the node's CNI network config and the RuntimeClasses."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.cni import realnet
from tests.e2e.cluster.layout import (
    APISERVER_PORT,
    CLUSTER_CIDR,
    CLUSTER_DOMAIN,
    CONTROL_IP,
    CONTROLLER_MANAGER_PORT,
    DNS_PORT,
    DNS_SERVICE_IP,
    DOCKER_INSTANCE,
    ETCD_CLIENT_PORT,
    ETCD_PEER_PORT,
    HOLLOW_DIR,
    HOLLOW_SOCKET_TEMPLATE,
    NODE_CIDR_MASK,
    NODE_NET,
    PKI,
    PROXY_HEALTHZ_PORT,
    PROXY_METRICS_PORT,
    ROOT,
    RUN,
    RUNV_DRIVERS,
    RUNV_OVERHEAD,
    RUNV_TAG,
    SCHEDULER_PORT,
    SERVICE_CIDR,
    Binaries,
    HollowNode,
    NodeSpec,
)
from tests.e2e.cluster.pki import FRONT_PROXY_CA, FRONT_PROXY_CLIENT
from tests.e2e.kubelet.config import runv_qemu_table, shim_command

ETCD_URL = f"https://127.0.0.1:{ETCD_CLIENT_PORT}"
API_URL = f"https://{CONTROL_IP}:{APISERVER_PORT}"
# How often etcd tells every watch how far it is (etcd_argv): below the API server's watch cache's
# 3 s wait for a resourceVersion it has not seen.
ETCD_PROGRESS_NOTIFY = "1s"
WATCH_CACHE_WAIT_SECONDS = 3.0


def _write(path: Path, data: dict[str, Any]) -> str:
    """JSON is YAML: the components read either."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return str(path)


def etcd_argv(b: Binaries) -> list[str]:
    return [
        b.etcd,
        "--name=crishim-cluster",
        f"--data-dir={ROOT / 'etcd'}",
        f"--listen-client-urls={ETCD_URL}",
        f"--advertise-client-urls={ETCD_URL}",
        f"--listen-peer-urls=http://127.0.0.1:{ETCD_PEER_PORT}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{ETCD_PEER_PORT}",
        f"--initial-cluster=crishim-cluster=http://127.0.0.1:{ETCD_PEER_PORT}",
        f"--cert-file={PKI / 'etcd-server.crt'}",
        f"--key-file={PKI / 'etcd-server.key'}",
        f"--trusted-ca-file={PKI / 'ca.crt'}",
        "--client-cert-auth=true",
        "--snapshot-count=10000",
        # Debian's etcd 3.4 lacks what the API server's watch cache asks for when a watch names a
        # resourceVersion it has not seen yet (RequestWatchProgress: "not supported" in its log);
        # the cache then waits only for events of that resource or etcd's periodic progress
        # notifications, every 10 min by default, and after 3 s fails the watch ("Too large resource
        # version"), which under load cost conformance specs. kube-up's etcd sets 5 s; 1 s stays
        # below that 3 s wait.
        f"--experimental-watch-progress-notify-interval={ETCD_PROGRESS_NOTIFY}",
    ]


def apiserver_argv(b: Binaries) -> list[str]:
    """As kubeadm sets it up, the aggregation layer's front proxy included: the API server proxies
    an APIService's group to its extension API server with the front-proxy client certificate and
    the caller's user, groups and extras in the X-Remote-* headers (the Aggregator conformance spec
    registers a sample API server that way)."""
    return [
        b.path("kube-apiserver"),
        f"--advertise-address={CONTROL_IP}",
        f"--bind-address={CONTROL_IP}",
        f"--secure-port={APISERVER_PORT}",
        f"--etcd-servers={ETCD_URL}",
        f"--etcd-cafile={PKI / 'ca.crt'}",
        f"--etcd-certfile={PKI / 'apiserver-etcd-client.crt'}",
        f"--etcd-keyfile={PKI / 'apiserver-etcd-client.key'}",
        f"--tls-cert-file={PKI / 'apiserver.crt'}",
        f"--tls-private-key-file={PKI / 'apiserver.key'}",
        f"--client-ca-file={PKI / 'ca.crt'}",
        f"--kubelet-client-certificate={PKI / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={PKI / 'apiserver-kubelet-client.key'}",
        "--kubelet-preferred-address-types=InternalIP",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        "--allow-privileged=true",
        "--enable-bootstrap-token-auth=true",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={PKI / 'sa.pub'}",
        f"--service-account-signing-key-file={PKI / 'sa.key'}",
        f"--requestheader-client-ca-file={PKI / f'{FRONT_PROXY_CA}.crt'}",
        f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={PKI / f'{FRONT_PROXY_CLIENT}.crt'}",
        f"--proxy-client-key-file={PKI / f'{FRONT_PROXY_CLIENT}.key'}",
        "--profiling=false",
        "--v=1",
    ]


def controller_manager_argv(b: Binaries) -> list[str]:
    kubeconfig = str(PKI / "controller-manager.kubeconfig")
    return [
        b.path("kube-controller-manager"),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={CONTROLLER_MANAGER_PORT}",
        "--allocate-node-cidrs=true",
        f"--cluster-cidr={CLUSTER_CIDR}",
        f"--node-cidr-mask-size={NODE_CIDR_MASK}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        f"--cluster-signing-cert-file={PKI / 'ca.crt'}",
        f"--cluster-signing-key-file={PKI / 'ca.key'}",
        f"--root-ca-file={PKI / 'ca.crt'}",
        f"--service-account-private-key-file={PKI / 'sa.key'}",
        "--use-service-account-credentials=true",
        "--controllers=*,bootstrapsigner,tokencleaner",
        "--leader-elect=false",
        "--profiling=false",
        "--v=1",
    ]


def scheduler_argv(b: Binaries) -> list[str]:
    kubeconfig = str(PKI / "scheduler.kubeconfig")
    return [
        b.path("kube-scheduler"),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={SCHEDULER_PORT}",
        "--leader-elect=false",
        "--profiling=false",
        "--v=1",
    ]


def kube_proxy_config(hostname: str) -> str:
    """iptables mode, leaving the host's conntrack and route_localnet settings alone."""
    cfg = {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(PKI / "kube-proxy.kubeconfig")},
        "mode": "iptables",
        "clusterCIDR": CLUSTER_CIDR,
        # One kube-proxy serves every node: they share the host's network namespace.
        "hostnameOverride": hostname,
        "bindAddress": "0.0.0.0",
        "healthzBindAddress": f"127.0.0.1:{PROXY_HEALTHZ_PORT}",
        "metricsBindAddress": f"127.0.0.1:{PROXY_METRICS_PORT}",
        # NodePorts on the nodes' addresses only: the machine's own are other people's.
        "nodePortAddresses": [NODE_NET],
        # root lacks CAP_SYS_RESOURCE here: a negative oom_score_adj fails.
        "oomScoreAdj": 0,
        "iptables": {"localhostNodePorts": False, "syncPeriod": "30s", "minSyncPeriod": "1s"},
        "conntrack": {
            "maxPerCore": 0,
            "min": 0,
            "tcpEstablishedTimeout": "0s",
            "tcpCloseWaitTimeout": "0s",
        },
    }
    return _write(ROOT / "kube-proxy.yaml", cfg)


def kube_proxy_argv(b: Binaries, hostname: str) -> list[str]:
    return [b.path("kube-proxy"), f"--config={kube_proxy_config(hostname)}", "--v=1"]


def kubelet_config(n: NodeSpec | HollowNode) -> str:
    cfg = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": n.ip,
        "port": n.port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": n.healthz_port,
        "containerRuntimeEndpoint": f"unix://{n.socket}",
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(PKI / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        # The harness's DNS (dnsserver.py) behind the kube-dns Service; the host's resolv.conf
        # gives the search domains pods get after the cluster's and what ClusterFirst falls back on.
        "clusterDNS": [DNS_SERVICE_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": "/etc/resolv.conf",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": n.cgroup_root,
        "cgroupsPerQOS": True,
        # This machine's cgroups are hybrid (v1 controllers): a 1.35 kubelet refuses v1 unless told.
        "failCgroupV1": False,
        # root lacks CAP_SYS_RESOURCE here: a negative oom_score_adj fails.
        "oomScoreAdj": 0,
        "failSwapOn": False,
        "protectKernelDefaults": False,
        # kube-proxy owns the host's iptables rules of the cluster.
        "makeIPTablesUtilChains": False,
        "podLogsDir": str(n.pod_logs),
        "volumePluginDir": str(n.dir / "volume-plugins"),
        "serializeImagePulls": False,
        "rotateCertificates": False,
        # A busy shared disk must not evict pods or garbage-collect the test images.
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "localStorageCapacityIsolation": True,
    }
    return _write(n.dir / "kubelet.yaml", cfg)


def dns_argv() -> list[str]:
    """The cluster's DNS server on the control plane's address, reading the API server as the admin
    (it lists every namespace's Services, EndpointSlices and Pods; no RBAC role is made for it)."""
    return [
        sys.executable,
        "-m",
        "tests.e2e.cluster.dnsserver",
        f"--listen={CONTROL_IP}:{DNS_PORT}",
        f"--kubeconfig={PKI / 'admin.kubeconfig'}",
        f"--domain={CLUSTER_DOMAIN}",
        f"--reverse-cidr={SERVICE_CIDR}",
        f"--reverse-cidr={CLUSTER_CIDR}",
    ]


def kube_dns() -> list[dict[str, Any]]:
    """Service kube-system/kube-dns at DNS_SERVICE_IP, selector-less, and the EndpointSlice that
    points it at the DNS server on the control plane's address (kube-proxy routes it from there)."""
    ports = [("dns", "UDP"), ("dns-tcp", "TCP")]
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": "kube-dns",
                "namespace": "kube-system",
                "labels": {"k8s-app": "kube-dns"},
            },
            "spec": {
                "clusterIP": DNS_SERVICE_IP,
                "ports": [
                    {"name": n, "protocol": p, "port": DNS_PORT, "targetPort": DNS_PORT} for n, p in ports
                ],
            },
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "kube-dns-harness",
                "namespace": "kube-system",
                "labels": {
                    "kubernetes.io/service-name": "kube-dns",
                    "endpointslice.kubernetes.io/managed-by": "cri-shim-cluster-harness",
                },
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [CONTROL_IP], "conditions": {"ready": True}}],
            "ports": [{"name": n, "protocol": p, "port": DNS_PORT} for n, p in ports],
        },
    ]


def kubelet_argv(n: NodeSpec | HollowNode, kubelet: str) -> list[str]:
    return [
        kubelet,
        f"--config={kubelet_config(n)}",
        f"--kubeconfig={PKI / f'node-{n.name}.kubeconfig'}",
        f"--root-dir={n.kubelet_root}",
        f"--hostname-override={n.name}",
        f"--node-ip={n.ip}",
        "--node-labels=" + ",".join(f"{k}={v}" for k, v in n.labels.items()),
        "--v=2",
    ]


def shim_config(n: NodeSpec, pause: str, runv_driver: str = "stub") -> str:
    lines = [
        "[server]",
        'transport = "native"',  # the default of serve, as the nodes users run
        "[images]",
        f'pause_image = "{pause}"',
        "[streaming]",
        'address = "127.0.0.1"',
        "[nri]",
        # One NRI socket per machine: the harness's nodes take none.
        "enable = false",
        "[logging]",
        'level = "info"',
    ]
    if n.handler == "docker":
        lines += [
            "[handlers.docker]",
            'type = "docker"',
            'pod_network = "cni"',
            f'instance = "{DOCKER_INSTANCE}"',
        ]
    elif n.handler == "runv":
        tag = RUNV_TAG
        lines += [
            "[handlers.runv]",
            'type = "runv"',
            'pod_network = "cni"',
            f'root = "{n.dir / "runv"}"',
            f'run_dir = "{RUN / "rv"}"',  # short: agent socket paths must fit in sun_path
            "[handlers.runv.network]",
            # runv's own bridge serves no pod here (they are on CNI); named so that the clean-up finds it.
            f'bridge = "rvk{tag}"',
            'subnet = "10.94.250.0/24"',
            f'ipam_dir = "{n.dir / "runv-ipam"}"',
            f'hostport_chain = "CRISHIM-K-{tag}"',
            "[handlers.runv.stub]",
            f'cgroup_parent = "cri-shim-runv-e2e-{tag}"',
        ]
        if runv_driver == "qemu":
            # VMs of the node's shape from templates, shares on virtio-fs (the driver's defaults);
            # its VMs' state, agent sockets and templates under run_dir, cgroups below the same parent.
            lines.insert(lines.index('type = "runv"') + 1, 'driver = "qemu"')
            lines += runv_qemu_table("runv", f"cri-shim-runv-e2e-{tag}")
        elif runv_driver != "stub":
            raise ValueError(f"runv driver {runv_driver!r}: one of {', '.join(RUNV_DRIVERS)}")
    else:
        lines += ["[handlers.fake]", 'type = "fake"']
    if n.cni:
        lines += [
            "[cni]",
            f'conf_dir = "{n.cni_conf_dir}"',
            f'bin_dirs = ["{realnet.PLUGIN_DIR}"]',
        ]
    path = n.dir / "cri-shim.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def shim_argv(n: NodeSpec, pause: str, runv_driver: str = "stub") -> list[str]:
    return [
        *shim_command(),
        "serve",
        "--config",
        shim_config(n, pause, runv_driver),
        "--listen",
        f"unix://{n.socket}",
        "--state-dir",
        str(n.state_dir),
        "--default-handler",
        n.handler,
    ]


def hollow_shim_config(pause: str) -> str:
    """One fake handler, copied per node by `cri-shim hollow`; NRI off (no `{i}` in a socket path)."""
    lines = [
        "[server]",
        'transport = "native"',
        "[images]",
        f'pause_image = "{pause}"',
        "[streaming]",
        'address = "127.0.0.1"',
        "[nri]",
        "enable = false",
        "[logging]",
        'level = "info"',  # mutating RPCs only: the kubelets' polls log at debug
        "[handlers.fake]",
        'type = "fake"',
    ]
    path = HOLLOW_DIR / "cri-shim.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def hollow_shim_argv(count: int, pause: str) -> list[str]:
    return [
        *shim_command(),
        "hollow",
        "--nodes",
        str(count),
        "--config",
        hollow_shim_config(pause),
        "--socket-template",
        HOLLOW_SOCKET_TEMPLATE,
        "--state-root",
        str(HOLLOW_DIR / "shim"),
    ]


def conflist(n: NodeSpec, pod_cidr: str) -> dict[str, Any]:
    """The node's network: its own bridge (the gateway of its pod CIDR: the host routes between the
    nodes' bridges), host-local addresses from the node's podCIDR, portmap for host ports."""
    gateway = pod_cidr.rsplit(".", 1)[0] + ".1"
    return {
        "cniVersion": "1.0.0",
        "name": n.network,
        "plugins": [
            {"type": "loopback"},
            {
                "type": "bridge",
                "bridge": n.bridge,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(n.ipam_dir),
                    "ranges": [[{"subnet": pod_cidr, "gateway": gateway}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def write_conflist(n: NodeSpec, pod_cidr: str) -> None:
    """Written whole or not at all: the shim reads the directory again when it changes."""
    n.cni_conf_dir.mkdir(parents=True, exist_ok=True)
    tmp = n.cni_conf_dir / ".conflist.tmp"
    tmp.write_text(json.dumps(conflist(n, pod_cidr), indent=2) + "\n")
    tmp.replace(n.conflist)


def runtime_classes(nodes: Sequence[NodeSpec], runv_driver: str = "stub") -> list[dict[str, Any]]:
    """A RuntimeClass per extra handler, scheduled onto the node whose shim serves it; runv's with
    the overhead its driver's VMs need (RUNV_OVERHEAD)."""
    out: list[dict[str, Any]] = []
    for n in nodes:
        if n.handler not in ("runv", "fake"):
            continue
        rc: dict[str, Any] = {
            "apiVersion": "node.k8s.io/v1",
            "kind": "RuntimeClass",
            "metadata": {"name": n.handler},
            "handler": n.handler,
            "scheduling": {"nodeSelector": n.labels},
        }
        if n.handler == "runv":
            rc["overhead"] = {"podFixed": dict(RUNV_OVERHEAD[runv_driver])}
        out.append(rc)
    return out


# ------------------------------------------------------------ a containerd node (the comparison)
def containerd_config(n: NodeSpec, pause: str) -> str:
    """containerd 1.6 with its CRI plugin, private to the node: its socket, root and state, runc's
    state, the network namespaces, the node's CNI directory (the same conflist a cri-shim node gets),
    the local registry over plain HTTP (the TLS mirror of registry.k8s.io is in the system's CA store)."""
    certs = n.dir / "certs.d"
    hosts = certs / "127.0.0.1:5000" / "hosts.toml"
    hosts.parent.mkdir(parents=True, exist_ok=True)
    hosts.write_text(
        'server = "http://127.0.0.1:5000"\n[host."http://127.0.0.1:5000"]\n'
        '  capabilities = ["pull", "resolve", "push"]\n'
    )
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    runc = f"{cri}.containerd.runtimes.runc"
    text = f"""version = 2
root = "{n.state_dir}"
state = "{RUN / n.name}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "{n.socket}"
[ttrpc]
  address = "{n.socket}.ttrpc"
[{cri}]
  sandbox_image = "{pause}"
  # root lacks CAP_SYS_RESOURCE here: runc cannot set the negative scores the plugin asks for.
  restrict_oom_score_adj = {"false" if _has_sys_resource() else "true"}
  enable_selinux = false
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  netns_mounts_under_state_dir = true
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{runc}]
      runtime_type = "io.containerd.runc.v2"
      [{runc}.options]
        SystemdCgroup = false
        Root = "{RUN / n.name / "runc"}"
  [{cri}.cni]
    bin_dir = "{realnet.PLUGIN_DIR}"
    conf_dir = "{n.cni_conf_dir}"
    max_conf_num = 1
  [{cri}.registry]
    config_path = "{certs}"
"""
    path = n.dir / "containerd.toml"
    path.write_text(text)
    return str(path)


def _has_sys_resource() -> bool:
    with open("/proc/self/status") as fh:
        eff = next(int(line.split()[1], 16) for line in fh if line.startswith("CapEff:"))
    return bool(eff >> 24 & 1)


def containerd_argv(n: NodeSpec, pause: str, containerd: str) -> list[str]:
    return [containerd, "--config", containerd_config(n, pause), "--log-level", "info"]
