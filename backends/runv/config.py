"""The keys of a runv handler's config table, checked when the backend is created.

A misspelt key or a value of the wrong type would otherwise be ignored or fail much later
(a pod on the wrong bridge, a boot that never times out): each is an error naming the
handler, the table and the key, which the shim reports as a configuration error at start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backends.contract import options
from backends.contract.options import Kind, Schema

STR, NUMBER, INT, STRINGS, BOOL = Kind.STR, Kind.NUMBER, Kind.INT, Kind.STRINGS, Kind.BOOL

TOP: dict[str, Kind] = {
    "root": STR,
    "run_dir": STR,
    "agent_timeout": NUMBER,
    "overhead_vcpus": NUMBER,
    "overhead_memory_mib": INT,
    "insecure_registries": STRINGS,
    "driver": STR,  # "stub" (default) or "qemu"
    "pod_network": STR,  # "builtin" (the network table's bridge, the default) or "cni"
}

STUB: dict[str, Kind] = {
    "run_dir": STR,  # default: the handler's run_dir
    "cgroup_parent": STR,
    "boot_latency": NUMBER,
    "shutdown_latency": NUMBER,
    "boot_timeout": NUMBER,
    "python": STR,
    "runc": STR,
    "unshare": STR,
    "ip": STR,
    "capacity_vcpus": INT,
    "capacity_memory": INT,
    "cpu_overcommit": INT,
    "template": BOOL,  # VMs cloned from a template process (default true; drivers/template.py)
}

# The qemu driver (backends/runv/drivers/qemu.py).
QEMU: dict[str, Kind] = {
    "run_dir": STR,
    "guest_dir": STR,
    "qemu": STR,
    "accel": STR,
    "machine": STR,
    "boot_timeout": NUMBER,
    "cgroup_parent": STR,
    "ip": STR,
    "tc": STR,
    "unshare": STR,
    "python": STR,
    "guest_memory_mib": INT,
    "host_overhead_mib": INT,  # QEMU's own memory beyond the guest's RAM (its cgroup's limit)
    "confine": BOOL,  # QEMU as a uid of its own, no capabilities, seccomp, a root of its own
    "uid_base": INT,
    "uid_count": INT,
    "setpriv": STR,
    "virtfs_proxy_helper": STR,
    "shares": STR,  # "virtiofs" or "9p" (default: virtiofs when virtiofsd and the guest have it)
    "virtiofsd": STR,
    "kernel_args": STRINGS,
    "capacity_vcpus": INT,
    "capacity_memory": INT,
    "cpu_overcommit": INT,
    "template": BOOL,  # VMs started from a saved booted VM of their shape (default true; qemu_template.py)
    "criu": BOOL,  # the guest image with CRIU (checkpoints: checkpoint.py); default guest_dir then its own
}

NETWORK: dict[str, Kind] = {
    "bridge": STR,
    "subnet": STR,
    "gateway": STR,
    "mtu": INT,
    "ipam_dir": STR,
    "hostport_chain": STR,
    "ip": STR,
    "iptables": STR,
    "owner": STR,  # default: a hash of root; IPs and host-port rules are tagged with it
}

# Warm VMs (backends/runv/pool.py).
POOL: dict[str, Kind] = {
    "size": INT,
    "vcpus": INT,
    "memory_mib": INT,
    "refill_interval": NUMBER,
    "max_cpu": NUMBER,
}

SCHEMA: Schema = {**TOP, "stub": STUB, "qemu": QEMU, "network": NETWORK, "pool": POOL}


def check(name: str, config: Mapping[str, Any]) -> None:
    """Raise InvalidArgumentError for an unknown key or a wrongly typed value of ``config``."""
    options.check(name, config, SCHEMA)
