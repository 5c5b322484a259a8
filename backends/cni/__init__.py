"""A CNI client, written here from the CNI specification (SPEC.md 1.1.0; results of 0.3.0 on).

Pods are networked the way every Kubernetes node does it: by the CNI plugins of the network
config in a directory (``/etc/cni/net.d``). The docker and runv backends use this package; it
imports nothing of ``shim`` nor of another backend.

The surface so far (the client comes next):

- :class:`NetworkConfig`, read from the config directory;
- :class:`Result` (:class:`Interface`, :class:`IPConfig`, :class:`Route`, :class:`DNS`) and
  :class:`PodAddresses`;
- errors, all conditions of :mod:`backends.contract.errors`: :class:`ConfigError` and
  :class:`PluginNotFoundError` (failed precondition), :class:`PluginError` (plugin, command,
  CNI code, message), :class:`ResultError` and :class:`GcError` (internal),
  :class:`PluginTimeoutError` (deadline exceeded; the plugin was killed).

Modules: ``config`` (loading, validation, reload, request configs), ``exec`` (running one
plugin), ``result``, ``errors``.
"""

from __future__ import annotations

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
    "ConfigError",
    "GcError",
    "IPConfig",
    "Interface",
    "NetworkConfig",
    "PluginError",
    "PluginNotFoundError",
    "PluginTimeoutError",
    "PodAddresses",
    "Result",
    "ResultError",
    "Route",
]
