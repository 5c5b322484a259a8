"""One pod's attachment to the network: who it is (CNI_* parameters) and its capability arguments.

``CNI_ARGS`` is what the kubelet's runtimes pass
(``IgnoreUnknown=1;K8S_POD_NAMESPACE=..;K8S_POD_NAME=..;K8S_POD_INFRA_CONTAINER_ID=..;K8S_POD_UID=..``).
The capability arguments follow CONVENTIONS.md of the CNI repository: ``portMappings``,
``bandwidth``, ``ipRanges`` and ``dns``; each reaches only the plugins that declare it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from backends.contract.errors import InvalidArgumentError


def _given(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields that are set: the conventions' optional keys go unset rather than empty."""
    return {k: v for k, v in fields.items() if v}


_CONTAINER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*\Z")
IFNAME_MAX = 15  # IFNAMSIZ less the terminating NUL


@dataclasses.dataclass(frozen=True, slots=True)
class PortMapping:
    host_port: int
    container_port: int
    protocol: str = "tcp"
    host_ip: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "hostPort": self.host_port,
            "containerPort": self.container_port,
            "protocol": self.protocol.lower(),
        } | _given({"hostIP": self.host_ip})


@dataclasses.dataclass(frozen=True, slots=True)
class Bandwidth:
    """Rates in bits per second, bursts in bits; 0 leaves that one out."""

    ingress_rate: int = 0
    ingress_burst: int = 0
    egress_rate: int = 0
    egress_burst: int = 0

    def to_json(self) -> dict[str, Any]:
        return _given(
            {
                "ingressRate": self.ingress_rate,
                "ingressBurst": self.ingress_burst,
                "egressRate": self.egress_rate,
                "egressBurst": self.egress_burst,
            }
        )


@dataclasses.dataclass(frozen=True, slots=True)
class IpRange:
    subnet: str
    range_start: str = ""
    range_end: str = ""
    gateway: str = ""

    def to_json(self) -> dict[str, Any]:
        return _given(
            {
                "subnet": self.subnet,
                "rangeStart": self.range_start,
                "rangeEnd": self.range_end,
                "gateway": self.gateway,
            }
        )


@dataclasses.dataclass(frozen=True, slots=True)
class DnsArgs:
    servers: tuple[str, ...] = ()
    searches: tuple[str, ...] = ()
    options: tuple[str, ...] = ()

    def to_json(self) -> dict[str, list[str]]:
        return {"servers": list(self.servers), "searches": list(self.searches), "options": list(self.options)}


@dataclasses.dataclass(frozen=True, slots=True)
class Attachment:
    """``container_id`` is the pod sandbox's ID; ``netns`` the path of its network namespace.

    ``ip_ranges`` left empty means the node's pod CIDRs (one range set per CIDR), when the client
    has them. Port mappings without a host port are not passed: nothing on the host maps them.
    """

    container_id: str
    netns: str
    ifname: str = "eth0"
    pod_namespace: str = ""
    pod_name: str = ""
    pod_uid: str = ""
    extra_args: tuple[tuple[str, str], ...] = ()
    port_mappings: tuple[PortMapping, ...] = ()
    bandwidth: Bandwidth | None = None
    ip_ranges: tuple[tuple[IpRange, ...], ...] = ()
    dns: DnsArgs | None = None

    def __post_init__(self) -> None:
        if not _CONTAINER_ID.match(self.container_id):
            raise InvalidArgumentError(f"CNI container ID {self.container_id!r} is not valid")
        name = self.ifname
        if (
            not name
            or len(name) > IFNAME_MAX
            or name in (".", "..")
            or any(c in name for c in "/:")
            or any(c.isspace() for c in name)
        ):
            raise InvalidArgumentError(f"CNI interface name {name!r} is not valid")
        for key, value in self.args():
            if any(c in key + value for c in ";=") or not key:
                raise InvalidArgumentError(f"CNI_ARGS entry {key}={value} has ';' or '=' in it")

    def args(self) -> list[tuple[str, str]]:
        pod = [
            ("K8S_POD_NAMESPACE", self.pod_namespace),
            ("K8S_POD_NAME", self.pod_name),
            ("K8S_POD_INFRA_CONTAINER_ID", self.container_id),
            ("K8S_POD_UID", self.pod_uid),
        ]
        return [(k, v) for k, v in pod if v] + list(self.extra_args)

    def cni_args(self) -> str:
        # IgnoreUnknown: plugins that know none of these keys must not fail on them.
        return ";".join(f"{k}={v}" for k, v in [("IgnoreUnknown", "1"), *self.args()])

    def runtime_args(self, pod_cidrs: tuple[str, ...] = ()) -> dict[str, Any]:
        """The capability arguments this attachment has, by capability name."""
        out: dict[str, Any] = {}
        mappings = [m.to_json() for m in self.port_mappings if m.host_port > 0]
        if mappings:
            out["portMappings"] = mappings
        if self.bandwidth is not None and self.bandwidth.to_json():
            out["bandwidth"] = self.bandwidth.to_json()
        ranges = self.ip_ranges or tuple((IpRange(cidr),) for cidr in pod_cidrs)
        if ranges:
            out["ipRanges"] = [[r.to_json() for r in group] for group in ranges]
        if self.dns is not None:
            out["dns"] = self.dns.to_json()
        return out
