"""The keys of a runv handler's config table, checked when the backend is created.

A misspelt key or a value of the wrong type would otherwise be ignored or fail much later
(a pod on the wrong bridge, a boot that never times out): each is an error naming the
handler, the table and the key, which the shim reports as a configuration error at start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backends.contract.errors import InvalidArgumentError

STR = "a string"
NUMBER = "a non-negative number"
INT = "a non-negative integer"
STRINGS = "a list of strings"

# Keys the shim adds to every handler's options, whichever its type; runv has no use for them.
SHIM_KEYS: dict[str, str] = {
    "type": STR,
    "state_dir": STR,
    "pause_image": STR,
    "pull_no_progress_timeout": NUMBER,
    "cgroup_driver": STR,
}

TOP: dict[str, str] = {
    "root": STR,
    "run_dir": STR,
    "agent_timeout": NUMBER,
    "overhead_vcpus": NUMBER,
    "overhead_memory_mib": INT,
    "insecure_registries": STRINGS,
    "driver": STR,  # "stub" (default) or "qemu"
}

STUB: dict[str, str] = {
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
}

# The qemu driver (backends/runv/drivers/qemu.py).
QEMU: dict[str, str] = {
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
    "kernel_args": STRINGS,
    "capacity_vcpus": INT,
    "capacity_memory": INT,
    "cpu_overcommit": INT,
}

NETWORK: dict[str, str] = {
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
POOL: dict[str, str] = {
    "size": INT,
    "vcpus": INT,
    "memory_mib": INT,
    "refill_interval": NUMBER,
    "max_cpu": NUMBER,
}

TABLES: dict[str, dict[str, str]] = {"stub": STUB, "qemu": QEMU, "network": NETWORK, "pool": POOL}


def _fits(kind: str, value: Any) -> bool:
    if isinstance(value, bool):
        return False  # TOML true/false is never a number or a string here
    if kind == STR:
        return isinstance(value, str)
    if kind == NUMBER:
        return isinstance(value, int | float) and value >= 0
    if kind == INT:
        return isinstance(value, int) and value >= 0
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _check_table(
    name: str, table: str, data: Mapping[str, Any], known: dict[str, str], accepted: dict[str, str]
) -> None:
    where = f"runv handler {name!r}: [handlers.{name}{'.' + table if table else ''}]"
    for key, value in data.items():
        kind = known.get(key) or accepted.get(key)
        if kind is None:
            raise InvalidArgumentError(f"{where} unknown key {key!r} (known: {', '.join(sorted(known))})")
        if not _fits(kind, value):
            raise InvalidArgumentError(f"{where} {key}: expected {kind}, got {value!r}")


def check(name: str, config: Mapping[str, Any]) -> None:
    """Raise InvalidArgumentError for an unknown key or a wrongly typed value of ``config``."""
    _check_table(name, "", {k: v for k, v in config.items() if k not in TABLES}, TOP, SHIM_KEYS)
    for table, known in TABLES.items():
        data = config.get(table)
        if data is None:
            continue
        if not isinstance(data, Mapping):
            raise InvalidArgumentError(f"runv handler {name!r}: [handlers.{name}] {table}: expected a table")
        _check_table(name, table, data, known, {})
