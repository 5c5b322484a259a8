"""Warm VMs: a bounded pool of booted VMs whose agents answer, handed out on RunPodSandbox.

Booting a VM and its agent does not depend on the pod, so it can be done before
the pod is asked for (Kata calls this a VM factory). The pool keeps up to
``size`` VMs of one shape ready; RunPodSandbox takes one when the pod's sizing
is at least that shape (the backend hot-plugs the rest) and boots cold
otherwise, or when the pool is empty: it never waits for a refill.

Refilling boots one VM at a time, ``refill_interval`` apart, and pauses while
the node is busy: while a RunPodSandbox is in progress, or while the host's
CPUs were busier than ``max_cpu`` (a fraction of all of them, measured since
the previous look, a moment ago; 0: never pauses for CPU). A pool VM
belongs to no pod: no CRI list shows it, it counts against the hypervisor's
capacity like any VM (a cold boot that finds no room gives one back first), and
after a SIGKILL of the shim its ID is in no record, so the next start removes it
with the other leftovers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from backends.contract import options
from backends.contract.pool import CpuMeter, Pool
from backends.runv.config import POOL

__all__ = ["CpuMeter", "Pool", "PoolConfig"]


@dataclasses.dataclass(frozen=True, slots=True)
class PoolConfig:
    size: int = 0  # VMs kept ready; 0: no pool
    vcpus: int = 0  # 0: the size of a pod without limits
    memory_mib: int = 0  # 0: the size of a pod without limits
    refill_interval: float = 0.05  # seconds between two boots of a refill
    max_cpu: float = 0.8  # share of all CPUs busy above which refilling pauses; 0: ignore the CPU

    @classmethod
    def from_table(cls, table: dict[str, Any] | None, handler: str = "runv") -> PoolConfig:
        table = dict(table or {})
        # The handler's config check refuses a bad table first; a direct caller gets the same error.
        options.check_section(f"handlers.{handler}.pool", table, POOL)
        return cls(**table)
