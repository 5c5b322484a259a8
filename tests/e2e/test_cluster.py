"""A cluster of cri-shim nodes (tests/e2e/cluster): issue 27's scenarios through the API server.

Opt-in: runs only as root with CRI_SHIM_K8S_BIN_DIR naming the directory of the v1.35
kube-apiserver, kube-controller-manager, kube-scheduler, kube-proxy and kubectl (and
CRI_SHIM_KUBELET a kubelet, default kubelet-1.35 there); skipped, also in CI, without them. The
module brings the cluster up once, runs each scenario in a namespace of its own with kubectl and
the admin kubeconfig, and at the end takes everything down, asserting that nothing is left.
CRI_SHIM_CLUSTER_KEEP=1 leaves the cluster running instead (`python -m tests.e2e.cluster down`), and
runs the scenarios on a cluster that `python -m tests.e2e.cluster up` left running.

Scenarios run on the docker and runv nodes, and on the fake where it can: its pods have simulated
IPs (no traffic reaches them) and its shell has no tar or dd, so pod networking, Services, `cp`
and the OOM kill are asserted on docker and runv only.

CRI_SHIM_CLUSTER_RUNV_DRIVER=qemu runs the runv node on runv's qemu driver (real VMs, TCG here;
`up --runv-driver qemu`): its pods' waits, and every test's deadline, are RUNV_PATIENCE (layout) times longer.
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import cluster as cl
from tests.e2e.cluster import dnswire, layout
from tests.e2e.cluster import workloads as w
from tests.e2e.cluster.kubectl import condition, node_ready
from tests.e2e.cluster.layout import CLUSTER_CIDR, CLUSTER_DOMAIN, CONTROL_IP, DNS_SERVICE_IP, NODES

HANDLERS = [n.handler for n in NODES]
REAL = ["docker", "runv"]  # real processes and a real pod network
RUNV_DRIVER = os.environ.get(layout.RUNV_DRIVER_ENV) or "stub"
SLOW = layout.RUNV_PATIENCE.get(RUNV_DRIVER, 1.0)  # the tests' deadlines (a last resort) with that driver

pytestmark = [pytest.mark.slow]


@dataclasses.dataclass
class Env:
    b: cl.Binaries
    k: cl.Kubectl
    state: dict[str, Any]
    is_down: bool = False

    def patience(self, handler: str) -> float:
        """How many times the stub's waits a pod of the node of `handler` is given."""
        return layout.RUNV_PATIENCE[self.state.get("runv_driver") or "stub"] if handler == "runv" else 1.0

    def image(self, name: str) -> str:
        image = str(self.state["images"][name])
        if not image:
            pytest.skip(f"no {name} image: /etc/testenv/e2e-images.txt does not list it")
        return image


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Env]:
    if not os.environ.get("CRI_SHIM_K8S_BIN_DIR"):
        pytest.skip("set CRI_SHIM_K8S_BIN_DIR to the Kubernetes binaries to run the cluster scenarios")
    b = cl.Binaries.from_env()
    keep = bool(os.environ.get("CRI_SHIM_CLUSTER_KEEP"))
    if keep and cl.is_up():  # a cluster left up by an earlier run: scenarios on it again
        state = cl.state()
        if (state.get("runtime") or "cri-shim") != "cri-shim":
            pytest.skip(
                f"the cluster left up has {state['runtime']} nodes (`up --runtime`): the scenarios need cri-shim's"
            )
        if (state.get("runv_driver") or "stub") != RUNV_DRIVER:
            pytest.skip(
                f"the cluster left up runs runv on {state.get('runv_driver')}: set {layout.RUNV_DRIVER_ENV}"
            )
        yield Env(b, cl.Kubectl(b), state)
        return
    problem = cl.environment_problem(b, runv_driver=RUNV_DRIVER)
    if problem:
        pytest.skip(problem)
    env = Env(b, cl.Kubectl(b), cl.up(b, runv_driver=RUNV_DRIVER))
    print(f"cluster up (runv: {RUNV_DRIVER}) in {env.state['up_seconds']} s: {env.state['timings']}")
    yield env
    if not env.is_down and not keep:
        cl.down(b, keep_logs=request.session.testsfailed > 0)


@pytest.fixture
def ns(cluster: Env, request: pytest.FixtureRequest) -> Iterator[str]:
    name = w.new_namespace(cluster.k, request.node.name.replace("[", "-").replace("]", "")[5:])
    yield name
    cluster.k.run("delete", "namespace", name, "--wait=false", check=False)


def busybox_pod(env: Env, name: str, handler: str, *command: str, **extra: Any) -> dict[str, Any]:
    cmd = command or ("sleep", "3600")
    return w.pod(name, w.container("main", env.image("busybox"), *cmd), on=cl.node(handler), **extra)


def wait_pod(env: Env, ns: str, pod: str, handler: str, pred: Any = w.ready, timeout: float = 240) -> Any:
    """w.wait_pod, `timeout` being the stub's: times the patience of the node of `handler`."""
    return w.wait_pod(env.k, ns, pod, pred, timeout * env.patience(handler))


def run_pod(env: Env, ns: str, manifest: dict[str, Any], timeout: float = 240) -> dict[str, Any]:
    spec = manifest["spec"]
    handler = (spec.get("nodeSelector") or {}).get("cri-shim.io/handler") or spec.get("runtimeClassName")
    env.k.apply(manifest, namespace=ns)
    return wait_pod(env, ns, manifest["metadata"]["name"], handler or "", timeout=timeout)


def sh(env: Env, ns: str, pod: str, script: str, container: str | None = None) -> str:
    c = ["-c", container] if container else []
    return env.k("exec", "-n", ns, pod, *c, "--", "sh", "-c", script)


def rfc3339(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


# ------------------------------------------------------------ nodes and their network
@pytest.mark.timeout(900 * SLOW)
def test_nodes_ready_only_after_their_cni_config(cluster: Env) -> None:
    k = cluster.k
    cidrs = set()
    for n in NODES:
        node = k.get("node", n.name)
        assert node_ready(node), node["status"]["conditions"]
        cidr = ipaddress.ip_network(node["spec"]["podCIDR"])
        assert cidr.subnet_of(ipaddress.ip_network(CLUSTER_CIDR)) and cidr.prefixlen == 24
        cidrs.add(cidr)
        assert {a["address"] for a in node["status"]["addresses"] if a["type"] == "InternalIP"} == {n.ip}
    assert len(cidrs) == len(NODES)
    for n in NODES:
        if not n.cni:
            continue
        seen = cluster.state["cni"][n.name]
        # Before the harness wrote the config: NotReady, for the runtime's network, naming the directory.
        assert seen["before"]["status"] == "False"
        assert "NetworkReady=false" in seen["before"]["message"]
        assert str(n.cni_conf_dir) in seen["before"]["message"]
        # Ready from the second the config was written, not before (the API keeps whole seconds).
        assert rfc3339(seen["ready"]["lastTransitionTime"]) >= int(seen["written_at"])
        plugins = json.loads(n.conflist.read_text())["plugins"]
        assert plugins[1]["ipam"]["ranges"][0][0]["subnet"] == seen["pod_cidr"]

    # The same, live: a node whose config goes away turns NotReady, and Ready when it is back.
    n = cl.node("runv")
    saved = n.conflist.read_text()
    n.conflist.unlink()
    try:
        gone = cl.wait_for(
            f"{n.name} NotReady", lambda: (lambda c: c if c["status"] != "True" else None)(
                condition(k.get("node", n.name), "Ready")
            ), 120,
        )  # fmt: skip
        assert "NetworkReady=false" in gone["message"]
    finally:
        n.conflist.write_text(saved)
    cl.wait_for(f"{n.name} Ready again", lambda: node_ready(k.get("node", n.name)), 120)


@pytest.mark.timeout(600 * SLOW)
def test_deployment_of_six_spreads_over_the_nodes(cluster: Env, ns: str) -> None:
    spread = {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": {"app": "spread"}},
    }
    template = w.pod(
        "spread",
        w.container("main", cluster.image("busybox"), "sleep", "3600"),
        topologySpreadConstraints=[spread],
    )
    cluster.k.apply(w.deployment("spread", 6, template), namespace=ns)
    cl.wait_for(
        "6 replicas available",
        lambda: cluster.k.get("deployment", "spread", ns)["status"].get("availableReplicas") == 6,
        300 * SLOW,
    )
    pods = w.pods_of(cluster.k, ns, "app=spread")
    assert collections.Counter(p["spec"]["nodeName"] for p in pods) == {n.name: 2 for n in NODES}
    for p in pods:
        node = cluster.k.get("node", p["spec"]["nodeName"])
        assert ipaddress.ip_address(p["status"]["podIP"]) in ipaddress.ip_network(node["spec"]["podCIDR"])


@dataclasses.dataclass
class Web:
    ns: str
    ips: dict[str, str]  # pod name -> IP

    @property
    def pods(self) -> list[str]:
        return sorted(self.ips)


@pytest.fixture(scope="module")
def web(cluster: Env) -> Iterator[Web]:
    """agnhost netexec on the docker and the runv node behind a NodePort Service `web` (port 80)."""
    k = cluster.k
    ns = w.new_namespace(k, "web")
    image = cluster.image("agnhost")
    for handler in REAL:
        manifest = w.netexec(f"web-{handler}", image, cl.node(handler))
        manifest["metadata"]["labels"] = {"app": "web"}
        k.apply(manifest, namespace=ns)
    k.apply(w.service("web", {"app": "web"}, 80, 8080, node_port=True), namespace=ns)
    ips = {f"web-{h}": wait_pod(cluster, ns, f"web-{h}", h)["status"]["podIP"] for h in REAL}
    yield Web(ns, ips)
    k.run("delete", "namespace", ns, "--wait=false", check=False)


def curl(env: Env, ns: str, pod: str, url: str) -> str:
    return env.k("exec", "-n", ns, pod, "--", "curl", "-sS", "-m", "10", url).strip()


def from_host(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode()).strip()


@pytest.mark.timeout(600 * SLOW)
def test_pod_to_pod_across_nodes_by_ip(cluster: Env, web: Web) -> None:
    for src in web.pods:
        for dst in web.pods:
            if src == dst:
                continue
            assert curl(cluster, web.ns, src, f"http://{web.ips[dst]}:8080/hostname") == dst
            # Not masqueraded on the way: the server sees the client pod's own address.
            seen = curl(cluster, web.ns, src, f"http://{web.ips[dst]}:8080/clientip")
            assert seen.rsplit(":", 1)[0] == web.ips[src]
    for pod, ip in web.ips.items():  # and the host (the nodes' network namespace) to every pod
        assert from_host(f"http://{ip}:8080/hostname") == pod


def backends_seen(fetch: Any, expected: set[str], tries: int = 60) -> set[str]:
    """Ask through a Service until every backend answered (or `tries` answers came)."""
    seen: set[str] = set()
    for _ in range(tries):
        seen.add(fetch())
        if seen >= expected:
            break
    return seen


@pytest.mark.timeout(900 * SLOW)
def test_cluster_ip_and_node_port_answer_from_every_node_and_pod(cluster: Env, web: Web) -> None:
    svc = cluster.k.get("service", "web", web.ns)
    cluster_ip, node_port = svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["nodePort"]
    expected = set(web.pods)
    urls = [f"http://{cluster_ip}:80/hostname"] + [f"http://{n.ip}:{node_port}/hostname" for n in NODES]
    cl.wait_for(  # kube-proxy programs the rules within its sync period
        "the Service's endpoints in kube-proxy's rules",
        lambda: (lambda x: x in expected)(from_host(urls[0])),
        60,
    )
    for url in urls:
        assert backends_seen(lambda url=url: from_host(url), expected) == expected, f"from the host: {url}"
    for pod in web.pods:
        for url in urls:
            got = backends_seen(lambda pod=pod, url=url: curl(cluster, web.ns, pod, url), expected)
            assert got == expected, f"from {pod}: {url}"
        # The API server through its Service, with the pod's service-account token and the cluster CA.
        token = "/var/run/secrets/kubernetes.io/serviceaccount"
        out = sh(
            cluster, web.ns, pod,
            f'curl -sS -m 10 --cacert {token}/ca.crt -H "Authorization: Bearer $(cat {token}/token)" '
            f"https://kubernetes.default.svc.cluster.local:443/api --resolve "
            f"kubernetes.default.svc.cluster.local:443:10.96.0.1",
        )  # fmt: skip
        assert json.loads(out)["kind"] == "APIVersions", out


@pytest.mark.timeout(600 * SLOW)
def test_cluster_dns_from_pods_and_the_host(cluster: Env, web: Web) -> None:
    """The harness's DNS through the kube-dns Service: names of Services (ClusterIP, headless, by the
    search path), the API server by name with the pod's token, from each real node's pods; from the
    host both at the server's own address and at the Service's."""
    k = cluster.k
    headless = w.service("web-pods", {"app": "web"}, 8080, 8080, node_port=False)
    headless["spec"]["clusterIP"] = "None"
    k.apply(headless, namespace=web.ns)
    fqdn = f"web.{web.ns}.svc.{CLUSTER_DOMAIN}"
    svc_ip = k.get("service", "web", web.ns)["spec"]["clusterIP"]

    def answers(server: str) -> list[object] | None:
        m = dnswire.ask(server, 53, fqdn, dnswire.A, tcp=server == DNS_SERVICE_IP)
        return [r.data for r in m.answers] or None

    for server in (CONTROL_IP, DNS_SERVICE_IP):
        assert cl.wait_for(f"{fqdn} from {server}", lambda server=server: answers(server), 60) == [svc_ip]
    expected = set(web.pods)
    token = "/var/run/secrets/kubernetes.io/serviceaccount"
    for pod in web.pods:
        resolv = sh(cluster, web.ns, pod, "cat /etc/resolv.conf")
        assert f"nameserver {DNS_SERVICE_IP}" in resolv and f"{web.ns}.svc.{CLUSTER_DOMAIN}" in resolv, resolv
        for url in (f"http://{fqdn}:80/hostname", "http://web/hostname"):
            got = backends_seen(lambda pod=pod, url=url: curl(cluster, web.ns, pod, url), expected)
            assert got == expected, f"from {pod}: {url}"
        # The headless Service's name is the pods' addresses (which one a client takes is its own choice).
        assert curl(cluster, web.ns, pod, f"http://web-pods.{web.ns}:8080/hostname") in expected
        out = sh(
            cluster, web.ns, pod,
            f'curl -sS -m 10 --cacert {token}/ca.crt -H "Authorization: Bearer $(cat {token}/token)" '
            "https://kubernetes.default.svc/api",
        )  # fmt: skip
        assert json.loads(out)["kind"] == "APIVersions", out


# ------------------------------------------------------------ kubectl through the API server
LOGGER = (
    "if [ -f /data/ran ]; then echo second-run; else touch /data/ran; echo first-run; exit 1; fi; "
    "echo early-line; i=0; while true; do i=$((i+1)); echo tick-$i; sleep 1; done"
)


@pytest.mark.timeout(600 * SLOW)
@pytest.mark.parametrize("handler", HANDLERS)
def test_kubectl_logs(cluster: Env, ns: str, handler: str) -> None:
    k = cluster.k
    manifest = busybox_pod(
        cluster, "logger", handler, "sh", "-c", LOGGER, volumes=[{"name": "data", "emptyDir": {}}]
    )
    manifest["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    k.apply(manifest, namespace=ns)
    # Ready in its second run: the first may be seen running before it exits.
    second = lambda p: w.ready(p) and w.container_status(p, "main")["restartCount"] >= 1  # noqa: E731
    wait_pod(cluster, ns, "logger", handler, second, timeout=300)
    current = k("logs", "-n", ns, "logger")
    assert "second-run" in current and "first-run" not in current
    previous = k("logs", "-n", ns, "logger", "--previous")
    assert "first-run" in previous and "second-run" not in previous
    with w.background(k, "logs", "-f", "-n", ns, "logger") as follow:
        w.read_until(follow, "tick-15", 120)  # lines keep coming while it follows
    stamped = k("logs", "-n", ns, "logger", "--timestamps").splitlines()
    tick3 = next(line.split()[0] for line in stamped if line.endswith(" tick-3"))
    since = k("logs", "-n", ns, "logger", f"--since-time={tick3}")
    assert "tick-3" in since.split() and "early-line" not in since
    # early-line is 14 s old or more by now, and a tick comes every second.
    recent = k("logs", "-n", ns, "logger", "--since=5s")
    assert "early-line" not in recent and "tick-" in recent, recent
    assert k("logs", "-n", ns, "logger", "--tail=1").startswith("tick-")


@pytest.mark.timeout(600 * SLOW)
@pytest.mark.parametrize("handler", HANDLERS)
def test_kubectl_exec_with_and_without_tty(cluster: Env, ns: str, handler: str) -> None:
    run_pod(cluster, ns, busybox_pod(cluster, "box", handler))
    assert sh(cluster, ns, "box", "echo $((6*7))") == "42\n"
    assert cluster.k("exec", "-i", "-n", ns, "box", "--", "cat", input="from-stdin\n") == "from-stdin\n"
    failed = cluster.k.run("exec", "-n", ns, "box", "--", "sh", "-c", "exit 3", check=False)
    assert failed.returncode == 3, failed.stderr
    assert "TTY-NO" in sh(cluster, ns, "box", "[ -t 0 ] && echo TTY-YES || echo TTY-NO")
    out = w.exec_tty(cluster.k, ns, "box", "[ -t 0 ] && echo TTY-YES || echo TTY-NO; echo done-$((2+3))")
    assert "done-5" in out, out
    if handler != "fake":  # the fake's shell has no terminal to test
        assert "TTY-YES" in out, out


@pytest.mark.timeout(600 * SLOW)
@pytest.mark.parametrize("handler", HANDLERS)
def test_kubectl_attach(cluster: Env, ns: str, handler: str) -> None:
    manifest = busybox_pod(cluster, "reader", handler, "sh", "-c", "while read l; do echo got-$l; done")
    manifest["spec"]["containers"][0]["stdin"] = True
    run_pod(cluster, ns, manifest)
    with w.background(cluster.k, "attach", "-i", "-n", ns, "reader") as proc:
        assert proc.stdin is not None
        proc.stdin.write("ping\n")
        proc.stdin.flush()
        w.read_until(proc, "got-ping", 60)
    assert "got-ping" in cluster.k("logs", "-n", ns, "reader")


@pytest.mark.timeout(600 * SLOW)
@pytest.mark.parametrize("handler", HANDLERS)
def test_kubectl_port_forward(cluster: Env, ns: str, handler: str) -> None:
    if handler == "fake":  # the fake answers port-forward with an echo
        run_pod(cluster, ns, busybox_pod(cluster, "fwd", handler))
        with (
            w.port_forward(cluster.k, ns, "fwd", 8080) as port,
            socket.create_connection(("127.0.0.1", port)) as s,
        ):
            s.settimeout(30)
            s.sendall(b"ping\n")
            assert s.recv(16) == b"ping\n"
        return
    run_pod(cluster, ns, w.netexec("fwd", cluster.image("agnhost"), cl.node(handler)))
    with w.port_forward(cluster.k, ns, "fwd", 8080) as port:
        for _ in range(3):  # several connections over one forward
            assert from_host(f"http://127.0.0.1:{port}/hostname") == "fwd"


@pytest.mark.timeout(600 * SLOW)
@pytest.mark.parametrize("handler", HANDLERS)
def test_kubectl_cp(cluster: Env, ns: str, handler: str, tmp_path: Path) -> None:
    if handler == "fake":
        pytest.skip("kubectl cp runs tar in the container: the fake's shell has none")
    run_pod(cluster, ns, busybox_pod(cluster, "files", handler))
    sent = tmp_path / "sent.txt"
    sent.write_text("".join(f"line {i} {secrets.token_hex(8)}\n" for i in range(2000)))
    cluster.k("cp", str(sent), f"{ns}/files:/tmp/in.txt")
    assert sh(cluster, ns, "files", "md5sum < /tmp/in.txt").split()[0] == (
        subprocess.run(["md5sum"], input=sent.read_bytes(), capture_output=True, check=True)
        .stdout.split()[0]
        .decode()
    )
    sh(cluster, ns, "files", "mkdir -p /tmp/out && cp /tmp/in.txt /tmp/out/back.txt")
    back = tmp_path / "back"
    cluster.k("cp", f"{ns}/files:/tmp/out", str(back))
    assert (back / "back.txt").read_text() == sent.read_text()


@pytest.mark.timeout(600 * SLOW)
@pytest.mark.parametrize("handler", HANDLERS)
def test_kubectl_debug_ephemeral_container(cluster: Env, ns: str, handler: str) -> None:
    run_pod(cluster, ns, busybox_pod(cluster, "target", handler, "sleep", "7777"))
    cluster.k(
        "debug", "-n", ns, "target", f"--image={cluster.image('busybox')}", "-c", "dbg", "--target=main",
        "--", "sh", "-c", "echo from-debug; sleep 3600",
    )  # fmt: skip
    dbg = lambda p: "running" in w.container_status(p, "dbg").get("state", {})  # noqa: E731
    p = wait_pod(cluster, ns, "target", handler, dbg)
    assert w.container_status(p, "dbg")["ready"] is False  # ephemeral containers are never ready
    assert "from-debug" in cluster.k("logs", "-n", ns, "target", "-c", "dbg")
    if handler != "fake":  # --target: the debug container sees the target's processes
        assert "sleep 7777" in sh(cluster, ns, "target", "ps", container="dbg")


# ------------------------------------------------------------ scheduling, probes, eviction
@pytest.mark.timeout(600 * SLOW)
@pytest.mark.parametrize("handler", ["runv", "fake"])
def test_runtime_class_schedules_onto_its_node(cluster: Env, ns: str, handler: str) -> None:
    manifest = w.pod("classy", w.container("main", cluster.image("busybox"), "sleep", "3600"))
    manifest["spec"]["runtimeClassName"] = handler
    p = run_pod(cluster, ns, manifest)
    assert p["spec"]["nodeName"] == cl.node(handler).name
    assert p["spec"]["nodeSelector"] == cl.node(handler).labels  # merged in by the RuntimeClass admission


def endpoint_ready(env: Env, ns: str, service: str) -> list[tuple[str, bool]]:
    slices = env.k.json("get", "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={service}")
    return sorted(
        (e["addresses"][0], bool(e.get("conditions", {}).get("ready")))
        for s in slices["items"]
        for e in s.get("endpoints") or []
    )


@pytest.mark.timeout(600 * SLOW)
@pytest.mark.parametrize("handler", HANDLERS)
def test_probes_drive_endpoints(cluster: Env, ns: str, handler: str) -> None:
    k = cluster.k
    t = int(5 * cluster.patience(handler))  # an exec probe in a VM under TCG may take over 1 s
    probes: dict[str, Any] = {
        "readinessProbe": {
            "exec": {"command": ["cat", "/tmp/ready"]},
            "periodSeconds": 1,
            "failureThreshold": 1,
            "timeoutSeconds": t,
        },
        "livenessProbe": {
            "exec": {"command": ["cat", "/tmp/alive"]},
            "periodSeconds": 2,
            "failureThreshold": 1,
            "timeoutSeconds": t,
        },
    }
    if handler == "fake":
        c = w.container(
            "main", cluster.image("busybox"), "sh", "-c", "touch /tmp/alive; sleep 3600", **probes
        )
    else:  # an HTTP startup probe too: the kubelet reaches the pod on its network
        # agnhost listens seconds after it started in a VM under TCG: the startup probe waits a minute.
        probes["startupProbe"] = {
            "httpGet": {"path": "/healthz", "port": 8080},
            "periodSeconds": 1,
            "failureThreshold": 60,
        }
        c = w.container(
            "main", cluster.image("agnhost"), "sh", "-c", "touch /tmp/alive; exec /agnhost netexec --http-port=8080",
            **probes,
        )  # fmt: skip
    k.apply(w.pod("probed", c, on=cl.node(handler)), namespace=ns)
    k.apply(w.service("probed", {"app": "probed"}, 80, 8080, node_port=False), namespace=ns)
    running = lambda p: p["status"].get("phase") == "Running" and p["status"].get("podIP")  # noqa: E731
    p = wait_pod(cluster, ns, "probed", handler, running)
    ip = p["status"]["podIP"]
    cl.wait_for("a not-ready endpoint", lambda: endpoint_ready(cluster, ns, "probed") == [(ip, False)], 60)
    sh(cluster, ns, "probed", "touch /tmp/ready")
    cl.wait_for("a ready endpoint", lambda: endpoint_ready(cluster, ns, "probed") == [(ip, True)], 60)
    if handler != "fake":
        svc_ip = k.get("service", "probed", ns)["spec"]["clusterIP"]
        cl.wait_for("the Service answering", lambda: from_host(f"http://{svc_ip}/hostname") == "probed", 60)
    sh(cluster, ns, "probed", "rm /tmp/ready")
    cl.wait_for("not ready again", lambda: endpoint_ready(cluster, ns, "probed") == [(ip, False)], 60)
    sh(cluster, ns, "probed", "rm /tmp/alive")  # the liveness probe fails: the kubelet restarts it
    restarted = lambda p: w.container_status(p, "main")["restartCount"] >= 1  # noqa: E731
    p = wait_pod(cluster, ns, "probed", handler, restarted, timeout=120)
    last = w.container_status(p, "main").get("lastState", {}).get("terminated")
    assert last is not None, w.describe(p)
    events = k("get", "events", "-n", ns, "--field-selector", "involvedObject.name=probed")
    assert "Liveness probe failed" in events, events


@pytest.mark.timeout(900 * SLOW)
def test_drain_evicts_and_reschedules(cluster: Env, ns: str) -> None:
    k = cluster.k
    docker = cl.node("docker")
    spread = {  # Honor: a cordoned node (tainted unschedulable) stops being a domain of the spread
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "DoNotSchedule",
        "nodeTaintsPolicy": "Honor",
        "labelSelector": {"matchLabels": {"app": "drained"}},
    }
    template = w.pod(
        "drained",
        w.container("main", cluster.image("busybox"), "sleep", "3600"),
        topologySpreadConstraints=[spread],
    )
    k.apply(w.deployment("drained", 4, template), namespace=ns)
    ready4 = lambda: k.get("deployment", "drained", ns)["status"].get("availableReplicas") == 4  # noqa: E731
    cl.wait_for("4 replicas available", ready4, 300 * SLOW)
    before = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in w.pods_of(k, ns, "app=drained")}
    on_docker = {name for name, node in before.items() if node == docker.name}
    assert on_docker, before
    try:
        k(
            "drain",
            docker.name,
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--force",
            "--timeout=300s",
            timeout=360,
        )
        assert k.get("node", docker.name)["spec"].get("unschedulable") is True
        cl.wait_for("4 replicas available again", ready4, 300 * SLOW)
        after = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in w.pods_of(k, ns, "app=drained")}
        assert docker.name not in after.values(), after
        assert not on_docker & set(after), "the evicted pods were replaced by new ones"
    finally:
        k("uncordon", docker.name)


# ------------------------------------------------------------ restarts, OOM, stats
def node_snapshot(env: Env, ns: str, pod: str, node: str) -> tuple[str, int, str, str]:
    """The pod's container ID, restart count and IP, and its node's Ready transition time."""
    p = env.k.get("pod", pod, ns)
    c = w.container_status(p, "main")
    ready = condition(env.k.get("node", node), "Ready")
    assert ready is not None and ready["status"] == "True"
    return c["containerID"], c["restartCount"], p["status"]["podIP"], ready["lastTransitionTime"]


@pytest.mark.timeout(600 * SLOW)
@pytest.mark.parametrize("handler", HANDLERS)
def test_shim_sigkilled_and_restarted_node_stays_ready_no_pod_restarted(
    cluster: Env, ns: str, handler: str
) -> None:
    n = cl.node(handler)
    run_pod(cluster, ns, busybox_pod(cluster, "survivor", handler))
    before = node_snapshot(cluster, ns, "survivor", n.name)
    how = cl.restart_shim(n, signal.SIGKILL)
    assert "SIGKILL" in how, how
    # Through the new shim, once the kubelet's connection to the socket is back (gRPC's reconnect backoff).
    cl.wait_for("exec through the new shim", lambda: sh(cluster, ns, "survivor", "echo back") == "back\n", 60)
    run_pod(cluster, ns, busybox_pod(cluster, "newcomer", handler))  # it runs new pods too
    # Two node-status periods (10 s each) after the kill: the node never left Ready.
    time.sleep(20)
    assert node_snapshot(cluster, ns, "survivor", n.name) == before
    events = cluster.k("get", "events", "-n", ns, "--field-selector", "involvedObject.name=survivor")
    assert "SandboxChanged" not in events and "Killing" not in events, events


@pytest.mark.timeout(600 * SLOW)
@pytest.mark.parametrize("handler", HANDLERS)
def test_kubelet_restarted(cluster: Env, ns: str, handler: str) -> None:
    n = cl.node(handler)
    run_pod(cluster, ns, busybox_pod(cluster, "steady", handler))
    cid, restarts, ip, _ = node_snapshot(cluster, ns, "steady", n.name)
    cl.restart_kubelet(n, cluster.b)
    cl.wait_for(f"{n.name} Ready", lambda: node_ready(cluster.k.get("node", n.name)), 120)
    assert node_snapshot(cluster, ns, "steady", n.name)[:3] == (cid, restarts, ip)
    # The new kubelet serves exec once it has the pod again from the API server.
    cl.wait_for(
        "exec through the new kubelet", lambda: sh(cluster, ns, "steady", "echo here") == "here\n", 60
    )
    run_pod(cluster, ns, busybox_pod(cluster, "after", handler))


@pytest.mark.timeout(600 * SLOW)
@pytest.mark.parametrize("handler", HANDLERS)
def test_oom_killed_pod_reported(cluster: Env, ns: str, handler: str) -> None:
    if handler == "fake":
        pytest.skip("the fake runs no process that could use memory")
    memory = {"memory": "32Mi", "cpu": "100m"}
    manifest = busybox_pod(
        cluster,
        "hog",
        handler,
        "dd",
        "if=/dev/zero",
        "of=/dev/null",
        "bs=256M",
        "count=1",
        restartPolicy="Never",
    )
    manifest["spec"]["containers"][0]["resources"] = {"limits": memory, "requests": memory}
    cluster.k.apply(manifest, namespace=ns)
    ended = lambda p: p["status"].get("phase") in ("Failed", "Succeeded")  # noqa: E731
    p = wait_pod(cluster, ns, "hog", handler, ended)
    terminated = w.container_status(p, "main")["state"]["terminated"]
    assert (terminated["reason"], terminated["exitCode"]) == ("OOMKilled", 137), w.describe(p)


def millicores(nano: int | None) -> int:
    return (nano or 0) // 1_000_000


def resource_metrics(env: Env, node: str, ns: str, pod: str) -> dict[str, float]:
    """The kubelet's /metrics/resource samples of one pod (what metrics-server, and so `kubectl top`, reads)."""
    text = env.k("get", "--raw", f"/api/v1/nodes/{node}/proxy/metrics/resource")
    out = {}
    for line in text.splitlines():
        if f'namespace="{ns}"' in line and f'pod="{pod}"' in line:
            name, value = line.split("{")[0], line.split("} ")[1].split()[0]
            out[name] = float(value)
    return out


@pytest.mark.timeout(600 * SLOW)
@pytest.mark.parametrize("handler", HANDLERS)
def test_summary_api_figures(cluster: Env, ns: str, handler: str) -> None:
    n = cl.node(handler)
    manifest = busybox_pod(cluster, "busy", handler, "sh", "-c", "while :; do :; done")
    manifest["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "100m", "memory": "64Mi"}}
    p = run_pod(cluster, ns, manifest)
    uid = p["metadata"]["uid"]

    def busy_pod() -> dict[str, Any] | None:
        summary = json.loads(cluster.k("get", "--raw", f"/api/v1/nodes/{n.name}/proxy/stats/summary"))
        for s in summary["pods"]:
            c = s["containers"][0] if s["podRef"]["uid"] == uid and s.get("containers") else {}
            if not (c.get("cpu") or {}).get("usageNanoCores") or not (c.get("memory") or {}).get(
                "workingSetBytes"
            ):
                continue
            # docker and runv: the pod's cgroup too, once cAdvisor (housekeeping every 10 s) has found it.
            if handler == "fake" or (s.get("cpu") or {}).get("usageNanoCores"):
                return {"node": summary["node"], "pod": s, "main": c}
        return None

    got = cl.wait_for("the container's CPU and memory in the summary", busy_pod, 120, interval=5)
    node, pod, main = got["node"], got["pod"], got["main"]
    metrics = resource_metrics(cluster, n.name, ns, "busy")
    # What `kubectl top pod` would print: the sum of the containers' figures.
    print(
        f"{n.name}: node cpu {millicores(node['cpu'].get('usageNanoCores'))}m "
        f"memory {node['memory'].get('workingSetBytes', 0) // 2**20}Mi; pod busy: container cpu "
        f"{millicores(main['cpu']['usageNanoCores'])}m memory {main['memory']['workingSetBytes'] // 1024}Ki; "
        f"pod cgroup cpu {millicores((pod.get('cpu') or {}).get('usageNanoCores'))}m; /metrics/resource {metrics}"
    )
    assert node["cpu"].get("usageNanoCores", 0) > 0 and node["memory"].get("workingSetBytes", 0) > 0
    assert [c["name"] for c in pod["containers"]] == ["main"]
    assert metrics.get("container_cpu_usage_seconds_total", 0) > 0, metrics
    assert metrics.get("container_memory_working_set_bytes", 0) > 0, metrics
    if handler == "fake":  # its figures are simulated
        return
    # A busy loop held to its 100m limit (a short overshoot between two samples allowed).
    assert millicores(main["cpu"]["usageNanoCores"]) <= 150, main["cpu"]
    # The pod's cgroup, which the kubelet reads through cAdvisor, holds the containers (waited for
    # above): on runv the whole VM, whose own work (QEMU, under TCG an emulated CPU) comes on top.
    assert millicores(pod["cpu"]["usageNanoCores"]) > 0, pod["cpu"]
    if handler == "docker":
        assert millicores(pod["cpu"]["usageNanoCores"]) <= 150, pod["cpu"]


# ------------------------------------------------------------ the end
@pytest.mark.timeout(600 * SLOW)
def test_down_leaves_nothing(cluster: Env, request: pytest.FixtureRequest) -> None:
    if os.environ.get("CRI_SHIM_CLUSTER_KEEP"):
        pytest.skip("CRI_SHIM_CLUSTER_KEEP: the cluster stays up")
    assert cl.check(), "check sees nothing of a running cluster"
    cluster.is_down = True
    left = cl.down(cluster.b, keep_logs=request.session.testsfailed > 0)  # the logs, to /tmp
    assert left == []
