# ruff: noqa: ASYNC240
# sysfs lookups of interfaces are in-memory and bounded; not worth a thread hop.
"""Pod networking of the runv backend: a bridge on the host, a veth per VM, host ports by DNAT.

Layout (defaults): bridge ``crishim-rv0`` with the gateway ``10.90.0.1/16``;
per pod a veth pair whose host end ``rv<vm id>`` is enslaved to the bridge and
whose peer is hot-plugged into the VM (the stub moves it into the VM's network
namespace), where the agent names it ``eth0`` and gives it the pod IP and a
default route via the gateway. Pod IPs come from the subnet and are persisted
by the caller in the sandbox record, so a restarted shim re-reserves them.

Host ports are iptables DNAT rules in a chain of ours in the nat table, jumped
to from PREROUTING and OUTPUT for local destinations; each rule carries the
sandbox ID in a comment so that stop (and recovery of leftovers) deletes
exactly its rules. DNAT of 127.0.0.1 needs ``route_localnet`` on the bridge and
a MASQUERADE of loopback sources leaving through it (as kube-proxy does). All of
this is L3 on the host, so ``br_netfilter`` is not needed; hairpin traffic
(a pod to its own host port) is not supported.

Only the host and the namespaces we create talk over the bridge: no outbound
NAT for pods is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import os
import shlex
from collections.abc import Sequence
from typing import Any

from backends.contract import errors
from backends.runv import host
from cri_api import api_pb2 as pb

IFNAME_MAX = 15
COMMENT_PREFIX = "crishim:"
_PROTOCOLS = {pb.TCP: "tcp", pb.UDP: "udp", pb.SCTP: "sctp"}


@dataclasses.dataclass(frozen=True, slots=True)
class HostPort:
    protocol: str
    host_ip: str
    host_port: int
    container_port: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def host_ports(mappings: Sequence[pb.PortMapping]) -> list[HostPort]:
    """The mappings of a PodSandboxConfig that publish a host port (IPv4 only)."""
    out: list[HostPort] = []
    for m in mappings:
        if m.host_port <= 0:
            continue  # container port only: reachable at the pod IP already
        if not 0 < m.container_port < 65536 or m.host_port > 65535:
            raise errors.InvalidArgumentError(f"invalid port mapping {m.host_port}->{m.container_port}")
        host_ip = m.host_ip if m.host_ip not in ("", "0.0.0.0") else ""
        if host_ip:
            try:
                addr = ipaddress.ip_address(host_ip)
            except ValueError:
                raise errors.InvalidArgumentError(f"invalid host_ip {host_ip!r}") from None
            if addr.version != 4:
                continue  # IPv6 host ports are not supported by this bridge (IPv4 only)
        out.append(HostPort(_PROTOCOLS.get(m.protocol, "tcp"), host_ip, m.host_port, m.container_port))
    return out


def _write_sysctl(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


class BridgeNetwork:
    """The bridge, the pod IPs and the host-port rules of one runv backend."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.bridge = str(config.get("bridge", "crishim-rv0"))
        if not 0 < len(self.bridge) <= IFNAME_MAX:
            raise errors.InvalidArgumentError(f"bridge name {self.bridge!r} is not a valid interface name")
        self.subnet = ipaddress.IPv4Network(str(config.get("subnet", "10.90.0.0/16")), strict=False)
        if self.subnet.num_addresses < 4:
            raise errors.InvalidArgumentError(f"subnet {self.subnet} is too small")
        self.gateway = str(config.get("gateway") or self.subnet.network_address + 1)
        self.mtu = int(config.get("mtu", 1500))
        self.ip_cmd = str(config.get("ip", "ip"))
        self.iptables = str(config.get("iptables", "iptables"))
        # Chain names: iptables allows 28 characters.
        self.chain = str(config.get("hostport_chain", f"CRISHIM-HP-{self.bridge}"))[:28]
        # Identifies this backend's IPs and rules among those of others sharing the bridge.
        self.owner = str(config.get("owner") or "default")
        self.ipam_dir = str(config.get("ipam_dir") or f"/run/cri-shim/ipam/{self.bridge}")
        self._next = int(self.subnet.network_address) + 2
        self._lock = asyncio.Lock()
        self._bridge_ready = False
        self._nat_ready = False

    @property
    def prefix(self) -> int:
        return self.subnet.prefixlen

    # ------------------------------------------------------------------ bridge
    async def ensure_bridge(self) -> None:
        """Create the bridge with the gateway address, up. Idempotent (also after a restart)."""
        if self._bridge_ready and os.path.isdir(f"/sys/class/net/{self.bridge}"):
            return
        if not os.path.isdir(f"/sys/class/net/{self.bridge}"):
            argv = (self.ip_cmd, "link", "add", self.bridge, "type", "bridge")
            code, out = await host.run(*argv)
            if code != 0 and "exists" not in out:
                raise errors.InternalError(
                    f"cannot create bridge {self.bridge}: {host.describe(argv, code, out)}"
                )
        cidr = f"{self.gateway}/{self.prefix}"
        await host.must(
            f"cannot address bridge {self.bridge}", self.ip_cmd, "addr", "replace", cidr, "dev", self.bridge
        )
        await host.must(
            f"cannot bring bridge {self.bridge} up",
            self.ip_cmd,
            "link",
            "set",
            self.bridge,
            "mtu",
            str(self.mtu),
            "up",
        )
        # Host ports on 127.0.0.1 are DNATed out through the bridge (see the module doc).
        with contextlib.suppress(OSError):
            _write_sysctl(f"/proc/sys/net/ipv4/conf/{self.bridge}/route_localnet", "1")
        self._bridge_ready = True

    async def remove_bridge(self) -> None:
        """Delete the bridge and our iptables chain (tests, uninstall). Idempotent."""
        await self._nat_teardown()
        if os.path.isdir(f"/sys/class/net/{self.bridge}"):
            await host.run(self.ip_cmd, "link", "del", self.bridge)
        self._bridge_ready = False

    # ------------------------------------------------------------------ addresses
    # One file per allocated IP (named by the IP, holding "owner sandbox-id") in a host-wide
    # directory per bridge: several backends (shims, test runs) sharing a bridge never hand
    # out the same IP, and each one only collects its own leftovers (its owner tag).
    def _ipam(self, ip: str) -> str:
        return os.path.join(self.ipam_dir, ip)

    def _holder(self, ip: str) -> tuple[str, str]:
        try:
            with open(self._ipam(ip)) as fh:
                owner, _, sid = fh.read().strip().partition(" ")
        except OSError:
            return "", ""
        return owner, sid

    def reserve(self, sandbox_id: str, ip: str) -> None:
        """Mark an IP used (recovery of a pod that kept running across a shim restart)."""
        os.makedirs(self.ipam_dir, exist_ok=True)
        with open(self._ipam(ip), "w") as fh:
            fh.write(f"{self.owner} {sandbox_id}\n")

    def allocate(self, sandbox_id: str) -> str:
        os.makedirs(self.ipam_dir, exist_ok=True)
        first = int(self.subnet.network_address) + 1
        last = int(self.subnet.broadcast_address) - 1
        size = last - first + 1
        # Round robin from the last allocation: a released IP is not handed out again at once.
        for i in range(size):
            cand = first + (self._next - first + i) % size
            ip = str(ipaddress.IPv4Address(cand))
            if ip == self.gateway:
                continue
            try:
                fd = os.open(self._ipam(ip), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(f"{self.owner} {sandbox_id}\n")
            self._next = cand + 1
            return ip
        raise errors.ResourceExhaustedError(f"no free pod IP left in {self.subnet}")

    def transfer(self, ip: str, holder: str, sandbox_id: str) -> None:
        """Hand an IP allocated for ``holder`` (a warm VM) to a sandbox, atomically."""
        if self._holder(ip) != (self.owner, holder):
            raise errors.InternalError(f"IP {ip} is not held by {holder}")
        tmp = self._ipam(ip) + ".new"
        with open(tmp, "w") as fh:
            fh.write(f"{self.owner} {sandbox_id}\n")
        os.replace(tmp, self._ipam(ip))

    def release(self, ip: str, sandbox_id: str) -> None:
        if ip and self._holder(ip) == (self.owner, sandbox_id):
            with contextlib.suppress(OSError):
                os.unlink(self._ipam(ip))

    def in_use(self) -> dict[str, str]:
        """IP -> sandbox ID of this backend's allocations."""
        out: dict[str, str] = {}
        with contextlib.suppress(OSError):
            for ip in os.listdir(self.ipam_dir):
                owner, sid = self._holder(ip)
                if owner == self.owner:
                    out[ip] = sid
        return out

    def release_unknown(self, known: set[str]) -> None:
        """Free this backend's IPs held by sandboxes it no longer has (recovery)."""
        for ip, sid in self.in_use().items():
            if sid not in known:
                self.release(ip, sid)

    # ------------------------------------------------------------------ interfaces
    @staticmethod
    def veth_names(vm_id: str) -> tuple[str, str]:
        """Host end and (temporary, before the guest renames it) peer name of a VM's veth pair."""
        return "rv" + vm_id[: IFNAME_MAX - 2], "rp" + vm_id[: IFNAME_MAX - 2]

    async def create_veth(self, vm_id: str) -> tuple[str, str]:
        await self.ensure_bridge()
        host_if, peer = self.veth_names(vm_id)
        await self.delete_veth(host_if)  # a leftover of a failed attempt
        await host.must(
            f"cannot create veth pair {host_if}",
            self.ip_cmd,
            "link",
            "add",
            host_if,
            "mtu",
            str(self.mtu),
            "type",
            "veth",
            "peer",
            "name",
            peer,
        )
        try:
            await host.must(
                f"cannot attach {host_if} to bridge {self.bridge}",
                self.ip_cmd,
                "link",
                "set",
                host_if,
                "master",
                self.bridge,
                "up",
            )
        except BaseException:
            await self.delete_veth(host_if)
            raise
        return host_if, peer

    async def delete_veth(self, host_if: str) -> None:
        """Delete a veth pair by its host end (the peer goes with it). Idempotent."""
        if host_if and os.path.exists(f"/sys/class/net/{host_if}"):
            argv = (self.ip_cmd, "link", "del", host_if)
            code, out = await host.run(*argv)
            if code != 0 and os.path.exists(f"/sys/class/net/{host_if}"):
                raise errors.InternalError(f"cannot delete {host_if}: {host.describe(argv, code, out)}")

    def bridge_ports(self) -> list[str]:
        """Interfaces enslaved to our bridge."""
        try:
            return sorted(os.listdir(f"/sys/class/net/{self.bridge}/brif"))
        except OSError:
            return []

    # ------------------------------------------------------------------ host ports
    def _ipt(self, *args: str) -> list[str]:
        return [self.iptables, "-w", "5", "-t", "nat", *args]

    def _jumps(self) -> list[tuple[str, list[str]]]:
        local = ["-m", "addrtype", "--dst-type", "LOCAL", "-j", self.chain]
        return [
            ("PREROUTING", local),
            ("OUTPUT", local),
            ("POSTROUTING", ["-s", "127.0.0.0/8", "-o", self.bridge, "-j", "MASQUERADE"]),
        ]

    async def _nat_setup(self) -> None:
        if self._nat_ready:
            return
        argv = self._ipt("-N", self.chain)
        code, out = await host.run(*argv)
        if code != 0 and "exists" not in out:
            raise errors.InternalError(
                f"cannot create iptables chain {self.chain}: {host.describe(argv, code, out)}"
            )
        for parent, rule in self._jumps():
            if (await host.run(*self._ipt("-C", parent, *rule)))[0] != 0:
                await host.must(f"cannot add a jump to {self.chain}", *self._ipt("-A", parent, *rule))
        self._nat_ready = True

    async def _nat_teardown(self) -> None:
        for parent, rule in self._jumps():
            while (await host.run(*self._ipt("-C", parent, *rule)))[0] == 0:
                await host.must(f"cannot delete a jump to {self.chain}", *self._ipt("-D", parent, *rule))
        if (await host.run(*self._ipt("-S", self.chain)))[0] == 0:
            await host.run(*self._ipt("-F", self.chain))
            await host.run(*self._ipt("-X", self.chain))
        self._nat_ready = False

    async def rules(self) -> list[str]:
        """The rules of our host-port chain, as ``iptables -S`` prints them."""
        code, out = await host.run(*self._ipt("-S", self.chain))
        if code != 0:
            return []
        return [line for line in out.splitlines() if line.startswith("-A ")]

    async def add_host_ports(self, sandbox_id: str, ip: str, ports: Sequence[HostPort]) -> None:
        if not ports:
            return
        await self.ensure_bridge()
        async with self._lock:
            await self._nat_setup()
            taken = {_rule_key(r) for r in await self.rules()}
            for p in ports:
                clash = [
                    t for t in taken if t[0] == p.protocol and t[2] == p.host_port and p.host_ip in ("", t[1])
                ]
                if clash or (p.protocol, "", p.host_port) in taken:
                    raise errors.InvalidArgumentError(
                        f"host port {p.host_ip or '*'}:{p.host_port}/{p.protocol} is already mapped"
                    )
            try:
                for p in ports:
                    match = ["-p", p.protocol] + (["-d", p.host_ip] if p.host_ip else [])
                    comment = ["-m", "comment", "--comment", f"{COMMENT_PREFIX}{self.owner}:{sandbox_id}"]
                    target = ["-j", "DNAT", "--to-destination", f"{ip}:{p.container_port}"]
                    await host.must(
                        f"cannot map host port {p.host_port}/{p.protocol}",
                        *self._ipt("-A", self.chain, *match, "--dport", str(p.host_port), *comment, *target),
                    )
            except BaseException:
                await self._delete_rules(lambda sid: sid == sandbox_id)
                raise

    async def remove_host_ports(self, sandbox_id: str) -> None:
        async with self._lock:
            await self._delete_rules(lambda sid: sid == sandbox_id)

    async def remove_unknown_host_ports(self, known: set[str]) -> None:
        """Delete rules of sandboxes this backend does not know (left by an earlier shim)."""
        async with self._lock:
            await self._delete_rules(lambda sid: sid not in known)

    async def _delete_rules(self, select: Any) -> None:
        for rule in await self.rules():
            owner, _, sid = _rule_sandbox(rule).partition(":")
            if sid and owner == self.owner and select(sid):
                # "-A CHAIN ..." -> "-D CHAIN ..."; the comment is quoted by -S, unquote it.
                args = _split_rule(rule)
                args[0] = "-D"
                argv = self._ipt(*args)
                code, out = await host.run(*argv)
                if code != 0:
                    raise errors.InternalError(
                        f"cannot delete host-port rule {rule!r}: {host.describe(argv, code, out)}"
                    )


def _split_rule(rule: str) -> list[str]:
    return shlex.split(rule)


def _rule_sandbox(rule: str) -> str:
    args = _split_rule(rule)
    for i, a in enumerate(args[:-1]):
        if a == "--comment" and args[i + 1].startswith(COMMENT_PREFIX):
            return args[i + 1].removeprefix(COMMENT_PREFIX)
    return ""


def _rule_key(rule: str) -> tuple[str, str, int]:
    args = _split_rule(rule)
    proto = host = ""
    port = 0
    for i, a in enumerate(args[:-1]):
        if a == "-p":
            proto = args[i + 1]
        elif a == "-d":
            host = args[i + 1].removesuffix("/32")
        elif a == "--dport":
            port = int(args[i + 1])
    return proto, host, port
