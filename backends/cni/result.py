"""ADD results of CNI 0.3.0 to 1.1.0, read into one type.

Since 0.3.0 a result lists ``interfaces``, and ``ips`` that name theirs by index; 0.3.x and
0.4.0 also give each IP a ``version`` (1.0.0 dropped it: the address tells), 1.1.0 added route
and interface fields. Unknown fields are ignored here, and the plugin's JSON is kept as it came
(``raw``): it is what the next plugin of a chain gets as ``prevResult`` and what the cache keeps.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping
from typing import Any

from backends.cni.config import SUPPORTED_VERSIONS

IPInterface = ipaddress.IPv4Interface | ipaddress.IPv6Interface
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class _Invalid(ValueError):
    """A result that does not follow the spec; the caller names the plugin."""


@dataclasses.dataclass(frozen=True, slots=True)
class Interface:
    name: str
    mac: str = ""
    mtu: int = 0
    sandbox: str = ""  # the netns path for interfaces in the pod, "" on the host
    socket_path: str = ""
    pci_id: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class IPConfig:
    address: IPInterface  # address and prefix
    gateway: IPAddress | None = None
    interface: int | None = None  # index into Result.interfaces


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    dst: IPNetwork
    gw: IPAddress | None = None
    mtu: int = 0
    advmss: int = 0
    priority: int = 0
    table: int | None = None
    scope: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class DNS:
    nameservers: tuple[str, ...] = ()
    domain: str = ""
    search: tuple[str, ...] = ()
    options: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class PodAddresses:
    ipv4: ipaddress.IPv4Address | None = None
    ipv6: ipaddress.IPv6Address | None = None

    def ordered(self) -> tuple[IPAddress, ...]:
        """IPv4 first, as the CRI reports a dual-stack pod's IP and its additional IP."""
        return tuple(ip for ip in (self.ipv4, self.ipv6) if ip is not None)


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    cni_version: str
    interfaces: tuple[Interface, ...] = ()
    ips: tuple[IPConfig, ...] = ()
    routes: tuple[Route, ...] = ()
    dns: DNS = DNS()
    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    def pod_addresses(self, ifname: str) -> PodAddresses:
        """The first IPv4 and IPv6 address of the pod's interface ``ifname`` (the one with a
        sandbox); when no IP names an interface (as IPAM-style results do), of all IPs."""
        on_pod = [
            ip
            for ip in self.ips
            if ip.interface is not None
            and self.interfaces[ip.interface].name == ifname
            and self.interfaces[ip.interface].sandbox
        ]
        if not on_pod and all(ip.interface is None for ip in self.ips):
            on_pod = list(self.ips)
        v4 = next((ip.address.ip for ip in on_pod if isinstance(ip.address, ipaddress.IPv4Interface)), None)
        v6 = next((ip.address.ip for ip in on_pod if isinstance(ip.address, ipaddress.IPv6Interface)), None)
        return PodAddresses(v4, v6)


def _str(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key, "")
    if not isinstance(value, str):
        raise _Invalid(f"{where}.{key} is not a string")
    return value


def _uint(obj: Mapping[str, Any], key: str, where: str) -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise _Invalid(f"{where}.{key} is not an unsigned integer")
    return value


def _strings(obj: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = obj.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _Invalid(f"{where}.{key} is not a list of strings")
    return tuple(value)


def _objects(obj: Mapping[str, Any], key: str) -> list[tuple[str, Mapping[str, Any]]]:
    value = obj.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise _Invalid(f"{key} is not a list of objects")
    return [(f"{key}[{i}]", v) for i, v in enumerate(value)]


def _gateway(obj: Mapping[str, Any], key: str, where: str) -> IPAddress | None:
    text = _str(obj, key, where)
    try:
        return ipaddress.ip_address(text) if text else None
    except ValueError:
        raise _Invalid(f"{where}.{key} {text!r} is not an IP address") from None


def _interface(where: str, obj: Mapping[str, Any]) -> Interface:
    name = _str(obj, "name", where)
    if not name:
        raise _Invalid(f"{where}.name is missing")
    return Interface(
        name=name,
        mac=_str(obj, "mac", where),
        mtu=_uint(obj, "mtu", where) or 0,
        sandbox=_str(obj, "sandbox", where),
        socket_path=_str(obj, "socketPath", where),
        pci_id=_str(obj, "pciID", where),
    )


def _ip(where: str, obj: Mapping[str, Any], interfaces: int) -> IPConfig:
    text = _str(obj, "address", where)
    try:
        if "/" not in text:
            raise ValueError(text)
        address = ipaddress.ip_interface(text)
    except ValueError:
        raise _Invalid(f"{where}.address {text!r} is not an address in CIDR notation") from None
    index = _uint(obj, "interface", where)
    if index is not None and index >= interfaces:
        raise _Invalid(f"{where}.interface {index} is not an index of interfaces")
    return IPConfig(address, _gateway(obj, "gateway", where), index)


def _route(where: str, obj: Mapping[str, Any]) -> Route:
    text = _str(obj, "dst", where)
    try:
        dst = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise _Invalid(f"{where}.dst {text!r} is not a network in CIDR notation") from None
    return Route(
        dst=dst,
        gw=_gateway(obj, "gw", where),
        mtu=_uint(obj, "mtu", where) or 0,
        advmss=_uint(obj, "advmss", where) or 0,
        priority=_uint(obj, "priority", where) or 0,
        table=_uint(obj, "table", where),
        scope=_uint(obj, "scope", where),
    )


def parse_result(raw: object, default_version: str) -> Result:
    """Raises ValueError naming the field that is wrong."""
    if not isinstance(raw, dict):
        raise _Invalid("not a JSON object")
    version = raw.get("cniVersion") or default_version
    if version not in SUPPORTED_VERSIONS:
        raise _Invalid(f"cniVersion {version!r} is not one this client reads")
    interfaces = tuple(_interface(w, o) for w, o in _objects(raw, "interfaces"))
    dns = raw.get("dns") or {}
    if not isinstance(dns, dict):
        raise _Invalid("dns is not an object")
    return Result(
        cni_version=version,
        interfaces=interfaces,
        ips=tuple(_ip(w, o, len(interfaces)) for w, o in _objects(raw, "ips")),
        routes=tuple(_route(w, o) for w, o in _objects(raw, "routes")),
        dns=DNS(
            nameservers=_strings(dns, "nameservers", "dns"),
            domain=_str(dns, "domain", "dns"),
            search=_strings(dns, "search", "dns"),
            options=_strings(dns, "options", "dns"),
        ),
        raw=raw,
    )
