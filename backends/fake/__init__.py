"""The fake runtime: in-memory CRI behaviour, call recording and fault injection."""

from __future__ import annotations

from typing import Any

from backends.contract import options
from backends.contract.options import Kind, Schema
from backends.fake.backend import FakeBackend, FakeRuntime
from backends.fake.faults import Call, FaultInjector, error_from_spec
from backends.fake.program import PROGRAM_ANNOTATION, Program

__all__ = [
    "PROGRAM_ANNOTATION",
    "Call",
    "FakeBackend",
    "FakeRuntime",
    "FaultInjector",
    "Program",
    "create",
    "error_from_spec",
]


# The keys of a ``[handlers.NAME]`` table of type "fake"; the tables and lists hold rules whose parts
# the fake's modules check as they read them (faults.py, program.py, images.py, exec.py).
SCHEMA: Schema = {
    "pod_cidr": Kind.STR,  # where simulated pod IPs come from; UpdateRuntimeConfig replaces it
    "pull_seconds": Kind.NUMBER,
    "checkpoint_seconds": Kind.NUMBER,  # how long writing a checkpoint takes (0: at once)
    "images": Kind.TABLE,
    "missing_images": Kind.STRINGS,
    "available_images": Kind.STRINGS,  # when given, the only images a pull finds (patterns)
    "programs": Kind.TABLE,
    "exec": Kind.LIST,
    "port_responses": Kind.TABLE,
    "errors": Kind.TABLE,
    "latency": Kind.TABLE,
    "max_calls": Kind.INT,
    "registry_config_path": Kind.STR,  # hosts.toml files (backends.oci.hosts): pulls record the hosts
}


def create(name: str, config: dict[str, Any]) -> FakeBackend:
    options.check(name, config, SCHEMA)
    return FakeBackend(name, config)
