"""A CNI client, written here from the CNI specification (SPEC.md 1.1.0; results of 0.3.0 on).

Pods are networked the way every Kubernetes node does it: by the CNI plugins of the network
config in a directory (``/etc/cni/net.d``). The docker and runv backends use this package; it
imports nothing of ``shim`` nor of another backend.

Use::

    client = CniClient(CniSettings(cache_dir=state_dir + "/cni"))
    client.set_pod_cidr("10.244.1.0/24")              # UpdateRuntimeConfig (optional)
    ready = await client.readiness()                   # Status: NetworkReady, or NetworkPluginNotReady
    att = Attachment(sandbox_id, "/run/netns/x", pod_namespace="ns", pod_name="web", pod_uid=uid,
                     port_mappings=(PortMapping(8080, 80),))
    result = await client.add(att)                     # RunPodSandbox
    ip = result.pod_addresses(att.ifname).ordered()    # the pod's IPs, IPv4 first
    await client.delete(att)                           # StopPodSandbox: idempotent, works from the cache

The surface:

- :class:`CniClient` (``network``, ``set_pod_cidr``, ``readiness``, ``add``, ``check``,
  ``delete``, ``status``, ``gc``, ``cached_result``) and its :class:`CniSettings` (config
  directory, plugin directories ``/opt/cni/bin`` then ``/usr/lib/cni``, cache directory, plugin
  timeout, config template);
- :class:`Attachment`, one pod on the network (CNI_CONTAINERID, CNI_NETNS, CNI_IFNAME, the
  kubelet's CNI_ARGS), with its capability arguments :class:`PortMapping`, :class:`Bandwidth`,
  :class:`IpRange` and :class:`DnsArgs`;
- :class:`Result` (:class:`Interface`, :class:`IPConfig`, :class:`Route`, :class:`DNS`) and
  :class:`PodAddresses`; :class:`NetworkConfig`; :class:`Readiness` (reason
  ``NetworkPluginNotReady``, a message naming the directory or file);
- errors, all conditions of :mod:`backends.contract.errors`: :class:`ConfigError` and
  :class:`PluginNotFoundError` (failed precondition), :class:`PluginError` (plugin, command,
  CNI code, message), :class:`ResultError` and :class:`GcError` (internal),
  :class:`PluginTimeoutError` (deadline exceeded; the plugin was killed).

Modules: ``config`` (loading, validation, reload, request configs), ``template`` (the config
rendered with the pod CIDRs), ``attachment``, ``exec`` (running one plugin), ``result``,
``cache`` (per-attachment state, written atomically), ``client`` (the operations, ordering,
readiness), ``errors``.
"""

from __future__ import annotations

from backends.cni.attachment import Attachment, Bandwidth, DnsArgs, IpRange, PortMapping
from backends.cni.client import NOT_READY, CniClient, CniSettings, Readiness
from backends.cni.config import NetworkConfig
from backends.cni.errors import (
    ConfigError,
    GcError,
    PluginError,
    PluginNotFoundError,
    PluginTimeoutError,
    ResultError,
)
from backends.cni.result import DNS, Interface, IPConfig, PodAddresses, Result, Route

__all__ = [
    "DNS",
    "NOT_READY",
    "Attachment",
    "Bandwidth",
    "CniClient",
    "CniSettings",
    "ConfigError",
    "DnsArgs",
    "GcError",
    "IPConfig",
    "Interface",
    "IpRange",
    "NetworkConfig",
    "PluginError",
    "PluginNotFoundError",
    "PluginTimeoutError",
    "PodAddresses",
    "PortMapping",
    "Readiness",
    "Result",
    "ResultError",
    "Route",
]
