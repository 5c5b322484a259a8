"""The checks of a run on a CNI network of its own (--cni; host.CniNetwork).

The pod CIDR reaching the shim, the pods' addresses, pod to pod by IP and a
hostPort on the host while everything runs; after the stop, that nothing of
the network is left: no address in host-local's store, no veth on the bridge,
no pin, cache entry or portmap rule of the shim's, and the bridge and chains
gone with the harness's clean-up.
"""

from __future__ import annotations

import ipaddress
import json
import time
import urllib.parse
import urllib.request
from typing import Any

from cri_api import api_pb2 as pb
from tests.e2e.kubelet.checks import CheckFailed, Result, check, passed
from tests.e2e.kubelet.host import CniNetwork
from tests.e2e.kubelet.pods import NAMESPACE, WEB_BODY, WEB_PORT
from tests.e2e.kubelet.runner import Harness

# What the shim renders its config template to (backends.cni.client.CniSettings.template_output).
RENDERED = "10-cri-shim-net.conflist"
# Pods that run until the end, each with an address of the network.
RUNNING = (("net", "main"), ("two", "httpd"), ("init", "app"), ("web", "main"))


def on_cni(h: Harness) -> bool:
    return h.cni is not None


def _cni(h: Harness) -> CniNetwork:
    assert h.cni is not None  # `when=on_cni`
    return h.cni


def _pod_ip(h: Harness, pod: str, container: str) -> str:
    """The pod's IP in the kubelet's /pods, once its container runs."""
    h.wait_running(pod, container)
    deadline = time.monotonic() + 15
    while True:
        status: dict[str, Any] = h.kubelet_pods().get(h.full(pod), {}).get("status", {})
        if status.get("podIP"):
            return str(status["podIP"])
        if time.monotonic() > deadline:
            raise CheckFailed(f"{pod}: no podIP in /pods (phase {status.get('phase')})")
        time.sleep(1)


def _run(h: Harness, pod: str, container: str, command: str) -> str:
    """`command` (split at spaces, as the kubelet does) run in the container through POST /run;
    a command that fails fails the check (the kubelet answers 500)."""
    query = urllib.parse.urlencode({"cmd": command})
    return h.api_ok("POST", f"/run/{NAMESPACE}/{h.full(pod)}/{container}?{query}", timeout=20).decode(
        errors="replace"
    )


@check("cni", 1, when=on_cni)
def check_pod_cidr(h: Harness) -> Result:
    """the kubelet's podCIDR reaches the shim, which renders the network config and is NetworkReady"""
    cni = _cni(h)
    path = cni.net.conf_dir / RENDERED
    if not path.exists():
        raise CheckFailed(f"no {path}: the shim got no pod CIDR (UpdateRuntimeConfig) from the kubelet")
    plugins = json.loads(path.read_text())["plugins"]
    ranges = [p["ipam"]["ranges"] for p in plugins if p["type"] == "bridge"]
    want = [[[{"subnet": str(cni.net.subnet)}]]]
    if ranges != want:
        raise CheckFailed(f"{path.name}: host-local ranges {ranges}, want {want[0]}")
    conditions = h.cri().Status(pb.StatusRequest(), timeout=10).status.conditions
    network = [c for c in conditions if c.type == "NetworkReady"]
    if not network or not network[0].status:
        raise CheckFailed(f"Status: {network[0] if network else 'no NetworkReady condition'}")
    return passed(f"{path.name} rendered with {cni.net.subnet} (host-local's range); NetworkReady")


@check("cni", 2, when=on_cni)
def check_pod_ips(h: Harness) -> Result:
    """the pods' IPs (the kubelet's /pods) are in the network's range, each held by host-local"""
    cni = _cni(h)
    ips = {pod: _pod_ip(h, pod, container) for pod, container in RUNNING}
    outside = {p: ip for p, ip in ips.items() if ipaddress.ip_address(ip) not in cni.net.subnet}
    if outside:
        raise CheckFailed(f"not in {cni.net.subnet}: {outside}")
    if len(set(ips.values())) != len(ips):
        raise CheckFailed(f"pods share an address: {ips}")
    unheld = sorted(set(ips.values()) - set(cni.net.reserved()))
    if unheld:
        raise CheckFailed(f"{unheld} not in host-local's store {cni.net.ipam_dir}/{cni.net.network}")
    host_ip = h.kubelet_pods()[h.full("hostnet")]["status"].get("podIP", "")
    if host_ip and ipaddress.ip_address(host_ip) in cni.net.subnet:
        raise CheckFailed(f"the host-network pod has {host_ip}, an address of the pod network")
    return passed(", ".join(f"{p} {ip}" for p, ip in ips.items()) + f" in {cni.net.subnet}")


@check("cni", 3, when=on_cni, timeout=45)
def check_pod_to_pod(h: Harness) -> Result:
    """two pods reach each other by IP (ping both ways), and a third's server over TCP"""
    net_ip, two_ip, web_ip = (
        _pod_ip(h, pod, c) for pod, c in (("net", "main"), ("two", "sleeper"), ("web", "main"))
    )
    for pod, container, ip in (("net", "main", two_ip), ("two", "sleeper", net_ip)):
        out = _run(h, pod, container, f"ping -c1 -W5 {ip}")
        if " 0% packet loss" not in out:
            raise CheckFailed(f"{pod} pinging {ip}: {out!r}")
    # `timeout`, not wget's -T: busybox 1.36's wget segfaults with it.
    body = _run(h, "net", "main", f"timeout 5 wget -q -O - http://{web_ip}:{WEB_PORT}/index.html")
    if body.strip() != WEB_BODY:
        raise CheckFailed(f"net fetching from web at {web_ip}:{WEB_PORT}: {body!r}")
    return passed(f"net {net_ip} <-> two {two_ip} by ping; net -> web {web_ip}:{WEB_PORT}: {WEB_BODY!r}")


@check("cni", 4, when=on_cni)
def check_host_port(h: Harness) -> Result:
    """a pod's hostPort answers on the host (127.0.0.1), published by portmap"""
    cni = _cni(h)
    h.wait_running("web", "main")
    url = f"http://127.0.0.1:{cni.host_port}/index.html"
    deadline = time.monotonic() + 15
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                body = resp.read().decode(errors="replace")
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise CheckFailed(f"GET {url}: {exc}") from None
            time.sleep(1)
    if body.strip() != WEB_BODY:
        raise CheckFailed(f"GET {url}: {body!r}, want {WEB_BODY!r}")
    rules = [line for _, _, line in cni.net.iptables() if f"--dports {cni.host_port}" in line]
    if not rules:
        raise CheckFailed(f"{url} answered, but no portmap rule of the network names port {cni.host_port}")
    return passed(f"GET {url}: {WEB_BODY!r}; portmap: {rules[0]!r}")


@check("cni", 5, when=on_cni, after_stop=True)
def check_nothing_left(h: Harness) -> Result:
    """after the teardown host-local holds no IP, no veth, pin or cache entry is left, the bridge and chains are gone"""
    cni = _cni(h)
    if cni.held is None or cni.remains is None:
        raise CheckFailed("the harness did not get as far as removing the network")
    if not cni.store_used:
        raise CheckFailed(f"host-local never made its store {cni.net.ipam_dir}/{cni.net.network}")
    if cni.held:
        raise CheckFailed(f"the stopped shim's pods still held {len(cni.held)}: {cni.held[:6]}")
    if cni.remains:
        raise CheckFailed(f"left after the network's removal: {cni.remains[:6]}")
    return passed(
        f"host-local's store empty, no veth on {cni.net.bridge}, pin, cache entry or portmap rule; "
        "bridge and chains removed"
    )
