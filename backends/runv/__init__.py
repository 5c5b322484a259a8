"""runv: a VM per pod (runV/Kata style), containers inside it driven by a guest agent.

``create`` is the factory the backend registry calls for handler type ``runv``.
Config keys: ``root``, ``run_dir``, ``agent_timeout``, ``overhead_vcpus``,
``overhead_memory_mib``, ``insecure_registries``, ``log_drain_timeout`` and a ``stub`` table
(``boot_latency``, ``shutdown_latency``, ``capacity_vcpus``, ``capacity_memory``,
``cpu_overcommit``, ``runc``, ``cgroup_parent``, ``ip``) and a ``network``
table (``bridge``, ``subnet``, ``gateway``, ``mtu``, ``ipam_dir``,
``hostport_chain``, ``ip``, ``iptables``; see README.md).
"""

from __future__ import annotations

from typing import Any

from backends.runv.backend import RunvBackend

__all__ = ["RunvBackend", "create"]


def create(name: str, config: dict[str, Any]) -> RunvBackend:
    return RunvBackend(name, config)
