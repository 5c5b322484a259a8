"""A network of a test's own for Debian's CNI plugins (loopback, bridge, host-local, portmap).

A bridge ``<tag>0-<rand>``, a /24 of ``10.<octet>.0.0/16`` that no route of the host overlaps,
host-local's store and the config directory under the test's tmp, network namespaces
``<tag>-<rand>-N``. :func:`own_network` removes what the test made, and only that (other test
runs may use the plugins at the same time): its namespaces and bridge (with the bridge's
route), the iptables rules and chains that name its network or hang off those, and portmap's
shared chains when they came with this test and no network uses them any more.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from tests.cni import fakeplugin

PLUGIN_DIR = "/usr/lib/cni"  # Debian's containernetworking-plugins
NEEDED = ("loopback", "bridge", "host-local", "portmap")
# portmap's chains for every network, made by its first ADD and never removed by it.
SHARED_CHAINS = ("CNI-HOSTPORT-DNAT", "CNI-HOSTPORT-MASQ", "CNI-HOSTPORT-SETMARK")

Line = tuple[str, str, str]  # (iptables-save tool, table, line)


def why_not() -> str:
    if os.geteuid() != 0:
        return "needs root (network namespaces, a bridge, iptables)"
    missing = [p for p in NEEDED if not os.access(os.path.join(PLUGIN_DIR, p), os.X_OK)]
    if missing:
        return f"CNI plugins {', '.join(missing)} not in {PLUGIN_DIR} (containernetworking-plugins)"
    tools = [t for t in ("ip", "iptables", "iptables-save") if shutil.which(t) is None]
    return f"{', '.join(tools)} not found" if tools else ""


def run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout


def cni_iptables() -> set[Line]:
    """Every chain and rule that names a CNI chain, counters left out."""
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


def _free_subnet(octet: int) -> ipaddress.IPv4Network:
    used = []
    for line in run("ip", "-4", "route").splitlines():
        with contextlib.suppress(ValueError):
            used.append(ipaddress.IPv4Network(line.split()[0], strict=False))
    for _ in range(100):
        net = ipaddress.IPv4Network(f"10.{octet}.{secrets.randbelow(256)}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError(f"no free /24 in 10.{octet}.0.0/16")


class Net:
    def __init__(self, root: Path, tag: str, octet: int, gateway: bool) -> None:
        self.root = root
        self.tag = tag
        self.rand = secrets.token_hex(3)
        self.bridge = f"{tag}0-{self.rand}"
        assert len(self.bridge) <= 15, "a longer name is not a valid interface name"
        self.subnet = _free_subnet(octet)
        # With a gateway the host has an address on the bridge and a route to the pods.
        self.gateway = gateway
        self.network = f"{tag}-{self.rand}"
        self.namespaces: list[str] = []
        self.conf_dir = root / "net.d"
        self.ipam_dir = root / "ipam"
        self.bin_dir = root / "bin"
        self._forward: list[str] = []  # the FORWARD rule of open_forward, removed by cleanup

    def open_forward(self) -> None:
        """Accept traffic between the bridge's ports: with br_netfilter loaded it passes FORWARD,
        whose policy Docker may have set to DROP."""
        self._forward = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        run("iptables", "-I", *self._forward)

    def netns(self) -> str:
        name = f"{self.tag}-{self.rand}-{len(self.namespaces)}"
        run("ip", "netns", "add", name)
        self.namespaces.append(name)
        return f"/run/netns/{name}"

    def conflist(self, *extra: dict[str, Any], ipam: dict[str, Any] | None = None) -> dict[str, Any]:
        """loopback, bridge with host-local (``ipam`` replaces its ranges), portmap, then ``extra``."""
        ipam = {"type": "host-local", "dataDir": str(self.ipam_dir)} | (
            ipam if ipam is not None else {"ranges": [[{"subnet": str(self.subnet)}]]}
        )
        bridge = {"type": "bridge", "bridge": self.bridge, "isGateway": self.gateway, "ipMasq": False}
        plugins = [
            {"type": "loopback"},
            bridge | {"ipam": ipam},
            {"type": "portmap", "capabilities": {"portMappings": True}},
            *extra,
        ]
        return {"cniVersion": "1.0.0", "name": self.network, "plugins": plugins}

    def write_conflist(self, *extra: dict[str, Any]) -> Path:
        return fakeplugin.write_json(self.conf_dir / "10-test.conflist", self.conflist(*extra))

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

    def iptables(self) -> set[Line]:
        """The rules naming this network (portmap's comments) and the chains they jump to."""
        lines = cni_iptables()
        ours = {x for x in lines if f'name: \\"{self.network}\\"' in x[2]}
        chains = {c for x in ours for c in re.findall(r"-j (CNI-DN-\S+)", x[2])}
        return ours | {x for x in lines if any(x[2].startswith((f":{c} ", f"-A {c} ")) for c in chains)}

    def leftovers(self, state_dir: str) -> list[str]:
        """What the pods of a shim with ``state_dir`` still hold of the network, each named: the
        addresses host-local reserves, veths on the bridge, portmap's rules, the namespaces pinned
        and the CNI cache entries under ``state_dir``. Empty once the shim released every pod."""
        out = [
            f"address {ip} held by host-local for {cid[:12]}" for ip, cid in sorted(self.reserved().items())
        ]
        out += [f"veth {port} on {self.bridge}" for port in self.ports()]
        out += [f"iptables {table} {line}" for _, table, line in sorted(self.iptables())]
        out += [f"pinned network namespace {m}" for m in pinned_under(state_dir)]
        cache = Path(state_dir, "cni")
        out += [f"CNI cache entry {p.relative_to(cache)}" for p in sorted(cache.rglob("*.json"))]
        return out

    def cleanup(self, before: set[Line]) -> None:
        for name in self.namespaces:
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], check=False, capture_output=True)
        _remove(self.iptables())
        now = cni_iptables()
        shared_new = not any(x[2].startswith(f":{c} ") for x in before for c in SHARED_CHAINS)
        if shared_new and not any(x[2].startswith("-A CNI-HOSTPORT-DNAT ") for x in now):
            _remove({x for x in now if any(c in x[2] for c in SHARED_CHAINS)})
        if self._forward:
            subprocess.run(["iptables", "-D", *self._forward], check=False, capture_output=True)
            self._forward = []


def pinned_under(directory: str) -> list[str]:
    """The network namespaces bind-mounted (pinned) under ``directory``."""
    prefix = directory.rstrip("/") + "/"
    with open("/proc/self/mountinfo") as fh:
        # the fields after " - " are the filesystem type, the source and the options
        mounts = [(line.split()[4], line.split(" - ")[1].split()[0]) for line in fh]
    return sorted(point for point, fstype in mounts if point.startswith(prefix) and fstype == "nsfs")


def _remove(lines: set[Line]) -> None:
    for tool, table, line in sorted(x for x in lines if x[2].startswith("-A ")):
        subprocess.run([tool.removesuffix("-save"), "-t", table, "-D", *shlex.split(line)[1:]], check=False)
    for tool, table, line in sorted(x for x in lines if x[2].startswith(":")):
        chain = line[1:].split()[0]
        for op in ("-F", "-X"):
            subprocess.run([tool.removesuffix("-save"), "-t", table, op, chain], check=False)


N = TypeVar("N", bound=Net)


@contextlib.contextmanager
def own_network(root: Path, tag: str, octet: int, kind: type[N], gateway: bool = False) -> Iterator[N]:
    """A :class:`Net` (of class ``kind``), removed after; then nothing of it may be left."""
    before = cni_iptables()
    net = kind(root, tag, octet, gateway)
    net.open_forward()
    try:
        yield net
    finally:
        net.cleanup(before)
    assert net.iptables() == set()
    assert not Path(f"/sys/class/net/{net.bridge}").exists()
    assert not [n for n in run("ip", "netns", "list").split() if n.startswith(f"{tag}-{net.rand}")]
