"""The client with Debian's CNI plugins (loopback, bridge, host-local, portmap) in namespaces of our own.

Everything is made here and removed after: network namespaces ``cnitest-<rand>-N``, a bridge
``cnitest0-<rand>``, a subnet in 10.250.0.0/16 used only on that bridge (no gateway on the host,
no routes out), host-local's store under tmp, and the iptables chains portmap adds (compared
with ``iptables-save`` before and after). Traffic goes only between our namespaces.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.cni import (
    Attachment,
    CniClient,
    CniSettings,
    PluginError,
    PluginTimeoutError,
    PortMapping,
)
from tests.cni import fakeplugin
from tests.cni.conftest import REAL_MARKER

PLUGIN_DIR = "/usr/lib/cni"  # Debian's containernetworking-plugins
NEEDED = ("loopback", "bridge", "host-local", "portmap")


def _why_not() -> str:
    if os.geteuid() != 0:
        return "needs root (network namespaces, a bridge, iptables)"
    missing = [p for p in NEEDED if not os.access(os.path.join(PLUGIN_DIR, p), os.X_OK)]
    if missing:
        return f"CNI plugins {', '.join(missing)} not in {PLUGIN_DIR} (containernetworking-plugins)"
    tools = [t for t in ("ip", "iptables", "iptables-save") if shutil.which(t) is None]
    return f"{', '.join(tools)} not found" if tools else ""


pytestmark = [getattr(pytest.mark, REAL_MARKER), pytest.mark.skipif(bool(_why_not()), reason=_why_not())]


def run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout


def cni_iptables() -> set[tuple[str, str, str]]:
    """(tool, table, line) of every chain and rule that names a CNI chain, counters left out."""
    found = set()
    for tool in ("iptables-save", "ip6tables-save"):
        if shutil.which(tool) is None:
            continue
        table = ""
        for line in run(tool).splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif "CNI-" in line and line.startswith((":", "-A ")):
                found.add((tool, table, re.sub(r" \[\d+:\d+\]$", "", line)))
    return found


def remove_iptables_since(before: set[tuple[str, str, str]]) -> None:
    extra = cni_iptables() - before
    for tool, table, line in sorted(x for x in extra if x[2].startswith("-A ")):
        subprocess.run([tool.removesuffix("-save"), "-t", table, "-D", *shlex.split(line)[1:]], check=False)
    for tool, table, line in sorted(x for x in extra if x[2].startswith(":")):
        chain = line[1:].split()[0]
        for op in ("-F", "-X"):
            subprocess.run([tool.removesuffix("-save"), "-t", table, op, chain], check=False)


class Host:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.rand = secrets.token_hex(3)
        self.bridge = f"cnitest0-{self.rand}"  # 15 characters, the most a name may have
        self.subnet = ipaddress.ip_network(f"10.250.{secrets.randbelow(256)}.0/24")
        self.network = f"cnitest-{self.rand}"
        self.namespaces: list[str] = []
        self.conf_dir = root / "net.d"
        self.ipam_dir = root / "ipam"
        self.bin_dir = root / "bin"
        self.forward = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]

    def netns(self) -> str:
        name = f"cnitest-{self.rand}-{len(self.namespaces)}"
        run("ip", "netns", "add", name)
        self.namespaces.append(name)
        return f"/run/netns/{name}"

    def client(self, **settings: Any) -> CniClient:
        base: dict[str, Any] = {
            "conf_dir": str(self.conf_dir),
            "bin_dirs": (str(self.bin_dir), PLUGIN_DIR),
            "cache_dir": str(self.root / "cache"),
            "plugin_timeout": 30.0,
        }
        return CniClient(CniSettings(**(base | settings)))

    def write_conflist(self, *extra: dict[str, Any]) -> Path:
        ipam = {
            "type": "host-local",
            "dataDir": str(self.ipam_dir),
            "ranges": [[{"subnet": str(self.subnet)}]],
        }
        plugins = [
            {"type": "loopback"},
            {"type": "bridge", "bridge": self.bridge, "isGateway": False, "ipMasq": False, "ipam": ipam},
            {"type": "portmap", "capabilities": {"portMappings": True}},
            *extra,
        ]
        return fakeplugin.write_json(
            self.conf_dir / "10-test.conflist",
            {"cniVersion": "1.0.0", "name": self.network, "plugins": plugins},
        )

    def reserved(self) -> dict[str, str]:
        """host-local's store: reserved address -> container ID."""
        store = self.ipam_dir / self.network
        if not store.exists():
            return {}
        out = {}
        for path in store.iterdir():
            with contextlib.suppress(ValueError):
                ipaddress.ip_address(path.name)
                out[path.name] = path.read_text().splitlines()[0].strip()
        return out

    def ports(self) -> list[str]:
        """The veths enslaved to the bridge."""
        if subprocess.run(["ip", "link", "show", self.bridge], capture_output=True).returncode != 0:
            return []
        return [
            line.split(":")[1].strip().split("@")[0]
            for line in run("ip", "-o", "link", "show", "master", self.bridge).splitlines()
        ]

    def addresses(self, netns: str) -> list[str]:
        out = run("ip", "-n", os.path.basename(netns), "-j", "addr", "show", "dev", "eth0")
        return [
            f"{a['local']}/{a['prefixlen']}"
            for link in json.loads(out)
            for a in link["addr_info"]
            if a["family"] == "inet"
        ]

    def cleanup(self) -> None:
        for name in self.namespaces:
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], check=False, capture_output=True)


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    before = cni_iptables()
    h = Host(tmp_path)
    # Bridged traffic passes FORWARD when br_netfilter is loaded; Docker may have set its policy to DROP.
    run("iptables", "-I", *h.forward)
    try:
        yield h
    finally:
        h.cleanup()
        subprocess.run(["iptables", "-D", *h.forward], check=False, capture_output=True)
        remove_iptables_since(before)
    assert cni_iptables() == before
    assert not Path(f"/sys/class/net/{h.bridge}").exists()
    assert not [n for n in run("ip", "netns", "list").split() if n.startswith(f"cnitest-{h.rand}")]


def exchange(server_ns: str, server_ip: str, client_ns: str) -> str:
    """A TCP round trip from one namespace to the other: what the client got back."""
    serve = (
        "import socket\n"
        "s = socket.socket()\n"
        f"s.bind(({server_ip!r}, 7777))\n"
        "s.listen(1)\n"
        "s.settimeout(30)\n"
        "print('ready', flush=True)\n"
        "c, _ = s.accept()\n"
        "c.sendall(c.recv(64)[::-1])\n"
        "c.close()\n"
    )
    ask = (
        "import socket\n"
        f"s = socket.create_connection(({server_ip!r}, 7777), timeout=10)\n"
        "s.sendall(b'ping')\n"
        "print(s.recv(64).decode())\n"
    )
    with subprocess.Popen(
        ["ip", "netns", "exec", os.path.basename(server_ns), sys.executable, "-c", serve],
        stdout=subprocess.PIPE,
        text=True,
    ) as server:
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
            return run("ip", "netns", "exec", os.path.basename(client_ns), sys.executable, "-c", ask).strip()
        finally:
            server.kill()


async def test_pods_get_addresses_reach_each_other_and_del_frees_everything(host: Host) -> None:
    host.write_conflist()
    client = host.client()
    assert (await client.readiness()).ready
    ns1, ns2 = host.netns(), host.netns()
    pod1 = Attachment(
        f"pod1{host.rand}",
        ns1,
        pod_namespace="default",
        pod_name="one",
        pod_uid="u1",
        port_mappings=(PortMapping(31000 + secrets.randbelow(1000), 80),),
    )
    pod2 = Attachment(f"pod2{host.rand}", ns2, pod_namespace="default", pod_name="two", pod_uid="u2")

    r1 = await client.add(pod1)
    r2 = await client.add(pod2)
    ip1, ip2 = (r.pod_addresses("eth0").ipv4 for r in (r1, r2))
    assert ip1 in host.subnet and ip2 in host.subnet and ip1 != ip2
    assert host.addresses(ns1) == [f"{ip1}/24"]
    assert host.reserved() == {str(ip1): pod1.container_id, str(ip2): pod2.container_id}
    assert len(host.ports()) == 2
    assert any(f'id: \\"{pod1.container_id}\\"' in line for _, _, line in cni_iptables())

    assert exchange(ns2, str(ip2), ns1) == "gnip"
    assert exchange(ns1, str(ip1), ns2) == "gnip"

    await client.delete(pod1)
    assert host.reserved() == {str(ip2): pod2.container_id}
    assert len(host.ports()) == 1
    assert not [line for _, _, line in cni_iptables() if pod1.container_id in line or "CNI-DN-" in line]
    await client.delete(pod1)  # again: nothing left to do
    assert client.cached_result(pod1.container_id) is None


async def test_del_after_the_config_was_removed_and_the_netns_is_gone(host: Host) -> None:
    conflist = host.write_conflist()
    ns = host.netns()
    pod = Attachment(
        f"pod3{host.rand}", ns, port_mappings=(PortMapping(32000 + secrets.randbelow(1000), 80),)
    )
    result = await host.client().add(pod)
    assert host.reserved() == {str(result.pod_addresses("eth0").ipv4): pod.container_id}
    conflist.unlink()
    run("ip", "netns", "del", os.path.basename(ns))
    host.namespaces.remove(os.path.basename(ns))
    restarted = host.client()
    assert not (await restarted.readiness()).ready
    await restarted.delete(pod)
    assert host.reserved() == {}
    assert host.ports() == []
    assert not [line for _, _, line in cni_iptables() if "CNI-DN-" in line]


@pytest.mark.parametrize("how", ["fails", "hangs"])
async def test_a_chained_plugin_that_fails_or_hangs_leaves_nothing(host: Host, how: str) -> None:
    fakeplugin.install(host.bin_dir, "breaker")
    pids = host.root / "pids"
    action = {"fails": {"error": {"code": 7, "msg": "refused"}}, "hangs": {"hang": str(pids)}}[how]
    host.write_conflist({"type": "breaker", "fake": {"ADD": action}})
    ns = host.netns()
    pod = Attachment(
        f"pod4{host.rand}", ns, port_mappings=(PortMapping(33000 + secrets.randbelow(1000), 80),)
    )
    client = host.client(plugin_timeout=5.0)
    with pytest.raises(PluginTimeoutError if how == "hangs" else PluginError, match="breaker ADD"):
        await client.add(pod)
    if how == "hangs":
        assert not any(fakeplugin.alive(int(pid)) for pid in pids.read_text().split())
    assert host.reserved() == {}
    assert host.ports() == []
    assert run("ip", "-n", os.path.basename(ns), "-o", "link").count(": eth0") == 0
    assert not [line for _, _, line in cni_iptables() if "CNI-DN-" in line]
    assert client.cached_result(pod.container_id) is None
    assert not list((host.root / "cache").rglob("*.json"))
