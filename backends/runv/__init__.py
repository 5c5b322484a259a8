"""runv: a VM per pod (runV/Kata style), containers inside it driven by a guest agent.

``create`` is the factory the backend registry calls for handler type ``runv``.
Config keys: ``driver`` (``stub``, the default, or ``qemu``), ``pod_network`` (``builtin``, the
default: the ``network`` table's bridge; or ``cni``: the node's CNI network, ``cninet.py``),
``root``, ``run_dir`` (default ``/var/lib/cri-shim/NAME`` and ``/run/cri-shim/NAME``), ``agent_timeout``,
``overhead_vcpus``, ``overhead_memory_mib``, ``insecure_registries``, a ``qemu`` table (see
``drivers/qemu.py`` and README.md) and a ``stub`` table
(``boot_latency``, ``shutdown_latency``, ``boot_timeout``, ``capacity_vcpus``,
``capacity_memory``, ``cpu_overcommit``, ``runc``, ``unshare``, ``python``, ``cgroup_parent``,
``run_dir``, ``ip``) and a ``network``
table (``bridge``, ``subnet``, ``gateway``, ``mtu``, ``ipam_dir``,
``hostport_chain``, ``ip``, ``iptables``, ``owner``; see README.md). An unknown key or a
value of the wrong type in any of them is an InvalidArgumentError naming the handler, the
table and the key, raised here (``config.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backends.runv.backend import RunvBackend

__all__ = ["create"]


def create(name: str, config: dict[str, Any]) -> RunvBackend:
    # Imported here: the guest agent (``backends.runv.agent``, a process of each VM) is in this
    # package too, and must not pay for the host side (protobuf, structlog, the image store).
    from backends.runv.backend import RunvBackend

    return RunvBackend(name, config)
