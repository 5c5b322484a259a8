"""Pods on the node's CNI network, in the kubelet's terms: what a backend (docker, runv) asks of it.

- :func:`pod_network`: a handler's choice of network, ``pod_network = "builtin"`` (the
  backend's own network: docker's engine network, runv's bridge; the default) or ``"cni"``;
- :func:`settings_from`: the ``[cni]`` table the shim hands every handler, as
  :class:`~backends.cni.client.CniSettings`. Each handler has a cache of its own
  (``<cache_dir>/<handler>``): at recovery a handler releases every attachment in its cache
  that none of its pods holds, which must never be another handler's;
- :func:`attachment`: a pod sandbox config as an :class:`~backends.cni.attachment.Attachment`:
  the CNI_ARGS the kubelet's runtimes pass, ``portMappings`` from the pod's host ports (the
  ``portmap`` plugin publishes them), ``bandwidth`` from the ``kubernetes.io/ingress-bandwidth``
  and ``egress-bandwidth`` annotations, ``dns`` from the pod's DNS config; ``ipRanges`` is the
  client's, from the pod CIDR;
- :class:`CniPodNetwork`: ADD a pod (its addresses, IPv4 first, as the CRI reports them), DEL it,
  release what pods no longer there held, readiness and the pod CIDR.
"""

from __future__ import annotations

import decimal
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from backends.cni.attachment import Attachment, Bandwidth, DnsArgs, PortMapping
from backends.cni.client import CniClient, CniSettings, Readiness
from backends.contract import options
from backends.contract.errors import InternalError, InvalidArgumentError
from backends.contract.options import Kind, Schema
from backends.contract.values import SandboxNetwork
from cri_api import api_pb2 as pb

IFNAME = "eth0"  # the pod's interface, as every kubelet runtime names it
BUILTIN, CNI = "builtin", "cni"

SCHEMA: Schema = {
    "conf_dir": Kind.STR,
    "bin_dirs": Kind.STRINGS,
    "cache_dir": Kind.STR,
    "conf_template": Kind.STR,
    "plugin_timeout": Kind.NUMBER,
}

INGRESS_ANNOTATION = "kubernetes.io/ingress-bandwidth"
EGRESS_ANNOTATION = "kubernetes.io/egress-bandwidth"
# The kubelet's bounds on a pod's bandwidth (bits per second), and the burst it gives with a
# rate: 2^31-1 bits, in practice no limit on bursts.
_MIN_RATE, _MAX_RATE = 1000, 10**15
_BURST = 2**31 - 1

_PROTOCOLS = {pb.TCP: "tcp", pb.UDP: "udp", pb.SCTP: "sctp"}


def pod_network(handler: str, handler_options: Mapping[str, Any]) -> str:
    """``BUILTIN`` or ``CNI``, from the handler's ``pod_network`` key."""
    mode = handler_options.get("pod_network", BUILTIN)
    if mode not in (BUILTIN, CNI):
        raise InvalidArgumentError(
            f"[handlers.{handler}] pod_network: {mode!r} is not {BUILTIN!r} or {CNI!r}"
        )
    return str(mode)


def settings_from(handler: str, table: Mapping[str, Any], state_dir: str = "") -> CniSettings:
    """The settings of ``handler`` from the ``[cni]`` table; the cache root defaults to
    ``<state_dir>/cni``. InvalidArgumentError naming ``[cni]`` and the key."""
    options.check_section("cni", table, SCHEMA)
    defaults = CniSettings()
    timeout = float(table.get("plugin_timeout", defaults.plugin_timeout))
    if timeout <= 0:
        raise InvalidArgumentError(f"[cni] plugin_timeout: must be more than 0, got {timeout!r}")
    bin_dirs = tuple(table.get("bin_dirs", defaults.bin_dirs))
    if not bin_dirs:
        raise InvalidArgumentError("[cni] bin_dirs: needs at least one directory")
    cache_root = str(table.get("cache_dir") or (os.path.join(state_dir, "cni") if state_dir else ""))
    if not cache_root:
        raise InvalidArgumentError(f"[cni] cache_dir: not set, and handler {handler!r} has no state_dir")
    return CniSettings(
        conf_dir=str(table.get("conf_dir", defaults.conf_dir)),
        bin_dirs=bin_dirs,
        cache_dir=os.path.join(cache_root, handler),
        plugin_timeout=timeout,
        conf_template=str(table.get("conf_template", "")),
    )


_QUANTITY = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)\Z")
_SUFFIX = {
    "n": decimal.Decimal("1e-9"),
    "u": decimal.Decimal("1e-6"),
    "m": decimal.Decimal("1e-3"),
    "": decimal.Decimal(1),
    "k": decimal.Decimal("1e3"),
    "M": decimal.Decimal("1e6"),
    "G": decimal.Decimal("1e9"),
    "T": decimal.Decimal("1e12"),
    "P": decimal.Decimal("1e15"),
    "E": decimal.Decimal("1e18"),
} | {s: decimal.Decimal(1024**i) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"), 1)}


def quantity(text: str) -> int:
    """A Kubernetes quantity (``10M``, ``1.5Gi``, ``1e6``) rounded up to an integer, as its
    ``Value()``; ValueError when it is not one."""
    match = _QUANTITY.match(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a quantity")
    number, exponent, suffix = match.groups()
    value = decimal.Decimal(number)
    value = value.scaleb(int(exponent[1:])) if exponent else value * _SUFFIX[suffix or ""]
    return math.ceil(value)


def _rate(annotations: Mapping[str, str], key: str) -> int:
    text = annotations.get(key)
    if text is None:
        return 0
    try:
        rate = quantity(text)
    except ValueError as exc:
        raise InvalidArgumentError(f"annotation {key}: {exc}") from None
    if not _MIN_RATE <= rate <= _MAX_RATE:
        raise InvalidArgumentError(f"annotation {key}: {text} is out of range (1k to 1P bits per second)")
    return rate


def bandwidth(annotations: Mapping[str, str]) -> Bandwidth | None:
    """The pod's bandwidth limits from its annotations; None without any."""
    ingress, egress = _rate(annotations, INGRESS_ANNOTATION), _rate(annotations, EGRESS_ANNOTATION)
    if not ingress and not egress:
        return None
    return Bandwidth(
        ingress_rate=ingress,
        ingress_burst=_BURST if ingress else 0,
        egress_rate=egress,
        egress_burst=_BURST if egress else 0,
    )


def attachment(sandbox_id: str, netns: str, config: pb.PodSandboxConfig) -> Attachment:
    md = config.metadata
    dns = config.dns_config if config.HasField("dns_config") else None
    return Attachment(
        sandbox_id,
        netns,
        ifname=IFNAME,
        pod_namespace=md.namespace,
        pod_name=md.name,
        pod_uid=md.uid,
        port_mappings=tuple(
            PortMapping(pm.host_port, pm.container_port, _PROTOCOLS.get(pm.protocol, "tcp"), pm.host_ip)
            for pm in config.port_mappings
            if pm.container_port > 0
        ),
        bandwidth=bandwidth(config.annotations),
        dns=None if dns is None else DnsArgs(tuple(dns.servers), tuple(dns.searches), tuple(dns.options)),
    )


class CniPodNetwork:
    """One handler's pods on the node's network."""

    def __init__(self, settings: CniSettings) -> None:
        self.client = CniClient(settings)

    @property
    def conf_dir(self) -> str:
        return self.client.settings.conf_dir

    async def readiness(self) -> Readiness:
        return await self.client.readiness()

    def set_pod_cidr(self, cidr: str) -> None:
        self.client.set_pod_cidr(cidr)

    async def add(self, sandbox_id: str, netns: str, config: pb.PodSandboxConfig) -> SandboxNetwork:
        """ADD the pod whose network namespace is ``netns``; its addresses from the result.

        A result that gives the pod no address is an error (the caller DELs, as after any)."""
        att = attachment(sandbox_id, netns, config)
        result = await self.client.add(att)
        ips = result.pod_addresses(att.ifname).ordered()
        if not ips:
            raise InternalError(
                f"CNI network {self.client.network().name}: the ADD result gives {att.ifname} no address"
            )
        return SandboxNetwork(ip=str(ips[0]), additional_ips=tuple(str(ip) for ip in ips[1:]))

    async def delete(self, sandbox_id: str) -> None:
        """DEL the pod from its cached attachment: the config and namespace its ADD used, even if
        the config has changed or gone since. Nothing to do when there is none."""
        await self.client.delete(Attachment(sandbox_id, "", ifname=IFNAME))

    async def release_all_but(self, sandbox_ids: Iterable[str]) -> None:
        """DEL every cached attachment of a pod not in ``sandbox_ids`` (a restart after a crash
        between an ADD and the pod's record). Only the cache: a plugin GC would also release
        what other runtimes of the node hold on the same network. GcError lists failures."""
        await self.client.gc(((sid, IFNAME) for sid in sandbox_ids), plugins=False)
